"""Parameter names that do not depend on the parallel layout or the backend.

megatron-core numbers a stage's transformer layers from 0 (``decoder.layers.{i}`` is stage-local) and
wrappers add ``module.`` prefixes; SNIP's probe noise is drawn by parameter name, and the faults a run
reports name parameters, so both use the name a parameter has in the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

# Transformer Engine's LayerNormLinear holds the norm before it: its weight gets the local layer
# spec's name (megatron-core's TE <-> local checkpoint key map), so the probes' noise, drawn by
# parameter name, is the same on both backends.
_FUSED_NORM_NAMES = {".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
                     ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight"}


def global_parameter_names(chunks: Sequence[torch.nn.Module]) -> dict[torch.nn.Parameter, str]:
    """Parameter -> name independent of the parallel layout and the backend, for the model ``chunks`` of
    this rank (wrapped or not): wrapper prefixes (``module.``) dropped, transformer layers numbered
    globally (``decoder.layers.{layer_number - 1}``), Transformer Engine's fused norm weights under the
    local spec's names."""
    names = {}
    for chunk in chunks:
        layers = {prefix: m.layer_number - 1 for prefix, m in chunk.named_modules() if isinstance(m, TransformerLayer)}
        for name, param in chunk.named_parameters():
            for prefix, layer in layers.items():
                if name.startswith(prefix + "."):
                    name = f"decoder.layers.{layer}" + name[len(prefix):]
                    break
            while name.startswith("module."):
                name = name[len("module."):]
            for fused, local in _FUSED_NORM_NAMES.items():
                if name.endswith(fused):
                    name = name[:-len(fused)] + local
            names[param] = name
    return names
