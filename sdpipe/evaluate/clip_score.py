"""CLIP score of generated images against their prompts: the mean of 100 * max(cos(image, text), 0), as torchmetrics
defines it, with an open_clip model.

The model is found offline exactly as caption.clip_tags finds its own (sdpipe.captioners.clip_tags): an open_clip
pretrained tag whose file is already in the Hugging Face cache (or ~/.cache/clip), a local checkpoint file, a custom
architecture registered from model_config, or an "hf-hub:"/"local-dir:" model. The default is the captioner's cheap
ViT-B-32, so one download serves both. Missing weights give a null score with the reason and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sdpipe import weights
from sdpipe.captioners import clip_tags
from sdpipe.errors import UserError
from sdpipe.evaluate import measured, unavailable

KEY = "evaluate.clip_score"


@dataclass(frozen=True)
class ClipSettings:
    """evaluate.clip_score; any object with these attributes (the config's section) does as well."""

    model: str = "ViT-B-32"
    pretrained: str = "laion2b_s34b_b79k"
    model_config: str | None = None


def _keyed(resolver, *args):
    """Run a clip_tags resolver, naming this metric's config keys in its errors instead of the captioner's."""
    try:
        return resolver(*args)
    except UserError as exc:
        raise UserError(str(exc).replace(clip_tags.KEY, KEY)) from None


def _missing(c) -> str | None:
    """Why the weights are not on this machine and the fix; None when they are, or when the config itself is wrong
    (locate then says so)."""
    import open_clip

    kind, _, ident = c.model.partition(":")
    if kind == "hf-hub" and ident:
        try:
            weights.resolve(ident)
        except UserError as exc:
            return f"{exc}; `sdpipe fetch-weights` does the same"
        return None
    if kind == "local-dir" or Path(c.pretrained).expanduser().is_file():
        return None
    if weights.is_local(c.pretrained):
        return (
            f"{KEY}.pretrained: checkpoint file {c.pretrained} does not exist; copy the checkpoint there or set "
            f"{KEY}.pretrained to an open_clip pretrained tag"
        )
    tag = open_clip.get_pretrained_cfg(c.model, c.pretrained)
    found, how = clip_tags.cached_tag_file(tag) if tag else (True, "")
    if found:
        return None
    return (
        f"open_clip weights {c.model}/{c.pretrained} are not in the local cache; {how}, or run `sdpipe "
        f"fetch-weights` there (then copy the cache here), or set {KEY}.pretrained to a local checkpoint file"
    )


def locate(c) -> tuple[dict | None, str | None]:
    """({"arch", "weights", "preprocess", "quick_gelu"}, None), or (None, why the weights are missing and the fix).

    Config mistakes (an unknown architecture or tag, a bad model_config) raise UserError: no download fixes them.
    """
    import open_clip

    _keyed(clip_tags.register, c)
    reason = _missing(c)
    if reason:
        return None, reason
    arch, local, preprocess, _ = _keyed(clip_tags.locate, c)
    # A checkpoint loaded by path loses its tag's activation; tags trained with QuickGELU (e.g. openai) need it back.
    tag = {} if arch.startswith("local-dir:") else open_clip.get_pretrained_cfg(c.model, c.pretrained)
    return {
        "arch": arch,
        "weights": str(local),
        "preprocess": preprocess,
        "quick_gelu": bool(tag.get("quick_gelu")),
    }, None


def load(found: dict, device: str = "cpu") -> Callable[[list, list], list[float]]:
    """A function from (RGB images, prompts) to one score per pair, 100 * max(cos, 0)."""
    import open_clip
    import torch
    import torch.nn.functional as F

    from_folder = found["arch"].startswith("local-dir:")
    model, _, preprocess = open_clip.create_model_and_transforms(
        found["arch"],
        pretrained=None if from_folder else found["weights"],
        device=device,
        force_quick_gelu=found["quick_gelu"],
        **found["preprocess"],
    )
    model.eval()
    tokenizer = open_clip.get_tokenizer(found["arch"])  # truncates prompts to the context length, as torchmetrics

    def scores(images: list, prompts: list[str]) -> list[float]:
        pixels = torch.stack([preprocess(image.convert("RGB")) for image in images]).to(device)
        with torch.inference_mode():
            image_emb = F.normalize(model.encode_image(pixels).float(), dim=-1)
            text_emb = F.normalize(model.encode_text(tokenizer(prompts).to(device)).float(), dim=-1)
        return (100 * (image_emb * text_emb).sum(dim=-1).clamp(min=0)).tolist()

    return scores


def clip_score(images: list, prompts: list[str], c=ClipSettings(), device: str = "cpu", batch_size: int = 32) -> dict:
    """The mean CLIP score of each image against its own prompt; null with the reason when the weights are missing."""
    if len(images) != len(prompts) or not images:
        raise ValueError(f"need one prompt per image and at least one image, got {len(images)} and {len(prompts)}")
    details = {"model": c.model, "pretrained": c.pretrained, "n": len(images)}
    found, reason = locate(c)
    if found is None:
        return unavailable(reason, **details)
    score = load(found, device)
    values = [
        v
        for start in range(0, len(images), batch_size)
        for v in score(images[start : start + batch_size], prompts[start : start + batch_size])
    ]
    return measured(sum(values) / len(values), **details, weights=found["weights"])
