"""BLIP image captioning through transformers, loaded offline from a local folder or the Hugging Face cache.

With caption.blip.prompt set, BLIP continues that text ("a photo of" -> "a photo of a red circle"); a result
that is only the prompt again counts as no caption.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import weights
from sdpipe.captioners import CaptionFn, ModelSpec
from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

# Files besides the weights that change the output: image preprocessing and the tokenizer that decodes it.


def _check_folder(name: str, local: Path) -> None:
    config = local / "config.json"
    if not local.is_dir() or not config.is_file():
        raise UserError(f"caption.blip.model = {name!r}: expected a transformers model folder with config.json")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        model_type = None
    if model_type != "blip":
        raise UserError(
            f"caption.blip.model = {name!r} is a {model_type or 'unknown'} model, not BLIP; "
            "use a BLIP captioning model such as Salesforce/blip-image-captioning-base"
        )


def describe(cfg: Config, memo_file) -> ModelSpec:
    b = cfg.caption.blip
    local = weights.resolve(b.model)
    _check_folder(b.model, local)
    memo = weights.HashMemo(memo_file)
    # Every file: the processor's and tokenizer's files decide the captions as much as the weights do.
    weights_sha256 = memo.tree_hash(local, every_file=True)
    params = dataclasses.asdict(b)
    # The model's name is left out of the key on purpose: the same weights under another path reuse the cache.
    key_params = {k: v for k, v in params.items() if k != "model"}
    provenance = {"source": "blip", "model": b.model, "weights_sha256": weights_sha256, "params": params}
    return ModelSpec("blip", str(local), weights_sha256, key_params, provenance, params)


def _only_prompt(text: str, prompt: str | None) -> bool:
    # Uncased tokenizers lower-case the echoed prompt, so compare the way they decode.
    return bool(prompt) and " ".join(text.split()).lower() == " ".join(prompt.split()).lower()


def load(spec: ModelSpec, device: str) -> CaptionFn:
    import torch
    from transformers import AutoProcessor, BlipForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    processor = AutoProcessor.from_pretrained(spec.local, local_files_only=True)
    model = BlipForConditionalGeneration.from_pretrained(spec.local, local_files_only=True).to(device).eval()
    prompt = spec.load_args["prompt"] or None
    generate = {"max_new_tokens": spec.load_args["max_new_tokens"], "num_beams": spec.load_args["num_beams"]}

    def caption(images: list) -> list[str | None]:
        inputs = processor(images=images, text=[prompt] * len(images) if prompt else None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs.to(device), **generate)
        return [None if _only_prompt(t, prompt) else t for t in processor.batch_decode(out, skip_special_tokens=True)]

    return caption
