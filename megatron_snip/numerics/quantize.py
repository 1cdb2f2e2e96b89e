"""One dispatch from a quantization scheme to its quantizer: the torch reference or the fused kernel.

:func:`quantize_dequantize` is what the quantized linear layers (``linear.py``) and
``fake_quantize`` both call, so a scheme name (``registry.SCHEMES``) means one thing
everywhere: :data:`QUANTIZERS` holds one function per registered scheme (no chain of
tests on names). The fused Triton kernels (``triton_qdq.py``) are bit-identical to the torch
reference and are used where the caller passes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from megatron_snip.numerics.blocks import tensor_amax
from megatron_snip.numerics.formats import E2M1, E4M3
from megatron_snip.numerics.fp8 import _apply_tensor_scale, quantize_fp8_block
from megatron_snip.numerics.mx import quantize_mxfp4, quantize_mxfp8
from megatron_snip.numerics.nvfp4 import quantize_nvfp4
from megatron_snip.numerics.recipes import OperandQuantizer
from megatron_snip.numerics.registry import SCHEMES


def quantize_dequantize(x: torch.Tensor, q: OperandQuantizer, *, scale: torch.Tensor | None = None,
                        global_amax: torch.Tensor | None = None, generator: torch.Generator | None = None,
                        kernels: ModuleType | None = None) -> torch.Tensor:
    """``x`` quantized by scheme ``q`` and dequantized, in fp32 (blocks along the last dim).

    Args:
        x: (..., C) tensor of any float dtype; the caller transposes for columnwise quantizers.
        q: the operand quantizer (``q.hadamard`` is the caller's business).
        scale: per-tensor FP8 schemes: the 0-d fp32 encode scale (required for them).
        global_amax: nvfp4: the amax of the whole tensor when ``x`` is one shard of it; fp8_rowwise:
            the (R,) row amaxes over every shard of each row.
        generator: RNG of stochastic rounding (``q.stochastic``), on x's device.
        kernels: the ``triton_qdq`` module to use its fused kernels, or None for the reference.
    Returns:
        fp32 tensor of ``x``'s shape, laid out as ``torch.empty_like(x)`` (a transposed view stays
        one) on either path: a GEMM on a GPU sums in an order that depends on its operands'
        strides, so the reference and the kernels must hand it the same layout to agree in every
        bit (the reference's padded blocks otherwise leave a wider row stride behind; an H200 moved
        26 of 6144 fp8-blockwise layer outputs by an ulp).
    """
    out = _dispatch(x, q, scale, global_amax, generator, kernels)
    if out.stride() == x.stride():
        return out
    target = torch.empty_like(x, dtype=torch.float32)
    return out if out.stride() == target.stride() else target.copy_(out)


@dataclass(frozen=True)
class _Args:
    """What a quantizer may need besides the tensor and its :class:`OperandQuantizer`."""

    scale: torch.Tensor | None
    global_amax: torch.Tensor | None
    generator: torch.Generator | None
    kernels: ModuleType | None


def _bf16(x: torch.Tensor, q: OperandQuantizer, a: _Args) -> torch.Tensor:
    return x.float().to(torch.bfloat16).float()


def _fp8_per_tensor(x: torch.Tensor, q: OperandQuantizer, a: _Args) -> torch.Tensor:
    if a.scale is None:
        raise ValueError(f"{q.scheme} needs the per-tensor scale")
    if a.kernels is not None:
        return a.kernels.qdq_fp8_tensorwise(x, a.scale, q.element)
    return _apply_tensor_scale(x.float(), a.scale, q.element).dequantized


def _fp8_rowwise(x: torch.Tensor, q: OperandQuantizer, a: _Args) -> torch.Tensor:
    # Emulation only runs where no FP8 tensor cores do (the GPU path casts to bytes: fp8_gemm.py),
    # so the reference serves both kernel settings.
    return quantize_fp8_block(x, block=q.block, amax=a.global_amax).dequantized


def _fp8_block(x: torch.Tensor, q: OperandQuantizer, a: _Args) -> torch.Tensor:
    if a.kernels is not None:
        return a.kernels.qdq_fp8_block(x, block=q.block)
    return quantize_fp8_block(x, block=q.block).dequantized


def _mxfp8(x: torch.Tensor, q: OperandQuantizer, a: _Args) -> torch.Tensor:
    return a.kernels.qdq_mx(x, E4M3, scale_rule="ceil") if a.kernels is not None else quantize_mxfp8(x).dequantized


def _stochastic(q: OperandQuantizer, a: _Args) -> dict:
    return dict(stochastic=q.stochastic, generator=a.generator if q.stochastic else None)


def _mxfp4(x: torch.Tensor, q: OperandQuantizer, a: _Args) -> torch.Tensor:
    if a.kernels is not None:
        return a.kernels.qdq_mx(x, E2M1, scale_rule="ocp", **_stochastic(q, a))
    return quantize_mxfp4(x, **_stochastic(q, a)).dequantized


def _nvfp4(x: torch.Tensor, q: OperandQuantizer, a: _Args) -> torch.Tensor:
    if a.kernels is not None:
        return a.kernels.qdq_nvfp4(x, block=q.block, global_amax=tensor_amax(x, a.global_amax).float(),
                                   **_stochastic(q, a))
    return quantize_nvfp4(x, block=q.block, amax=a.global_amax, **_stochastic(q, a)).dequantized


#: Each registered scheme's quantize-dequantize (``registry.SCHEMES``; checked complete below).
QUANTIZERS: dict[str, Callable[[torch.Tensor, OperandQuantizer, _Args], torch.Tensor]] = {
    "bf16": _bf16, "fp8_tensorwise": _fp8_per_tensor, "fp8_delayed": _fp8_per_tensor, "fp8_rowwise": _fp8_rowwise,
    "fp8_block": _fp8_block, "mxfp8": _mxfp8, "mxfp4": _mxfp4, "nvfp4": _nvfp4,
}
if set(QUANTIZERS) != set(SCHEMES):
    raise ImportError(f"quantize.QUANTIZERS and registry.SCHEMES disagree: {sorted(set(QUANTIZERS) ^ set(SCHEMES))}")


def _dispatch(x: torch.Tensor, q: OperandQuantizer, scale: torch.Tensor | None, global_amax: torch.Tensor | None,
              generator: torch.Generator | None, kernels: ModuleType | None) -> torch.Tensor:
    return QUANTIZERS[q.scheme](x, q, _Args(scale, global_amax, generator, kernels))
