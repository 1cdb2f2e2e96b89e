"""megatron-core tensor-parallel linear layers whose GEMMs run in a per-module precision.

:class:`QuantizedColumnParallelLinear` and :class:`QuantizedRowParallelLinear`
are drop-in subclasses of megatron-core's local ``ColumnParallelLinear`` /
``RowParallelLinear`` (same constructor, parameters, checkpoint layout and
``(output, bias)`` return). Each holds a ``precision`` that can be set at any
time without rebuilding anything. In bf16 they *are* the parent (its forward
runs), except on one rank without megatron-core's weight-gradient fusion, where
the parent's linear is torch's ``F.linear`` with a Python backward around it and
``F.linear`` itself runs (the same products); otherwise they do the parent's
tensor-parallel communication around
:func:`megatron_snip.numerics.linear.quantized_linear` (in a layer that
``--torch-compile`` traces, ``model/compile.py`` says what runs instead):

- column-parallel (W split along out): ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce of dX backward), or with sequence parallelism
  ``gather_from_sequence_parallel_region`` (all-gather of the sequence forward,
  reduce-scatter of dX backward), then the GEMM; the output stays split.
  Split operands: W and dY.
- row-parallel (W split along in, input already split): the GEMM on the
  shard, then ``reduce_from_tensor_model_parallel_region``, or with sequence
  parallelism ``reduce_scatter_to_sequence_parallel_region``. Split operands: X and W.

Per-tensor amaxes of split operands are all-reduced (MAX) over the TP group,
and a split reduction dim must fall on block boundaries, so a TP-sharded
layer quantizes exactly as the unsharded one. Sequence parallelism changes
only the communication: the GEMMs see the whole sequence either way. Context
parallelism gives each rank part of the tokens: the amaxes of X and dY are
all-reduced over the CP group as well.

:func:`precision_layer_spec` puts these classes into megatron-core's local GPT layer spec.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Collection

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size

from megatron_snip.model import graph_collectives
from megatron_snip.model.compile import collective
from megatron_snip.numerics.linear import LinearQuantization, LinearQuantizers, QuantState, quantized_linear
from megatron_snip.numerics.linear_op import compiled_quantized_linear, register
from megatron_snip.numerics.recipes import BF16, Precision, RecipeConfig, misaligned_split


class PlanLinear(abc.ABC):
    """The interface through which ``PrecisionController`` drives a linear module of a plan,
    whatever runs its GEMMs: a precision validated on assignment and the recipe realising it;
    and what SNIP's probes read of it, the same for every backend (the probes run this
    package's quantizers on the operands they see here, so measurement does not depend on
    who executes the GEMMs).

    Subclasses set ``_precision``, ``recipe``, ``quant_state`` and ``module_name``, and provide:
        forward_module: the ``torch.nn.Module`` whose forward runs the GEMMs; a forward hook on
            it sees (input, (output, bias)), with the output's autograd gradient dY.
        weight: this rank's shard of W, [out / tp, in] (column-parallel) or [out, in / tp] (row).
        tp_group: the module's tensor-parallel group.
        sharded_operands: the GEMM operands split over TP ranks: {"w", "dy"} column-parallel,
            {"x", "w"} row-parallel (empty at TP=1 is decided by the callers from the group size).
        sequence_parallel: the forward's input (column-parallel) or output (row-parallel) is this
            rank's slice of the sequence (only ever true at TP > 1).
    """

    sharded_operands: frozenset[str] = frozenset()

    @property
    def precision(self) -> Precision:
        return self._precision

    @precision.setter
    def precision(self, precision: Precision) -> None:
        if not isinstance(precision, Precision):  # text is parsed once, at the edge (plans, flags)
            raise TypeError(f"{self.module_name}: precision must be a Precision, got {precision!r}; "
                            "use Precision.parse for text such as 'fp8/bf16'")
        self.check_precision(precision, self.recipe)
        self._use(precision, self.recipe)
        self._precision = precision

    def set_recipe(self, recipe: RecipeConfig) -> None:
        self.check_precision(self._precision, recipe)
        self._use(self._precision, recipe)
        self.recipe = recipe

    @abc.abstractmethod
    def check_precision(self, precision: Precision, recipe: RecipeConfig) -> None:
        """Raise ValueError if this module cannot run ``precision`` under ``recipe``."""

    @abc.abstractmethod
    def _use(self, precision: Precision, recipe: RecipeConfig) -> None:
        """Hand a checked (precision, recipe) to whatever runs the GEMMs, before they are stored."""

    def gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM's input X from the forward's input (the same tensor unless the module fuses
        something before its GEMM, as Transformer Engine's LayerNormLinear fuses the norm)."""
        return x

    @property
    def row_parallel(self) -> bool:
        return "x" in self.sharded_operands

    def check_tensor_parallel_blocks(self, precision: Precision, recipe: RecipeConfig) -> None:
        """Raise ValueError (naming the module) if TP splits W's reduction-side dimension off the
        scaling blocks of ``precision``: every rank's slice must hold whole blocks."""
        if precision.is_bf16:
            return
        tp = get_pg_size(self.tp_group)
        if tp == 1:
            return
        # A strided layout (SwiGLU's fc1: [gate_r; up_r] per rank) holds `stride` separate
        # slices of the full tensor: each must start on a block boundary.
        stride = getattr(self.weight, "partition_stride", 1)
        size = self.weight.shape[1 if self.row_parallel else 0] // stride
        bad = misaligned_split(precision, recipe, size)
        if bad is not None:
            name, block = bad
            slices = f" in {stride} slices of {size}" if stride > 1 else f" ({size} per rank)"
            dim = "input" if self.row_parallel else "output"
            raise ValueError(
                f"{self.module_name}: cannot run {name}: its {dim} dimension is split over "
                f"TP={tp} ranks{slices}, not a multiple of the {name} block of {block}"
            )

    @property
    def cp_group(self):
        """The context-parallel group (its ranks hold other tokens of the same sequences), or None."""
        return parallel_state.get_context_parallel_group(check_initialized=False)

    def amax_all_reduce(self, amax: torch.Tensor) -> torch.Tensor:
        """The MAX of a split operand's per-tensor amax over the TP group (so a sharded module
        quantizes exactly as the unsharded one)."""
        return _all_max(amax, self.tp_group)

    def token_amax_all_reduce(self, amax: torch.Tensor) -> torch.Tensor:
        """The MAX of amaxes over this rank's tokens over the CP group (so a CP run quantizes as CP=1)."""
        return _all_max(amax, self.cp_group)

    def split_reductions(self) -> dict:
        """``quantized_linear``'s keyword arguments that turn this rank's amaxes into the whole operands':
        over TP for the operands it splits, over CP for the tokens of X and dY."""
        split = get_pg_size(self.tp_group) > 1
        return {"amax_reduce": self.amax_all_reduce if split else None,
                "sharded": self.sharded_operands if split else frozenset(),
                "token_amax_reduce": self.token_amax_all_reduce if get_pg_size(self.cp_group) > 1 else None}


