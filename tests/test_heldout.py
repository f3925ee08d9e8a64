"""The held-out loss (train.validation.heldout_every): fixed timesteps and noise on the eval split, logged in
metrics.csv at its interval, the same in two identical runs and on two processes as on one."""

from __future__ import annotations

import pytest
import torch

from sdpipe import config
from sdpipe.errors import UserError
from sdpipe.models import families
from sdpipe.models.loading import load_noise_scheduler
from tests.conftest import cache_latents, small_config
from tests.test_train import metrics, train

HELDOUT = {"validation": {"heldout_every": 2, "heldout_timesteps": [0.2, 0.6]}}


def test_fixed_timesteps_are_fractions_of_each_familys_schedule(tiny_model):
    scheduler = load_noise_scheduler(str(tiny_model))
    ddpm = families.named("sd").objective.at_fractions(scheduler, [0.1, 0.5, 0.999])
    assert ddpm.tolist() == [100, 500, 999] and not ddpm.is_floating_point()
    flow = families.named("flux").objective.at_fractions(scheduler, [0.1, 0.5])
    assert flow.tolist() == pytest.approx([100.0, 500.0])


def test_the_heldout_loss_needs_an_eval_split():
    with pytest.raises(UserError, match="train.validation.heldout_every needs held-out images"):
        config.from_dict({"prepare": {"eval_fraction": 0.0}, "train": HELDOUT})


@pytest.fixture(scope="module")
def cache(tmp_path_factory, demo_source, tiny_model):
    """The demo's latent cache with a quarter of the images held out, their latents cached for the held-out loss."""
    tmp = tmp_path_factory.mktemp("heldout")
    raw_cfg = small_config(tmp, demo_source, tiny_model, prepare={"eval_fraction": 0.25}, train=HELDOUT)
    return cache_latents(tmp, raw_cfg), raw_cfg


@pytest.mark.slow
def test_the_heldout_loss_is_logged_and_the_same_across_runs_and_process_counts(tmp_path, cache):
    from sdpipe import io

    held = io.read_json(cache[0])["eval_items"]
    assert 0 < len(held) <= 64 and not any(item["flip_key"] or item["text_keys"] for item in held)
    settings = {**HELDOUT, "max_steps": 4, "log_every": 4}
    train(tmp_path, cache, "a", **settings)
    train(tmp_path, cache, "b", **settings)
    train(tmp_path, cache, "two", num_processes=2, per_device_batch_size=2, **settings)
    rows = {run: metrics(tmp_path / run) for run in ("a", "b", "two")}
    # rows at steps 2 and 4 (held-out), 4 also the training log; the held-out cells filled exactly there
    assert [(r["step"], r["heldout_loss"] != "") for r in rows["a"]] == [("2", True), ("4", True)]
    values = {run: [float(r["heldout_loss"]) for r in rs] for run, rs in rows.items()}
    assert values["a"] == values["b"], "fixed timesteps and noise: the same run gives the same curve"
    torch.testing.assert_close(torch.tensor(values["two"]), torch.tensor(values["a"]), rtol=2e-4, atol=1e-6)
    assert values["a"][0] != values["a"][1], "it follows the weights"


def test_an_empty_eval_split_trains_without_the_curve_and_says_so(tmp_path, caplog):
    from sdpipe import io
    from sdpipe.train import heldout

    cfg = config.from_dict({"train": HELDOUT})
    io.write_json(tmp_path / "index.json", {"items": [{"id": "x"}], "eval_items": []})
    assert heldout.load(cfg, tmp_path / "index.json", verify=False) is None
    assert "no held-out loss: the eval split has no images" in caplog.text
