"""Sweep demo settings (VAE and UNet training) and measure colour accuracy through the real stages.

Shared once: the demo data, the tiny base model, prepare and caption. Per VAE setting: train_vae, then the
latents stage, and the colour accuracy of the VAE's own reconstructions (the ceiling for everything after it).
Per variant, in parallel processes: train -> export -> evaluate (FID and CLIP off, more seeds), exactly the stage
functions the Snakemake rules call. Prints one table last. Overrides use `sdpipe`'s `--set` syntax.

    python scripts/calibrate_demo.py --work /tmp/cal --parallel 6 --seeds 8
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import multiprocessing
import os
import time
from pathlib import Path

VAES = {  # name -> model.train_vae overrides
    "v600": [],
}
VARIANTS = {  # name -> (VAE name, overrides); "default" is config/config.yaml as shipped
    "default": ("v600", []),
    "lr2e-3": ("v600", ["train.learning_rate=0.002"]),
    "lr3e-3": ("v600", ["train.learning_rate=0.003"]),
    "s3000b16": ("v600", ["train.max_steps=3000", "train.per_device_batch_size=16"]),
    "te": ("v600", ["train.text_encoder.mode=full"]),
    "snr5": ("v600", ["train.snr_gamma=5.0"]),
}
GUIDANCE = (2.0,)  # each trained variant is evaluated at each scale
CONFIG = "config.yaml"
FAST = [
    "evaluate.fid.enabled=false",
    "evaluate.clip_score.enabled=false",
    "train.validation.every=0",
    "train.resume=null",
    "train.num_processes=1",
    "export.single_file=false",
]


EXTRA: list[str] = []  # --set: appended to every stage's overrides (e.g. short schedules for a smoke run)


def load(overrides: list[str]):
    from sdpipe import config

    return config.load(CONFIG, [*FAST, *overrides, *EXTRA])


def shared(work: Path) -> None:
    """Demo data, base model, prepare and caption, once."""
    from sdpipe import demo
    from sdpipe.models import presets
    from sdpipe.stages import caption, prepare

    r = Path("results")
    if (r / "captions.jsonl").is_file():
        return
    demo.generate(Path("data/raw"))
    presets.build_and_save("tiny", Path("models/tiny"))
    cfg = load([])
    prepare.run(
        cfg, {}, {"manifest": r / "manifest.jsonl", "rejected": r / "rejected.jsonl", "summary": r / "prepare.json"}
    )
    caption.run(
        cfg, {"manifest": r / "manifest.jsonl"}, {"captions": r / "captions.jsonl", "summary": r / "captions.json"}
    )


def recon_accuracy(model: Path, manifest: Path, captions: Path) -> float:
    """Colour accuracy of the VAE's reconstructions of the training images against their captions."""
    import numpy as np
    import torch
    from diffusers import AutoencoderKL
    from PIL import Image

    from sdpipe import io, vae_train
    from sdpipe.demo.colours import colour_accuracy

    text = {r["id"]: r["caption"] for r in io.read_jsonl(captions)}
    rows = [r for r in io.read_jsonl(manifest) if r["split"] == "train"]
    pixels = vae_train.load_pixels([Path(r["file"]) for r in rows], 32)
    vae = AutoencoderKL.from_pretrained(model, subfolder="vae").eval()
    with torch.no_grad():
        x = vae_train.to_model_range(pixels, "cpu")
        y = vae.decode(vae.encode(x).latent_dist.mean).sample.clamp(-1, 1)
    arr = ((y + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    return colour_accuracy([Image.fromarray(np.ascontiguousarray(a)) for a in arr], [text[r["id"]] for r in rows])


def vae_stage(name: str, overrides: list[str]) -> dict:
    from sdpipe.stages import latents, train_vae

    r, v = Path("results"), Path("results") / name
    start = time.perf_counter()
    stats = train_vae.run(
        load(overrides), {"manifest": r / "manifest.jsonl"}, {"out": v / "model", "summary": v / "vae.json"}
    )
    seconds = time.perf_counter() - start
    latents.run(
        load([*overrides, f"model.pretrained={v / 'model'}"]),
        {"manifest": r / "manifest.jsonl", "captions": r / "captions.jsonl"},
        {"index": v / "latents/index.json", "summary": v / "latents.json"},
    )
    acc = recon_accuracy(v / "model", r / "manifest.jsonl", r / "captions.jsonl")
    return {"vae": name, "vae_s": round(seconds, 1), "rgb_error": stats["rgb_error"], "recon_acc": round(acc, 3)}


def variant(work: str, name: str, vae: str, overrides: list[str], seeds: int, extra: list[str]) -> dict:
    log = Path(work) / f"{name}.log"
    with open(log, "w") as f, contextlib.redirect_stderr(f), contextlib.redirect_stdout(f):
        try:
            return _variant(work, name, vae, overrides, seeds, extra)
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others' results
            import traceback

            traceback.print_exc()
            return {"name": name, "train_s": f"failed: {exc!r} (see {log})"}


def _variant(work: str, name: str, vae: str, overrides: list[str], seeds: int, extra: list[str]) -> dict:
    import torch

    from sdpipe.stages import evaluate, export, train

    EXTRA[:] = extra
    torch.set_num_threads(2)  # several variants share the machine's cores
    os.chdir(work)
    r, out = Path("results"), Path("results") / name
    cfg = load(
        [
            f"model.pretrained=results/{vae}/model",
            *overrides,
            f"evaluate.seeds=[{','.join(str(s) for s in range(seeds))}]",
        ]
    )
    start = time.perf_counter()
    train.run(
        cfg, {"index": r / vae / "latents/index.json"}, {"out": out / "train", "summary": out / "train/summary.json"}
    )
    seconds = time.perf_counter() - start
    export.run(cfg, {"final": out / "train/final"}, {"out": out / "export", "summary": out / "export/summary.json"})
    row = {
        "name": name,
        "train_s": round(seconds, 1),
        "steps": json.loads((out / "train/summary.json").read_text()).get("optimizer_steps"),
    }
    for g in GUIDANCE:
        cfg = load(
            [
                f"model.pretrained=results/{vae}/model",
                *overrides,
                f"evaluate.guidance={g}",
                f"evaluate.seeds=[{','.join(str(s) for s in range(seeds))}]",
            ]
        )
        metrics = evaluate.run(
            cfg,
            {
                "model": out / "export/diffusers",
                "manifest": r / "manifest.jsonl",
                "train_summary": out / "train/summary.json",
                "scaling": r / "none.json",
            },
            {"metrics": out / f"metrics-g{g}.json", "samples": out / f"samples-g{g}"},
        )
        row[f"g{g}"] = metrics["colour_accuracy"]["value"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/cal")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=8, help="evaluate seeds per prompt")
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--set", nargs="*", default=[], help="overrides for every stage, after the variant's")
    args = parser.parse_args()
    EXTRA[:] = args.set
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / CONFIG).write_text((Path(__file__).resolve().parent.parent / "config/config.yaml").read_text())
    os.chdir(work)
    shared(work)
    names = args.only or list(VARIANTS)
    vaes = [vae_stage(v, VAES[v]) for v in dict.fromkeys(VARIANTS[n][0] for n in names)]
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(args.parallel, mp_context=ctx) as pool:
        futures = [pool.submit(variant, str(work), n, *VARIANTS[n], args.seeds, args.set) for n in names]
        rows = []
        for done in cf.as_completed(futures):  # each row as soon as it is in: a cut-off run still reports
            rows.append(done.result())
            print("variant done:", json.dumps(rows[-1]), flush=True)
    print(json.dumps({"vaes": vaes, "variants": rows}, indent=1))
    print("\n| VAE | VAE s | RGB error | reconstruction colour accuracy |\n|---|---|---|---|")
    for v in vaes:
        print(f"| {v['vae']} | {v['vae_s']} | {v['rgb_error']} | {v['recon_acc']} |")
    print(
        "\n| variant | VAE | overrides | train s | steps | "
        + " | ".join(f"colour accuracy g={g}" for g in GUIDANCE)
        + " |\n|---|---|---|---|---|"
        + "---|" * len(GUIDANCE)
    )
    for row in rows:
        vae, overrides = VARIANTS[row["name"]]
        print(
            f"| {row['name']} | {vae} | {' '.join(overrides)} | {row['train_s']} | {row.get('steps')} | "
            + " | ".join(str(row.get(f"g{g}")) for g in GUIDANCE)
            + " |"
        )


if __name__ == "__main__":
    main()
