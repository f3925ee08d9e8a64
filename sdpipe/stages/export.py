"""Export the trained weights as files people load elsewhere, and verify each by reloading it.

Formats: a diffusers pipeline folder (StableDiffusion(XL)Pipeline.from_pretrained), one original-layout
.safetensors (A1111, ComfyUI, diffusers' from_single_file) and, for LoRA runs, the LoRA in diffusers/peft and kohya
format. Every export is reloaded with diffusers' own loader and renders the verification prompt with a fixed seed;
that image is compared with the one the trained model itself renders, and the difference goes into the summary.

The renders run on the machine's first GPU in fp16 when it has one (export.verify.device: auto), the trained
model's reference image too, so that an export and the reference differ only by what exporting changed; on a CPU
they run in fp32. Noise comes from a CPU generator seeded by export.verify.seed: the same image on every rerun.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io
from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config
    from sdpipe.export.verify import Check

log = logging.getLogger(__name__)
INPUTS = {"final": "results/train/final"}
OUTPUTS = {"out": "results/export", "summary": "results/export/summary.json"}
# The config keys the outputs depend on (stages/declared.py).
READS = ("export", "model", "train.prediction_type", "prepare.buckets")
MAX_VERIFY_SIDE = 512  # export.verify.resolution: null renders at the training resolution, at most this


def trained_source(cfg: Config, final: Path) -> tuple[Path, dict]:
    """The folder of trained weights to export (final/ or final/ema/) and what it holds."""
    if not (final / "final.json").is_file():
        raise UserError(f"no trained model at {final}; run `snakemake train` first")
    info = io.read_json(final / "final.json")
    if cfg.export.ema and not info.get("ema"):
        raise UserError(
            "export.ema is true but the run kept no EMA; set train.ema.enabled and retrain, or export.ema: false"
        )
    return (final / "ema" if cfg.export.ema else final), info


def remove_stale(out: Path, files) -> None:
    """Exported weight files of an earlier export.name (or export.single_file) go: the folder is this stage's
    output, and a user copying it must not find an older run's model beside this one."""
    keep = {out / f for f in files.files().values()}
    for path in [*out.glob("*.safetensors"), *(out / "lora").glob("*.safetensors")]:
        if path not in keep:
            log.info("export: removing %s (not a file of this export's name)", path)
            path.unlink()


def verification(cfg: Config, out: Path) -> Check:
    """export.verify's render, at the training resolution (at most MAX_VERIFY_SIDE) unless it sets one."""
    from sdpipe.export.verify import Check, device_for

    v = cfg.export.verify
    height, width = v.resolution or [min(cfg.prepare.buckets.resolution, MAX_VERIFY_SIDE)] * 2
    device, dtype = device_for(v.device)
    return Check(v, (height, width), out, cfg.train.prediction_type, device, dtype)


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from sdpipe.export import verify
    from sdpipe.export.metadata import base_version, file_metadata
    from sdpipe.export.names import export_files

    out, e = Path(outputs["out"]), cfg.export
    source, info = trained_source(cfg, Path(inputs["final"]))
    components = info["components"]
    lora = "lora" in components.values()
    files = export_files(e.name, e.single_file, lora)
    remove_stale(out, files)
    if lora:
        from sdpipe.export.lora import check_lora_matches

        check_lora_matches(source, cfg.model.pretrained)  # before any rendering
    check = verification(cfg, out)
    log.info("export: verification renders on %s in %s", check.device, str(check.dtype).removeprefix("torch."))

    def trained(fuse: bool, **where):
        return verify.trained_pipeline(cfg.model, cfg.train.prediction_type, source, components, fuse, **where)

    reference = verify.render(trained(False, dtype=check.dtype, device=check.device), check)
    verify.check_reference(reference)
    verify.compare("trained", reference, reference, check)
    folder = verify.save_diffusers(trained(True), out / files.diffusers, e.dtype)
    formats = {"diffusers": verify.diffusers_folder(folder, reference, check)}
    if e.single_file:
        metadata = file_metadata(cfg, info, folder)
        formats["single_file"] = verify.single_file(
            folder, out / files.single_file, e.dtype, metadata, info["family"], reference, check
        )
    if lora:
        from sdpipe.export.lora import read_lora
        from sdpipe.models import families

        adapter = read_lora(source)[1].get(families.named(info["family"]).denoiser, {})
        metadata = file_metadata(cfg, info, folder, adapter)
        formats.update(verify.loras(cfg.model, source, files, metadata, reference, check))
    # family and base version: what the model card says was trained (kohya's names, as in the files' metadata)
    summary = {
        "source": str(source),
        "components": components,
        "family": info["family"],
        "base_model_version": base_version(folder, info["family"]),
        "name": e.name,
        "dtype": e.dtype,
        "ema": e.ema,
        "verify": {
            **vars(e.verify),
            "rendered_on": check.device,
            "render_dtype": str(check.dtype).removeprefix("torch."),
        },
        "reference_image": str(out / "verify" / "trained.png"),
        "formats": formats,
    }
    io.write_json(outputs["summary"], summary)
    _log_and_check(formats, e.verify.tolerance, outputs["summary"])
    return summary


def _log_and_check(formats: dict, tolerance: float, summary: Path) -> None:
    for name, result in formats.items():
        log.info(
            "export %s: %s (mean |diff| %.3f, max %d RGB levels) %s",
            name,
            result["path"],
            result["mean_abs_diff"],
            result["max_abs_diff"],
            "verified" if result["verified"] else "FAILED",
        )
    failed = [name for name, r in formats.items() if not r["verified"]]
    if failed:
        raise UserError(
            f"export verification failed for {', '.join(failed)} (mean difference above "
            f"export.verify.tolerance = {tolerance}); see {summary}"
        )
