"""Checkpoint saves that fail say why in one line (issue 26, item 7: a full disk gave a torch error that never said
the disk was full)."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest

from sdpipe.errors import UserError
from sdpipe.train import checkpoint


def _accelerator(error: BaseException) -> SimpleNamespace:
    def save_state(folder):
        raise error

    return SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None, save_state=save_state)


def test_a_full_disk_is_named_and_leaves_no_half_checkpoint(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    torch_says = RuntimeError(
        "[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file data/0: file write failed"
    )
    torch_says.__context__ = full
    with pytest.raises(UserError, match=r"^the disk is full: checkpoint checkpoint-00000004 could not be saved"):
        checkpoint.save(_accelerator(torch_says), tmp_path, 4, {"step": 4}, keep=3)
    assert list(tmp_path.iterdir()) == []


def test_other_save_errors_are_not_called_a_full_disk(tmp_path):
    with pytest.raises(RuntimeError, match="something else"):
        checkpoint.save(_accelerator(RuntimeError("something else")), tmp_path, 4, {"step": 4}, keep=3)
