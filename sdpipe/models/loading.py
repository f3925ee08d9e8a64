"""Load SD 1.x/2.x and SDXL components the way a user's real checkpoint is loaded: diffusers/transformers
`from_pretrained` on a diffusers folder.

A model is a local folder or a hub id already in the HF cache; `weights.resolve` turns either into a local folder
(and never downloads), so what is loaded here is exactly what `weights.weights_hash` hashed for the cache keys.
Missing or unloadable weights become a one-line UserError that says what to fix.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
import transformers
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

from sdpipe import io, weights
from sdpipe.errors import UserError
from sdpipe.models import families

# (tokenizer, text encoder) pairs in pipeline order; SDXL's refiner has only the second.
TEXT_PAIRS = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))


def model_index(pretrained: str, revision: str | None = None) -> tuple[Path, dict]:
    """The local folder and its model_index.json (what makes a folder a diffusers pipeline)."""
    root = weights.resolve(str(pretrained), revision)
    index = root / "model_index.json"
    if not index.is_file():
        raise UserError(
            f"{pretrained} is not a diffusers pipeline folder (no model_index.json); convert a single-file "
            f"checkpoint with diffusers' from_single_file(...).save_pretrained(folder) first"
        )
    return root, io.read_json(index)


def pipeline_family(pretrained: str, revision: str | None = None) -> str:
    """ "sdxl" for SDXL pipelines (base or refiner), "sd" for SD 1.x / 2.x; any other pipeline is a UserError."""
    _, index = model_index(pretrained, revision)
    return families.detect(index, str(pretrained)).name


def text_component_names(pretrained: str, revision: str | None = None) -> list[str]:
    """The text encoder subfolders, in pipeline order: the weights that text embeddings depend on."""
    _, index = model_index(pretrained, revision)
    names = [enc for _, enc in TEXT_PAIRS if families.present(index, enc)]
    if not names:
        raise UserError(
            f"{pretrained} has no text encoder (model_index.json lists neither text_encoder nor "
            f"text_encoder_2); sdpipe needs a text-conditioned SD/SDXL pipeline"
        )
    return names


@contextlib.contextmanager
def user_errors(pretrained: str, what: str, variant: str | None) -> Iterator[None]:
    """Turn from_pretrained's missing-file errors (OSError, or ValueError for variants) into one fixable line."""
    try:
        yield
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = f" (is variant={variant!r} right? leave it unset for plain weights)" if variant else ""
        raise UserError(f"cannot load {what} from {pretrained}{hint}: {first}") from None


def _frozen(model: torch.nn.Module, device: str | torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    # dtype None for diffusers models: from_pretrained already cast them, keeping any fp32-only modules in fp32.
    model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return model


def _class(index: dict, name: str, default: type) -> Any:
    """The class model_index.json names for a component (e.g. CLIPTextModelWithProjection), if transformers has it."""
    entry = index.get(name) or [None, None]
    return getattr(transformers, entry[1] or "", None) or default


def load_vae(
    pretrained: str,
    revision: str | None = None,
    variant: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> AutoencoderKL:
    """The pipeline's VAE, frozen (eval, no grads). Callers decide about fp32 upcasting (config.force_upcast)."""
    root, _ = model_index(pretrained, revision)
    with user_errors(pretrained, "the VAE", variant):
        vae = AutoencoderKL.from_pretrained(root, subfolder="vae", variant=variant, torch_dtype=dtype)
    return _frozen(vae, device)


def load_unet(
    pretrained: str,
    revision: str | None = None,
    variant: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> UNet2DConditionModel:
    """The UNet as saved (trainable: grads on, eval mode as from_pretrained leaves it; training calls .train())."""
    root, _ = model_index(pretrained, revision)
    with user_errors(pretrained, "the UNet", variant):
        unet = UNet2DConditionModel.from_pretrained(root, subfolder="unet", variant=variant, torch_dtype=dtype)
    return unet.to(device=device)


def load_noise_scheduler(pretrained: str, revision: str | None = None) -> DDPMScheduler:
    """The training noise schedule: DDPM with the pipeline's betas and prediction type (SDXL ships Euler's config)."""
    root, _ = model_index(pretrained, revision)
    with user_errors(pretrained, "the scheduler", None):
        return DDPMScheduler.from_pretrained(root, subfolder="scheduler")


class TextStack:
    """The pipeline's tokenizer(s) and frozen text encoder(s): captions -> the UNet's text conditioning.

    encode() returns "hidden" [B, 77, D] (cross-attention input) for every family and, for SDXL, "pooled" [B, P]
    (text_encoder_2's projected embedding, an input of SDXL's added time/text embedding).
    """

    def __init__(
        self,
        family: str,
        tokenizers: list,
        encoders: list[Any],  # transformers CLIP text models
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        names: tuple[str, ...] | list[str] = (),
    ):
        self.family, self.tokenizers, self.encoders = family, tokenizers, encoders
        self.names = list(names) or [enc for _, enc in TEXT_PAIRS][: len(encoders)]  # pipeline component names
        self.dtype, self.device = dtype, torch.device(device)

    def ids(self, tokenizer, encoder, captions: list[str]) -> dict[str, torch.Tensor]:
        encoder = getattr(encoder, "module", encoder)  # a DDP-wrapped encoder (text-encoder training)
        length = min(tokenizer.model_max_length, encoder.config.max_position_embeddings)  # guards a 1e30 default
        tok = tokenizer(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        ids = {"input_ids": tok.input_ids.to(self.device)}
        if getattr(encoder.config, "use_attention_mask", False):  # as diffusers' pipelines do; off for SD/SDXL
            ids["attention_mask"] = tok.attention_mask.to(self.device)
        return ids

    @torch.no_grad()
    def encode(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return self.embed(captions)

    def embed(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """encode() with gradients, for training the text encoders."""
        return families.named(self.family).embed(self, captions)


def load_text_stack(
    pretrained: str,
    revision: str | None = None,
    variant: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> TextStack:
    root, index = model_index(pretrained, revision)
    family, tokenizers, encoders, names = pipeline_family(pretrained, revision), [], [], []
    for tok_name, enc_name in TEXT_PAIRS:
        if not families.present(index, enc_name):
            continue
        with user_errors(pretrained, f"{tok_name}/{enc_name}", variant):
            tokenizers.append(_class(index, tok_name, transformers.CLIPTokenizer).from_pretrained(root / tok_name))
            encoder = _class(index, enc_name, transformers.CLIPTextModel).from_pretrained(
                root / enc_name, variant=variant
            )
        encoders.append(_frozen(encoder, device, dtype))
        names.append(enc_name)
    if not encoders:
        text_component_names(pretrained, revision)  # raises the UserError that explains it
    return TextStack(family, tokenizers, encoders, dtype=dtype, device=device, names=names)
