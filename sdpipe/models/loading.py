"""Load SD 1.x/2.x and SDXL components the way a user's real checkpoint is loaded: diffusers/transformers
`from_pretrained` on a diffusers folder.

A model is a local folder or a hub id already in the HF cache; `weights.resolve` turns either into a local folder
(and never downloads), so what is loaded here is exactly what `weights.weights_hash` hashed for the cache keys.
Missing or unloadable weights become a one-line UserError that says what to fix.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import transformers
from diffusers import AutoencoderKL, ModelMixin

from sdpipe.errors import UserError
from sdpipe.models import families
from sdpipe.models.pipeline_index import family_of, model_index, pipeline_family, text_component_names  # noqa: F401


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


def _class(index: dict, name: str, default: str) -> Any:
    """The class model_index.json names for a component (e.g. CLIPTextModelWithProjection), if transformers has it,
    else the family's default."""
    entry = index.get(name) or [None, None]
    return getattr(transformers, entry[1] or "", None) or getattr(transformers, default)


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
) -> ModelMixin:
    """The family's denoiser (the UNet) as saved (trainable: grads on, eval mode as from_pretrained leaves it;
    training calls .train())."""
    root, index = model_index(pretrained, revision)
    family = families.detect(index, str(pretrained))
    with user_errors(pretrained, f"the {family.denoiser}", variant):
        model = family.denoiser_type().from_pretrained(
            root, subfolder=family.denoiser, variant=variant, torch_dtype=dtype
        )
    return model.to(device=device)


def load_noise_scheduler(pretrained: str, revision: str | None = None):
    """The training noise schedule of the family's objective with the pipeline's settings: for SD and SDXL, DDPM
    with the pipeline's betas and prediction type (SDXL ships Euler's config)."""
    import diffusers

    root, index = model_index(pretrained, revision)
    cls = getattr(diffusers, families.detect(index, str(pretrained)).objective.scheduler_class)
    with user_errors(pretrained, "the scheduler", None):
        return cls.from_pretrained(root, subfolder="scheduler")


class TextStack:
    """The pipeline's tokenizer(s) and frozen text encoder(s): captions -> the UNet's text conditioning.

    encode() returns the family's text fields (families.Family.text_fields): SD's "hidden" [B, 77, D]
    (cross-attention input), SDXL's also "pooled" [B, P] (text_encoder_2's projected embedding).
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
        default = families.named(family).text_encoders[: len(encoders)]
        self.names = list(names) or list(default)  # pipeline component names
        parts = {part.encoder: part for part in families.named(family).text_parts}
        self.lengths = [parts[name].max_length if name in parts else None for name in self.names]
        self.dtype, self.device = dtype, torch.device(device)

    def ids(self, tokenizer, encoder, captions: list[str], length: int | None = None) -> dict[str, torch.Tensor]:
        """Token ids padded to `length`, by default the tokenizer's own length, at most the encoder's positions
        (which guards a 1e30 default)."""
        encoder = getattr(encoder, "module", encoder)  # a DDP-wrapped encoder (text-encoder training)
        length = length or min(tokenizer.model_max_length, encoder.config.max_position_embeddings)
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
    family, tokenizers, encoders, names = families.detect(index, str(pretrained)), [], [], []
    for part in family.text_parts:
        if not families.present(index, part.encoder):
            continue
        with user_errors(pretrained, f"{part.tokenizer}/{part.encoder}", variant):
            tokenizers.append(
                _class(index, part.tokenizer, part.tokenizer_class).from_pretrained(root / part.tokenizer)
            )
            encoder = _class(index, part.encoder, part.encoder_class).from_pretrained(
                root / part.encoder, variant=variant
            )
        encoders.append(_frozen(encoder, device, dtype))
        names.append(part.encoder)
    if not encoders:
        text_component_names(pretrained, revision)  # raises the UserError that explains it
    return TextStack(family.name, tokenizers, encoders, dtype=dtype, device=device, names=names)


def load_components(pretrained: str, names: list[str], dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Pipeline components by name ("vae" and text encoders), frozen on the CPU: what a single file lacks, taken
    from a diffusers folder beside it."""
    out: dict[str, Any] = {"vae": load_vae(pretrained, dtype=dtype)} if "vae" in names else {}
    if set(names) - {"vae"}:
        stack = load_text_stack(pretrained, dtype=dtype)
        out |= {name: encoder for name, encoder in zip(stack.names, stack.encoders) if name in names}
    return out
