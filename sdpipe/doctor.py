"""`sdpipe doctor`: what this machine offers and whether the weights the config needs can be found offline."""

from __future__ import annotations

import importlib.metadata as md
import platform
from pathlib import Path
import sys

from sdpipe.errors import UserError

PACKAGES = ("torch", "diffusers", "transformers", "accelerate", "peft", "open_clip_torch", "snakemake", "dvc")


def _version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"


def system_rows() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    rows = [("python", f"{platform.python_version()} ({sys.executable})")]
    rows += [(name, _version(name)) for name in PACKAGES]
    rows.append(("cuda", f"{torch.version.cuda} (available: {torch.cuda.is_available()})"))
    count = torch.cuda.device_count()
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    rows.append(("gpus", f"{count}" + (f": {names}" if names else "")))
    nccl = dist.is_available() and dist.is_nccl_available()
    if nccl and count:
        rows.append(("nccl", "available " + ".".join(map(str, torch.cuda.nccl.version()))))
    else:
        rows.append(("nccl", "built into torch, but no GPU to run it" if nccl else "not available"))
    rows.append(("gloo", "available" if dist.is_available() and dist.is_gloo_available() else "not available"))
    return rows


def gpu_facts() -> dict:
    """GPU model, count and driver (for provenance); nulls on a CPU-only machine."""
    import subprocess

    import torch

    count = torch.cuda.device_count()
    driver = None
    if count:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            driver = out[0] if out else None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {"name": torch.cuda.get_device_name(0) if count else None, "count": count, "driver": driver,
            "cuda": torch.version.cuda}


def _check(name: str, finder) -> tuple[str, str, bool]:
    try:
        return name, f"found: {finder()}", True
    except UserError as exc:
        return name, str(exc), False


def weight_rows(cfg) -> list[tuple[str, str, bool]]:
    """(what, where or why not, found) for every set of weights this config will load."""
    from sdpipe import weights

    m = cfg.model
    if m.build_preset:
        built = weights.is_local(m.pretrained) and (Path(m.pretrained) / "model_index.json").is_file()
        note = "built" if built else "not built yet; the workflow builds it (rule base_model)"
        rows = [(f"model ({m.build_preset} preset)", f"{m.pretrained}: {note}", True)]
    else:
        rows = [_check(f"model {m.pretrained}", lambda: weights.resolve(m.pretrained, m.revision))]
    if "blip" in cfg.caption.chain:
        rows.append(_check(f"captioner blip {cfg.caption.blip.model}", lambda: weights.resolve(cfg.caption.blip.model)))
    if "clip_tags" in cfg.caption.chain:
        from sdpipe import captioners

        ct = cfg.caption.clip_tags
        memo = Path(cfg.cache_dir) / "weight-hashes.json"
        rows.append(_check(f"captioner clip_tags {ct.model}/{ct.pretrained}",
                           lambda: captioners.describe(cfg, "clip_tags", memo).local))
    return rows


def run(cfg, strict: bool = False) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="sdpipe doctor: system", show_header=False)
    for key, value in system_rows():
        table.add_row(key, value)
    console.print(table)
    table = Table(title="weights this config needs (offline)")
    for col in ("what", "status"):
        table.add_column(col)
    rows = weight_rows(cfg)
    for what, status, ok in rows:
        table.add_row(what, f"[green]{status}[/]" if ok else f"[red]{status}[/]")
    console.print(table)
    missing = [r for r in rows if not r[2]]
    if missing:
        console.print(f"{len(missing)} weight set(s) missing: fetch them where there is internet "
                      "(hf download ID) or point the config at a local copy.")
    return 1 if strict and missing else 0
