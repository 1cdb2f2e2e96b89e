"""Applying a precision plan to this rank's part of a megatron-core GPTModel.

The plan speaks in global names (``decoder.layers.{i}.mlp.linear_fc1``, i
the 0-based global layer index); a rank holds only its pipeline stage's
layers (``decoder.layers`` indices are stage-local there) and a TP shard of
each. :class:`PrecisionController` finds every quantized linear of the model
chunks it is given, names it globally from its ``TransformerLayer``'s
``layer_number`` (1-based, global), and sets precisions from plans. Every
rank applies the same plan at the same iteration; nothing is communicated.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_pg_size

from megatron_snip.model.quantized.layers import PlanLinear, QuantizedLinearMixin
from megatron_snip.numerics.health import OUTPUTS, HealthStats
from megatron_snip.numerics.recipes import Precision, RecipeConfig
from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, module_name, parse_module_name


def _is_plan_linear(module: torch.nn.Module) -> bool:
    """Our quantized layers, or megatron-core's Transformer Engine linears (``te_quant_params``)."""
    return isinstance(module, QuantizedLinearMixin) or hasattr(module, "te_quant_params")


def _plan_interface(module: torch.nn.Module) -> PlanLinear:
    """The precision interface of a plan linear: the module itself, or a TE module's adapter."""
    if isinstance(module, QuantizedLinearMixin):
        return module
    from megatron_snip.model.quantized.te_layers import TELinearPrecision

    return TELinearPrecision(module)


def _find_linears(chunks: Sequence[torch.nn.Module]) -> dict[str, PlanLinear]:
    """Global plan name -> linear module (or its TE adapter), ordered by layer then execution order."""
    found: dict[str, PlanLinear] = {}
    for chunk in chunks:
        for layer in chunk.modules():
            if not isinstance(layer, TransformerLayer):
                continue
            for relative, module in layer.named_modules():
                if not _is_plan_linear(module):
                    continue
                if relative not in LINEAR_MODULES:
                    raise ValueError(f"quantized linear at {relative!r} in layer {layer.layer_number} is not one "
                                     f"of the plan's modules ({', '.join(LINEAR_MODULES)})")
                found[module_name(layer.layer_number - 1, relative)] = _plan_interface(module)
    total = sum(_is_plan_linear(m) for chunk in chunks for m in chunk.modules())
    if total != len(found):
        raise ValueError(f"{total - len(found)} quantized linear module(s) lie outside a TransformerLayer "
                         "and have no plan name")
    return dict(sorted(found.items(), key=lambda item: _order(item[0])))


def _order(name: str) -> tuple[int, int]:
    layer, module = parse_module_name(name)
    return layer, LINEAR_MODULES.index(module)


def _module_seed(name: str, seed: int) -> int:
    """A stable per-module seed: the same on every rank and every run (Python's hash() is not)."""
    return (seed << 32) ^ zlib.crc32(name.encode())


