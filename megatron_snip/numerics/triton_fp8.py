"""Fused Triton casts of a GEMM operand to FP8 bytes plus scales, for ``torch._scaled_mm``.

The casts the fast FP8 linear (``fp8_gemm.py``) feeds the tensor cores with. Each output is
bit-identical to the reference (``fp8.py``: ``to_elements(x * scale)`` and ``1 / scale``):
the elements are rounded onto the format's grid in fp32 by the same integer arithmetic as
``triton_qdq`` (``_round_signed``) and encoded into the FP8 byte by bit manipulation, so
the result does not depend on a hardware conversion's rounding (and runs in Triton's
interpreter on CPU, whose float8 conversion does not round to nearest even).

Kernels and what one cast of an (R, C) operand costs (E = R * C elements, b = bytes per
input element: 2 for bf16, 4 for fp32):

* per-tensor scaling (``cast_tensorwise``): ``_amax_kernel`` (one pass: read E*b bytes, one
  atomic max per 32 rows into a 4-byte buffer zeroed by one memset) then ``_cast_kernel`` (read
  E*b, write E bytes, and E more for the transposed copy): 3 launches and 2b + 2 bytes per
  element with the transposed copy (6 for bf16), against about 21 launches and ~29 bytes per
  element of the plain-torch path it replaces (amax in 4 launches, the scale in ~11, then
  float copy, multiply, clamp and cast through fp32 temporaries), plus one ``.contiguous()``
  copy per transposed operand (2 bytes per element) for dgrad and wgrad. The scale is computed
  inside the cast from the 0-d amax (``fp8_scale_from_amax`` in the kernel), so no scalar
  launches remain. Under tensor parallelism the amax is all-reduced between the two kernels
  (the caller's ``amax_reduce``), as before.
* per-row scaling (``cast_rowwise``, one scale per row along the GEMM's reduction dim, power
  of two): ``_row_amax_kernel`` (read E*b, write 4 bytes per row) then ``_cast_kernel``:
  2 launches, 2b + 1 bytes per element. A columnwise copy (wgrad's operands, the weight for
  dgrad) is the same cast of the transposed view (strided loads, no copy): a second cast.
* delayed scaling: the amax kernel, the scaler's few scalar ops, then the cast with the given
  scale.

The amax: ``max |x|`` as the maximum of the int32 bit patterns of ``|x|`` (for non-negative
floats the integer order is the float order, and a NaN's pattern is above +Inf's, so a NaN
anywhere wins, as ``tensor_amax`` propagates it). Verified bit for bit against the reference
in Triton's interpreter by tests/test_fp8_linear.py; on a GPU the same tests run compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_snip.numerics.formats import E4M3, E5M2, FloatFormat
from megatron_snip.numerics.triton_qdq import _FP32_MAX, _reciprocal, _round_signed

_BIAS = {E4M3.name: 7, E5M2.name: 15}
_TILE_R, _TILE_C = 32, 128


@triton.jit
def _encode(e, EMIN: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
            INV_ULP: tl.constexpr):
    """The FP8 byte (int32 0..255) of fp32 ``e``, a value on the format's grid or NaN:
    sign | biased exponent | mantissa for normals, the count of 2^(EMIN - MANT) ulps for
    subnormals (``INV_ULP`` = 2^(MANT - EMIN)), and 0x7F (with e's sign bit) for NaN, as torch's float8
    conversion writes it."""
    bits = e.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    m = bits & 0x7FFFFFFF
    normal = m >= ((EMIN + 127) << 23)
    code_n = ((((m >> 23) - 127 + BIAS) << MANT) | ((m >> (23 - MANT)) & ((1 << MANT) - 1)))
    code_s = (m.to(tl.float32, bitcast=True) * INV_ULP).to(tl.int32)  # exact: an integer below 2^MANT
    code = tl.where(normal, code_n, code_s)
    code = tl.where(m > 0x7F800000, 0x7F, code)  # NaN
    return code | sign


@triton.jit
def _scale_from_amax(amax, MAXV: tl.constexpr, POW2: tl.constexpr):
    """``fp8.fp8_scale_from_amax(amax, fmt, pow2=POW2)`` (margin 0), elementwise."""
    scale = tl.div_rn(tl.full(amax.shape, MAXV, tl.float32), amax)
    scale = tl.where(scale == float("inf"), _FP32_MAX, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    scale = tl.where(amax == 0.0, 1.0, scale)
    return tl.where(amax < float("inf"), scale, float("nan"))  # NaN and +Inf amaxes: NaN


@triton.jit
def _amax_kernel(x_ptr, amax_bits_ptr, R, C, stride_r, stride_c, TR: tl.constexpr, TC: tl.constexpr):
    """Atomic max of ``|x|``'s bit patterns over TR rows (looping over the columns) into ``amax_bits_ptr``
    (int32): one atomic per TR rows, so a few hundred on one address for an activation, not one per tile."""
    rows = tl.program_id(0) * TR + tl.arange(0, TR)
    acc = tl.zeros([TR, TC], dtype=tl.int32)
    for start in range(0, C, TC):
        cols = start + tl.arange(0, TC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True))
    tl.atomic_max(amax_bits_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _row_amax_kernel(x_ptr, amax_bits_ptr, R, C, stride_r, stride_c, TR: tl.constexpr, TC: tl.constexpr):
    """``max |x|`` of each of TR rows (bit patterns, int32), looping over the columns."""
    rows = tl.program_id(0) * TR + tl.arange(0, TR)
    acc = tl.zeros([TR], dtype=tl.int32)
    for start in range(0, C, TC):
        cols = start + tl.arange(0, TC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.max(tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True), axis=1))
    tl.store(amax_bits_ptr + rows, acc, mask=rows < R)


@triton.jit
def _cast_kernel(
    x_ptr, out_ptr, out_t_ptr, src_ptr, scale_inv_ptr, R, C, stride_r, stride_c,
    FROM_AMAX: tl.constexpr, PER_ROW: tl.constexpr, POW2: tl.constexpr, TRANSPOSE: tl.constexpr,
    EMIN: tl.constexpr, EMAX: tl.constexpr, MANT: tl.constexpr, MAXV: tl.constexpr, BIAS: tl.constexpr,
    INV_ULP: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
):
    """One TR x TC tile of an (R, C) operand -> FP8 bytes (row-major, and transposed with TRANSPOSE).

    ``src_ptr``: the amax (FROM_AMAX) or the encode scale, one (0-d) or one per row (PER_ROW).
    The decode scales ``1 / scale`` go to ``scale_inv_ptr`` (by the first program, or by each
    row's first column tile).
    """
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * TR + tl.arange(0, TR)
    cols = pid_c * TC + tl.arange(0, TC)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if PER_ROW:
        src = tl.load(src_ptr + rows, mask=row_ok, other=1.0)
    else:
        src = tl.load(src_ptr + tl.zeros([TR], dtype=tl.int32))
    if FROM_AMAX:
        scale = _scale_from_amax(src, MAXV, POW2)
    else:
        scale = src
    elements = _round_signed(x * scale[:, None], x, EMIN, EMAX, MANT, MAXV, False)
    codes = _encode(elements, EMIN, MANT, BIAS, INV_ULP).to(tl.uint8)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], codes, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(codes), mask=tl.trans(mask))
    scale_inv = _reciprocal(scale)
    if PER_ROW:
        if pid_c == 0:
            tl.store(scale_inv_ptr + rows, scale_inv, mask=row_ok)
    elif (pid_r == 0) & (pid_c == 0):
        tl.store(scale_inv_ptr + tl.arange(0, TR), scale_inv, mask=tl.arange(0, TR) < 1)


def _check(x: torch.Tensor, fmt: FloatFormat) -> None:
    if x.dim() != 2:
        raise ValueError(f"the FP8 casts take 2-D operands, got shape {tuple(x.shape)}")
    if fmt.name not in _BIAS:
        raise ValueError(f"FP8 bytes are E4M3 or E5M2, not {fmt.name}")


def _grid(x: torch.Tensor) -> tuple[int, int]:
    return triton.cdiv(x.shape[0], _TILE_R), triton.cdiv(x.shape[1], _TILE_C)


def tensor_amax_bits(x: torch.Tensor) -> torch.Tensor:
    """0-d fp32 ``max |x|`` of 2-D ``x`` (NaN if any element is NaN; ``blocks.tensor_amax``'s value)."""
    bits = torch.zeros((), dtype=torch.int32, device=x.device)
    _amax_kernel[(triton.cdiv(x.shape[0], _TILE_R),)](x, bits, x.shape[0], x.shape[1], x.stride(0), x.stride(1),
                                                      TR=_TILE_R, TC=_TILE_C)
    return bits.view(torch.float32)


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """(R,) fp32 ``max |x|`` of each row of 2-D ``x`` (NaN where a row has a NaN)."""
    bits = torch.empty(x.shape[0], dtype=torch.int32, device=x.device)
    _row_amax_kernel[(triton.cdiv(x.shape[0], _TILE_R),)](x, bits, x.shape[0], x.shape[1], x.stride(0),
                                                          x.stride(1), TR=_TILE_R, TC=_TILE_C)
    return bits.view(torch.float32)


def _cast(x: torch.Tensor, fmt: FloatFormat, src: torch.Tensor, *, from_amax: bool, per_row: bool, pow2: bool,
          transpose: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    _check(x, fmt)
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=fmt.torch_dtype, device=x.device)
    out_t = torch.empty(cols, rows, dtype=fmt.torch_dtype, device=x.device) if transpose else None
    scale_inv = torch.empty(rows if per_row else (), dtype=torch.float32, device=x.device)
    _cast_kernel[_grid(x)](
        x, out.view(torch.uint8), (out_t if transpose else out).view(torch.uint8), src.float().contiguous(),
        scale_inv, rows, cols, x.stride(0), x.stride(1),
        FROM_AMAX=from_amax, PER_ROW=per_row, POW2=pow2, TRANSPOSE=transpose,
        EMIN=fmt.emin, EMAX=fmt.emax, MANT=fmt.mant_bits, MAXV=fmt.max, BIAS=_BIAS[fmt.name],
        INV_ULP=2.0 ** (fmt.mant_bits - fmt.emin),
        TR=_TILE_R, TC=_TILE_C, enable_fp_fusion=False,
    )
    return out, out_t, scale_inv


def cast_tensorwise(x: torch.Tensor, fmt: FloatFormat, *, amax: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None, transpose: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-tensor FP8 cast of 2-D ``x``: (bytes (R, C), bytes of x.T (C, R) contiguous or None, 0-d
    decode scale). The encode scale comes from ``amax`` (0-d fp32: the all-shard amax under tensor
    parallelism; default ``x``'s own) as ``fp8_scale_from_amax``, or is ``scale`` (delayed scaling)."""
    if scale is not None:
        return _cast(x, fmt, scale, from_amax=False, per_row=False, pow2=False, transpose=transpose)
    return _cast(x, fmt, tensor_amax_bits(x) if amax is None else amax, from_amax=True, per_row=False,
                 pow2=False, transpose=transpose)


def cast_rowwise(x: torch.Tensor, fmt: FloatFormat = E4M3, *, amax: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 cast of 2-D ``x`` (power-of-two scales, one per row): (bytes (R, C), (R,) decode
    scales). ``amax``: (R,) row amaxes (all-reduced over shards of the row), default ``x``'s own."""
    data, _, scale_inv = _cast(x, fmt, row_amax(x) if amax is None else amax, from_amax=True, per_row=True,
                               pow2=True, transpose=False)
    return data, scale_inv


@triton.jit
def _block_cast_kernel(
    x_ptr, out_ptr, out_t_ptr, scale_inv_ptr, R, C, stride_r, stride_c, n_col_blocks,
    TRANSPOSE: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MANT: tl.constexpr, MAXV: tl.constexpr,
    BIAS: tl.constexpr, INV_ULP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, TR: tl.constexpr,
):
    """TR x BC elements of an (R, C) operand (TR // BR blocks of BR x BC) -> FP8 bytes and one power-of-two
    decode scale per block (``fp8.quantize_fp8_block``): the block amax as the max of ``|x|``'s bit
    patterns (a NaN wins), the scale as ``fp8_scale_from_amax(pow2=True)``."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * TR + tl.arange(0, TR)
    cols = pid_c * BC + tl.arange(0, BC)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    bits = tl.reshape(tl.abs(x).to(tl.int32, bitcast=True), (TR // BR, BR, BC))
    amax = tl.max(tl.max(bits, axis=2), axis=1).to(tl.float32, bitcast=True)  # (TR // BR,)
    scale = _scale_from_amax(amax, MAXV, True)
    xs = tl.reshape(tl.reshape(x, (TR // BR, BR, BC)) * scale[:, None, None], (TR, BC))
    codes = _encode(_round_signed(xs, xs, EMIN, EMAX, MANT, MAXV, False), EMIN, MANT, BIAS, INV_ULP).to(tl.uint8)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], codes, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(codes), mask=tl.trans(mask))
    block_rows = pid_r * (TR // BR) + tl.arange(0, TR // BR)
    tl.store(scale_inv_ptr + block_rows * n_col_blocks + pid_c, _reciprocal(scale),
             mask=block_rows < tl.cdiv(R, BR))


def cast_blockwise(x: torch.Tensor, block: tuple[int, int], fmt: FloatFormat = E4M3, *, transpose: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Block-scaled FP8 cast of 2-D ``x`` (blocks (1, BC) or square tiles): (bytes (R, C), bytes of x.T (C, R)
    or None, decode scales (ceil(R / BR), ceil(C / BC))), as ``fp8.quantize_fp8_block`` (power-of-two scales).
    Launches: one (a program per TR rows x one block column), reading x once."""
    _check(x, fmt)
    rows, cols = x.shape
    br, bc = block
    tile_r = br if br > 1 else 16
    out = torch.empty(rows, cols, dtype=fmt.torch_dtype, device=x.device)
    out_t = torch.empty(cols, rows, dtype=fmt.torch_dtype, device=x.device) if transpose else None
    n_col_blocks = triton.cdiv(cols, bc)
    scale_inv = torch.empty(triton.cdiv(rows, br), n_col_blocks, dtype=torch.float32, device=x.device)
    _block_cast_kernel[(triton.cdiv(rows, tile_r), n_col_blocks)](
        x, out.view(torch.uint8), (out_t if transpose else out).view(torch.uint8), scale_inv, rows, cols,
        x.stride(0), x.stride(1), n_col_blocks, TRANSPOSE=transpose,
        EMIN=fmt.emin, EMAX=fmt.emax, MANT=fmt.mant_bits, MAXV=fmt.max, BIAS=_BIAS[fmt.name],
        INV_ULP=2.0 ** (fmt.mant_bits - fmt.emin), BR=br, BC=bc, TR=tile_r, enable_fp_fusion=False,
    )
    return out, out_t, scale_inv
