"""FP8 GEMMs on FP8 bytes: the operands cast once to bytes plus scales, the GEMM on the tensor cores.

The fast FP8 path of the quantized linear (``linear.py``) for the recipes whose GEMMs
``torch._scaled_mm`` runs: per-tensor scaling (``tensorwise``, ``delayed``) and per-row scaling
(``rowwise``: one power-of-two scale per row of each GEMM's reduction dim). An operand becomes an
:class:`FP8Operand`: its FP8 bytes, its decode scales, and, where a later GEMM reads it transposed,
the transposed bytes written by the same cast, so no GEMM copies an operand into the layout
``_scaled_mm`` wants (A row-major, B column-major):

============ ======================= ================================================
GEMM         A (row-major)           B (column-major)
============ ======================= ================================================
fprop  Y     X bytes                 W bytes (W^T viewed: W row-major is W^T col-major)
dgrad  dX    dY bytes                W^T bytes (the transposed copy of fprop's cast)
wgrad  dW    dY^T bytes (transposed)  X^T bytes viewed (the transposed copy)
============ ======================= ================================================

Per-row scaling scales along each GEMM's own reduction dim, so the wgrad operands (and W for
dgrad) are separate casts of the transposed views (``triton_fp8.cast_rowwise`` reads them through
their strides, without a copy), as torchao's rowwise recipe does.

Who casts: the fused Triton kernels (``triton_fp8.py``) where ``RecipeConfig.kernels`` selects them
(CUDA, or Triton's interpreter on CPU in tests), else the torch reference (``fp8.py``). The two give
the same bytes and scales, and both are the reference quantizers' values: the fast path changes
speed, never the values the GEMM reads. Outputs are written by ``_scaled_mm`` in the destination
dtype (BF16 for a BF16 model's Y and dX; fp32 for fp32 master weights' dW), so nothing is cast
after the GEMM; they equal the emulated fp32 GEMM up to accumulation order (and the output rounding).

Tensor parallelism: a per-tensor amax of a split operand, and the row amaxes of an operand whose
reduction dim is split, are all-reduced (MAX) over the group before the cast, so a sharded layer
casts exactly as the unsharded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from megatron_snip.numerics.blocks import tensor_amax
from megatron_snip.numerics.formats import FloatFormat, to_elements
from megatron_snip.numerics.fp8 import fp8_scale_from_amax, quantize_fp8_block
from megatron_snip.numerics.recipes import OperandQuantizer
from megatron_snip.numerics.registry import ROW


@dataclass(frozen=True)
class FP8Operand:
    """An FP8 GEMM operand kept as bytes: its value is ``data * scale_inv``.

    Attributes:
        data: float8 tensor (e4m3fn / e5m2) of the operand's (logical) shape (R, C).
        scale_inv: fp32 decode scales: 0-d (per tensor), (R, 1) (per row) or (1, C) (per column:
            a per-row cast of the transpose, seen through ``t()``).
        data_t: the same bytes transposed, (C, R) row-major, where the cast wrote them; None elsewhere.
        block: block-scaled operands: the (rows, cols) block, ``scale_inv`` then holds one scale per
            block, (ceil(R / rows), ceil(C / cols)); None for per-tensor and per-row scales.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: torch.Tensor | None = None
    block: tuple[int, int] | None = None

    def t(self) -> FP8Operand:
        scale = self.scale_inv.t() if self.scale_inv.dim() == 2 else self.scale_inv
        block = None if self.block is None else self.block[::-1]
        if self.data_t is not None:
            return FP8Operand(self.data_t, scale, self.data, block)
        return FP8Operand(self.data.t(), scale, None, block)

    def dequantized(self) -> torch.Tensor:
        if self.block is None:
            return self.data.float() * self.scale_inv
        rows, cols = self.data.shape
        scales = self.scale_inv.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)
        return self.data.float() * scales[:rows, :cols]

    @property
    def per_tensor(self) -> bool:
        return self.scale_inv.dim() == 0

    def row_major(self) -> torch.Tensor:
        """The bytes laid out row-major (a copy only where neither layout was written so)."""
        if self.data.is_contiguous():
            return self.data
        return self.data.contiguous()

    def col_major(self) -> torch.Tensor:
        """The bytes laid out column-major: the transpose of a row-major (C, R) tensor."""
        if self.data.t().is_contiguous():
            return self.data
        if self.data_t is not None:
            return self.data_t.t()
        return self.data.t().contiguous().t()


def casts_to_bytes(q: OperandQuantizer, device: torch.device) -> bool:
    """Whether ``q``'s operands travel as FP8 bytes to a scaled GEMM on ``device``: per-tensor and per-row
    scales (``_scaled_mm``), block scales where torch's block-scaled GEMM runs (:func:`blockwise_enabled`)."""
    return q.spec.per_tensor or q.block == (1, ROW) or (q.spec.block_gemm and blockwise_enabled(device))


