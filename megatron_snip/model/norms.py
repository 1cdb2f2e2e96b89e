"""The norms of the local layer spec: torch's RMSNorm / LayerNorm that also run under sequence parallelism.

megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel`` (and 0.16's local spec picks it for RMSNorm even where apex is
installed). Under sequence parallelism a norm sees this rank's slice of the sequence,
which is all a per-token norm needs; only its parameters' gradients are partial sums over
the slices. megatron-core completes them itself for every parameter that carries
``sequence_parallel = True`` (``finalize_model_grads`` all-reduces them over the TP group,
as for its fused norms), so marking the parameters is the whole change. The modules are
plain ``torch.nn.RMSNorm`` / ``LayerNorm`` (same state-dict keys as ``WrappedTorchNorm``'s:
checkpoints are interchangeable), on CPU and GPU alike.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm whose stored weight is its scale minus 1 (megatron-core's ``layernorm_zero_centered_gamma``,
    Megatron-LM's --apply-layernorm-1p, as Transformer Engine's norms compute it): zeros at start, the
    output ``x / rms(x) * (1 + weight)``."""

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


_NORMS = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}


class TEExtraState:
    """Mixin: an ``_extra_state`` entry (None) in the module's state dict, where Transformer Engine's norm has one.

    With Transformer Engine installed, megatron-core builds a Megatron-LM model's final norm as ``TENorm``
    (``LayerNormImpl``, whatever ``--transformer-impl``): TE's RMSNorm / LayerNorm operation, whose state dict
    holds ``_extra_state`` (its FP8 metadata; an empty tensor without FP8). Such a Megatron-LM run asks a
    checkpoint for ``decoder.final_layernorm._extra_state``, and megatron-core's load fails on a key the
    checkpoint lacks, so the final norm here writes one. None is what megatron-core's local linears write for
    theirs (``ColumnParallelLinear.get_extra_state``), and TE's ``set_extra_state`` skips None. What a
    checkpoint holds there (a TE run's FP8 metadata) means nothing to a torch norm and is ignored.
    """

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state) -> None:
        """Ignored (see the class docstring)."""


# The final norm's classes: each of TorchNorm's with TEExtraState.
_WITH_TE_EXTRA_STATE = {kind: type(kind.__name__, (TEExtraState, kind), {"__module__": __name__})
                        for kind in (*_NORMS.values(), ZeroCenteredRMSNorm)}


class TorchNorm:
    """Builds ``config.normalization`` (RMSNorm, zero-centred with ``config.layernorm_zero_centered_gamma``,
    or LayerNorm) as a torch module whose parameters
    carry ``sequence_parallel`` (megatron's norm constructor signature; ``__new__`` returns the
    torch module itself, as ``WrappedTorchNorm`` does)."""

    te_extra_state = False  # FinalNorm: with Transformer Engine's extra-state entry (TEExtraState)

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization not in _NORMS:
            raise ValueError(f"TorchNorm: normalization {config.normalization!r} is not one of {sorted(_NORMS)}")
        if config.memory_efficient_layer_norm:
            raise ValueError("TorchNorm: the memory-efficient layer norm needs Transformer Engine or apex norms")
        if config.layernorm_zero_centered_gamma and config.normalization != "RMSNorm":
            raise ValueError("TorchNorm: zero-centered gamma is implemented for RMSNorm only")
        kind = ZeroCenteredRMSNorm if config.layernorm_zero_centered_gamma else _NORMS[config.normalization]
        if cls.te_extra_state:
            kind = _WITH_TE_EXTRA_STATE[kind]
        # In the parameters' dtype (bf16 with --bf16), as megatron's Float16Module casts every
        # parameter: the mixed-precision optimizer maps only bf16 parameters to its fp32 masters.
        norm = kind(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class FinalNorm(TorchNorm):
    """The decoder's final norm: :class:`TorchNorm` whose state dict also holds Transformer Engine's
    ``_extra_state`` entry (:class:`TEExtraState`), so that a Megatron-LM run with TE loads the checkpoint."""

    te_extra_state = True


def with_torch_norms(layer: ModuleSpec) -> ModuleSpec:
    """A copy of a local transformer-layer spec whose two norms are :class:`TorchNorm`."""
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm))


def block_spec(layer: ModuleSpec, config: TransformerConfig, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """This (virtual) pipeline stage's decoder: its layers and, on the last stage, the final norm
    as :class:`FinalNorm` (megatron-core would pick its own norm class for a bare layer spec)."""
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=FinalNorm)
