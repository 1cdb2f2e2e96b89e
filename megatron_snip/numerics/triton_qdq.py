"""Fused Triton quantize-dequantize kernels for the quantized linear's operands (GPU path).

Each kernel makes one pass over a 2-D operand: load it (any float dtype, any
strides, so a "columnwise" copy is read through the transpose without a copy),
find the block amaxes, derive the scales, round the elements, dequantize, and
store fp32. The results are bit-identical to the pure-torch reference
quantizers (``fp8.py``, ``mx.py``, ``nvfp4.py``), which stay the CPU path and
the specification: every step below repeats the reference's fp32 operations
in the same order, with correctly rounded division (``tl.div_rn``) where the
reference divides, integer bit manipulation where it reads exponent bits, and
``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA.

What stays in torch, around the kernel:
- the amax of a whole tensor (FP8 current scaling, the NVFP4 global scale) is a
  reduction over all of it, and under tensor parallelism an all-reduce, so it
  runs before the kernel (as Transformer Engine runs a separate amax kernel);
  the few fp32 scalar operations on it go in as a small parameter tensor;
- the uniforms of stochastic rounding are drawn by ``torch.rand`` from the
  module's generator, in the reference's order, so equal generator states give
  equal bits (at the cost of reading 4 bytes more per element).

Verified bit for bit against the reference in Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU by tests/test_triton_qdq.py; on a GPU the same
tests run compiled (see docs/numerics.md for what has been measured where).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_snip.numerics.formats import E2M1, E4M3, FloatFormat
from megatron_snip.numerics.nvfp4 import nvfp4_global_scale
from megatron_snip.numerics.registry import FP8_BLOCK

# A global a @triton.jit function reads must be a constexpr (Triton 3.6 refuses a plain float).
_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_KIND_TENSOR, _KIND_FP8_BLOCK, _KIND_MX, _KIND_NVFP4 = 0, 1, 2, 3
_MX_RULES = {"ceil": 0, "ocp": 1}


@triton.jit
def _round_magnitude(a, u, EMIN: tl.constexpr, EMAX: tl.constexpr, MANT: tl.constexpr,
                     MAXV: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Round non-negative fp32 ``a`` onto the grid of a format (NaN stays NaN, beyond max saturates).

    Same arithmetic as ``formats._ulp`` / ``round_to_format`` / ``round_e2m1_stochastic``:
    the ulp of a's binade (clamped to [emin, emax]) from its exponent bits, then
    a / ulp is exact and only its rounding to an integer remains.
    """
    a = tl.where(a > MAXV, MAXV, a)  # +Inf -> max; NaN compares false and stays
    power = a.to(tl.int32, bitcast=True) & 0x7F800000
    power = tl.minimum(tl.maximum(power, (EMIN + 127) << 23), (EMAX + 127) << 23)
    ulp_bits = power - (MANT << 23)
    ulp = ulp_bits.to(tl.float32, bitcast=True)
    inv_ulp = ((254 << 23) - ulp_bits).to(tl.float32, bitcast=True)  # 1/ulp, exact: a power of two
    units = a * inv_ulp
    low = tl.floor(units)
    frac = units - low  # exact
    if STOCHASTIC:
        up = u < frac
    else:  # round half to even
        up = (frac > 0.5) | ((frac == 0.5) & ((low.to(tl.int32) & 1) == 1))
    return (low + up.to(tl.float32)) * ulp


