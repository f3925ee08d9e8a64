"""Sweep demo training settings and measure how often generated shapes have the prompt's colour.

Builds the demo data and model once (prepare, caption, train_vae, latents through the real stages), then trains
each variant (config overrides, in parallel processes) and renders every evaluate prompt x seed at several
guidance scales. Prints one table last: variant, training seconds, colour accuracy per guidance.

    python scripts/calibrate_demo.py --work /tmp/cal --parallel 6
"""

from __future__ import annotations

import argparse
import multiprocessing
import concurrent.futures as cf
import os
import time
from pathlib import Path

VARIANTS = {  # config overrides on top of config/config.yaml (the shipped demo settings are "default")
    "default": [],
    "te": ["train.text_encoder.mode=full"],
    "3k": ["train.max_steps=3000"],
    "3k-te": ["train.max_steps=3000", "train.text_encoder.mode=full"],
    "lr1e-3-te": ["train.learning_rate=0.001", "train.text_encoder.mode=full"],
    "snr5-te": ["train.snr_gamma=5.0", "train.text_encoder.mode=full"],
}
GUIDANCE = (1.0, 2.0, 4.0)


def prepare_data(work: Path, overrides: list[str]) -> None:
    from sdpipe import config, demo
    from sdpipe.models import presets
    from sdpipe.stages import caption, latents, prepare, train_vae

    os.chdir(work)
    if not Path("results/latents/index.json").is_file():
        demo.generate(Path("data/raw"))
        presets.build_and_save("tiny", Path("models/tiny"))
        cfg = config.load(CONFIG, overrides)
        r = Path("results")
        prepare.run(cfg, {}, {"manifest": r / "m.jsonl", "rejected": r / "r.jsonl", "summary": r / "p.json"})
        caption.run(cfg, {"manifest": r / "m.jsonl"}, {"captions": r / "c.jsonl", "summary": r / "cs.json"})
        train_vae.run(cfg, {"manifest": r / "m.jsonl"}, {"out": r / "vae", "summary": r / "vae.json"})
        cfg = config.load(CONFIG, overrides + ["model.pretrained=results/vae"])
        latents.run(cfg, {"manifest": r / "m.jsonl", "captions": r / "c.jsonl"},
                    {"index": r / "latents/index.json", "summary": r / "ls.json"})


def train_and_score(work: str, name: str, overrides: list[str]) -> dict:
    import contextlib

    log = Path(work) / f"{name}.log"
    with open(log, "w") as f, contextlib.redirect_stderr(f), contextlib.redirect_stdout(f):
        try:
            return _train_and_score(work, name, overrides)
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others' results
            return {"name": name, "seconds": f"failed: {exc} (see {log})"}


def _train_and_score(work: str, name: str, overrides: list[str]) -> dict:
    import torch

    from sdpipe import config
    from sdpipe.demo_colours import colour_accuracy
    from sdpipe.stages import export, train

    torch.set_num_threads(2)
    os.chdir(work)
    cfg = config.load(CONFIG, ["model.pretrained=results/vae", "train.validation.every=0", "train.resume=null",
                               "train.num_processes=1", *overrides])
    out = Path("results") / f"train-{name}"
    start = time.perf_counter()
    train.run(cfg, {"index": Path("results/latents/index.json")}, {"out": out, "summary": out / "summary.json"})
    seconds = time.perf_counter() - start
    components = __import__("json").loads((out / "final" / "final.json").read_text())["components"]
    pipe = export.trained_pipeline(cfg, out / "final", components, fuse=True).to("cuda" if torch.cuda.is_available() else "cpu")
    e, scores = cfg.evaluate, {}
    for g in GUIDANCE:
        images, prompts = [], []
        for prompt in e.prompts:
            for seed in range(8):
                images.append(pipe(prompt, height=32, width=32, num_inference_steps=e.steps, guidance_scale=g,
                                   generator=torch.Generator("cpu").manual_seed(seed)).images[0])
                prompts.append(prompt)
        scores[g] = colour_accuracy(images, prompts)
    return {"name": name, "seconds": round(seconds, 1), **{f"g{g}": round(s, 3) for g, s in scores.items()}}


CONFIG = "config.yaml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default="/tmp/cal")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / CONFIG).write_text((Path(__file__).resolve().parent.parent / "config/config.yaml").read_text())
    prepare_data(work, [])
    names = args.only or list(VARIANTS)
    with cf.ProcessPoolExecutor(args.parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = list(pool.map(train_and_score, [str(work)] * len(names), names, [VARIANTS[n] for n in names]))
    print("\nvariant | train s | " + " | ".join(f"acc@g{g}" for g in GUIDANCE))
    for r in rows:
        print(f"{r['name']} | {r['seconds']} | " + " | ".join(str(r.get(f'g{g}')) for g in GUIDANCE))


if __name__ == "__main__":
    main()
