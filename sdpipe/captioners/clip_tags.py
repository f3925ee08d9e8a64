"""Zero-shot tags from an open_clip model: the most likely vocabulary words, comma-joined ("dog, flower").

Weights are found offline: caption.clip_tags.pretrained is a local checkpoint file, or an open_clip pretrained tag
whose file is already in the Hugging Face cache (or open_clip's ~/.cache/clip). A custom or tiny architecture is
registered from caption.clip_tags.model_config, a JSON file named after the architecture. A model name with an
open_clip schema ("hf-hub:org/repo", "local-dir:/path") is also accepted; its folder carries its own config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import hashing, weights
from sdpipe.captioners import CaptionFn, ModelSpec
from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

HUB_WEIGHT_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
KEY = "caption.clip_tags"


def tags(probs: list[float], vocabulary: list[str], top_k: int, min_probability: float) -> str | None:
    """The top_k words by probability, most likely first, keeping those >= min_probability; None if none."""
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])[:top_k]
    return ", ".join(vocabulary[i] for i in ranked if probs[i] >= min_probability) or None


def _check_prompt(prompt: str) -> None:
    try:
        prompt.format("word")
    except (IndexError, KeyError, ValueError):
        raise UserError(f"{KEY}.prompt = {prompt!r}: use {{}} once for the word and no other braces") from None


def register(c) -> str | None:
    """Register caption.clip_tags.model_config with open_clip; return its content hash (it shapes the model)."""
    import open_clip

    if not c.model_config:
        return None
    path = Path(c.model_config).expanduser()
    if not path.is_file():
        raise UserError(f"{KEY}.model_config: {path} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UserError(f"{KEY}.model_config: {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not all(k in data for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise UserError(f"{KEY}.model_config: {path} needs embed_dim, vision_cfg and text_cfg (an open_clip config)")
    if path.stem != c.model:
        raise UserError(
            f"{KEY}.model_config {path.name} defines the architecture {path.stem!r} (open_clip names it "
            f"after the file) but {KEY}.model is {c.model!r}; make them match"
        )
    open_clip.add_model_config(path)
    return hashing.sha256_file(path)


def cached_tag_file(tag: dict) -> tuple[Path | None, str]:
    """(the tag's weights file if already downloaded, how to download it)."""
    from huggingface_hub import try_to_load_from_cache

    if tag.get("file"):
        return (Path(tag["file"]) if Path(tag["file"]).is_file() else None), f"put the file at {tag['file']}"
    hub, how = tag.get("hf_hub"), ""
    if hub:
        repo, filename = os.path.split(hub)
        names = [filename.rsplit(".", 1)[0] + ".safetensors", filename] if filename else list(HUB_WEIGHT_NAMES)
        for name in names:
            found = try_to_load_from_cache(repo, name)
            if isinstance(found, str):
                return Path(found), ""
        how = f"on a machine with internet run `hf download {repo} {names[-1]}`"
    if tag.get("url"):
        local = Path("~/.cache/clip").expanduser() / os.path.basename(tag["url"])
        if local.is_file():
            return local, ""
        how = how or f"download {tag['url']} into ~/.cache/clip/"
    return None, how


def _checkpoint(model: str, pretrained: str) -> tuple[Path, dict]:
    """(weights file, the preprocessing those weights were trained with: from the tag, empty for a file)."""
    import open_clip

    if Path(pretrained).expanduser().is_file():
        return Path(pretrained).expanduser(), {}
    tag = open_clip.get_pretrained_cfg(model, pretrained)
    if not tag:
        if weights.is_local(pretrained):
            raise UserError(f"{KEY}.pretrained: checkpoint file {pretrained} does not exist")
        known = ", ".join(open_clip.list_pretrained_tags_by_model(model)) or "none"
        raise UserError(
            f"{KEY}.pretrained = {pretrained!r} is neither a checkpoint file nor a pretrained tag of "
            f"{model} (known tags: {known})"
        )
    found, how = cached_tag_file(tag)
    if found is None:
        raise UserError(
            f"open_clip weights {model}/{pretrained} are not in the local cache; {how} "
            f"(or set {KEY}.pretrained to a local checkpoint file)"
        )
    names = {
        "mean": "image_mean",
        "std": "image_std",
        "interpolation": "image_interpolation",
        "resize_mode": "image_resize_mode",
    }
    return found, {arg: (list(tag[k]) if isinstance(tag[k], tuple) else tag[k]) for k, arg in names.items() if k in tag}


def locate(c) -> tuple[str, Path, dict, str | None]:
    """(name to create the model by, weights path, preprocessing overrides, hash of a folder's own config)."""
    import open_clip

    kind, _, ident = c.model.partition(":")
    if kind in ("hf-hub", "local-dir") and ident:
        folder = weights.resolve(ident) if kind == "hf-hub" else Path(ident).expanduser()
        config = folder / "open_clip_config.json"
        if not config.is_file():
            raise UserError(f"{KEY}.model = {c.model!r}: no open_clip_config.json in {folder}")
        return f"local-dir:{folder}", folder, {}, hashing.sha256_file(config)
    if open_clip.get_model_config(c.model) is None:
        raise UserError(
            f"{KEY}.model = {c.model!r} is not an open_clip architecture; pick one of "
            f"open_clip.list_models() or set {KEY}.model_config to a JSON file named {c.model}.json"
        )
    checkpoint, preprocess = _checkpoint(c.model, c.pretrained)
    return c.model, checkpoint, preprocess, None


def describe(cfg: Config, memo_file) -> ModelSpec:
    import dataclasses

    c = cfg.caption.clip_tags
    _check_prompt(c.prompt)
    config_sha256 = register(c)
    arch, local, preprocess, folder_config_sha256 = locate(c)
    memo = weights.HashMemo(memo_file)
    weights_sha256 = memo.file_hash(local) if local.is_file() else memo.tree_hash(local)
    params = dataclasses.asdict(c)
    # File paths stay out of the key (the hashes stand for their content); the tag's preprocessing goes in.
    key_params = {
        "model": arch if folder_config_sha256 is None else "local-dir",
        "config_sha256": config_sha256 or folder_config_sha256,
        "preprocess": preprocess,
        **{k: params[k] for k in ("vocabulary", "top_k", "min_probability", "prompt")},
    }
    load_args = {**params, "arch": arch, "preprocess": preprocess}
    provenance = {"source": "clip_tags", "model": c.model, "weights_sha256": weights_sha256, "params": params}
    if folder_config_sha256 is None:
        provenance["pretrained"] = c.pretrained
    return ModelSpec("clip_tags", str(local), weights_sha256, key_params, provenance, load_args)


def load(spec: ModelSpec, device: str) -> CaptionFn:
    import open_clip
    import torch
    import torch.nn.functional as F

    a = spec.load_args
    if a["model_config"]:
        open_clip.add_model_config(Path(a["model_config"]).expanduser())
    from_folder = a["arch"].startswith("local-dir:")
    model, _, preprocess = open_clip.create_model_and_transforms(
        a["arch"], pretrained=None if from_folder else spec.local, device=device, **a["preprocess"]
    )
    model.eval()
    tokenizer = open_clip.get_tokenizer(a["arch"])
    with torch.inference_mode():
        prompts = tokenizer([a["prompt"].format(word) for word in a["vocabulary"]]).to(device)
        text = F.normalize(model.encode_text(prompts), dim=-1)  # (words, embed_dim), computed once
        scale = model.logit_scale.exp()

    def caption(images: list) -> list[str | None]:
        pixels = torch.stack([preprocess(image) for image in images]).to(device)
        with torch.inference_mode():
            probs = (scale * F.normalize(model.encode_image(pixels), dim=-1) @ text.T).softmax(dim=-1)
        return [tags(row, a["vocabulary"], a["top_k"], a["min_probability"]) for row in probs.tolist()]

    return caption
