"""SD 3 / 3.5's transformer (diffusers' SD3Transformer2DModel) -> the original MMDiT names of Stability's single files.

The inverse of diffusers' `convert_sd3_transformer_checkpoint_to_diffusers` (a test round-trips it through that
function): each block's q, k and v are stacked into one `qkv` per stream; the last block's context stream (which
keeps only its modulation) and the final layer store their adaLN halves as (shift, scale) where diffusers has
(scale, shift). Names come from the model's own blocks, so every size converts, the tiny preset included.
"""

from __future__ import annotations

import torch

from sdpipe.errors import UserError

# diffusers module -> original module, outside the blocks
_OUTER = {
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
}
# Inside block i: diffusers module -> original module (renamed as is)
_IN_BLOCK = {
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "attn2.norm_q": "x_block.attn2.ln_q",
    "attn2.norm_k": "x_block.attn2.ln_k",
    "attn2.to_out.0": "x_block.attn2.proj",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}
# Inside block i: original fused module <- the diffusers modules stacked into it, in order
_FUSED = {
    "x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
}


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """(scale, shift) <-> (shift, scale) along dim 0: its own inverse, as diffusers' swap_scale_shift."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _block(state: dict, i: int, last: bool) -> dict:
    src = lambda name: f"transformer_blocks.{i}.{name}"
    out = {}
    for fused, parts in _FUSED.items():
        for kind in ("weight", "bias"):
            if src(f"{parts[0]}.{kind}") in state:
                out[f"{fused}.{kind}"] = torch.cat([state.pop(src(f"{p}.{kind}")) for p in parts])
    for name, original in _IN_BLOCK.items():
        for kind in ("weight", "bias"):
            if src(f"{name}.{kind}") in state:
                out[f"{original}.{kind}"] = state.pop(src(f"{name}.{kind}"))
    for kind in ("weight", "bias"):
        value = state.pop(src(f"norm1_context.linear.{kind}"))
        out[f"context_block.adaLN_modulation.1.{kind}"] = swap_halves(value) if last else value
    return {f"joint_blocks.{i}.{k}": v for k, v in out.items()}


def mmdit_state(transformer) -> dict:
    """The transformer's weights under the original MMDiT names (without the `model.diffusion_model.` prefix)."""
    state = dict(transformer.state_dict())
    out = {"pos_embed": state.pop("pos_embed.pos_embed")}
    for name, original in _OUTER.items():
        for kind in ("weight", "bias"):
            out[f"{original}.{kind}"] = state.pop(f"{name}.{kind}")
    for kind in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{kind}"] = swap_halves(state.pop(f"norm_out.linear.{kind}"))
    n = len(transformer.transformer_blocks)
    for i in range(n):
        out.update(_block(state, i, last=i == n - 1))
    if state:
        raise UserError(
            f"cannot write the SD 3 transformer in the original layout: no original name for {next(iter(state))} "
            f"({len(state)} tensors unmapped)"
        )
    return out
