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

The shapes come from the run's validated :class:`ModelConfig`: its layers, widths, heads and query
groups, ``vocab_size`` (the real rows; the rest of megatron's padded embedding is padding),
``share_embeddings_and_output_weights`` (no ``lm_head``) and ``apply_layernorm_1p`` (zero-centred
norms).
"""

from __future__ import annotations

import re

import torch

from megatron_snip.model.config import ModelConfig


def _heads_per_group(model: ModelConfig) -> int:
    return model.num_attention_heads // model.num_query_groups


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


def megatron_target(hf_name: str, model: ModelConfig) -> tuple[str, str] | None:
    """(megatron parameter, part) that Hugging Face tensor ``hf_name`` fills; None for tensors
    that carry no weights (rotary buffers; ``lm_head`` of a tied model). Raises KeyError for a
    name a Llama does not have."""
    if _IGNORED.fullmatch(hf_name) or (hf_name == "lm_head.weight" and model.share_embeddings_and_output_weights):
        return None
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    m = _LAYER_NAME.fullmatch(hf_name)
    if m and m.group(2) in _LAYER and int(m.group(1)) < model.num_layers:
        name, part = _LAYER[m.group(2)]
        return f"decoder.layers.{m.group(1)}.{name}", part
    raise KeyError(hf_name)


def hf_names(model: ModelConfig) -> dict[str, tuple[str, str]]:
    """Every Hugging Face weight of the model -> (megatron parameter, part)."""
    tied = model.share_embeddings_and_output_weights
    names = {n: t for n, t in _GLOBAL.items() if not (tied and n == "lm_head.weight")}
    for i in range(model.num_layers):
        names.update({f"model.layers.{i}.{n}": (f"decoder.layers.{i}.{m}", part) for n, (m, part) in _LAYER.items()})
    return names


def part_view(param: torch.Tensor, part: str, model: ModelConfig) -> torch.Tensor:
    """The view of megatron parameter ``param`` (full, unsharded) that holds ``part``, shaped as
    the Hugging Face tensor (copying into the view writes the parameter)."""
    h, d, g, per = model.hidden_size, model.kv_channels, model.num_query_groups, _heads_per_group(model)
    if part in ("all", "norm"):
        return param
    if part == "vocab":
        return param[: model.vocab_size]
    if part in ("gate", "up"):
        f = model.ffn_hidden_size
        return param[:f] if part == "gate" else param[f:]
    groups = param.view(g, per + 2, d, h)
    if part == "q":
        return groups[:, :per]  # (g, per, d, h): reshape of q_proj's (heads * d, h) rows
    return groups[:, per if part == "k" else per + 1]  # (g, d, h)


def import_part(param: torch.Tensor, part: str, hf_tensor: torch.Tensor, model: ModelConfig, hf_name: str) -> None:
    """Copy ``hf_tensor`` into its part of ``param``; a shape that does not fit is an error naming both."""
    view = part_view(param, part, model)
    expected = _expected_shape(part, view, model)
    if tuple(hf_tensor.shape) != expected:
        raise ValueError(f"{hf_name} has shape {tuple(hf_tensor.shape)} but config.json implies {expected}")
    with torch.no_grad():
        view.copy_(hf_tensor.reshape(view.shape) - _norm_offset(part, model))


def _expected_shape(part: str, view: torch.Tensor, model: ModelConfig) -> tuple[int, ...]:
    if part in ("q", "k", "v"):
        return (view.numel() // model.hidden_size, model.hidden_size)
    return tuple(view.shape)


def export_part(param: torch.Tensor, part: str, model: ModelConfig) -> torch.Tensor:
    """The Hugging Face tensor of ``part`` of megatron parameter ``param`` (a copy)."""
    view = part_view(param, part, model)
    if part in ("q", "k", "v"):
        return view.reshape(-1, model.hidden_size).clone()
    return view.clone() + _norm_offset(part, model)


def _norm_offset(part: str, model: ModelConfig) -> float:
    """What Hugging Face's value of ``part`` adds to megatron's: 1 for a zero-centred norm, else 0."""
    return 1.0 if part == "norm" and model.apply_layernorm_1p else 0.0


def zero_padding_rows(param: torch.Tensor, model: ModelConfig) -> None:
    """Megatron's extra vocabulary rows: zero, so they neither shift an input nor a logit."""
    with torch.no_grad():
        param[model.vocab_size:].zero_()
