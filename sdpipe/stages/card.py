"""Write the model card: README.md with Hugging Face front matter, and a copy of the evaluation grid beside it.

A stage of its own after evaluate, writing only into results/card: the card needs evaluate's metrics, which run
after export, so writing it into results/export would give that folder two owners (Snakemake's and DVC's output
rules refuse that). Copy results/card/* next to the exported files to publish them together.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INPUTS = {
    "prepare": "results/prepare/summary.json",
    "manifest": "results/prepare/manifest.jsonl",
    "captions": "results/captions/captions.jsonl",
    "train_summary": "results/train/summary.json",
    "export": "results/export/summary.json",
    "metrics": "results/evaluate/metrics.json",
    "eval_grid": "results/evaluate/samples/grid.png",
    "eval_prompts": "results/evaluate/samples/prompts.json",
}
OUTPUTS = {"card": "results/card/README.md", "grid": "results/card/samples.png"}
# The config keys the outputs depend on (stages/declared.py).
READS = (
    "model.pretrained",
    "export.name",
    "train",
    "prepare.buckets.resolution",
    "seed",
    "dreambooth",
    "evaluate.steps",
    "evaluate.guidance",
)


def copy_grid(source: Path, dest: Path) -> bool:
    """The grid beside the card, or False (and no older grid left) when evaluate wrote none."""
    if not source.is_file():
        log.warning("card: no sample grid at %s; the card shows none", source)
        if dest.exists():
            dest.unlink()  # an older run's grid would pass for this one's
        return False
    with io.atomic_path(dest) as tmp:
        shutil.copyfile(source, tmp)
    return True


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> str:
    from sdpipe.card import body, facts, front_matter

    known = facts.gather(cfg, {k: Path(v) for k, v in inputs.items()})
    card, grid = Path(outputs["card"]), Path(outputs["grid"])
    # linked relatively: the card and the grid move together (the Hub resolves it in the same repository)
    link = None
    if copy_grid(Path(inputs["eval_grid"]), grid):
        link = Path(os.path.relpath(grid.resolve(), card.parent.resolve())).as_posix()
    text = front_matter.render(known, link) + "\n" + body.render(known, link)
    io.write_text(card, text)
    log.info("card: %s (%s%s)", card, "LoRA" if known["lora"] else "fine-tune", f", sample grid {grid}" if link else "")
    return text