class PrecisionController:
    """Sets the precision of every quantized linear in this rank's model chunks.

    Args:
        model: a GPTModel chunk (possibly wrapped, e.g. in DDP / Float16Module) or a list
            of chunks (virtual pipeline stages).
        recipe: the recipe for all modules.
        seed: base seed of the modules' stochastic rounding and Hadamard signs. Hadamard
            signs depend on (seed, module name) only, so all TP ranks of a module agree;
            the rounding RNG also mixes in the global rank, so shards draw independently.
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], *,
                 recipe: RecipeConfig = RecipeConfig(), seed: int = 0):
        chunks = list(model) if isinstance(model, Sequence) else [model]
        self._modules = _find_linears(chunks)
        if not self._modules:
            raise ValueError("no quantized linear modules in the model: build it with precision_layer_spec() "
                             "or megatron-core's Transformer Engine layer spec")
        self.num_layers = next(iter(self._modules.values())).config.num_layers
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, module in self._modules.items():
            module.module_name = name
            module.quant_state.reseed(_module_seed(name, seed), stream=rank)
            module.set_recipe(recipe)

    def module_names(self) -> list[str]:
        """Global names of this rank's quantized linears, by layer then execution order."""
        return list(self._modules)

    def modules(self) -> dict[str, PlanLinear]:
        """Global name -> module, for this rank."""
        return dict(self._modules)

    def apply(self, plan: PrecisionPlan) -> dict[str, tuple[Precision, Precision]]:
        """Set every module's precision from ``plan``, effective at the next forward.

        All modules are checked before any changes, so a plan that does not fit
        (layers beyond the model, TP block alignment, what the te backend cannot run) raises
        ValueError and leaves the model as it was.

        Returns:
            This rank's modules whose precision changed: name -> (old, new).
        """
        plan.validate(self.num_layers)
        for name, module in self._modules.items():
            module.check_precision(plan[name], module.recipe)
        changed = {}
        for name, module in self._modules.items():
            if module.precision != plan[name]:
                changed[name] = (module.precision, plan[name])
                module.precision = plan[name]
        return changed

    def quant_states(self) -> dict[str, dict]:
        """This rank's per-module quantization state (stochastic-rounding RNGs, delayed-scaling
        histories), by global module name, for a checkpoint."""
        return {name: module.quant_state.state_dict() for name, module in self._modules.items()}

    def load_quant_states(self, states: dict[str, dict]) -> None:
        """Restore :meth:`quant_states` of the same rank of the same layout."""
        for name, module in self._modules.items():
            if name in states:
                module.quant_state.load_state_dict(states[name])

    def enable_health(self) -> None:
        """Keep quantization health statistics in every quantized linear of ours (``--quant-health``;
        Transformer Engine modules keep none)."""
        for module in self._modules.values():
            if isinstance(module, QuantizedLinearMixin):
                module.quant_state.health = HealthStats()

    def disable_health(self) -> None:
        """Stop keeping health statistics (``--no-quant-health``)."""
        for module in self._modules.values():
            if isinstance(module, QuantizedLinearMixin):
                module.quant_state.health = None

    def reset_health(self, full: bool) -> None:
        """Start a step's health numbers: all of them (``full``) or only the non-finite flags."""
        for module in self._modules.values():
            if getattr(module, "quant_state", None) is not None and module.quant_state.health is not None:
                module.quant_state.health.reset(full)

    def health_rows(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's health rows since the last reset: module -> operand -> row, each operand of a
        module counted once over its tensor-parallel ranks (replicated operands on TP rank 0 only)
        and the weight once over its data- and context-parallel replicas (dp-cp rank 0 only), so
        that summing over all ranks gives whole-tensor numbers: the weight's, and the activations'
        and gradients' of the global batch (each DP and CP rank holds its own tokens). GEMM outputs
        (``OUTPUTS``) come from every rank: each rank's own GEMM result (a shard, or a partial sum
        before the TP reduction), so a non-finite value made by any rank's GEMM is counted (only >0
        is used)."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        weight_here = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        rows = {}
        for name, module in self._modules.items():
            health = getattr(getattr(module, "quant_state", None), "health", None)
            measured = health.rows if health is not None else {}
            if not measured:
                continue
            split = get_pg_size(module.tp_group) > 1
            rows[name] = {}
            for key, row in measured.items():
                operand = key.split(".")[1]
                if key in OUTPUTS or ((tp_rank == 0 or (split and operand in module.sharded_operands))
                                      and (operand != "w" or weight_here)):
                    rows[name][key] = row
        return rows

    def set_recipe(self, recipe: RecipeConfig) -> None:
        """Use ``recipe`` in every module from the next forward (checked for all modules first)."""
        for module in self._modules.values():
            module.check_precision(module.precision, recipe)
        for module in self._modules.values():
            module.set_recipe(recipe)  # re-resolves its quantizers (assigning .recipe alone would keep the old ones)
