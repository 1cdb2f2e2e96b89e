"""The quantized linear GEMMs: ``Y = Q(X) Q(W)^T``, ``dX = Q(dY) Q(W)``, ``dW = Q(dY)^T Q(X)``.

Every operand is quantized per GEMM as :func:`recipes.operand_quantizer`
says (blocks along that GEMM's reduction dim), dequantized to fp32, and the
GEMM runs in fp32 (FP32 accumulation, as tensor cores do). The rounding is
straight-through: dX and dW are the gradients with respect to X and W.
Outputs come back in the dtypes of X (Y, dX) and W (dW), so FP32 master
weights stay FP32 and receive FP32 gradients.

Stateful parts of a module (FP8 delayed-scaling amax histories, the RNG of
stochastic rounding, the Hadamard sign vector) live in a :class:`QuantState`
owned by the module and passed in.

Tensor parallelism: a per-tensor amax (FP8 tensorwise/delayed scale, NVFP4
global scale) of an operand that is split across ranks must be the amax of
the whole tensor, or a sharded GEMM would not quantize like the unsharded
one. The caller names the split operands and passes ``amax_reduce`` (an
all-reduce MAX over the TP group); block scales need nothing, provided the
split falls on block boundaries (checked by the layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .blocks import tensor_amax
from .fp8 import FP8DelayedScaling, _apply_tensor_scale, quantize_fp8_block, quantize_fp8_tensorwise
from .formats import FloatFormat
from .hadamard import HADAMARD_SIZE, random_hadamard_transform, random_signs
from .mx import quantize_mxfp4, quantize_mxfp8
from .nvfp4 import quantize_nvfp4
from .recipes import OperandQuantizer, Precision, RecipeConfig, operand_quantizer

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]
_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct (seed, stream) pairs give distinct seeds
_SEED_MASK = (1 << 63) - 1


class QuantState:
    """Mutable quantization state of one linear module.

    Attributes:
        seed: the module's seed: the Hadamard signs derive from it alone, so every
            tensor-parallel rank of a module uses the same transform.
        stream: mixed into the seed of the stochastic-rounding RNG, so ranks holding
            different shards (or data) draw different random numbers.
        delayed: FP8 delayed-scaling quantizers by operand ("x", "w", "dy"), created
            at first use; a recipe with other settings replaces them (fresh history).
    """

    def __init__(self, seed: int = 0, stream: int = 0):
        self.delayed: dict[str, FP8DelayedScaling] = {}
        self.reseed(seed, stream)

    def reseed(self, seed: int, stream: int = 0) -> None:
        """Restart the random streams from ``seed`` (and ``stream``); delayed scaling is kept."""
        self.seed = seed
        self.stream = stream
        self._signs = random_signs(HADAMARD_SIZE, seed=seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The stochastic-rounding RNG on ``device`` (one per device, created seeded)."""
        if device not in self._generators:
            seed = (self.seed * _SEED_MIX + self.stream) & _SEED_MASK
            self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def hadamard_signs(self, device: torch.device) -> torch.Tensor:
        """The 16 random signs of the Hadamard transform, on ``device``."""
        if self._signs.device != device:
            self._signs = self._signs.to(device)
        return self._signs

    def delayed_scaler(self, operand: str, element: FloatFormat, recipe: RecipeConfig) -> FP8DelayedScaling:
        """The delayed-scaling quantizer of ``operand`` matching ``recipe`` (fresh if settings changed)."""
        scaler = self.delayed.get(operand)
        settings = (element, recipe.fp8_amax_history_len, recipe.fp8_amax_compute_algo, recipe.fp8_margin)
        if scaler is None or (scaler.fmt, scaler.amax_history.numel(), scaler.algo, scaler.margin) != settings:
            scaler = FP8DelayedScaling(element, history_len=recipe.fp8_amax_history_len,
                                       algo=recipe.fp8_amax_compute_algo, margin=recipe.fp8_margin)
            self.delayed[operand] = scaler
        return scaler


