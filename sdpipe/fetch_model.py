"""`sdpipe fetch-model`: download, where there is internet, only the files of the base model this config loads.

A diffusers repo on the Hub holds far more than a job reads: SD 1.5's has fp32 and fp16 weights, .bin copies of
each, EMA/non-EMA UNets, ONNX and Flax exports and whole-model single files beside the diffusers folders. Here the
repo's model_index.json names the components; each gets its configs and tokenizer files, and the UNet, VAE and
text encoders get the weights of one variant (model.variant: `*.fp16.safetensors`; unset: the plain
`*.safetensors`), never both, and .bin files only where a component has no safetensors at all. For a single-file
model.pretrained only the configs and tokenizers of model.single_file_config (or diffusers' default repo for the
file's type) are fetched: the weights are in the file. Everything lands in the Hugging Face cache, where
`weights.resolve` finds it offline.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe.errors import UserError
from sdpipe.models import families
from sdpipe.weights import weight_variant

if TYPE_CHECKING:
    from sdpipe.config import Config

SMALL = (".json", ".txt", ".model")  # configs, shard indexes, tokenizer vocab/merges/sentencepiece


def component_files(
    index: dict, repo_files: list[str], variant: str | None, weights: bool | tuple[str, ...] = True
) -> list[str]:
    """The files of the repo a job reads: model_index.json, every listed component's small files and the weights
    of `variant` (safetensors, else .bin) of the components in `weights` (True: every component sdpipe loads)."""
    components = [name for name, entry in index.items() if isinstance(entry, list) and entry[0] is not None]
    loaded = families.components() if weights is True else weights or ()
    chosen = ["model_index.json"]
    for comp in components:
        inside = [f for f in repo_files if f.startswith(f"{comp}/") and f.count("/") == 1]
        chosen += [f for f in inside if f.endswith(SMALL)]
        if comp in loaded:
            chosen += _weights(comp, inside, variant)
    return chosen


def _weights(comp: str, files: list[str], variant: str | None) -> list[str]:
    for suffix in (".safetensors", ".bin"):
        of_kind = [f for f in files if f.endswith(suffix)]
        picked = [f for f in of_kind if weight_variant(f.split("/")[-1]) == variant]
        if picked:
            return picked
        if of_kind:  # safetensors exist, just not this variant: never fall back to .bin copies
            have = sorted({weight_variant(f.split("/")[-1]) or "plain" for f in of_kind})
            raise UserError(
                f"the repo has no {variant or 'plain'} {suffix} weights for {comp} (it has: "
                f"{', '.join(have)}); set model.variant to one of those (null = plain)"
            )
    raise UserError(f"the repo has no .safetensors or .bin weights for {comp}")


def plan(cfg: Config) -> list[tuple[str, str | None, bool | tuple[str, ...]]] | str:
    """(hub repo, revision, the components whose weights it needs: True for all) to fetch for this config, or why
    there is nothing to fetch. For a single file: the configs, and the weights of what the file lacks."""
    from sdpipe import single_file, weights

    m = cfg.model
    if m.build_preset:
        return f"nothing to fetch: model.build_preset = {m.build_preset} builds a random-init model at {m.pretrained}"
    if single_file.is_checkpoint(m.pretrained):
        info = single_file.tensor_info(m.pretrained)
        source = m.single_file_config or single_file.default_config(info)
        if weights.is_local(source):
            return f"nothing to fetch: {m.pretrained} is a single file and {single_file.KEY} a local folder ({source})"
        return [(source, None, tuple(single_file.parts_not_in_file(info, single_file.family(m.pretrained, info))))]
    if weights.is_local(m.pretrained):
        if m.pretrained.endswith(weights.WEIGHT_SUFFIXES):
            raise UserError(f"model.pretrained = {m.pretrained}: no such file")
        return f"nothing to fetch: model.pretrained is a local folder ({m.pretrained})"
    return [(m.pretrained, m.revision, True)]


def fetch_repo(
    repo: str, revision: str | None, variant: str | None, with_weights: bool | tuple[str, ...]
) -> tuple[Path, list[str]]:
    """Download the job's files of `repo` into the HF cache; (snapshot folder, files)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    from sdpipe import io

    try:
        files = [s.rfilename for s in HfApi().model_info(repo, revision=revision).siblings or []]
        if "model_index.json" not in files:
            raise UserError(f"{repo} is not a diffusers pipeline repo (no model_index.json)")
        index = io.read_json(hf_hub_download(repo, "model_index.json", revision=revision))
        wanted = component_files(index, files, variant if with_weights else None, weights=with_weights)
        folder = snapshot_download(repo, revision=revision, allow_patterns=[_literal(f) for f in wanted])
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise UserError(
            f"{repo}{f'@{revision}' if revision else ''} not found on the Hub (or private: set "
            f"HF_TOKEN): {str(exc).splitlines()[0]}"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise UserError(f"cannot fetch {repo}: {str(exc).splitlines()[0]}") from None
    return Path(folder), wanted


def _literal(name: str) -> str:
    """An fnmatch pattern matching exactly `name` (allow_patterns are patterns)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def fetch_model(cfg: Config) -> list[str]:
    """Fetch what the config's base model needs; lines saying what and how much."""
    todo = plan(cfg)
    if isinstance(todo, str):
        return [todo]
    lines = []
    for repo, revision, with_weights in todo:
        folder, files = fetch_repo(repo, revision, cfg.model.variant, with_weights)
        sizes = {f: (folder / f).stat().st_size for f in files if (folder / f).is_file()}
        if with_weights is True:
            what = f"weights{f' ({cfg.model.variant})' if cfg.model.variant else ''}, configs and tokenizers"
        elif with_weights:
            what = f"configs, tokenizers and the weights the single file lacks ({', '.join(with_weights)})"
        else:
            what = "configs and tokenizers only (the weights are in the single file)"
        lines.append(f"{repo}{f'@{revision}' if revision else ''}: {what} in {folder}")
        lines += [f"  {f}  {_size(n)}" for f, n in sizes.items()]
        lines.append(f"total {_size(sum(sizes.values()))} in {len(sizes)} files")
    return lines


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