def blockwise_enabled(device: torch.device) -> bool:
    """Whether torch offers its block-scaled FP8 GEMM (``F.scaled_mm``, 1x128 / 128x128 scales) on ``device``:
    cuBLAS has it for Hopper (sm_90); it is still checked against the emulation at first use per shape."""
    scaling = getattr(torch.nn.functional, "ScalingType", None)
    return (device.type == "cuda" and scaling is not None and hasattr(scaling, "BlockWise128x128")
            and torch.cuda.get_device_capability(device) == (9, 0))


def cast_block(src: torch.Tensor, element: FloatFormat, block: tuple[int, int], *, transpose: bool,
               kernels: ModuleType | None) -> FP8Operand:
    """Block-scaled FP8 bytes of 2-D ``src`` (blocks along its last dim; square tiles may also write the
    transposed bytes, their scales being the same grid transposed)."""
    transpose = transpose and block[0] == block[1]
    if kernels is not None:
        data, data_t, scale_inv = kernels.cast_blockwise(src, block, element, transpose=transpose)
        return FP8Operand(data, scale_inv, data_t, block)
    q = quantize_fp8_block(src, element, block=block)
    data = q.elements.to(element.torch_dtype)
    return FP8Operand(data, q.scales, data.t().contiguous() if transpose else None, block)


def cast_per_tensor(src: torch.Tensor, element: FloatFormat, scale: torch.Tensor, *, transpose: bool,
                    kernels: ModuleType | None) -> FP8Operand:
    """``src`` (2-D) as FP8 bytes under the 0-d encode ``scale`` (and its transpose with ``transpose``)."""
    if kernels is not None:
        data, data_t, scale_inv = kernels.cast_tensorwise(src, element, scale=scale, transpose=transpose)
    else:
        data = to_elements(src.float() * scale, element)
        data_t = data.t().contiguous() if transpose else None
        scale_inv = torch.reciprocal(scale)
    return FP8Operand(data, scale_inv, data_t)


def cast_current(src: torch.Tensor, element: FloatFormat, amax: torch.Tensor | None, *, transpose: bool,
                 kernels: ModuleType | None) -> FP8Operand:
    """Per-tensor current scaling: the scale from ``amax`` (0-d: the all-shard amax; None: ``src``'s own),
    computed inside the kernel's cast where the kernels run (one launch for amax, one for the cast)."""
    if kernels is not None:
        if amax is None:
            amax = kernels.tensor_amax_bits(src)
        data, data_t, scale_inv = kernels.cast_tensorwise(src, element, amax=amax, transpose=transpose)
        return FP8Operand(data, scale_inv, data_t)
    amax = tensor_amax(src, amax).float()
    return cast_per_tensor(src, element, fp8_scale_from_amax(amax, element), transpose=transpose, kernels=None)


def row_amax(src: torch.Tensor, kernels: ModuleType | None) -> torch.Tensor:
    """(R,) fp32 max |row| of 2-D ``src`` (NaN where a row has one)."""
    if kernels is not None:
        return kernels.row_amax(src)
    x = src.float()
    return torch.maximum(x.amax(dim=1), x.amin(dim=1).neg()).abs_()


def cast_rowwise(src: torch.Tensor, element: FloatFormat, amax: torch.Tensor | None, *,
                 kernels: ModuleType | None) -> FP8Operand:
    """Per-row scaling of 2-D ``src`` along its last dim (power-of-two scales): ``amax`` the (R,) row
    amaxes over every shard of each row (None: ``src``'s own)."""
    if kernels is not None:
        data, scale_inv = kernels.cast_rowwise(src, element, amax=amax)
        return FP8Operand(data, scale_inv.reshape(-1, 1))
    q = quantize_fp8_block(src, element, block=(1, ROW), amax=amax)
    return FP8Operand(q.elements.to(element.torch_dtype), q.scales)


def shapes_ok(a: FP8Operand, b: FP8Operand) -> bool:
    """Whether ``_scaled_mm`` takes a (M, K) @ b (K, N): every dim a multiple of 16, at most one operand in
    E5M2, and both scaled alike (per tensor, or per row of A and per column of B)."""
    dims_ok = all(d % 16 == 0 for d in (*a.data.shape, b.data.shape[1]))
    if not dims_ok or a.data.dtype == b.data.dtype == torch.float8_e5m2 or a.block or b.block:
        return False
    if a.per_tensor and b.per_tensor:
        return True
    return a.scale_inv.shape == (a.data.shape[0], 1) and b.scale_inv.shape == (1, b.data.shape[1])