@dataclass(frozen=True)
class LinearQuantization:
    """Everything the quantized GEMMs need besides the tensors.

    Attributes:
        precision: formats of the forward and backward GEMMs.
        recipe: how each format is realised.
        state: the module's mutable state (advanced by the GEMMs).
        amax_reduce: maps a local 0-d fp32 amax to the amax over all shards; applied to
            the per-tensor amaxes of the operands in ``sharded`` (None: nothing is split).
        sharded: operands ("x", "w", "dy") split across tensor-parallel ranks.
    """

    precision: Precision
    recipe: RecipeConfig
    state: QuantState
    amax_reduce: AmaxReduce | None = None
    sharded: frozenset[str] = frozenset()

    def quantizer(self, gemm: str, operand: str) -> OperandQuantizer:
        name = self.precision.fwd if gemm == "fprop" else self.precision.bwd
        return operand_quantizer(name, gemm, operand, self.recipe)

    def global_amax(self, t: torch.Tensor, operand: str) -> torch.Tensor | None:
        """The amax override for a per-tensor scale of ``t`` (None: the quantizer's own amax)."""
        if self.amax_reduce is None or operand not in self.sharded:
            return None
        return self.amax_reduce(tensor_amax(t))


def _quantize_delayed(t: torch.Tensor, scaler: FP8DelayedScaling, amax: torch.Tensor | None) -> torch.Tensor:
    """``scaler.quantize(t)``, but recording ``amax`` (the all-shard amax) when given, as TE
    reduces delayed-scaling amaxes over the TP group so every rank keeps the same scale."""
    if amax is None:
        return scaler.quantize(t).dequantized
    scaler.scale = scaler.scale.to(t.device)
    scaler.amax_history = scaler.amax_history.to(t.device)
    scale = torch.where(torch.isfinite(amax), scaler.scale, torch.full_like(scaler.scale, float("nan")))
    result = _apply_tensor_scale(t, scale, scaler.fmt)
    scaler._record(amax)
    return result.dequantized


def quantize_operand(t: torch.Tensor, q: OperandQuantizer, operand: str, quant: LinearQuantization) -> torch.Tensor:
    """Quantize-dequantize a 2-D operand for one GEMM.

    Args:
        t: (rows, cols) operand in its natural layout (X, dY: tokens x features; W: out x in).
        q: the quantizer; ``q.columnwise`` quantizes along dim 0 (via the transpose).
            ``q.hadamard`` is not applied here (see :func:`hadamard_wgrad_operands`).
        operand: "x", "w" or "dy" (selects the delayed-scaling history and the amax reduction).
        quant: precision, recipe, state, TP amax reduction.
    Returns:
        fp32 tensor of ``t``'s shape and layout.
    """
    src = (t.t() if q.columnwise else t).float()
    if q.scheme == "bf16":
        out = src.to(torch.bfloat16).float()
    elif q.scheme == "fp8_tensorwise":
        out = quantize_fp8_tensorwise(src, q.element, amax=quant.global_amax(src, operand)).dequantized
    elif q.scheme == "fp8_delayed":
        scaler = quant.state.delayed_scaler(operand, q.element, quant.recipe)
        out = _quantize_delayed(src, scaler, quant.global_amax(src, operand))
    elif q.scheme == "fp8_block":
        out = quantize_fp8_block(src, block=q.block).dequantized
    elif q.scheme == "mxfp8":
        out = quantize_mxfp8(src).dequantized
    else:
        generator = quant.state.generator(src.device) if q.stochastic else None
        if q.scheme == "mxfp4":
            out = quantize_mxfp4(src, stochastic=q.stochastic, generator=generator).dequantized
        else:
            out = quantize_nvfp4(src, block=q.block, amax=quant.global_amax(src, operand),
                                 stochastic=q.stochastic, generator=generator).dequantized
    return out.t() if q.columnwise else out


