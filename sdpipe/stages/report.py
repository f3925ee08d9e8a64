"""Write the run's report: provenance, curves, throughput, sample grids, metrics, data statistics, export checks.

One HTML file and one Markdown file state the same facts and refer to the same images in the assets folder by
relative path, so the three can be copied anywhere together. Everything but timings (marked ⏱) and the generation
time is a function of the inputs: two reports of the same run are equal. Optional inputs may be missing (a run
without export or captions stage output still gets a report that says what is not available); the config, the
training summary and metrics, and evaluate's metrics are required.

The config drives the grid labels (validation prompts and seeds), so the rule passes the resolved config as --config.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INPUTS = {
    # Not "config": the CLI's --config flag is taken (it loads the config the grid labels come from).
    "resolved_config": "results/config.resolved.yaml",
    "prepare": "results/prepare/summary.json",
    "captions": "results/captions/summary.json",
    "latents": "results/latents/summary.json",
    "manifest": "results/prepare/manifest.jsonl",
    "train_summary": "results/train/summary.json",
    "train_metrics": "results/train/metrics.csv",
    "samples_dir": "results/train/samples",
    "export": "results/export/summary.json",
    "metrics": "results/evaluate/metrics.json",
    "eval_grid": "results/evaluate/samples/grid.png",
    "eval_prompts": "results/evaluate/samples/prompts.json",
}
OUTPUTS = {
    "html": "results/report/index.html",
    "markdown": "results/report/report.md",
    "assets": "results/report/assets",
}
# The config keys the outputs depend on (stages/declared.py): all of them, as the report shows the run's config.
READS = ("*",)


def generated_at() -> str:
    # SOURCE_DATE_EPOCH (the reproducible-builds convention) pins the time when a byte-identical report is wanted.
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def build(cfg: Config, src, assets: Path) -> list:
    """All sections, in reading order; figures are written into `assets` on the way."""
    from sdpipe.report import figures, sections

    return [
        sections.provenance(src, cfg, generated_at()),
        figures.training(src, assets),
        figures.throughput(src, assets),
        figures.samples(src, cfg, assets),
        sections.metrics(src),
        sections.data(src),
        sections.export(src),
    ]


def _link(assets: Path, document: Path) -> str:
    """The assets folder as the document refers to it: relative, posix, URL-quoted."""
    rel = os.path.relpath(assets.resolve(), document.resolve().parent)
    return urllib.parse.quote(Path(rel).as_posix())


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> None:
    # Imported here: jinja2 and matplotlib stay out of every other `sdpipe` command's start-up.
    from sdpipe.report import render, sources

    src = sources.load(inputs)
    html_path, md_path, assets = (Path(outputs[k]) for k in ("html", "markdown", "assets"))
    # Assets are built in a temporary folder that replaces the old one only when all of them were written, so an
    # old image never lingers and a failed run leaves the previous report whole.
    with io.atomic_dir(assets) as tmp:
        doc = build(cfg, src, tmp)
        html = render.to_html(doc, _link(assets, html_path))
        markdown = render.to_markdown(doc, _link(assets, md_path))
    io.write_text(md_path, markdown)
    io.write_text(html_path, html)
    for name, hint in sorted(src.missing.items()):
        log.info("report: %s not available: %s", name, hint)
    log.info("report: %s, %s and %d images in %s", html_path, md_path, sum(1 for p in assets.rglob("*.png")), assets)
