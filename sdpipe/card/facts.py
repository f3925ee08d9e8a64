"""What the card says, gathered from the stages' outputs and the config into one plain dict.

The card states what the files say, not what the config hoped: steps and batch from the training summary, file
names and loaders from the export summary (which export.name named, sdpipe/export/names.py), metrics as
evaluate wrote them (null with its reason when not measured).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io
from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# Licenses of base models we know; a fine-tune of an OpenRAIL model carries its use restrictions on. Anything
# else is "other", and the card asks the user to set it before publishing.
KNOWN_LICENSES = {
    "stable-diffusion-v1-5/stable-diffusion-v1-5": "creativeml-openrail-m",
    "runwayml/stable-diffusion-v1-5": "creativeml-openrail-m",
    "CompVis/stable-diffusion-v1-4": "creativeml-openrail-m",
    "stabilityai/stable-diffusion-2-1": "openrail++",
    "stabilityai/stable-diffusion-2-1-base": "openrail++",
    "stabilityai/stable-diffusion-xl-base-1.0": "openrail++",
}


def hub_id(name: str) -> str | None:
    """`name` when it names a Hub repository (org/name) rather than a folder on this machine."""
    from sdpipe.weights import is_local

    return name if HUB_ID.fullmatch(name) and not is_local(name) else None


def required(path: Path, made_by: str) -> dict:
    if not Path(path).is_file():
        raise UserError(f"{path} not found; run `snakemake {made_by}` first")
    return io.read_json(path)


def instance_prompt(manifest: Path, captions: Path) -> tuple[str, int, int] | None:
    """DreamBooth's instance prompt: the caption most instance images share, with (how many share it, how many
    instance images there are); None when the files are missing."""
    if not (Path(manifest).is_file() and Path(captions).is_file()):
        return None
    instance = {r["id"] for r in io.read_jsonl(manifest) if r.get("role", "instance") == "instance"}
    counts = Counter(c["caption"] for c in io.read_jsonl(captions) if c["id"] in instance and c.get("caption"))
    if not counts:
        return None
    prompt, n = counts.most_common(1)[0]
    return prompt, n, len(instance)


def _base(export: dict) -> dict:
    """The base model's name and Hub tag, from the version the export recorded (the family knows its bases)."""
    from sdpipe.models import families

    base = families.base_named(export.get("base_model_version") or "")
    if base is None:
        return {"family": export.get("family", "unknown"), "hub_tag": "stable-diffusion"}
    return {"family": base.title, "hub_tag": base.hub_tag}


def gather(cfg: Config, inputs: dict[str, Path]) -> dict:
    export = required(inputs["export"], "export")
    metrics = required(inputs["metrics"], "evaluate")
    t = cfg.train
    facts = {
        "name": cfg.export.name,
        "base": cfg.model.pretrained,
        "base_hub_id": hub_id(cfg.model.pretrained),
        "license": KNOWN_LICENSES.get(cfg.model.pretrained, "other"),
        **_base(export),
        "components": export["components"],
        "lora": "lora" in export["components"].values(),
        "lora_settings": vars(t.lora),
        "text_encoder": t.text_encoder.mode,
        "export_dtype": export["dtype"],
        "formats": export["formats"],
        "train": required(inputs["train_summary"], "train"),
        "settings": {
            "learning_rate": t.learning_rate,
            "lr_scheduler": t.lr_scheduler,
            "resolution": cfg.prepare.buckets.resolution,
            "mixed_precision": t.mixed_precision,
            "ema": t.ema.enabled,
            "seed": cfg.seed,
            "snr_gamma": t.snr_gamma,
            "caption_dropout": t.caption_dropout,
        },
        "data": required(inputs["prepare"], "prepare"),
        "dreambooth": vars(cfg.dreambooth) if cfg.dreambooth.enabled else None,
        "instance_prompt": instance_prompt(inputs["manifest"], inputs["captions"]) if cfg.dreambooth.enabled else None,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, dict) and "value" in v},
        "sampling": {"steps": cfg.evaluate.steps, "guidance": cfg.evaluate.guidance},
        "prompts": io.read_json(inputs["eval_prompts"]) if Path(inputs["eval_prompts"]).is_file() else [],
    }
    return facts
