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
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from sdpipe import io
from sdpipe.errors import UserError
from sdpipe.models import loading

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INPUTS = {"final": "results/train/final"}
OUTPUTS = {"out": "results/export", "summary": "results/export/summary.json"}
# The config keys the outputs depend on (stages/declared.py).
READS = ("export", "model", "train.prediction_type", "prepare.buckets")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
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


def verify_device(cfg: Config) -> tuple[str, torch.dtype]:
    """Where verification renders, in which precision (export.verify.device)."""
    if cfg.export.verify.device == "auto" and torch.cuda.is_available():
        return "cuda:0", torch.float16
    return "cpu", torch.float32


def release(*pipes) -> None:
    """Free a pipeline's GPU memory before the next one loads (SDXL pipelines are 7-14 GB each)."""
    import gc

    from diffusers.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()  # diffusers warns that an fp16 pipeline cannot run on the CPU: it will not
    for pipe in pipes:
        if pipe.device.type != "cpu":
            pipe.to("cpu")
    dlog.set_verbosity(level)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trained_pipeline(
    cfg: Config, source: Path, components: dict, fuse: bool, dtype: torch.dtype = torch.float32, device: str = "cpu"
):
    """The base pipeline with the trained components: full ones replace the base's, LoRA ones are loaded as
    adapters (fused into the weights when `fuse`, the way an exported full model holds them)."""
    from sdpipe.models.pipeline import load_pipeline

    family = loading.family_of(cfg.model.pretrained, cfg.model.revision)
    parts = {}
    for name, mode in components.items():
        if mode == "full" and name == family.denoiser:
            parts[name] = family.denoiser_type().from_pretrained(source / name, torch_dtype=dtype)
        elif mode == "full":
            parts[name] = _text_class(cfg, name).from_pretrained(source / name, torch_dtype=dtype)
    # The trained objective goes into the scheduler config, so the exported pipeline samples with it.
    pipe = load_pipeline(
        cfg.model.pretrained,
        cfg.model.revision,
        cfg.model.variant,
        device,
        dtype,
        prediction_type=cfg.train.prediction_type,
        **parts,
    )
    if "lora" in components.values():
        pipe.load_lora_weights(str(source))
        if fuse:
            pipe.fuse_lora()
            pipe.unload_lora_weights()
    return pipe


def _text_class(cfg: Config, name: str):
    import transformers

    _, index = loading.model_index(cfg.model.pretrained, cfg.model.revision)
    return getattr(transformers, index[name][1])


def render(cfg: Config, pipe) -> np.ndarray:
    """The verification image: one prompt, one seed, CPU generator, as uint8 RGB."""
    v = cfg.export.verify
    size = v.resolution or [min(cfg.prepare.buckets.resolution, MAX_VERIFY_SIDE)] * 2
    image = pipe(
        v.prompt,
        height=size[0],
        width=size[1],
        num_inference_steps=v.steps,
        guidance_scale=v.guidance,
        generator=torch.Generator(device="cpu").manual_seed(v.seed),
    ).images[0]
    return np.asarray(image.convert("RGB"))


def render_once(cfg: Config, pipe) -> np.ndarray:
    """render(), then the pipeline's memory is freed."""
    try:
        return render(cfg, pipe)
    finally:
        release(pipe)


def check_reference(image: np.ndarray) -> None:
    """A reference of one flat colour (a NaN in half precision renders black) would match any other flat image:
    verification could not tell a broken export from a good one."""
    if int(image.max()) == int(image.min()):
        raise UserError(
            f"the trained model renders a flat image (every pixel {int(image.max())}) for "
            "export.verify.prompt, so the exports cannot be verified against it; if it renders black on "
            "a GPU, try export.verify.device: cpu (fp32) to see whether fp16 overflows"
        )


def compare(name: str, image: np.ndarray, reference: np.ndarray, tolerance: float, out: Path, **details) -> dict:
    """How far a reloaded export's image is from the trained model's own (RGB levels, 0-255)."""
    from PIL import Image

    diff = np.abs(image.astype(np.int16) - reference.astype(np.int16))
    path = out / "verify" / f"{name}.png"
    with io.atomic_path(path) as tmp:
        Image.fromarray(image).save(tmp, "PNG")
    mean = float(diff.mean())
    return {
        **details,
        "max_abs_diff": int(diff.max()),
        "mean_abs_diff": round(mean, 4),
        "verified": mean <= tolerance,
        "image": str(path),
    }


def export_diffusers(cfg: Config, pipe, folder: Path, dtype: str) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    with io.atomic_dir(folder) as tmp:
        pipe.to(DTYPES[dtype]).save_pretrained(tmp, safe_serialization=True)
    release(pipe)
    return folder


def verify_diffusers(cfg: Config, folder: Path, reference: np.ndarray, out: Path) -> dict:
    from sdpipe.models.pipeline import load_pipeline

    device, dtype = verify_device(cfg)
    pipe = load_pipeline(str(folder), device=device, dtype=dtype, prediction_type=cfg.train.prediction_type)
    loader = f"{type(pipe).__name__}.from_pretrained"
    return compare(
        "diffusers",
        render_once(cfg, pipe),
        reference,
        cfg.export.verify.tolerance,
        out,
        path=str(folder),
        loader=loader,
    )


