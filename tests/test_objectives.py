"""The families' noise objective against hand-computed cases (models/objectives.py), and the training loss built on
it (train/objective.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDPMScheduler

from sdpipe.models import families, objectives
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
    eps = DDPM().weight(SCHEDULER, steps, "epsilon", 5.0)
    v = DDPM().weight(SCHEDULER, steps, "v_prediction", 5.0)
    assert DDPM().weight(SCHEDULER, steps, "epsilon", None) is None  # train.snr_gamma unset: equal weights
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
    t = SimpleNamespace(input_perturbation=0.0, snr_gamma=None, masked_loss=SimpleNamespace(unmasked_weight=0.0))

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


# --- rectified flow (SD 3, Flux), each formula on a case worked by hand ---------------------------------------------

FLOW = SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000))


def test_timestep_densities_and_shifts():
    assert objectives.mode_sample(torch.tensor([0.5]), 1.29).item() == pytest.approx(0.5)  # cos^2(pi/4) = 1/2
    # u = 0.25: cos^2(pi/8) = 0.853553, so 1 - 0.25 - 1.29 * (0.853553 - 1 + 0.25) = 0.616416
    assert objectives.mode_sample(torch.tensor([0.25]), 1.29).item() == pytest.approx(0.616416, abs=1e-6)
    assert objectives.shift_sigma(torch.tensor([0.5]), 3.0).item() == pytest.approx(0.75)  # 1.5 / 2
    assert objectives.shift_sigma(torch.tensor([0.2]), 3.0).item() == pytest.approx(0.6 / 1.4)
    # Flux: 0.5 at 256 tokens, 1.15 at 4096; a 512 px image (32 x 32 tokens) gets 0.5 + 0.65 * 768 / 3840 = 0.63
    assert [objectives.flux_mu(n) for n in (256, 4096, 1024)] == pytest.approx([0.5, 1.15, 0.63])
    assert objectives.time_shift(math.log(3.0), torch.tensor([0.5])).item() == pytest.approx(0.75)  # = shift 3


def test_logit_normal_and_uniform_draws_come_from_the_samples_generator():
    """The same generator state gives the same u, whatever else draws: sigmoid(mean + std * n) for n ~ N(0, 1)."""
    n = torch.randn((1,), generator=torch.Generator().manual_seed(7)).item()
    g = torch.Generator().manual_seed(7)
    u = objectives.density_sample("logit_normal", g, 0.5, 2.0, 1.29).item()
    assert u == pytest.approx(1 / (1 + math.exp(-(0.5 + 2.0 * n))))
    flat = objectives.FlowMatching(sampling="uniform", shift=3.0)
    r = torch.rand((1,), generator=torch.Generator().manual_seed(3)).item()
    t = flat.timestep(torch.Generator().manual_seed(3), FLOW).item()
    assert t == pytest.approx(1000 * 3 * r / (1 + 2 * r), rel=1e-5)  # the shifted position, in scheduler units


def test_flow_weights():
    sigma = torch.tensor([0.5, 0.25])
    assert objectives.flow_weight("sigma_sqrt", sigma).tolist() == pytest.approx([4.0, 16.0])  # 1 / sigma^2
    # cosmap at 0.5: 2 / (pi (1 - 1 + 0.5)) = 4 / pi
    assert objectives.flow_weight("cosmap", sigma)[0].item() == pytest.approx(4 / math.pi)
    assert objectives.flow_weight("none", sigma) is None


def test_flow_matching_path_target_and_preconditioning():
    """t = 250 of 1000 is sigma 0.25: x_t = 0.75 x + 0.25 e; the velocity target is e - x; preconditioned, the
    output x_t - sigma * pred of a perfect velocity prediction is x itself, and the target is x."""
    steps = torch.tensor([250.0])
    flow, pre = objectives.FlowMatching(), objectives.FlowMatching(precondition=True)
    noisy = flow.noisy(FLOW, X, EPS, steps)
    assert noisy.item() == pytest.approx(0.75 * 1.0 + 0.25 * 2.0)
    velocity = flow.target(FLOW, X, EPS, steps, "flow")
    assert velocity.item() == 1.0 and flow.output(velocity, noisy, FLOW, steps) is velocity
    assert pre.output(velocity, noisy, FLOW, steps).item() == pytest.approx(1.0)  # 1.25 - 0.25 * 1 = x
    assert pre.target(FLOW, X, EPS, steps, "flow").item() == 1.0
