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
        amax: the 0-d or per-row amax the scales came from (quantization health reads it), or None.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: torch.Tensor | None = None
    amax: torch.Tensor | None = None

    def t(self) -> FP8Operand:
        scale = self.scale_inv.t() if self.scale_inv.dim() == 2 else self.scale_inv
        if self.data_t is not None:
            return FP8Operand(self.data_t, scale, self.data, self.amax)
        return FP8Operand(self.data.t(), scale, None, self.amax)

    def dequantized(self) -> torch.Tensor:
        return self.data.float() * self.scale_inv

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


def casts_to_bytes(q: OperandQuantizer) -> bool:
    """Whether ``q``'s operands can travel as FP8 bytes to ``_scaled_mm`` (per-tensor or per-row scales)."""
    return q.spec.per_tensor or q.block == (1, ROW)


def cast_per_tensor(src: torch.Tensor, element: FloatFormat, scale: torch.Tensor, amax: torch.Tensor, *,
                    transpose: bool, kernels: ModuleType | None) -> FP8Operand:
    """``src`` (2-D) as FP8 bytes under the 0-d encode ``scale`` (and its transpose with ``transpose``)."""
    if kernels is not None:
        data, data_t, scale_inv = kernels.cast_tensorwise(src, element, scale=scale, transpose=transpose)
    else:
        data = to_elements(src.float() * scale, element)
        data_t = data.t().contiguous() if transpose else None
        scale_inv = torch.reciprocal(scale)
    return FP8Operand(data, scale_inv, data_t, amax)


def cast_current(src: torch.Tensor, element: FloatFormat, amax: torch.Tensor | None, *, transpose: bool,
                 kernels: ModuleType | None) -> FP8Operand:
    """Per-tensor current scaling: the scale from ``amax`` (0-d: the all-shard amax; None: ``src``'s own),
    computed inside the kernel's cast where the kernels run (one launch for amax, one for the cast)."""
    if kernels is not None:
        if amax is None:
            amax = kernels.tensor_amax_bits(src)
        data, data_t, scale_inv = kernels.cast_tensorwise(src, element, amax=amax, transpose=transpose)
        return FP8Operand(data, scale_inv, data_t, amax)
    amax = tensor_amax(src, amax).float()
    return cast_per_tensor(src, element, fp8_scale_from_amax(amax, element), amax, transpose=transpose,
                           kernels=None)


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
        return FP8Operand(data, scale_inv.reshape(-1, 1), None, amax)
    q = quantize_fp8_block(src, element, block=(1, ROW), amax=amax)
    return FP8Operand(q.elements.to(element.torch_dtype), q.scales, None, amax)


def shapes_ok(a: FP8Operand, b: FP8Operand) -> bool:
    """Whether ``_scaled_mm`` takes a (M, K) @ b (K, N): every dim a multiple of 16, at most one operand in
    E5M2, and both scaled alike (per tensor, or per row of A and per column of B)."""
    dims_ok = all(d % 16 == 0 for d in (*a.data.shape, b.data.shape[1]))
    if not dims_ok or a.data.dtype == b.data.dtype == torch.float8_e5m2:
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
