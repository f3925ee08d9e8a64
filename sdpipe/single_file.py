"""A single-file checkpoint (the .safetensors or .ckpt that A1111 and ComfyUI users have) as a diffusers folder.

Every stage loads diffusers folders, so a single file is converted once, by diffusers' own `from_single_file`, into a
folder under cache_dir named by content: the file's sha256 and the config files used. A renamed or moved file
reuses the conversion; an edited one converts anew. `weights.resolve` is the only caller: everywhere a name becomes
a folder, a single file becomes its converted folder.

Conversion needs the family's diffusers configs and tokenizer files, which the file lacks. model.single_file_config
names them (a local diffusers folder or a hub id); null takes diffusers' default repo for the detected model type.
A hub id must already be in the local Hugging Face cache (`sdpipe fetch-model` fetches just those files): nothing
is downloaded here. Only the config folder's small text files are offered to diffusers, never its weights: for a
component it does not find in the file, diffusers would silently load the config folder's weights instead.

Files that hold the denoiser alone, or the denoiser and VAE, are how SD 3.5 and Flux ship (Stability's
sd3.5_medium.safetensors, BFL's flux1-dev.safetensors; ComfyUI loads the text encoders and VAE beside them). For
those, the components diffusers does not find in the file are loaded, explicitly and said in the log, from the
config folder's weights; their weight hashes then key the converted folder as well.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from sdpipe.errors import UserError

SUFFIXES = (".safetensors", ".ckpt")
CONFIG_SUFFIXES = (".json", ".txt", ".model")  # configs, tokenizer vocab/merges, sentencepiece: no weights
VERSION = 1  # bump when the conversion changes its output for the same file, so old folders are not reused
KEY = "model.single_file_config"
_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float32"}


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    config: str | None


_settings: Settings | None = None
_converted: dict[tuple, Path] = {}  # (file identity, settings) -> folder: resolve runs at every component load


def configure(cache_dir: str | Path, config: str | None) -> None:
    """Where conversions go and which configs they use: set by sdpipe.config whenever a config is loaded, because
    `weights.resolve(name)` is called with a name alone from every stage. Spawned workers get resolved folders."""
    global _settings
    _settings = Settings(Path(cache_dir), config)


def settings() -> Settings:
    if _settings is None:
        raise RuntimeError(
            "sdpipe.single_file.configure(cache_dir, config) must run before a single-file checkpoint "
            "is resolved (sdpipe.config.load does it)"
        )
    return _settings


def is_checkpoint(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.suffix.lower() in SUFFIXES and path.is_file()


def safetensors_header(path: str | Path) -> dict:
    """The header of a .safetensors file (name -> dtype, shape, offsets), checked against the file's length, so a
    truncated download is caught without reading gigabytes."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UserError(f"{path} is not a .safetensors file (only {size} bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, 100 << 20):
            raise UserError(f"{path} is not a .safetensors file (header length {length} does not fit its {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise UserError(f"{path} is not a .safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a .safetensors file (its header is not a mapping)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + length + end > size:
        raise UserError(
            f"{path} is truncated: its header describes {8 + length + end} bytes, the file has {size} "
            f"(an interrupted download or copy?)"
        )
    return tensors


def tensor_info(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) of every tensor in the checkpoint, without reading its data where possible."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        return {k: (tuple(v["shape"]), _DTYPES.get(v["dtype"], "float32")) for k, v in safetensors_header(path).items()}
    import torch

    try:  # weights_only: a pickle may run code; mmap: a 4 GB file is not read into memory
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises anything from a bad pickle: RuntimeError, UnpicklingError, EOFError...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot read {path} as a torch checkpoint: {first}") from None
    while isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # Lightning/ldm wrap the weights
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise UserError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items() if hasattr(v, "shape")}


DENOISER_PREFIX = "model.diffusion_model."


