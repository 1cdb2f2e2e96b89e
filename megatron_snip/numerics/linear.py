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

Speed without changing bits: ``recipe.kernels`` quantizes the operands with
fused Triton kernels (``triton_qdq.py``, bit-identical to the reference) on
GPU, and ``recipe.fp8_gemm`` runs per-tensor FP8 GEMMs on the FP8 bytes with
``torch._scaled_mm`` (tensor cores; equal to the fp32 GEMM up to accumulation
order). Everything else is emulated: quantize-dequantize, then an fp32 GEMM.

Tensor parallelism: a per-tensor amax (FP8 tensorwise/delayed scale, NVFP4
global scale) of an operand that is split across ranks must be the amax of
the whole tensor, or a sharded GEMM would not quantize like the unsharded
one. The caller names the split operands and passes ``amax_reduce`` (an
all-reduce MAX over the TP group); block scales need nothing, provided the
split falls on block boundaries (checked by the layers). Context parallelism
splits the tokens of X and dY: ``token_amax_reduce`` (a MAX over the CP group)
completes their per-tensor amaxes and the per-row amaxes of the wgrad GEMM,
whose rows run along tokens; blocks along tokens must not straddle CP ranks
(checked at start-up: ``arguments/context_parallel.py``).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_snip.compat.device import has_cuda
from megatron_snip.numerics.blocks import tensor_amax
from megatron_snip.numerics.formats import E4M3, FloatFormat
from megatron_snip.numerics.fp8 import FP8DelayedScaling, fp8_scale_from_amax
from megatron_snip.numerics.fp8_gemm import (
    FP8Operand,
    blockwise_enabled,
    blockwise_mm,
    cast_block,
    cast_current,
    cast_per_tensor,
    cast_rowwise,
    casts_to_bytes,
    row_amax,
    scaled_mm,
    shapes_ok,
)
from megatron_snip.numerics.hadamard import HADAMARD_SIZE, random_hadamard_transform, random_signs
from megatron_snip.numerics.health import HealthStats, OutputBound, element_format
from megatron_snip.numerics.quantize import quantize_dequantize
from megatron_snip.numerics.recipes import GEMM_OPERANDS as GEMM_OPERAND_NAMES
from megatron_snip.numerics.recipes import OperandQuantizer, Precision, RecipeConfig, operand_quantizer
from megatron_snip.numerics.registry import ROW

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]
TOKEN_OPERANDS = frozenset({"x", "dy"})  # the operands whose rows are tokens (context parallelism splits them)
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
        health: per-operand quantization health accumulated by the GEMMs (``health.py``),
            or None: not computed (``--quant-health`` off); the SNIP probes' private states hold
            an object with the same two methods (``snip.module_probe.OperandErrors``). Not part of the saved state.
    """

    def __init__(self, seed: int = 0, stream: int = 0):
        self.delayed: dict[str, FP8DelayedScaling] = {}
        self.health: HealthStats | None = None
        self.reseed(seed, stream)

    def reseed(self, seed: int, stream: int = 0) -> None:
        """Restart the random streams from ``seed`` (and ``stream``); delayed scaling is kept."""
        self.seed = seed
        self.stream = stream
        self._signs = random_signs(HADAMARD_SIZE, seed=seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit: the stochastic-rounding
        generators' states (per device) and the delayed-scaling scalers (on CPU)."""
        delayed = {}
        for operand, scaler in self.delayed.items():
            saved = copy.copy(scaler)
            saved.scale, saved.amax_history = scaler.scale.cpu(), scaler.amax_history.cpu()
            delayed[operand] = saved
        return {"seed": self.seed, "stream": self.stream, "delayed": delayed,
                "generators": {str(device): g.get_state() for device, g in self._generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (generators of devices this machine lacks are skipped)."""
        self.reseed(state["seed"], state["stream"])
        self.delayed = dict(state["delayed"])
        for device, generator_state in state["generators"].items():
            device = torch.device(device)
            if device.type == "cuda" and not has_cuda():
                continue
            self.generator(device).set_state(generator_state)

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


# Every (GEMM, operand) pair of a linear module's three GEMMs.
GEMM_OPERANDS = (("fprop", "x"), ("fprop", "w"), ("dgrad", "dy"), ("dgrad", "w"), ("wgrad", "dy"), ("wgrad", "x"))


@dataclass(frozen=True)
class LinearQuantizers:
    """The six operand quantizers of a module's GEMMs under one (precision, recipe), resolved once when
    the module's precision or recipe is assigned instead of at every GEMM of every micro-batch."""

    table: Mapping[tuple[str, str], OperandQuantizer]

    @classmethod
    def resolve(cls, precision: Precision, recipe: RecipeConfig) -> LinearQuantizers:
        return cls({(gemm, operand): operand_quantizer(precision.fwd if gemm == "fprop" else precision.bwd, gemm,
                                                       operand, recipe) for gemm, operand in GEMM_OPERANDS})

    def __call__(self, gemm: str, operand: str) -> OperandQuantizer:
        return self.table[(gemm, operand)]


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
        quantizers: ``precision``'s quantizers under ``recipe`` (resolved here when not given).
        token_amax_reduce: maps amaxes over this rank's tokens to amaxes over all tokens (a MAX over
            the context-parallel group; None: the tokens are whole): the per-tensor amaxes of X and dY
            and the per-row amaxes of the wgrad GEMM's operands.
    """

    precision: Precision
    recipe: RecipeConfig
    state: QuantState
    amax_reduce: AmaxReduce | None = None
    sharded: frozenset[str] = frozenset()
    quantizers: LinearQuantizers | None = None
    token_amax_reduce: AmaxReduce | None = None

    def __post_init__(self):
        if self.quantizers is None:
            object.__setattr__(self, "quantizers", LinearQuantizers.resolve(self.precision, self.recipe))

    def quantizer(self, gemm: str, operand: str) -> OperandQuantizer:
        return self.quantizers(gemm, operand)

    def global_amax(self, local: torch.Tensor, operand: str) -> torch.Tensor | None:
        """The amax over all shards of ``operand`` from its ``local`` 0-d amax, where the operand is split
        (None: it is not; the quantizer's own amax serves)."""
        amax = None
        if self.amax_reduce is not None and operand in self.sharded:
            amax = self.amax_reduce(local)
        if self.token_amax_reduce is not None and operand in TOKEN_OPERANDS:
            amax = self.token_amax_reduce(local if amax is None else amax)
        return amax

    def row_amax(self, local: torch.Tensor, gemm: str | None) -> torch.Tensor | None:
        """The (R,) row amaxes of a per-row-scaled operand over all shards of each row from its ``local``
        ones, where ``gemm``'s reduction dim is split, else None (rows are whole): tensor parallelism
        splits fprop's or dgrad's (both their operands are split), context parallelism wgrad's (tokens)."""
        if gemm == "wgrad":
            return None if self.token_amax_reduce is None else self.token_amax_reduce(local)
        if self.amax_reduce is None or gemm is None or not set(GEMM_OPERAND_NAMES[gemm]) <= self.sharded:
            return None
        return self.amax_reduce(local)


Operand = torch.Tensor | FP8Operand


def _triton(recipe: RecipeConfig, t: torch.Tensor, module: str = "triton_qdq"):
    """The fused-kernel module ``module`` (``triton_qdq``: quantize-dequantize; ``triton_fp8``: casts to
    FP8 bytes) when ``recipe.kernels`` selects the kernels for ``t``, else None."""
    if recipe.kernels == "torch" or (recipe.kernels == "auto" and not t.is_cuda):
        return None
    try:
        return importlib.import_module(f"{__package__}.{module}")
    except ImportError as e:
        if recipe.kernels == "triton":
            raise ImportError(f"--quant-kernels triton needs the triton package ({e}); "
                              "pip install triton, or use --quant-kernels torch") from e
        return None


def scaled_mm_enabled(recipe: RecipeConfig, t: torch.Tensor) -> bool:
    """Whether per-tensor FP8 GEMMs on ``t``'s device run through ``torch._scaled_mm``."""
    if recipe.fp8_gemm == "auto":
        return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 9)
    return recipe.fp8_gemm == "scaled_mm"


def describe_backend(recipe: RecipeConfig, device: torch.device) -> str:
    """One line for the start-up log: what quantizes the operands and what runs the GEMMs on ``device``."""
    probe = torch.empty(0, device=device)
    kernels = "fused Triton kernels" if _triton(recipe, probe) is not None else "torch reference quantizers"
    fp8 = ("per-tensor and rowwise FP8 GEMMs on torch._scaled_mm (operands cast to FP8 bytes, transposed copies "
           "by the cast)" + (", blockwise FP8 on torch's block-scaled GEMM where it agrees with the emulation at "
                             "first use" if blockwise_enabled(device) else "") + ", other GEMMs"
           if scaled_mm_enabled(recipe, probe) else "GEMMs")
    return f"torch: operands quantized by {kernels}; {fp8} on dequantized operands with fp32 accumulation"


def _quantize(t: torch.Tensor, q: OperandQuantizer, operand: str, quant: LinearQuantization,
              keep_fp8: bool = False, gemm: str | None = None, transpose: bool = False) -> Operand:
    """:func:`quantize_operand`; with ``keep_fp8`` an FP8 operand that a scaled GEMM on this device takes
    (``fp8_gemm.casts_to_bytes``) comes back as an :class:`FP8Operand` (bytes + scales, with ``transpose``
    also the transposed bytes where its scales allow: per tensor, square tiles) instead of dequantized."""
    src = t.t() if q.columnwise else t
    out, amax = _quantize_src(src, q, operand, quant, keep_fp8 and casts_to_bytes(q, src.device), gemm, transpose)
    health = quant.state.health
    if health is not None and gemm is not None:  # kept per GEMM operand, on the device (--quant-health)
        health.record(f"{gemm}.{operand}", src, out.dequantized if isinstance(out, FP8Operand) else out, q, amax)
    return out.t() if q.columnwise else out


def _quantize_src(src: torch.Tensor, q: OperandQuantizer, operand: str, quant: LinearQuantization,
                  keep_fp8: bool, gemm: str | None = None, transpose: bool = False
                  ) -> tuple[Operand, torch.Tensor | None]:
    """The quantized ``src`` (already transposed for a columnwise quantizer), and the max-abs of ``src``
    (0-d, or one per row) where the quantizer computed one anyway (None elsewhere): quantization health
    takes its non-finite flags from it at no cost."""
    scale = generator = None
    if keep_fp8 and q.spec.block_gemm:  # block scales for torch's block-scaled GEMM (Hopper)
        return cast_block(src, element_format(q), q.block, transpose=transpose,
                          kernels=_triton(quant.recipe, src, "triton_fp8")), None
    if q.block == (1, ROW):  # per-row scales: the row amaxes of a split reduction dim over all shards
        fp8 = _triton(quant.recipe, src, "triton_fp8")
        local = row_amax(src, fp8)
        amax = quant.row_amax(local, gemm)
        if keep_fp8:
            return cast_rowwise(src, E4M3, local if amax is None else amax, kernels=fp8), local
        return quantize_dequantize(src, q, global_amax=local if amax is None else amax), local
    if q.spec.per_tensor:
        fp8 = _triton(quant.recipe, src, "triton_fp8") if keep_fp8 else None
        local = fp8.tensor_amax_bits(src) if fp8 is not None else tensor_amax(src).float()
        amax = quant.global_amax(local, operand)
        if keep_fp8 and not q.spec.amax_history:  # per-tensor quantizers are never columnwise: src is t
            return cast_current(src, q.element, amax if amax is not None else local, transpose=transpose,
                                kernels=fp8), local
        amax = local if amax is None else amax
        if not q.spec.amax_history:
            scale = fp8_scale_from_amax(amax, q.element)
        else:
            scaler = quant.state.delayed_scaler(operand, q.element, quant.recipe)
            scale = scaler.scale_for(amax)
            scaler.record(amax)
        if keep_fp8:
            return cast_per_tensor(src, q.element, scale, transpose=transpose, kernels=fp8), local
    else:
        local = tensor_amax(src).float() if q.spec.global_scale else None  # nvfp4's per-tensor scale
    if q.stochastic:
        generator = quant.state.generator(src.device)
    global_amax = None
    if q.spec.global_scale:
        reduced = quant.global_amax(local, operand)
        global_amax = local if reduced is None else reduced
    out = quantize_dequantize(src, q, scale=scale, global_amax=global_amax, generator=generator,
                              kernels=_triton(quant.recipe, src))
    return out, local


def quantize_operand(t: torch.Tensor, q: OperandQuantizer, operand: str, quant: LinearQuantization,
                     gemm: str | None = None) -> torch.Tensor:
    """Quantize-dequantize a 2-D operand for one GEMM.

    Args:
        t: (rows, cols) operand in its natural layout (X, dY: tokens x features; W: out x in).
        q: the quantizer; ``q.columnwise`` quantizes along dim 0 (via the transpose).
            ``q.hadamard`` is not applied here (see :func:`hadamard_wgrad_operands`).
        operand: "x", "w" or "dy" (selects the delayed-scaling history and the amax reduction).
        quant: precision, recipe (incl. which kernels quantize), state, TP amax reduction.
        gemm: "fprop", "dgrad" or "wgrad": where the module's health statistics (if kept) go.
    Returns:
        fp32 tensor of ``t``'s shape and layout.
    """
    return _quantize(t, q, operand, quant, gemm=gemm)


def _record_output(quant: LinearQuantization, key: str, out: torch.Tensor, a: Operand, b: Operand) -> None:
    """Keep a GEMM output's health (``--quant-health``): whether this GEMM made non-finite values. Where
    it read FP8 bytes, the bound their scales put on it (``OutputBound``) says so without reading it."""
    if quant.state.health is not None:
        bound = None
        if isinstance(a, FP8Operand) and isinstance(b, FP8Operand):
            bound = OutputBound(a.scale_inv, b.scale_inv, a.data.shape[1] * torch.finfo(a.data.dtype).max
                                * torch.finfo(b.data.dtype).max, torch.finfo(out.dtype).max)
        quant.state.health.record_output(key, out, bound)


def _matmul(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` for a (M, K), b (K, N) in ``out_dtype``: tensor-core FP8 when both are FP8 bytes and
    ``torch._scaled_mm`` takes them (written in ``out_dtype`` directly), else an fp32 GEMM on the
    dequantized values, then cast."""
    if isinstance(a, FP8Operand) and isinstance(b, FP8Operand):
        if shapes_ok(a, b):
            return scaled_mm(a, b, out_dtype)
        if a.block is not None and b.block is not None:
            out = blockwise_mm(a, b, out_dtype)
            if out is not None:
                return out
    dense = [op.dequantized() if isinstance(op, FP8Operand) else op for op in (a, b)]
    return (dense[0] @ dense[1]).to(out_dtype)


def _keep(quantized: Operand, q: OperandQuantizer) -> bool:
    """Whether the backward keeps fprop's quantized copy of an operand (see _QuantizedLinearFn)."""
    return isinstance(quantized, FP8Operand) or q.spec.amax_history


def _save(ctx, *operands: Operand) -> None:
    """save_for_backward for operands, FP8 ones as their (bytes, scale) pair: of the bytes, the transposed
    copy where the cast wrote one (the backward GEMMs read X and W only transposed: column-major B), so
    one byte per element is kept."""
    tensors = []
    for op in operands:
        if isinstance(op, FP8Operand):
            tensors.extend((op.data if op.data_t is None else op.data_t.t(), op.scale_inv))
        else:
            tensors.append(op)
    ctx.fp8_saved = [(op.block,) if isinstance(op, FP8Operand) else None for op in operands]  # (its block,)
    ctx.save_for_backward(*tensors)


def _saved(ctx) -> list[Operand]:
    tensors = iter(ctx.saved_tensors)
    return [next(tensors) if fp8 is None else FP8Operand(next(tensors), next(tensors), block=fp8[0])
            for fp8 in ctx.fp8_saved]


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


@dataclass(frozen=True)
class Fprop:
    """What fprop tells the backward besides the operands it kept.

    Attributes:
        fp8_bytes: the GEMMs run on FP8 bytes where the operands allow (``scaled_mm_enabled``).
        x_ready, w_ready: the operand kept for the backward is fprop's quantized X / W (the backward
            GEMM quantizes it exactly as fprop did), not the operand itself.
        x_shape, x_dtype, w_dtype: of the inputs (dX comes back in X's shape and dtype, dW in W's).
    """

    fp8_bytes: bool
    x_ready: bool
    w_ready: bool
    x_shape: torch.Size
    x_dtype: torch.dtype
    w_dtype: torch.dtype


def fprop(x: torch.Tensor, weight: torch.Tensor, quant: LinearQuantization, x_grad: bool, w_grad: bool,
          keep_dequantized: bool = False) -> tuple[torch.Tensor, Operand, Operand, Fprop]:
    """The forward GEMM of :func:`quantized_linear`: (Y, the X and the W the backward reads, what it needs to
    know). ``x_grad`` / ``w_grad``: whether dX / dW will be computed (the casts then also write the transposed
    bytes a backward GEMM reads). ``keep_dequantized``: the backward reads fprop's dequantized X / W wherever it
    quantizes them alike, rather than quantizing them again (for a caller that holds one micro-batch at a time:
    the SNIP probes; below, why training does not)."""
    x2 = x.reshape(-1, x.shape[-1])
    fp8_bytes = scaled_mm_enabled(quant.recipe, x2)
    q_x, q_w = quant.quantizer("fprop", "x"), quant.quantizer("fprop", "w")
    # A backward GEMM that reuses fprop's bytes of X (wgrad) or W (dgrad) reads them transposed:
    # the cast writes that copy too (only per-tensor bytes are reused: see below).
    x_reused = quant.quantizer("wgrad", "x") == q_x and w_grad
    w_reused = quant.quantizer("dgrad", "w") == q_w and x_grad
    x_q = _quantize(x2, q_x, "x", quant, fp8_bytes, "fprop", transpose=x_reused)
    w_q = _quantize(weight, q_w, "w", quant, fp8_bytes, "fprop", transpose=w_reused)
    y = _matmul(x_q, w_q.t(), x.dtype)
    _record_output(quant, "fprop.y", y, x_q, w_q)
    # Where the backward GEMM quantizes an operand exactly as fprop did, it may keep the
    # fprop copy. It does so for FP8 bytes (1 byte/element, less than the operand itself)
    # and for delayed scaling (whose scale has moved on since fprop, and which must record
    # one amax per step). A dequantized fp32 copy is not kept: it is larger than X or W
    # themselves, and every micro-batch in flight would hold one (of the whole weights, for
    # W). The backward quantizes the saved X / W again instead: same tensor, stateless
    # quantizer, the same values.
    x_ready = quant.quantizer("wgrad", "x") == q_x and (keep_dequantized or _keep(x_q, q_x))
    w_ready = quant.quantizer("dgrad", "w") == q_w and (keep_dequantized or _keep(w_q, q_w))
    info = Fprop(fp8_bytes, x_ready, w_ready, x.shape, x.dtype, weight.dtype)
    return (y.reshape(*x.shape[:-1], weight.shape[0]), x_q if x_ready else x2, w_q if w_ready else weight, info)


def bprop(dy: torch.Tensor, x_saved: Operand, w_saved: Operand, info: Fprop, quant: LinearQuantization,
          needs_dx: bool, needs_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward GEMMs of :func:`quantized_linear` from what :func:`fprop` kept: (dX or None, dW or None)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    fp8_bytes = info.fp8_bytes
    q_dy_d, q_dy_w = quant.quantizer("dgrad", "dy"), quant.quantizer("wgrad", "dy")
    dx = dw = dy_q = None
    reuse_dy = q_dy_w == q_dy_d and not q_dy_w.hadamard and needs_dw
    if needs_dx:
        dy_q = _quantize(dy2, q_dy_d, "dy", quant, fp8_bytes, "dgrad", transpose=reuse_dy)
        w_q = w_saved if info.w_ready else _quantize(w_saved, quant.quantizer("dgrad", "w"), "w", quant,
                                                     fp8_bytes, "dgrad", transpose=True)
        dx = _matmul(dy_q, w_q, info.x_dtype)
        _record_output(quant, "dgrad.dx", dx, dy_q, w_q)
        dx = dx.reshape(info.x_shape)
    if needs_dw:
        q_x = quant.quantizer("wgrad", "x")
        if q_dy_w.hadamard:
            dy_w, x_w = hadamard_wgrad_operands(dy2, x_saved, quant.state.hadamard_signs(dy2.device))
            dy_wq = quantize_operand(dy_w, q_dy_w, "dy", quant, "wgrad")
            x_wq = quantize_operand(x_w, q_x, "x", quant, "wgrad")
        else:
            dy_wq = dy_q if reuse_dy and dy_q is not None else _quantize(dy2, q_dy_w, "dy", quant, fp8_bytes,
                                                                         "wgrad", transpose=True)
            x_wq = x_saved if info.x_ready else _quantize(x_saved, q_x, "x", quant, fp8_bytes, "wgrad",
                                                          transpose=True)
        dw = _matmul(dy_wq.t(), x_wq, info.w_dtype)
    return dx, dw


class _QuantizedLinearFn(torch.autograd.Function):
    """Autograd function of :func:`quantized_linear` (x: (..., in), weight: (out, in)) in eager code; compiled
    graphs call the same :func:`fprop` and :func:`bprop` through a custom operator (``linear_op.py``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, quant: LinearQuantization) -> torch.Tensor:
        y, x_saved, w_saved, ctx.info = fprop(x, weight, quant, x.requires_grad, weight.requires_grad)
        _save(ctx, x_saved, w_saved)
        ctx.quant = quant
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_saved, w_saved = _saved(ctx)
        dx, dw = bprop(dy, x_saved, w_saved, ctx.info, ctx.quant, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None


@torch.compiler.disable  # see below: a compiled region around the linear breaks here, cleanly
def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    precision: Precision,
    recipe: RecipeConfig,
    state: QuantState,
    *,
    amax_reduce: AmaxReduce | None = None,
    sharded: frozenset[str] = frozenset(),
    quantizers: LinearQuantizers | None = None,
    token_amax_reduce: AmaxReduce | None = None,
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
        quantizers: ``LinearQuantizers.resolve(precision, recipe)``, if the caller keeps it.
        token_amax_reduce: reduction of X's and dY's amaxes over the context-parallel ranks (None: none).
    Returns:
        (..., out) in x's dtype. Gradients: dX in x's dtype, dW in weight's dtype.

    Called directly inside a region ``torch.compile`` traces, it runs eagerly (``torch.compiler.disable``,
    a graph break there). The precision-aware linear modules call it through the custom operator of
    ``linear_op.py`` instead, which stays inside the graph and runs the same :func:`fprop` / :func:`bprop`.
    """
    quant = LinearQuantization(precision, recipe, state, amax_reduce, frozenset(sharded), quantizers, token_amax_reduce)
    return _QuantizedLinearFn.apply(x, weight, quant)

