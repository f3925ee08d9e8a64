"""No pickled code is run from files a user may be handed (issue 26, item 7)."""

from __future__ import annotations

import os

import pytest
import torch

from sdpipe import plain_data
from sdpipe.errors import UserError


class Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_plain_state_passes_and_pickled_code_is_refused(tmp_path):
    torch.save({"base_lrs": [1e-4], "last_epoch": 3, "shadow": [torch.zeros(2)]}, tmp_path / "plain.pkl")
    plain_data.check(tmp_path / "plain.pkl", "a scheduler state")
    torch.save({"base_lrs": [1e-4], "x": Payload()}, tmp_path / "evil.pkl")
    with pytest.raises(UserError, match=r"holds a pickled (posix|os)\.system, not plain data"):
        plain_data.check(tmp_path / "evil.pkl", "a scheduler state")
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


def test_a_checkpoint_with_pickled_code_is_refused_before_accelerate_unpickles_it(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from sdpipe.train import loop

    ckpt = tmp_path / "checkpoint-00000002"
    ckpt.mkdir()
    (ckpt / "sdpipe_state.json").write_text('{"model_id": "m"}')
    torch.save({"x": Payload()}, ckpt / "custom_checkpoint_0.pkl")
    loaded = []
    run = SimpleNamespace(model_id="m", accelerator=SimpleNamespace(load_state=loaded.append))
    with pytest.raises(UserError, match="not plain data"):
        loop._load(run, ckpt)
    assert loaded == []
