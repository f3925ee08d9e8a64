"""The demo learns colour words: generated shapes have the colour their prompt names.

The full demo (8 colours, 5 shapes, 480 images; `make demo`) takes over ten minutes on a 2-core CPU, too long for
the suite, and benchmarks/README.md records its colour accuracy. This runs the same Snakemake DAG, the
same tiny preset and the same stages (VAE training, latents, training, export, evaluate) on the demo's red and
blue images only, with a schedule short enough for CI, and checks every generated image against its prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sdpipe import demo
from sdpipe.demo.colours import dominant_colour, prompt_colour
from tests.workflow_helpers import make_project, run

pytestmark = pytest.mark.slow
COLOURS = ("red", "blue")
PROMPTS = [f"a {c} {s} on a {b} background" for c in COLOURS for s in ("circle", "square") for b in ("white", "black")]


def caption_of(image: Path) -> str:
    sidecar = image.with_suffix(".txt")
    return sidecar.read_text() if sidecar.is_file() else image.stem.replace("_", " ")


def red_and_blue(tmp: Path) -> Path:
    """The demo's images whose shape is red or blue (about a quarter of them), with their sidecars."""
    full, raw = tmp / "full", tmp / "raw"
    for image in demo.generate(full):
        if prompt_colour(caption_of(image)) in COLOURS:
            dest = raw / image.relative_to(full)
            dest.parent.mkdir(parents=True, exist_ok=True)
            for f in (image, image.with_suffix(".txt")):
                if f.is_file():
                    shutil.copy2(f, dest.with_suffix(f.suffix))
    return raw


def test_generated_shapes_have_the_prompted_colour(tmp_path):
    proj = make_project(
        tmp_path / "proj",
        red_and_blue(tmp_path),
        prepare={"eval_fraction": 0.0, "workers": 1},
        model={"train_vae": {"enabled": True, "steps": 300, "batch_size": 32}},
        train={
            "max_steps": 600,
            "per_device_batch_size": 32,
            "learning_rate": 0.001,
            "lr_warmup_steps": 20,
            "checkpoint_every": 600,
            "validation": {"every": 0},
        },
        evaluate={
            "prompts": PROMPTS,
            "seeds": [0, 1],
            "steps": 20,
            "guidance": 3.0,
            "fid": {"enabled": False},
            "clip_score": {"enabled": False},
        },
    )
    run(["snakemake", "--cores", "2", "evaluate"], proj)
    samples = sorted((proj / "results" / "evaluate" / "samples").glob("[0-9]*-[0-9]*.png"))
    assert len(samples) == len(PROMPTS) * 2
    from PIL import Image

    # Samples are named <prompt index>-<seed index>.png.
    seen = [(PROMPTS[int(p.stem.split("-")[0])], dominant_colour(Image.open(p).convert("RGB"))) for p in samples]
    hits = sum(prompt_colour(prompt) == colour for prompt, colour in seen)
    assert hits / len(seen) >= 0.75, f"colours of generated shapes against their prompts: {seen}"
    metrics = json.loads((proj / "results" / "evaluate" / "metrics.json").read_text())
    assert metrics["colour_accuracy"]["value"] == hits / len(seen)
