"""The name and layout mapping between Hugging Face Llama and megatron-core's GPTModel.

Pure functions on tensors. Each Hugging Face tensor is one *part* of one megatron parameter:

- ``q_proj``, ``k_proj``, ``v_proj`` -> ``linear_qkv``, interleaved per query group: for each of
  the ``G`` groups, its ``heads/G`` query heads, then its key head, then its value head
  (megatron's layout, which tensor parallelism splits into whole groups);
- ``gate_proj``, ``up_proj`` -> ``linear_fc1`` = [gate; up] (megatron's SwiGLU, ``silu(gate) * up``);
- ``embed_tokens`` / ``lm_head`` -> the first ``vocab_size`` rows of the padded embedding /
  output layer; the padding rows (``--make-vocab-size-divisible-by``) are zero on import and
  dropped on export;
- norms, ``o_proj``, ``down_proj``: one to one; a norm of a model with zero-centred scales
  (``--apply-layernorm-1p``) stores its scale minus 1, and Hugging Face the scale.

Rotary embeddings need no permutation: Hugging Face's Llama and megatron-core both rotate
halves (``rotate_half``), not interleaved pairs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LlamaLayout:
    """What the mapping needs to know about the model's shapes."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int          # real rows (the rest of megatron's padded embedding is padding)
    tied: bool               # output layer shares the embedding
    zero_centered_norms: bool = False  # the norms store scale - 1 (--apply-layernorm-1p)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight", "norm"),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "norm"),
    "self_attn.q_proj.weight": ("self_attention.linear_qkv.weight", "q"),
    "self_attn.k_proj.weight": ("self_attention.linear_qkv.weight", "k"),
    "self_attn.v_proj.weight": ("self_attention.linear_qkv.weight", "v"),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", "all"),
    "mlp.gate_proj.weight": ("mlp.linear_fc1.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.linear_fc1.weight", "up"),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", "all"),
}
_GLOBAL = {
    "model.embed_tokens.weight": ("embedding.word_embeddings.weight", "vocab"),
    "model.norm.weight": ("decoder.final_layernorm.weight", "norm"),
    "lm_head.weight": ("output_layer.weight", "vocab"),
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers older transformers versions saved; recomputed from the config, never weights.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def megatron_target(hf_name: str, layout: LlamaLayout) -> tuple[str, str] | None:
    """(megatron parameter, part) that Hugging Face tensor ``hf_name`` fills; None for tensors
    that carry no weights (rotary buffers; ``lm_head`` of a tied model). Raises KeyError for a
    name a Llama does not have."""
    if _IGNORED.fullmatch(hf_name) or (hf_name == "lm_head.weight" and layout.tied):
        return None
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    m = _LAYER_NAME.fullmatch(hf_name)
    if m and m.group(2) in _LAYER and int(m.group(1)) < layout.num_layers:
        name, part = _LAYER[m.group(2)]
        return f"decoder.layers.{m.group(1)}.{name}", part
    raise KeyError(hf_name)


def hf_names(layout: LlamaLayout) -> dict[str, tuple[str, str]]:
    """Every Hugging Face weight of the model -> (megatron parameter, part)."""
    names = {n: t for n, t in _GLOBAL.items() if not (layout.tied and n == "lm_head.weight")}
    for i in range(layout.num_layers):
        names.update({f"model.layers.{i}.{n}": (f"decoder.layers.{i}.{m}", part) for n, (m, part) in _LAYER.items()})
    return names


def part_view(param: torch.Tensor, part: str, layout: LlamaLayout) -> torch.Tensor:
    """The view of megatron parameter ``param`` (full, unsharded) that holds ``part``, shaped as
    the Hugging Face tensor (copying into the view writes the parameter)."""
    h, d, g, per = layout.hidden_size, layout.head_dim, layout.num_query_groups, layout.heads_per_group
    if part in ("all", "norm"):
        return param
    if part == "vocab":
        return param[: layout.vocab_size]
    if part in ("gate", "up"):
        f = layout.ffn_hidden_size
        return param[:f] if part == "gate" else param[f:]
    groups = param.view(g, per + 2, d, h)
    if part == "q":
        return groups[:, :per]  # (g, per, d, h): reshape of q_proj's (heads * d, h) rows
    return groups[:, per if part == "k" else per + 1]  # (g, d, h)


def import_part(param: torch.Tensor, part: str, hf_tensor: torch.Tensor, layout: LlamaLayout, hf_name: str) -> None:
    """Copy ``hf_tensor`` into its part of ``param``; a shape that does not fit is an error naming both."""
    view = part_view(param, part, layout)
    expected = _expected_shape(part, view, layout)
    if tuple(hf_tensor.shape) != expected:
        raise ValueError(f"{hf_name} has shape {tuple(hf_tensor.shape)} but config.json implies {expected}")
    with torch.no_grad():
        view.copy_(hf_tensor.reshape(view.shape) - _norm_offset(part, layout))


def _expected_shape(part: str, view: torch.Tensor, layout: LlamaLayout) -> tuple[int, ...]:
    if part in ("q", "k", "v"):
        return (view.numel() // layout.hidden_size, layout.hidden_size)
    return tuple(view.shape)


def export_part(param: torch.Tensor, part: str, layout: LlamaLayout) -> torch.Tensor:
    """The Hugging Face tensor of ``part`` of megatron parameter ``param`` (a copy)."""
    view = part_view(param, part, layout)
    if part in ("q", "k", "v"):
        return view.reshape(-1, layout.hidden_size).clone()
    return view.clone() + _norm_offset(part, layout)


def _norm_offset(part: str, layout: LlamaLayout) -> float:
    """What Hugging Face's value of ``part`` adds to megatron's: 1 for a zero-centred norm, else 0."""
    return 1.0 if part == "norm" and layout.zero_centered_norms else 0.0


def zero_padding_rows(param: torch.Tensor, layout: LlamaLayout) -> None:
    """Megatron's extra vocabulary rows: zero, so they neither shift an input nor a logit."""
    with torch.no_grad():
        param[layout.vocab_size:].zero_()
