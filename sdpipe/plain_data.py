"""Refuse pickles that hold code (issue 26): some libraries we call unpickle files with `weights_only=False` (the
FID weights in torch-fidelity, accelerate's custom checkpoint objects). Such a file may come from anyone: a
checkpoint folder handed to a user, a weights file copied from elsewhere. Loading it first with
`weights_only=True`, which rebuilds only tensors and plain containers, proves that the full load runs no code."""

from __future__ import annotations

import re
from pathlib import Path

from sdpipe.errors import UserError


def check(path: str | Path, what: str) -> None:
    """Raise a one-line UserError unless `path` unpickles as plain data (tensors, numbers, strings, containers)."""
    import pickle

    import torch

    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"(?i)unsupported global:? (?:GLOBAL )?([\w.]+)", str(exc))  # torch's wording varies
        if found:  # anything else (a damaged file) is left to the loader, which names its own error
            raise UserError(
                f"{path} ({what}) holds a pickled {found.group(1)}, not plain data; sdpipe will not unpickle it"
            ) from None
