"""The families' noise objective against hand-computed cases (models/objectives.py), and the training loss built on
it (train/objective.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDPMScheduler

from sdpipe.models import families
from sdpipe.models.objectives import DDPM
from sdpipe.train import objective

# Two steps, betas 0.1 and 0.5: alpha_bar is 0.9 at t=0 and 0.9 * 0.5 = 0.45 at t=1.
SCHEDULER = DDPMScheduler(num_train_timesteps=2, beta_schedule="linear", beta_start=0.1, beta_end=0.5)
X, EPS = torch.full((1, 1, 1, 1), 1.0), torch.full((1, 1, 1, 1), 2.0)


@pytest.mark.parametrize("t, alpha_bar", [(0, 0.9), (1, 0.45)])
def test_ddpm_noises_and_targets_as_the_paper_writes(t, alpha_bar):
    steps = torch.tensor([t])
    a, s = math.sqrt(alpha_bar), math.sqrt(1 - alpha_bar)
    assert DDPM().noisy(SCHEDULER, X, EPS, steps).item() == pytest.approx(
        a * 1.0 + s * 2.0
    )  # sqrt(ab) x + sqrt(1-ab) e
    assert DDPM().target(SCHEDULER, X, EPS, steps, "epsilon").item() == 2.0
    assert DDPM().target(SCHEDULER, X, EPS, steps, "v_prediction").item() == pytest.approx(a * 2.0 - s * 1.0)


def test_min_snr_weights_epsilon_and_v_prediction():
    steps = torch.tensor([0, 1])  # SNR = ab / (1 - ab): 9 and 0.45 / 0.55
    snr = torch.tensor([9.0, 0.45 / 0.55])
    eps = DDPM().snr_weight(SCHEDULER, steps, "epsilon", 5.0)
    v = DDPM().snr_weight(SCHEDULER, steps, "v_prediction", 5.0)
    assert eps.tolist() == pytest.approx([5 / 9, 1.0])  # min(SNR, 5) / SNR
    assert v.tolist() == pytest.approx((torch.minimum(snr, torch.tensor(5.0)) / (snr + 1)).tolist())


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_a_denoiser_that_predicts_the_target_has_zero_loss(prediction):
    """sample_losses asks the family's objective for the input and the target: a forward that returns exactly the
    objective's target for the noisy input scores zero, and one that is off by 1 everywhere scores 1 per sample."""
    fam = families.named("sd")
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    draws = {"noise": noise, "timesteps": torch.tensor([0, 1])}
    tgt = fam.objective.target(SCHEDULER, latents, noise, draws["timesteps"], prediction)
    noisy = fam.objective.noisy(SCHEDULER, latents, noise, draws["timesteps"])
    t = SimpleNamespace(input_perturbation=0.0, snr_gamma=None)

    def forward(offset):
        def call(x, steps, encoder_hidden_states, added_cond_kwargs):
            assert torch.equal(x, noisy) and added_cond_kwargs is None  # SD: no pooled or size conditioning
            return SimpleNamespace(sample=tgt + offset)

        return call

    def losses(offset):
        return objective.sample_losses(
            forward(offset), fam, SCHEDULER, latents, draws, {"hidden": None}, t, prediction, torch.no_grad
        )

    assert losses(0.0).tolist() == [0.0, 0.0]
    assert losses(1.0).tolist() == pytest.approx([1.0, 1.0])
