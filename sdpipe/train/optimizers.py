"""The optimizers `train.optimizer` names, each from the library that does it well: torch's fused AdamW,
bitsandbytes' 8-bit and paged 8-bit AdamW (moments stored as 8-bit blocks: a quarter of fp32's optimizer state,
which fits SDXL LoRA and larger on 24 GB), Prodigy (prodigyopt: estimates the step size itself, so
train.learning_rate is a multiplier, 1.0), Adafactor (transformers: factored second moments, no first moment) and
schedule-free AdamW (schedulefree: no decaying learning-rate schedule; the model is used at an average of the
iterates, which `eval_weights` swaps in).
The optional libraries install with `pip install 'sdpipe[optimizers]'`; a run that names one that does not load
stops in the config check, before any work."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

from sdpipe.errors import UserError

if TYPE_CHECKING:
    import torch

    from sdpipe.config import TrainConfig

# train.optimizer -> (the module it needs, the pip package that has it)
LIBRARIES = {
    "adamw": ("torch", "torch"),
    "adamw_8bit": ("bitsandbytes", "bitsandbytes"),
    "paged_adamw_8bit": ("bitsandbytes", "bitsandbytes"),
    "prodigy": ("prodigyopt", "prodigyopt"),
    "adafactor": ("transformers", "transformers"),
    "adamw_schedulefree": ("schedulefree", "schedulefree"),
}


def check_available(name: str) -> None:
    """A one-line UserError when the optimizer's library is not installed (found without importing it)."""
    module, package = LIBRARIES[name]
    if importlib.util.find_spec(module) is None:
        raise UserError(
            f"config: train.optimizer = {name} needs {package}, which is not installed: pip install "
            f"'sdpipe[optimizers]' (or {package}), or set train.optimizer: adamw"
        )


def _import(name: str) -> Any:
    module, package = LIBRARIES[name]
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - bitsandbytes raises RuntimeError and others where its binaries fail
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"train.optimizer = {name}: {package} does not load here: {first}") from None


def _adamw(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    import torch

    # Fused on GPUs and CPUs alike: one kernel per parameter group instead of a dozen ops per tensor.
    betas = (t.adam_beta1, t.adam_beta2)
    return torch.optim.AdamW(
        groups, lr=t.learning_rate, betas=betas, weight_decay=t.adam_weight_decay, eps=t.adam_epsilon, fused=True
    )


def _bitsandbytes(cls: str) -> Callable[[list[dict], TrainConfig], torch.optim.Optimizer]:
    def build(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
        optim = _import("adamw_8bit").optim
        betas = (t.adam_beta1, t.adam_beta2)
        return getattr(optim, cls)(
            groups, lr=t.learning_rate, betas=betas, weight_decay=t.adam_weight_decay, eps=t.adam_epsilon
        )

    return build


def _prodigy(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    # The settings its authors give for diffusion fine-tunes: bias correction, and the step-size estimate held
    # back during warm-up.
    return _import("prodigy").Prodigy(
        groups,
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.adam_weight_decay,
        eps=t.adam_epsilon,
        use_bias_correction=True,
        safeguard_warmup=True,
    )


def _adafactor(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    # A fixed learning rate under sdpipe's schedule (relative_step off), as kohya and OneTrainer run it.
    return _import("adafactor").Adafactor(
        groups,
        lr=t.learning_rate,
        weight_decay=t.adam_weight_decay,
        scale_parameter=False,
        relative_step=False,
        warmup_init=False,
    )


def _schedulefree(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    # The warm-up is sdpipe's scheduler's (train.lr_warmup_steps), which sets each group's lr as the optimizer's
    # own warmup_steps would.
    opt = _import("adamw_schedulefree").AdamWScheduleFree(
        groups,
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.adam_weight_decay,
        eps=t.adam_epsilon,
    )
    opt.train()  # it steps only in train mode
    return opt


@contextlib.contextmanager
def eval_weights(optimizer, when: bool = True) -> Iterator[None]:
    """Inside, the model holds the weights it is used with. A schedule-free optimizer trains at one point (y) and
    is used at the average of its iterates (x): its eval() swaps x in and train() swaps y back. Other optimizers
    have one set of weights, and so does a step where `when` is false (the swap costs a pass over the weights)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    switch = when and callable(getattr(inner, "eval", None)) and callable(getattr(inner, "train", None))
    if switch:
        inner.eval()
    try:
        yield
    finally:
        if switch:
            inner.train()


def train_mode(optimizer) -> None:
    """After a resume: a checkpoint saved with the averaged weights in (eval_weights) trains on from the iterate."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if callable(getattr(inner, "train", None)):
        inner.train()


BUILDERS: dict[str, Callable[[list[dict], TrainConfig], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "adamw_8bit": _bitsandbytes("AdamW8bit"),
    "paged_adamw_8bit": _bitsandbytes("PagedAdamW8bit"),
    "prodigy": _prodigy,
    "adafactor": _adafactor,
    "adamw_schedulefree": _schedulefree,
}


def build(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    return BUILDERS[t.optimizer](groups, t)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state held in tensors (what checkpoint files and GPU memory carry for it)."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    return sum(
        v.numel() * v.element_size() for state in inner.state.values() for v in state.values() if torch.is_tensor(v)
    )