def scaled_mm(a: FP8Operand, b: FP8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` on the FP8 bytes in ``out_dtype`` (check :func:`shapes_ok` first)."""
    scale_a, scale_b = a.scale_inv, b.scale_inv
    if not a.per_tensor:
        scale_a, scale_b = scale_a.contiguous(), scale_b.contiguous()
        if out_dtype != torch.bfloat16 and not rowwise_out_dtype_ok(a.data.device, out_dtype):
            # cuBLAS's row-wise scaled GEMM writes bf16 only (in the torch versions that say so)
            return torch._scaled_mm(a.row_major(), b.col_major(), scale_a=scale_a, scale_b=scale_b,
                                    out_dtype=torch.bfloat16).to(out_dtype)
    return torch._scaled_mm(a.row_major(), b.col_major(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


_ROWWISE_OUT: dict[tuple[str, torch.dtype], bool] = {}


def rowwise_out_dtype_ok(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether this torch writes a row-wise scaled ``_scaled_mm`` in ``out_dtype`` on ``device`` (asked
    once per device type and dtype with a 16 x 16 GEMM)."""
    key = (device.type, out_dtype)
    if key not in _ROWWISE_OUT:
        a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones(16, 1, device=device)
        try:
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=out_dtype)
            _ROWWISE_OUT[key] = True
        except RuntimeError:
            _ROWWISE_OUT[key] = False
    return _ROWWISE_OUT[key]


# Block-scaled GEMMs: how each operand's block grid is laid out for torch, found at first use per shape by
# comparing with the emulated GEMM (torch's contract for the scales' layout is cuBLAS's, which its docs
# leave implicit); None: no layout gave the emulated result (or torch refused), so that shape runs emulated.
_BLOCK_LAYOUTS: dict[tuple, tuple[str, str] | None] = {}
_LAYOUTS = ("outer", "row")  # scales column-major (outer-dim-major, cuBLAS's 1x128 order) or row-major


def _scales(op: FP8Operand, side: str, layout: str) -> torch.Tensor:
    """The operand's block scales in torch's orientation: A's grid as is (M, K / 128); B's (K, N) as the grid
    of B^T for 1x128 blocks, (N, K / 128), and of B for 128x128 tiles, (K / 128, N / 128)."""
    grid = op.scale_inv.t() if side == "b" and op.block[0] != op.block[1] else op.scale_inv
    return grid.t().contiguous().t() if layout == "outer" else grid.contiguous()


def _recipe(op: FP8Operand, side: str):
    kind = op.block if side == "a" else op.block[::-1]  # B's blocks run along its rows (K)
    return (torch.nn.functional.ScalingType.BlockWise128x128 if kind[0] == kind[1]
            else torch.nn.functional.ScalingType.BlockWise1x128)


def _block_call(a: FP8Operand, b: FP8Operand, out_dtype: torch.dtype, layouts: tuple[str, str]) -> torch.Tensor:
    return torch.nn.functional.scaled_mm(a.row_major(), b.col_major(), _scales(a, "a", layouts[0]), _recipe(a, "a"),
                                         _scales(b, "b", layouts[1]), _recipe(b, "b"), output_dtype=out_dtype)


def blockwise_mm(a: FP8Operand, b: FP8Operand, out_dtype: torch.dtype) -> torch.Tensor | None:
    """``a @ b`` on block-scaled FP8 bytes (a: 1x128 blocks along K; b: 1x128 along K or 128x128 tiles) with
    torch's block-scaled GEMM, or None where it does not run this shape (the caller emulates). The first
    call per shape tries the scale layouts and keeps the one whose result agrees with the emulated GEMM
    within fp32-accumulation error of Hopper's FP8 tensor cores (2 (K + 2) 2^-14 |A| |B|)."""
    key = (tuple(a.data.shape), tuple(b.data.shape), a.block, b.block, out_dtype, a.data.device)
    if key not in _BLOCK_LAYOUTS:
        _BLOCK_LAYOUTS[key] = None
        dense_a, dense_b = a.dequantized(), b.dequantized()
        want = dense_a @ dense_b
        if not torch.isfinite(want).all():  # nothing to compare against: decide at a later call
            del _BLOCK_LAYOUTS[key]
            return None
        bound = 2 * (a.data.shape[1] + 2) * 2.0**-14 * (dense_a.abs() @ dense_b.abs()) + 2.0**-7 * want.abs()
        for layouts in [(x, y) for x in _LAYOUTS for y in _LAYOUTS]:
            try:
                got = _block_call(a, b, out_dtype, layouts).float()
            except (RuntimeError, ValueError, NotImplementedError):
                continue
            if torch.all((got - want).abs() <= bound):
                _BLOCK_LAYOUTS[key] = layouts
                break
    layouts = _BLOCK_LAYOUTS[key]
    return None if layouts is None else _block_call(a, b, out_dtype, layouts)


def blockwise_layouts() -> dict[tuple, tuple[str, str] | None]:
    """What the first calls found, per shape (for the bench and the GPU tests to report)."""
    return dict(_BLOCK_LAYOUTS)