def export_single(cfg: Config, folder: Path, reference: np.ndarray, out: Path, info: dict, files) -> dict:
    from sdpipe.export.metadata import file_metadata
    from sdpipe.export.single_file import export_single_file, load_single_file

    device, dtype = verify_device(cfg)
    path = export_single_file(folder, out / files.single_file, cfg.export.dtype, file_metadata(cfg, info, folder))
    pipe = load_single_file(path, folder, info["family"], dtype).to(device)
    if cfg.train.prediction_type:
        pipe.scheduler.register_to_config(prediction_type=cfg.train.prediction_type)
    pipe.set_progress_bar_config(disable=True)
    loader = f"{type(pipe).__name__}.from_single_file"
    return compare(
        "single_file",
        render_once(cfg, pipe),
        reference,
        cfg.export.verify.tolerance,
        out,
        path=str(path),
        loader=loader,
    )


def export_loras(cfg: Config, source: Path, reference: np.ndarray, out: Path, metadata: dict, files) -> dict:
    """The LoRA as trained (diffusers/peft, alpha in its metadata) and in kohya format, each with `metadata` for
    other tools and each loaded into a fresh base pipeline with load_lora_weights, as the card tells users to."""
    from sdpipe.export.lora import LORA_FILE, export_kohya
    from sdpipe.export.metadata import add_metadata
    from sdpipe.models.pipeline import load_pipeline

    weight = out / files.lora_file
    with io.atomic_path(weight) as tmp:
        shutil.copy2(source / LORA_FILE, tmp)
    add_metadata(weight, metadata)
    kohya = export_kohya(weight, out / files.lora_kohya, cfg.model.pretrained, metadata)
    device, dtype = verify_device(cfg)
    results = {}
    for name, path, kwargs in (("lora", weight, {"weight_name": weight.name}), ("lora_kohya", kohya, {})):
        pipe = load_pipeline(
            cfg.model.pretrained,
            cfg.model.revision,
            cfg.model.variant,
            device,
            dtype,
            prediction_type=cfg.train.prediction_type,
        )
        # the folder and weight_name, the way a renamed diffusers LoRA is loaded
        pipe.load_lora_weights(str(path.parent if kwargs else path), **kwargs)
        results[name] = compare(
            name,
            render_once(cfg, pipe),
            reference,
            cfg.export.verify.tolerance,
            out,
            path=str(path),
            loader="load_lora_weights",
        )
    return results


def remove_stale(out: Path, files) -> None:
    """Exported weight files of an earlier export.name (or export.single_file) go: the folder is this stage's
    output, and a user copying it must not find an older run's model beside this one."""
    keep = {out / f for f in files.files().values()}
    for path in [*out.glob("*.safetensors"), *(out / "lora").glob("*.safetensors")]:
        if path not in keep:
            log.info("export: removing %s (not a file of this export's name)", path)
            path.unlink()


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from sdpipe.export.metadata import base_version
    from sdpipe.export.names import export_files

    out, e = Path(outputs["out"]), cfg.export
    source, info = trained_source(cfg, Path(inputs["final"]))
    components = info["components"]
    files = export_files(e.name, e.single_file, "lora" in components.values())
    remove_stale(out, files)
    if "lora" in components.values():
        from sdpipe.export.lora import check_lora_matches

        check_lora_matches(source, cfg.model.pretrained)  # before any rendering
    device, dtype = verify_device(cfg)
    log.info("export: verification renders on %s in %s", device, str(dtype).removeprefix("torch."))
    reference = render_once(cfg, trained_pipeline(cfg, source, components, fuse=False, dtype=dtype, device=device))
    check_reference(reference)
    compare("trained", reference, reference, e.verify.tolerance, out)
    folder = export_diffusers(cfg, trained_pipeline(cfg, source, components, fuse=True), out / files.diffusers, e.dtype)
    formats = {"diffusers": verify_diffusers(cfg, folder, reference, out)}
    if e.single_file:
        formats["single_file"] = export_single(cfg, folder, reference, out, info, files)
    if "lora" in components.values():
        from sdpipe.export.lora import read_lora
        from sdpipe.export.metadata import file_metadata

        adapter = read_lora(source)[1].get("unet", {})
        formats.update(export_loras(cfg, source, reference, out, file_metadata(cfg, info, folder, adapter), files))
    # family and base version: what the model card says was trained (kohya's names, as in the files' metadata)
    summary = {
        "source": str(source),
        "components": components,
        "family": info["family"],
        "base_model_version": base_version(folder, info["family"]),
        "name": e.name,
        "dtype": e.dtype,
        "ema": e.ema,
        "verify": {**vars(e.verify), "rendered_on": device, "render_dtype": str(dtype).removeprefix("torch.")},
        "reference_image": str(out / "verify" / "trained.png"),
        "formats": formats,
    }
    io.write_json(outputs["summary"], summary)
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
            f"export.verify.tolerance = {e.verify.tolerance}); see {outputs['summary']}"
        )
    return summary