def hadamard_wgrad_operands(
    dy: torch.Tensor, x: torch.Tensor, signs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The wgrad operands after the random Hadamard transform along tokens.

    Args:
        dy: (tokens, out); x: (tokens, in); signs: (16,) +-1.
    Returns:
        (M dY, M X) in fp32, tokens zero-padded to a multiple of 16 (zero tokens add
        nothing to dY^T X), M = H diag(signs) applied to every 16-token block, so that
        ``(M dY)^T (M X) == dY^T X`` in exact arithmetic.
    """
    pad = -dy.shape[0] % signs.numel()
    dy, x = (F.pad(t.float(), (0, 0, 0, pad)) for t in (dy, x))
    return random_hadamard_transform(dy, signs, dim=0), random_hadamard_transform(x, signs, dim=0)


class _QuantizedLinearFn(torch.autograd.Function):
    """Autograd function of :func:`quantized_linear` (x: (..., in), weight: (out, in))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, quant: LinearQuantization) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        q_x, q_w = quant.quantizer("fprop", "x"), quant.quantizer("fprop", "w")
        x_q = quantize_operand(x2, q_x, "x", quant)
        w_q = quantize_operand(weight, q_w, "w", quant)
        y = x_q @ w_q.t()
        # Where the backward GEMM quantizes an operand exactly as fprop did, keep the
        # fprop copy: it saves the work and, for delayed scaling, records one amax per step.
        ctx.x_ready = quant.quantizer("wgrad", "x") == q_x
        ctx.w_ready = quant.quantizer("dgrad", "w") == q_w
        ctx.save_for_backward(x_q if ctx.x_ready else x2, w_q if ctx.w_ready else weight)
        ctx.quant, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = quant, x.shape, x.dtype, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        quant: LinearQuantization = ctx.quant
        x_saved, w_saved = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        q_dy_d, q_dy_w = quant.quantizer("dgrad", "dy"), quant.quantizer("wgrad", "dy")
        dx = dw = dy_q = None
        if ctx.needs_input_grad[0]:
            dy_q = quantize_operand(dy2, q_dy_d, "dy", quant)
            w_q = w_saved if ctx.w_ready else quantize_operand(w_saved, quant.quantizer("dgrad", "w"), "w", quant)
            dx = (dy_q @ w_q).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            q_x = quant.quantizer("wgrad", "x")
            if q_dy_w.hadamard:
                dy_w, x_w = hadamard_wgrad_operands(dy2, x_saved, quant.state.hadamard_signs(dy2.device))
                dy_wq = quantize_operand(dy_w, q_dy_w, "dy", quant)
                x_wq = quantize_operand(x_w, q_x, "x", quant)
            else:
                reuse_dy = dy_q is not None and q_dy_w == q_dy_d
                dy_wq = dy_q if reuse_dy else quantize_operand(dy2, q_dy_w, "dy", quant)
                x_wq = x_saved if ctx.x_ready else quantize_operand(x_saved, q_x, "x", quant)
            dw = (dy_wq.t() @ x_wq).to(ctx.w_dtype)
        return dx, dw, None


def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: Precision,
    recipe: RecipeConfig,
    state: QuantState,
    *,
    amax_reduce: AmaxReduce | None = None,
    sharded: frozenset[str] = frozenset(),
) -> torch.Tensor:
    """``Y = Q(X) Q(W)^T`` with quantized backward GEMMs (see the module docstring).

    Args:
        x: (..., in) activations, any float dtype; the leading dims are tokens.
        weight: (out, in) weight (the master weight: fp32 or bf16).
        precision: formats of the forward and the backward GEMMs.
        recipe: how each format is realised.
        state: the module's quantization state (delayed scaling, RNG, Hadamard signs).
        amax_reduce: reduction of per-tensor amaxes over the shards of ``sharded`` operands.
        sharded: operands ("x", "w", "dy") split across tensor-parallel ranks.
    Returns:
        (..., out) in x's dtype. Gradients: dX in x's dtype, dW in weight's dtype.
    """
    quant = LinearQuantization(precision, recipe, state, amax_reduce, frozenset(sharded))
    return _QuantizedLinearFn.apply(x, weight, quant)

