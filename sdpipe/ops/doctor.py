"""`sdpipe doctor`: what this machine offers and whether the weights the config needs can be found offline."""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

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


def _check(name: str, finder) -> tuple[str, str, bool]:
    try:
        return name, f"found: {finder()}", True
    except UserError as exc:
        text = str(exc)
        return name, text if text.startswith(("missing: ", "unreadable: ")) else f"missing: {text}", False


def _unreadable(what: str) -> UserError:
    return UserError(f"unreadable: {what}")


def _read_config(path: Path) -> None:
    import json

    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unreadable(f"{path} does not parse as JSON ({str(exc).splitlines()[0]})") from None


def _component_weights(folder: Path, name: str, variant: str | None) -> list[Path]:
    """The weight files from_pretrained will read for one component (of `variant`), each header checked."""
    from sdpipe import single_file
    from sdpipe.weights import weight_variant

    files = [
        p
        for p in sorted(folder.iterdir())
        if p.suffix in (".safetensors", ".bin") and weight_variant(p.name) == variant
    ]
    if not files:
        raise UserError(f"missing: {folder} has no {variant or 'plain'} weights for {name} (*.safetensors or *.bin)")
    for path in files:
        if path.suffix == ".safetensors":
            try:
                single_file.safetensors_header(path)
            except (UserError, OSError) as exc:
                raise _unreadable(str(exc)) from None
        elif path.stat().st_size == 0:
            raise _unreadable(f"{path} is empty")
    return files


def pipeline_status(root: Path, variant: str | None = None) -> str:
    """What from_pretrained on `root` needs, checked without loading a tensor: model_index.json, every listed
    component's configs parsing, and the UNet/VAE/text encoders' weight files with readable, whole headers."""
    from sdpipe import io
    from sdpipe.models import families

    if not (root / "model_index.json").is_file():
        raise UserError(f"missing: {root} has no model_index.json (not a diffusers pipeline folder)")
    _read_config(root / "model_index.json")
    index, count, size = io.read_json(root / "model_index.json"), 0, 0
    for name, entry in index.items():
        if not (isinstance(entry, list) and entry[0] is not None):
            continue
        folder = root / name
        if not folder.is_dir():
            raise UserError(f"missing: {folder}/ (listed in model_index.json)")
        for config in folder.glob("*.json"):
            _read_config(config)
        if name in families.components():
            size += sum(p.stat().st_size for p in _component_weights(folder, name, variant))
        count += 1
    return f"{root} ({count} components, {size / 1e9:.2f} GB of weights)"


def single_file_status(path: Path) -> str:
    """A single-file checkpoint: its header or keys read, its family recognised and its conversion configs here."""
    from sdpipe import single_file

    try:
        info = single_file.tensor_info(path)
        family = single_file.family(path, info)
    except UserError as exc:
        raise _unreadable(str(exc)) from None
    source = single_file.config_source(info)
    single_file.config_folder(path, source, family)
    return (
        f"{path}: single-file {family} checkpoint, {len(info)} tensors; converted once, on first use, with the "
        f"configs of {source}"
    )


def model_status(name: str, revision: str | None, variant: str | None) -> str:
    from sdpipe import single_file, weights

    if weights.is_local(name) and single_file.is_checkpoint(name):
        return single_file_status(Path(name).expanduser())
    return pipeline_status(weights.resolve(name, revision), variant)


def weight_rows(cfg: Config) -> list[tuple[str, str, bool]]:
    """(what, where or why not, found) for every set of weights this config will load. "found" means the files
    are whole and readable, not only present."""
    from sdpipe import weights

    m = cfg.model
    if m.build_preset:
        built = weights.is_local(m.pretrained) and (Path(m.pretrained) / "model_index.json").is_file()
        note = "built" if built else "not built yet; the workflow builds it (rule base_model)"
        rows = [(f"model ({m.build_preset} preset)", f"{m.pretrained}: {note}", True)]
    else:
        rows = [_check(f"model {m.pretrained}", lambda: model_status(m.pretrained, m.revision, m.variant))]
    if "blip" in cfg.caption.chain:
        rows.append(_check(f"captioner blip {cfg.caption.blip.model}", lambda: weights.resolve(cfg.caption.blip.model)))
    if "clip_tags" in cfg.caption.chain:
        from sdpipe import captioners

        ct = cfg.caption.clip_tags
        memo = Path(cfg.cache_dir) / "weight-hashes.json"
        rows.append(
            _check(
                f"captioner clip_tags {ct.model}/{ct.pretrained}",
                lambda: captioners.describe(cfg, "clip_tags", memo).local,
            )
        )
    return rows


def run(cfg: Config, strict: bool = False) -> int:
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
        console.print(
            f"{len(missing)} weight set(s) missing or unreadable: fetch them where there is internet "
            "(`sdpipe fetch-model` for the base model, `hf download ID` for others) or point the config "
            "at a local copy."
        )
    return 1 if strict and missing else 0