def _all_max(amax: torch.Tensor, group) -> torch.Tensor:
    """The MAX of ``amax`` over ``group``, a copy."""
    # NaN -> Inf first: MAX over a NaN is order-dependent, Inf is not, and a non-finite
    # amax makes the whole tensor NaN on every rank either way (see docs/numerics.md).
    amax = torch.nan_to_num(amax.clone(), nan=math.inf)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


class QuantizedLinearMixin(PlanLinear):
    """What the column- and row-parallel quantized layers share (listed before the megatron base).

    Attributes:
        precision: the module's :class:`Precision` (validated on assignment; a Precision value, not
            text), effective from the next forward.
        recipe: the :class:`RecipeConfig` realising it (set through :meth:`set_recipe`).
        quant_state: the module's :class:`QuantState`.
        module_name: the global plan name, set by ``PrecisionController`` (used in messages).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._precision = BF16
        self.recipe = RecipeConfig()
        self._use(self._precision, self.recipe)
        self.quant_state = QuantState()
        self.module_name = type(self).__name__
        self._tp_split = get_pg_size(self.tp_group) > 1
        # Where megatron-core's path adds nothing to torch's GEMM (one rank, no weight-gradient fusion into
        # main_grad), BF16 runs F.linear eagerly too: autograd's own backward instead of megatron-core's Python
        # one, the same products.
        self._plain_bf16 = not self._tp_split and not self.gradient_accumulation_fusion
        self._register()

    def _register(self) -> None:
        # What a compiled graph passes its quantized GEMM (numerics/linear_op.py): a plain attribute, not a
        # buffer (no state-dict entry, never moved to the GPU: the operator reads it on the host).
        self._compile_key = register(self.linear_quantization)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._register()  # a copy (deepcopy, pickle) is a module of its own, with a key of its own

    @property
    def forward_module(self) -> torch.nn.Module:
        return self

    def _use(self, precision: Precision, recipe: RecipeConfig) -> None:
        """Resolve the GEMMs' operand quantizers once, for every forward and backward until the next change."""
        self._quantizers = LinearQuantizers.resolve(precision, recipe)
        # The one fact about the precision a compiled layer is specialised on (a plain bool: its guard is
        # one comparison): BF16 GEMMs are torch's, traced into the graph; others the quantized operator's.
        self._bf16 = precision.is_bf16

    def quantize_only(self, operands: Collection[tuple[str, str]]) -> None:
        """Keep the precision's quantizers on ``operands`` ((gemm, operand) pairs such as
        ``("dgrad", "w")``) and run every other operand in bf16, until the precision or recipe next
        changes: the ground truth's split of a GEMM's error by operand (snip_lab.ground_truth)."""
        exact = LinearQuantizers.resolve(BF16, self.recipe).table
        self._quantizers = LinearQuantizers({key: q if key in operands else exact[key]
                                             for key, q in self._quantizers.table.items()})

    def check_precision(self, precision: Precision, recipe: RecipeConfig) -> None:
        """Raise ValueError if this module cannot run ``precision`` under ``recipe``."""
        self.check_tensor_parallel_blocks(precision, recipe)

    def linear_quantization(self) -> LinearQuantization:
        """Everything this module's quantized GEMMs need now besides the tensors."""
        return LinearQuantization(self._precision, self.recipe, self.quant_state, quantizers=self._quantizers,
                                  **self.split_reductions())

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This rank's GEMM ``x @ weight^T`` in the module's precision. A BF16 GEMM is torch's own (in a graph
        ``torch.compile`` traces, fused with its neighbours; the weight gradient reaches ``main_grad`` through
        megatron-core's DDP hook); a quantized one the custom operator (numerics/linear_op.py) in a traced
        graph, the quantized autograd function in eager code."""
        if self._bf16:
            return F.linear(x, weight)
        if torch.compiler.is_compiling():
            return compiled_quantized_linear(x, weight, self._compile_key)
        return quantized_linear(x, weight, self._precision, self.recipe, self.quant_state,
                                quantizers=self._quantizers, **self.split_reductions())

    def _output_and_bias(self, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Add the bias, or hand it back to the caller with ``skip_bias_add``, as the parents do."""
        if self.skip_bias_add:
            return output, self.bias
        return (output if self.bias is None else output + self.bias), None

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, precision={self._precision})"