@triton.jit
def _round_signed(x, u, EMIN: tl.constexpr, EMAX: tl.constexpr, MANT: tl.constexpr,
                  MAXV: tl.constexpr, STOCHASTIC: tl.constexpr):
    """``_round_magnitude`` of |x| with x's sign bit put back (so -0 and small negatives stay -0)."""
    m = _round_magnitude(tl.abs(x), u, EMIN, EMAX, MANT, MAXV, STOCHASTIC)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (m.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _reciprocal(v):
    return tl.div_rn(tl.full(v.shape, 1.0, tl.float32), v)


@triton.jit
def _qdq_kernel(
    x_ptr, out_ptr, u_ptr, p_ptr, R, C, stride_r, stride_c, out_stride_r, out_stride_c, u_cols,
    KIND: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MANT: tl.constexpr, MAXV: tl.constexpr,
    MX_RULE: tl.constexpr, POW2: tl.constexpr, STOCHASTIC: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
):
    """One TR x TC tile of an (R, C) operand -> fp32 dequantized, written with the out strides.

    Tiles are whole scaling blocks (BR x BC); elements outside the matrix load as
    0, which is the reference's zero padding of partial blocks. Parameters in
    ``p_ptr`` by KIND: tensor [scale, scale_inv]; mx [fl(1/elem max)];
    nvfp4 [S_enc, S_dec, fl(S_enc * fl(1/6))]; fp8 block none.
    """
    rows = tl.program_id(0) * TR + tl.arange(0, TR)
    cols = tl.program_id(1) * TC + tl.arange(0, TC)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    x = x.to(tl.float32)
    u = x  # unused unless STOCHASTIC
    if STOCHASTIC:
        u = tl.load(u_ptr + rows[:, None] * u_cols + cols[None, :], mask=mask, other=0.0)
    if KIND == 0:
        scale = tl.load(p_ptr)
        scale_inv = tl.load(p_ptr + 1)
        out = _round_signed(x * scale, u, EMIN, EMAX, MANT, MAXV, STOCHASTIC) * scale_inv
    else:
        xb = tl.reshape(x, (TR // BR, BR, TC // BC, BC))
        ub = tl.reshape(u, (TR // BR, BR, TC // BC, BC))
        amax = tl.max(tl.max(tl.abs(xb), axis=3), axis=1)
        has_nan = tl.max(tl.max((xb != xb).to(tl.int32), axis=3), axis=1) > 0
        amax = tl.where(has_nan, float("nan"), amax)  # a NaN anywhere makes the block NaN
        finite = amax < float("inf")  # False for NaN too
        if KIND == 1:  # fp8_scale_from_amax, then TE's block scaling
            enc = tl.div_rn(tl.full(amax.shape, MAXV, tl.float32), amax)
            enc = tl.where(enc == float("inf"), _FP32_MAX, enc)
            if POW2:
                enc = (enc.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
            enc = tl.where(amax == 0.0, 1.0, enc)
            enc = tl.where(finite, enc, float("nan"))
            dec = _reciprocal(enc)
        elif KIND == 2:  # E8M0 shared exponent (mx.e8m0_code_ceil / e8m0_code_ocp)
            if MX_RULE == 0:
                ratio_bits = (amax * tl.load(p_ptr)).to(tl.int32, bitcast=True)
                exp_field = ratio_bits >> 23
                mant = ratio_bits & 0x7FFFFF
                round_up = (mant > 0) & (exp_field < 254) & ((exp_field > 0) | (mant > 4194304))
                code = exp_field + round_up.to(tl.int32)
            else:
                code = (amax.to(tl.int32, bitcast=True) >> 23) - EMAX
                code = tl.minimum(tl.maximum(code, 0), 254)
            code = tl.where(finite, code, 255)
            # 2^(code - 127); code 0 is 2^-127, the fp32 subnormal with only mantissa bit 22 set.
            dec_bits = tl.where(code == 0, 4194304, tl.minimum(tl.maximum(code, 1), 254) << 23)
            dec = dec_bits.to(tl.float32, bitcast=True)
            dec = tl.where(code == 255, float("nan"), dec)
            enc = _reciprocal(dec)
        else:  # NVFP4: E4M3 block decode scales under the fp32 tensor scale
            s_enc = tl.load(p_ptr)
            s_dec = tl.load(p_ptr + 1)
            s_enc_over_6 = tl.load(p_ptr + 2)
            s_b = _round_magnitude(amax * s_enc_over_6, amax, -6, 8, 3, 448.0, False)
            s_b = tl.where(finite, s_b, float("nan"))
            enc = _reciprocal(s_b * s_dec)
            enc = tl.where(enc > _FP32_MAX, _FP32_MAX, enc)  # NaN compares false and stays
        enc4 = tl.reshape(enc, (TR // BR, 1, TC // BC, 1))
        elements = _round_signed(xb * enc4, ub, EMIN, EMAX, MANT, MAXV, STOCHASTIC)
        if KIND == 3:
            outb = tl.div_rn(elements * tl.reshape(s_b, (TR // BR, 1, TC // BC, 1)), s_enc)
        else:
            outb = elements * tl.reshape(dec, (TR // BR, 1, TC // BC, 1))
        out = tl.reshape(outb, (TR, TC))
    tl.store(out_ptr + rows[:, None] * out_stride_r + cols[None, :] * out_stride_c, out, mask=mask)


def _launch(x: torch.Tensor, kind: int, fmt: FloatFormat, block: tuple[int, int],
            params: torch.Tensor, *, mx_rule: int = 0, pow2: bool = False,
            generator: torch.Generator | None = None, stochastic: bool = False) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"the fused quantizers take 2-D operands, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    br, bc = block
    tile_c = max(bc, 128)
    tile_r = max(br, 16 if bc <= 32 else 8)
    # In x's layout where x is dense (a transpose stays one), as the reference's result: the GEMM
    # behind it then sees the same layout on either path, and cuBLAS sums in the same order
    # (measured on an H200: a contiguous result here moved 26 of 6144 mxfp8 outputs by an ulp).
    out = torch.empty_like(x, dtype=torch.float32)
    u = params
    u_cols = 0
    if stochastic:
        # The reference draws torch.rand over its zero-padded blocked view, rows and
        # columns padded to whole blocks, row-major: the same numbers in the same order.
        padded = (-(-rows // br) * br, -(-cols // bc) * bc)
        u = torch.rand(padded, generator=generator, device=x.device, dtype=torch.float32)
        u_cols = padded[1]
    grid = (triton.cdiv(rows, tile_r), triton.cdiv(cols, tile_c))
    _qdq_kernel[grid](
        x, out, u, params, rows, cols, x.stride(0), x.stride(1), out.stride(0), out.stride(1), u_cols,
        KIND=kind, EMIN=fmt.emin, EMAX=fmt.emax, MANT=fmt.mant_bits, MAXV=fmt.max,
        MX_RULE=mx_rule, POW2=pow2, STOCHASTIC=stochastic,
        BR=br, BC=bc, TR=tile_r, TC=tile_c, enable_fp_fusion=False,
    )
    return out


def qdq_fp8_tensorwise(x: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``fp8._apply_tensor_scale(x, scale, fmt).dequantized``: x (R, C), scale 0-d fp32 encode scale."""
    scale = scale.float().reshape(1)
    params = torch.cat([scale, torch.reciprocal(scale)])
    return _launch(x, _KIND_TENSOR, fmt, (1, 1), params)


def qdq_fp8_block(x: torch.Tensor, *, block: tuple[int, int] = (1, FP8_BLOCK), pow2_scale: bool = True,
                  fmt: FloatFormat = E4M3) -> torch.Tensor:
    """``fp8.quantize_fp8_block(x, fmt, block=block, pow2_scale=pow2_scale).dequantized`` for 2-D x."""
    return _launch(x, _KIND_FP8_BLOCK, fmt, block, torch.empty(1, device=x.device), pow2=pow2_scale)


def qdq_mx(x: torch.Tensor, elem: FloatFormat, *, scale_rule: str, block_size: int = 32,
           stochastic: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """``mx.quantize_mx(x, elem, ...).dequantized`` for 2-D x."""
    if scale_rule not in _MX_RULES:
        raise ValueError(f"scale_rule must be one of {tuple(_MX_RULES)}, got {scale_rule!r}")
    params = torch.full((1,), 1.0 / elem.max, dtype=torch.float32, device=x.device)
    return _launch(x, _KIND_MX, elem, (1, block_size), params, mx_rule=_MX_RULES[scale_rule],
                   stochastic=stochastic, generator=generator)


def qdq_nvfp4(x: torch.Tensor, *, block: tuple[int, int], global_amax: torch.Tensor,
              stochastic: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """``nvfp4.quantize_nvfp4(x, block=block, amax=global_amax, ...).dequantized`` for 2-D x.

    ``global_amax``: 0-d fp32 amax of the whole (possibly TP-sharded) tensor.
    """
    s_enc = nvfp4_global_scale(global_amax.float()).reshape(1)
    params = torch.cat([s_enc, torch.reciprocal(s_enc), s_enc * (1.0 / E2M1.max)])
    return _launch(x, _KIND_NVFP4, E2M1, block, params, stochastic=stochastic, generator=generator)