def family(path: str | Path, info: dict) -> str:
    """The family's name from the checkpoint's key names (the original CompVis / SGM / MMDiT / BFL layouts), or a
    UserError that says what the file is instead. A family's key prefixes may sit under `model.diffusion_model.`
    (files holding more than the denoiser) or not (BFL's transformer-only files)."""
    from sdpipe.models import families

    has = lambda prefix: any(k.startswith(prefix) or k.startswith(DENOISER_PREFIX + prefix) for k in info)
    unet_in = info.get("model.diffusion_model.input_blocks.0.0.weight")
    if unet_in and len(unet_in[0]) == 4 and unet_in[0][1] != 4:
        raise UserError(
            f"{path} is an inpainting or other {unet_in[0][1]}-channel checkpoint; sdpipe fine-tunes "
            f"text-to-image SD 1.x/2.x and SDXL models (4 latent channels)"
        )
    if has("conditioner.embedders.0.model.") and not has("conditioner.embedders.1."):
        raise UserError(f"{path} is an SDXL refiner checkpoint (one OpenCLIP text encoder); fine-tune the SDXL base")
    found = families.from_single_file_keys(has)
    if found:
        return found.name
    if has("lora_") or any(".lora_" in k or "lora_down" in k for k in info):
        raise UserError(
            f"{path} is a LoRA file, not a base model; model.pretrained must be the full checkpoint it was trained on"
        )
    raise UserError(
        f"{path} is not a checkpoint of a family sdpipe trains ({', '.join(f.title for f in families.registered())}): "
        f"none of their original key layouts fits its {len(info)} tensors"
    )


def default_config(info: dict) -> str:
    """The hub repo whose configs diffusers itself would pick for this checkpoint (what from_single_file uses
    without config=)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS, infer_diffusers_model_type

    shapes = {k: SimpleNamespace(shape=v[0]) for k, v in info.items()}  # infer reads names and shapes only
    return DIFFUSERS_DEFAULT_PIPELINE_PATHS[infer_diffusers_model_type(shapes)]["pretrained_model_name_or_path"]


def config_source(info: dict) -> str:
    return settings().config or default_config(info)


def config_folder(path: str | Path, source: str, fam: str) -> Path:
    """The local folder holding `source`'s configs; a UserError that says what to run when it is not here."""
    from sdpipe import weights

    if weights.is_local(source) and not Path(source).expanduser().is_dir():
        raise UserError(f"{KEY} = {source}: no such folder (it must be a local diffusers folder or a hub id)")
    try:
        root = weights.resolve(source)
    except UserError:
        raise UserError(
            f"{path} is a single-file {fam} checkpoint; converting it needs the diffusers configs and "
            f"tokenizers of {source} ({KEY}; null picks diffusers' default for the checkpoint's type), "
            f"which are not in the local Hugging Face cache: where there is internet run `sdpipe "
            f"fetch-model --config <your config>` (configs and tokenizers only, no weights) and copy the "
            f"cache here, or set {KEY} to a local diffusers folder of this architecture"
        ) from None
    if not (root / "model_index.json").is_file():
        raise UserError(
            f"{KEY} = {source}: {root} has no model_index.json; it must be a diffusers pipeline of the "
            f"checkpoint's architecture (e.g. stabilityai/stable-diffusion-xl-base-1.0)"
        )
    return root