class QuantizedColumnParallelLinear(QuantizedLinearMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` with a per-module precision (W split along out)."""

    sharded_operands = frozenset({"w", "dy"})

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        """input_: [s, b, h]; returns ([s, b, out / tp] (or gathered), bias or None)."""
        if self._bf16 and not self._plain_bf16 and not torch.compiler.is_compiling():  # megatron-core's own path
            return super().forward(input_, weight, runtime_gather_output)
        split = self._tp_split
        if self.sequence_parallel:  # the parent's flag (off at TP=1): [s / tp, b, h] -> [s, b, h]
            x = _mapping(gather_from_sequence_parallel_region, split)(input_, tensor_parallel_output_grad=True,
                                                                       group=self.tp_group)
        else:
            x = _mapping(copy_to_tensor_model_parallel_region, split)(input_, group=self.tp_group)
        output, bias = self._output_and_bias(self._gemm(x, self.weight if weight is None else weight))
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = _mapping(gather_from_tensor_model_parallel_region, split)(output, group=self.tp_group)
        return output, bias


class QuantizedRowParallelLinear(QuantizedLinearMixin, RowParallelLinear):
    """``RowParallelLinear`` with a per-module precision (W and X split along in)."""

    sharded_operands = frozenset({"x", "w"})

    def forward(self, input_: torch.Tensor):
        """input_: [s, b, in / tp] (or [s, b, in] if not input_is_parallel); returns ([s, b, out]
        ([s / tp, b, out] with sequence parallelism), bias or None)."""
        if self._bf16 and not self._plain_bf16 and not torch.compiler.is_compiling():  # megatron-core's own path
            return super().forward(input_)
        split = self._tp_split
        x = input_ if self.input_is_parallel else _mapping(scatter_to_tensor_model_parallel_region, split)(
            input_, group=self.tp_group)
        partial = self._gemm(x, self.weight)
        if self.sequence_parallel:
            output = _mapping(reduce_scatter_to_sequence_parallel_region, split)(partial, group=self.tp_group)
        else:
            output = _mapping(reduce_from_tensor_model_parallel_region, split)(partial, group=self.tp_group)
        return self._output_and_bias(output)


# What a layer being traced by torch.compile calls instead of megatron-core's mappings, where the group is split:
# the same collectives as functional ones the graph holds (model/graph_collectives.py); the two the layers never
# reach in a Llama (a gathered output, an unsplit input) are called eagerly from the graph.
_TRACED = {copy_to_tensor_model_parallel_region: graph_collectives.copy_to_tensor_model_parallel_region,
           reduce_from_tensor_model_parallel_region: graph_collectives.reduce_from_tensor_model_parallel_region,
           gather_from_sequence_parallel_region: graph_collectives.gather_from_sequence_parallel_region,
           reduce_scatter_to_sequence_parallel_region: graph_collectives.reduce_scatter_to_sequence_parallel_region,
           gather_from_tensor_model_parallel_region: collective(gather_from_tensor_model_parallel_region),
           scatter_to_tensor_model_parallel_region: collective(scatter_to_tensor_model_parallel_region)}


def _mapping(fn, split: bool):
    """``fn`` where its group is split (in a graph being traced, what the graph calls instead), else the
    identity that ``fn`` is on one rank, without its autograd function."""
    if not split:
        return _identity
    return _TRACED[fn] if torch.compiler.is_compiling() else fn


def _identity(input_: torch.Tensor, **_) -> torch.Tensor:
    return input_


_QUANTIZED = {ColumnParallelLinear: QuantizedColumnParallelLinear, RowParallelLinear: QuantizedRowParallelLinear}
# Where the four linear modules sit in a TransformerLayer spec: submodule -> its linear fields.
_LINEAR_FIELDS = {"self_attention": ("linear_qkv", "linear_proj"), "mlp": ("linear_fc1", "linear_fc2")}


def _quantized(entry, where: str):
    """The quantized counterpart of a spec entry (a class or a ModuleSpec of one)."""
    cls = entry.module if isinstance(entry, ModuleSpec) else entry
    if cls in _QUANTIZED.values():
        return entry
    if cls not in _QUANTIZED:
        raise ValueError(f"precision_layer_spec: {where} is {cls!r}; it needs megatron-core's local "
                         "ColumnParallelLinear/RowParallelLinear (get_gpt_layer_local_spec)")
    return dataclasses.replace(entry, module=_QUANTIZED[cls]) if isinstance(entry, ModuleSpec) else _QUANTIZED[cls]


def precision_layer_spec(base: ModuleSpec) -> ModuleSpec:
    """A copy of a megatron-core local GPT layer spec with linear_qkv, linear_proj, linear_fc1
    and linear_fc2 replaced by the quantized classes (``base`` is left unchanged).

    Args:
        base: e.g. ``get_gpt_layer_local_spec(normalization="RMSNorm")``.
    Raises:
        ValueError: a linear is not megatron-core's local one (e.g. a Transformer Engine spec).
    """
    layer = base.submodules
    children = {}
    for child_field, linear_fields in _LINEAR_FIELDS.items():
        child = getattr(layer, child_field)
        linears = {f: _quantized(getattr(child.submodules, f), f"{child_field}.{f}") for f in linear_fields}
        children[child_field] = dataclasses.replace(child, submodules=dataclasses.replace(child.submodules, **linears))
    return dataclasses.replace(base, submodules=dataclasses.replace(layer, **children))
