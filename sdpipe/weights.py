"""Find model weights offline and hash them.

A model is named by a local path or a hub id. Nothing here downloads: a hub id must already be in the Hugging Face
cache (HF_HOME), or the user gets one line saying how to fetch it. Weight hashes are part of every cache key, so a
cache is never reused across different weights; hashing a multi-GB file is slow, so hashes are memoised by
(real path, size, mtime) in a small JSON file beside the caches.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from sdpipe import hashing, io
from sdpipe.errors import UserError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
CONFIG_NAMES = ("config.json", "model_index.json", "scheduler_config.json")
SHARD = re.compile(r"-\d{5}-of-\d{5}")


def weight_variant(name: str) -> str | None:
    """The variant a weight file belongs to, as diffusers and transformers name them:
    `diffusion_pytorch_model.fp16.safetensors` and `model.fp16-00001-of-00002.safetensors` -> fp16,
    `model-00001-of-00002.safetensors` -> None (plain), `diffusion_pytorch_model.non_ema.safetensors` -> non_ema."""
    parts = SHARD.sub("", name.rsplit(".", 1)[0]).split(".", 1)
    return parts[1] if len(parts) > 1 else None


def is_local(name: str) -> bool:
    return Path(name).expanduser().exists() or name.startswith(("/", "./", "../", "~"))


def resolve(name: str, revision: str | None = None) -> Path:
    """A local folder or file for `name`: the path itself, a single-file checkpoint's converted diffusers folder
    (sdpipe.single_file, converted once), or the hub id's snapshot in the local HF cache."""
    if is_local(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise UserError(f"model path {name} does not exist")
        from sdpipe import single_file

        return single_file.as_folder(path) if single_file.is_checkpoint(path) else path
    from huggingface_hub import errors, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub < 2 does not check completeness
    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except incomplete as exc:
        # The cached file list names every file of the repo; `sdpipe fetch-model` fetched only those a job needs
        # (one variant, no .bin/onnx copies). Loading says which file is missing, if one the job needs is.
        return Path(exc.snapshot_path)
    except (LocalEntryNotFoundError, OSError, ValueError):
        if looks_like_path(name):
            raise UserError(
                f"model path {name} does not exist (nothing at {Path(name).resolve()}; as a hub id it is "
                f"not in the local Hugging Face cache either)"
            ) from None
        raise UserError(
            f"weights for {name!r} are not in the local Hugging Face cache; on a machine with internet "
            f"run `sdpipe fetch-model` (only the files the config needs) or `hf download {name}` (or set "
            f"the config to a local folder)"
        ) from None


def looks_like_path(name: str) -> bool:
    """A name that cannot be a hub id ("org/name") or whose first part is a local folder: a mistyped path, not a
    model to download."""
    parts = name.split("/")
    return len(parts) > 2 or name.endswith(WEIGHT_SUFFIXES) or (len(parts) == 2 and Path(parts[0]).is_dir())


def files_to_hash(path: Path, every_file: bool = False) -> list[Path]:
    if path.is_file():
        return [path]
    wanted = lambda p: every_file or p.suffix in WEIGHT_SUFFIXES or p.name in CONFIG_NAMES
    chosen = [p for p in sorted(path.rglob("*")) if p.is_file() and wanted(p)]
    if not chosen:
        raise UserError(f"no weight files (*.safetensors, *.bin, ...) under {path}")
    return chosen


class HashMemo:
    """sha256 of files, remembered by (real path, size, mtime_ns) so unchanged weights are hashed once."""

    def __init__(self, memo_file: str | Path | None):
        self.memo_file = Path(memo_file) if memo_file else None
        self.memo: dict[str, str] = {}
        if self.memo_file and self.memo_file.is_file():
            try:
                self.memo = json.loads(self.memo_file.read_text())
            except (OSError, ValueError):
                self.memo = {}

    def file_hash(self, path: Path) -> str:
        real = os.path.realpath(path)
        st = os.stat(real)
        key = f"{real}|{st.st_size}|{st.st_mtime_ns}"
        if key not in self.memo:
            self.memo[key] = hashing.sha256_file(real)
            if self.memo_file:
                io.write_json(self.memo_file, self.memo)
        return self.memo[key]

    def tree_hash(self, path: Path, every_file: bool = False) -> str:
        """One hash for a weights folder (or file): names relative to it, plus each file's content hash."""
        root = path if path.is_dir() else path.parent
        files = files_to_hash(path, every_file)
        return hashing.key_of([(str(p.relative_to(root)), self.file_hash(p)) for p in files])


def weights_hash(
    name: str,
    subfolder: str | None = None,
    revision: str | None = None,
    memo_file: str | Path | None = None,
    every_file: bool = False,
) -> str:
    """Hash of a model's weight and config files (every_file: all files, e.g. for a tokenizer folder)."""
    path = resolve(name, revision)
    if subfolder:
        path = path / subfolder
        if not path.exists():
            raise UserError(f"model {name} has no {subfolder}/ folder")
    return HashMemo(memo_file).tree_hash(path, every_file)