def config_files(root: Path) -> list[Path]:
    """The small files of a config folder that a conversion may read (and that key the converted folder)."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix in CONFIG_SUFFIXES and ".cache" not in p.relative_to(root).parts
    )


def converted_name(file_sha: str, config_hashes: list[tuple[str, str]]) -> str:
    from sdpipe import hashing

    return hashing.key_of("single-file", VERSION, file_sha, config_hashes)[:32]


def as_folder(path: str | Path) -> Path:
    """The diffusers folder for single-file checkpoint `path`, converting it the first time."""
    from sdpipe import weights

    path, s = Path(path).expanduser(), settings()
    st = os.stat(os.path.realpath(path))
    ident = (os.path.realpath(path), st.st_size, st.st_mtime_ns, s)
    if ident in _converted and (_converted[ident] / "model_index.json").is_file():
        return _converted[ident]
    info = tensor_info(path)
    fam = family(path, info)
    root = config_folder(path, config_source(info), fam)
    memo = weights.HashMemo(s.cache_dir / "weight-hashes.json")
    configs, beside = config_files(root), parts_not_in_file(info, fam)
    keyed = configs + weight_files(root, beside, path, config_source(info))
    name = converted_name(memo.file_hash(path), [(str(p.relative_to(root)), memo.file_hash(p)) for p in keyed])
    out = s.cache_dir / "base-models" / name
    if not (out / "model_index.json").is_file():
        convert(path, fam, root, configs, out, _file_dtype(info), beside)
    _converted[ident] = out
    return out


def _file_dtype(info: dict) -> str:
    """The denoiser's dtype in the file: the converted folder keeps it (an fp16 SDXL file stays 7 GB, not 14). A
    file without the prefix holds the denoiser alone."""
    denoiser = [dtype for k, (_, dtype) in info.items() if k.startswith(DENOISER_PREFIX)]
    denoiser = denoiser or [dtype for _, dtype in info.values()]
    return max(set(denoiser), key=denoiser.count) if denoiser else "float32"


def parts_not_in_file(info: dict, fam: str) -> list[str]:
    """The pipeline's VAE and text encoders that diffusers' from_single_file does not find in the file, by the same
    tests it applies (names only)."""
    import transformers
    from diffusers.loaders.single_file_utils import LDM_VAE_KEYS, is_clip_model_in_single_file, is_t5_in_single_file

    from sdpipe.models import families

    keys = dict.fromkeys(info)
    missing = [] if any(k.startswith(tuple(LDM_VAE_KEYS)) for k in info) else ["vae"]
    for part in families.named(fam).text_parts:
        encoder = getattr(transformers, part.encoder_class)
        if not (is_clip_model_in_single_file(encoder, keys) or is_t5_in_single_file(keys)):
            missing.append(part.encoder)
    return missing


def weight_files(root: Path, parts: list[str], path: Path, source: str) -> list[Path]:
    """The weight files of `parts` in config folder `root`; a UserError that says what to fetch when one has none."""
    from sdpipe import weights

    found = []
    for part in parts:
        files = sorted(p for p in (root / part).glob("*") if p.suffix in weights.WEIGHT_SUFFIXES)
        if not files:
            raise UserError(
                f"{path} holds no {', '.join(parts)}; they are taken from {source} ({KEY}), which has no "
                f"weights for {part}: run `sdpipe fetch-model` where there is internet (it fetches them), or set "
                f"{KEY} to a local diffusers folder that has them"
            )
        found += files
    return found


def convert(
    path: Path, fam: str, root: Path, configs: list[Path], out: Path, dtype: str, beside: list[str] = ()
) -> Path:
    """from_single_file(path) with `root`'s config files and its weights of the `beside` components, saved as a
    diffusers folder at `out`. Built in a temporary folder beside it and renamed into place, so a reader never sees
    half a model; if another process finished the same conversion first, its folder is kept."""
    import logging

    import torch
    from diffusers.loaders.single_file_utils import SingleFileComponentError

    from sdpipe.models import families, loading

    log = logging.getLogger(__name__)
    log.info("converting single-file %s checkpoint %s to a diffusers folder at %s (once)", fam, path, out)
    if beside:
        log.info("%s holds no %s: taken from %s", path.name, ", ".join(beside), root)
    parts = loading.load_components(str(root), list(beside), getattr(torch, dtype)) if beside else {}
    cls = families.named(fam).pipeline()
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix=".configs.", dir=out.parent) as config_copy,
        tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp,
    ):
        for p in configs:
            dest = Path(config_copy) / p.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dest)
        try:
            pipe = cls.from_single_file(
                str(path), config=config_copy, local_files_only=True, torch_dtype=getattr(torch, dtype), **parts
            )
        except (OSError, ValueError, KeyError, RuntimeError, SingleFileComponentError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(
                f"cannot convert {path} as a single-file {fam} checkpoint with the configs of {root}: "
                f"{first} (is {KEY} the right architecture?)"
            ) from None
        built = Path(tmp) / "model"
        pipe.save_pretrained(built, safe_serialization=True)
        if out.exists() and not (out / "model_index.json").is_file():
            shutil.rmtree(out)  # left by an older, non-atomic writer: nothing reads a folder without its index
        try:
            os.rename(built, out)
        except OSError:
            if not (out / "model_index.json").is_file():
                raise
    return out
