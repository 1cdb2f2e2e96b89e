"""FLOPs of the linear modules of a Llama model, and how a plan splits them across formats.

Each linear module ``Y = X W^T`` with W of shape (out, in) runs three GEMMs
of ``2 * tokens * in * out`` FLOPs each: fprop counts to the module's forward
precision, dgrad and wgrad to its backward precision. Shapes (h = hidden,
f = ffn hidden, kv = kv_channels * num_query_groups):

=========== ====== ===================== =========================
module      in     out                   note
=========== ====== ===================== =========================
linear_qkv  h      h + 2 kv              Q for all heads, K and V per group
linear_proj h      h                     (attention heads * kv_channels = h)
linear_fc1  h      2 f                   SwiGLU: gate and up in one GEMM
linear_fc2  f      h
=========== ====== ===================== =========================

The fraction of linear FLOPs run in FP4 is SNIP's efficiency metric; tokens
cancel in it. What a user pays for is time: :func:`estimated_time_ratio` weighs each
GEMM's FLOPs by its format's throughput (a ``gemm_speed.GemmSpeedModel``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from megatron_snip.numerics.registry import PRECISION_NAMES, family
from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, module_names, parse_module_name

# Row-parallel modules split their input (reduction) dimension across TP ranks; the others their output.
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")


def gemm_flops(tokens: int, in_features: int, out_features: int) -> int:
    """FLOPs of one GEMM of a linear layer (fprop, dgrad or wgrad): 2 * tokens * in * out."""
    return 2 * tokens * in_features * out_features


@dataclass(frozen=True)
class LlamaLinearDims:
    """The dimensions that fix the linear layers of a Llama model.

    Attributes:
        num_layers: transformer layers.
        hidden_size: h.
        ffn_hidden_size: f (per gate/up half for a gated MLP).
        kv_channels: per-head dimension.
        num_query_groups: key/value heads (GQA).
        gated: SwiGLU (fc1 produces gate and up: out = 2 f).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    kv_channels: int
    num_query_groups: int
    gated: bool = True

    @classmethod
    def from_config(cls, config) -> LlamaLinearDims:
        """From a megatron-core ``TransformerConfig`` or the run's ``ModelConfig``."""
        return cls(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size,
            kv_channels=config.kv_channels,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            gated=config.gated_linear_unit,
        )

    def tp_slice(self, module: str, tp: int) -> tuple[str, int]:
        """Which dimension tensor parallelism splits in ``module`` ("input" for the row-parallel
        proj/fc2, else "output") and the length of each rank's contiguous slice of it (SwiGLU's
        fc1 holds a gate and an up slice per rank)."""
        fan_in, fan_out = self.in_out(module)
        if module in ROW_PARALLEL:
            return "input", fan_in // tp
        return "output", fan_out // tp // (2 if module == "mlp.linear_fc1" and self.gated else 1)

    def tp_shape(self, module: str, tp: int) -> tuple[int, int]:
        """(in, out) features of one tensor-parallel rank's shard of ``module``."""
        fan_in, fan_out = self.in_out(module)
        return (fan_in // tp, fan_out) if module in ROW_PARALLEL else (fan_in, fan_out // tp)

    def in_out(self, module: str) -> tuple[int, int]:
        """(in, out) features of linear ``module`` (one of ``plan.LINEAR_MODULES``)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        shapes = {
            "self_attention.linear_qkv": (h, h + 2 * self.kv_channels * self.num_query_groups),
            "self_attention.linear_proj": (h, h),
            "mlp.linear_fc1": (h, 2 * f if self.gated else f),
            "mlp.linear_fc2": (f, h),
        }
        if module not in shapes:
            raise ValueError(f"unknown linear module {module!r}; valid: {', '.join(LINEAR_MODULES)}")
        return shapes[module]


def module_gemm_flops(dims: LlamaLinearDims, name: str, tokens: int = 1) -> int:
    """FLOPs of *one* GEMM of module ``name`` (all three are equal) for ``tokens`` tokens."""
    return gemm_flops(tokens, *dims.in_out(parse_module_name(name)[1]))


def flops_by_format(
    plan: PrecisionPlan, dims: LlamaLinearDims, tokens: int = 1, names: Iterable[str] | None = None
) -> dict[str, int]:
    """Linear-layer training FLOPs per format name (keys ``PRECISION_NAMES``).

    Args:
        plan: the precision of every module.
        dims: model dimensions.
        tokens: tokens per step (1: FLOPs per token).
        names: modules to count (default: all of the model; e.g. one pipeline stage's).
    """
    totals = dict.fromkeys(PRECISION_NAMES, 0)
    for name in module_names(dims.num_layers) if names is None else names:
        gemm = module_gemm_flops(dims, name, tokens)
        precision = plan[name]
        totals[precision.fwd] += gemm        # fprop
        totals[precision.bwd] += 2 * gemm    # dgrad + wgrad
    return totals


@dataclass(frozen=True)
class FlopFractions:
    """Shares of linear-layer FLOPs by element width; they sum to 1."""

    fp4: float
    fp8: float
    bf16: float


def flop_fractions(plan: PrecisionPlan, dims: LlamaLinearDims, names: Iterable[str] | None = None) -> FlopFractions:
    """The fractions of linear-layer FLOPs that ``plan`` runs in FP4 (nvfp4 + mxfp4), FP8 and BF16."""
    totals = flops_by_format(plan, dims, names=names)
    total = sum(totals.values())
    if total == 0:
        raise ValueError("no linear modules to count")
    by_family = {f: sum(v for n, v in totals.items() if family(n) == f) / total for f in ("fp4", "fp8", "bf16")}
    return FlopFractions(**by_family)


def estimated_time_ratio(plan: PrecisionPlan, dims: LlamaLinearDims, speeds: Mapping[str, float],
                         names: Iterable[str] | None = None,
                         module_speeds: Mapping[str, Mapping[str, tuple[float, float]]] | None = None) -> float:
    """Linear-layer GEMM time of ``plan`` / the time of the same GEMMs in BF16, from a speed model.

    Args:
        speeds: precision name -> GEMM throughput relative to bf16
            (``GemmSpeedModel.precision_speeds``).
        names: modules to count (default: all of the model).
        module_speeds: a measured model's ``module_speeds()`` (module type -> precision -> (forward,
            backward) throughput vs the model-wide bf16 rate): each module's passes then take their
            own measured time, and ``speeds`` is not used.
    """
    if module_speeds is None:
        totals = flops_by_format(plan, dims, names=names)
        total = sum(totals.values())
        if total == 0:
            raise ValueError("no linear modules to count")
        return sum(v / speeds[n] for n, v in totals.items() if v) / total
    time = bf16 = 0.0
    for name in module_names(dims.num_layers) if names is None else names:
        gemm = module_gemm_flops(dims, name)
        row = module_speeds[parse_module_name(name)[1]]
        precision = plan[name]
        time += gemm / row[precision.fwd][0] + 2 * gemm / row[precision.bwd][1]
        bf16 += gemm / row["bf16"][0] + 2 * gemm / row["bf16"][1]
    if bf16 == 0:
        raise ValueError("no linear modules to count")
    return time / bf16
