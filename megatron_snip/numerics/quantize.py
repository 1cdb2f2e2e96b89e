"""One dispatch from a quantization scheme to its quantizer: the torch reference or the fused kernel.

:func:`quantize_dequantize` is what the quantized linear layers (``linear.py``) and
``fake_quantize`` both call, so a scheme name (``registry.SCHEMES``) means one thing
everywhere. The fused Triton kernels (``triton_qdq.py``) are bit-identical to the torch
reference and are used where the caller passes them.
"""

from __future__ import annotations

from types import ModuleType

import torch

from megatron_snip.numerics.blocks import tensor_amax
from megatron_snip.numerics.formats import E2M1, E4M3
from megatron_snip.numerics.fp8 import _apply_tensor_scale, quantize_fp8_block
from megatron_snip.numerics.mx import quantize_mxfp4, quantize_mxfp8
from megatron_snip.numerics.nvfp4 import quantize_nvfp4
from megatron_snip.numerics.recipes import OperandQuantizer


def quantize_dequantize(x: torch.Tensor, q: OperandQuantizer, *, scale: torch.Tensor | None = None,
                        global_amax: torch.Tensor | None = None, generator: torch.Generator | None = None,
                        kernels: ModuleType | None = None) -> torch.Tensor:
    """``x`` quantized by scheme ``q`` and dequantized, in fp32 (blocks along the last dim).

    Args:
        x: (..., C) tensor of any float dtype; the caller transposes for columnwise quantizers.
        q: the operand quantizer (``q.hadamard`` is the caller's business).
        scale: per-tensor FP8 schemes: the 0-d fp32 encode scale (required for them).
        global_amax: nvfp4: the amax of the whole tensor when ``x`` is one shard of it.
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


def _dispatch(x: torch.Tensor, q: OperandQuantizer, scale: torch.Tensor | None, global_amax: torch.Tensor | None,
              generator: torch.Generator | None, kernels: ModuleType | None) -> torch.Tensor:
    scheme = q.scheme
    sr = dict(stochastic=q.stochastic, generator=generator if q.stochastic else None)
    if scheme == "bf16":
        return x.float().to(torch.bfloat16).float()
    if q.spec.per_tensor:
        if scale is None:
            raise ValueError(f"{scheme} needs the per-tensor scale")
        if kernels is not None:
            return kernels.qdq_fp8_tensorwise(x, scale, q.element)
        return _apply_tensor_scale(x.float(), scale, q.element).dequantized
    if scheme == "fp8_block":
        return (kernels.qdq_fp8_block(x, block=q.block) if kernels is not None
                else quantize_fp8_block(x, block=q.block).dequantized)
    if scheme == "mxfp8":
        return kernels.qdq_mx(x, E4M3, scale_rule="ceil") if kernels is not None else quantize_mxfp8(x).dequantized
    if scheme == "mxfp4":
        return (kernels.qdq_mx(x, E2M1, scale_rule="ocp", **sr) if kernels is not None
                else quantize_mxfp4(x, **sr).dequantized)
    if scheme == "nvfp4":
        if kernels is not None:
            return kernels.qdq_nvfp4(x, block=q.block, global_amax=tensor_amax(x, global_amax).float(), **sr)
        return quantize_nvfp4(x, block=q.block, amax=global_amax, **sr).dequantized
    raise ValueError(f"no quantizer for scheme {scheme!r}")
