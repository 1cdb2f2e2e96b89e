"""Scaling groups: cutting a tensor into blocks (the one reshape shared by fp8_block, MX and
NVFP4), the amax of a block or of a whole tensor, and the block-scaled result type.

A tensor of shape (..., R, C) is viewed as a batch of L = prod(...) matrices
R x C. A block is ``(block_rows, block_cols)`` elements of one matrix:
``(1, n)`` is a 1-D block of n consecutive elements along the last dimension,
``(n, n)`` a 2-D tile (used for weights so that W and W.T get the same blocks), ``(1, 0)``
(``registry.ROW``) one block per row, however long (FP8 rowwise).

Blocked layout: (L, R/br, br, C/bc, bc). A per-block quantity (amax, scale)
has shape (L, R/br, 1, C/bc, 1) and broadcasts against it, so no Python loop
and no permute/copy is needed.

Sizes not divisible by the block are zero-padded at the end of the row/column
dimension before blocking and cropped afterwards. Zeros never raise a block's
amax, so a partial block is quantized exactly as if it had only its real
elements (this is also what TE's reference quantizers do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockView:
    """Bookkeeping to undo :func:`to_blocks`.

    Attributes:
        shape: original tensor shape.
        block: (block_rows, block_cols) actually used.
        rows, cols: unpadded matrix dims R, C.
    """

    shape: torch.Size
    block: tuple[int, int]
    rows: int
    cols: int

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Shape of the per-block tensors returned to users: leading dims + block grid.

        (..., ceil(R/br), ceil(C/bc)); for 1-D blocks that is (..., R, ceil(C/bc)),
        i.e. ``shape[:-1] + (ceil(C/bc),)``.
        """
        n_col_blocks = math.ceil(self.cols / self.block[1])
        if len(self.shape) < 2:
            return (n_col_blocks,)
        return (*self.shape[:-2], math.ceil(self.rows / self.block[0]), n_col_blocks)


def to_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, BlockView]:
    """View ``x`` as blocks.

    Args:
        x: tensor of shape (..., R, C) (a 1-D tensor is one row; a 2-D block on
            it degenerates to a 1-D block since there is no second dimension).
        block: (block_rows, block_cols).
    Returns:
        (blocked, view): ``blocked`` has shape (L, ceil(R/br), br, ceil(C/bc), bc),
        zero-padded where needed (a view of ``x`` when no padding is needed).
    """
    rows = x.shape[-2] if x.dim() >= 2 else 1
    cols = x.shape[-1] if x.dim() >= 1 else 1
    block_rows = block[0] if x.dim() >= 2 else 1
    block_cols = block[1] or cols  # registry.ROW (0): the whole row
    matrices = x.reshape(-1, rows, cols)
    pad_rows = -rows % block_rows
    pad_cols = -cols % block_cols
    if pad_rows or pad_cols:
        matrices = F.pad(matrices, (0, pad_cols, 0, pad_rows))
    blocked = matrices.reshape(
        matrices.shape[0],
        (rows + pad_rows) // block_rows,
        block_rows,
        (cols + pad_cols) // block_cols,
        block_cols,
    )
    return blocked, BlockView(x.shape, (block_rows, block_cols), rows, cols)


def block_amax(blocked: torch.Tensor) -> torch.Tensor:
    """Per-block max |x|, shape (L, Rb, 1, Cb, 1). NaN anywhere in a block makes it NaN.

    max(amax, -amin) reads the data twice but avoids materialising |x|, which is slower on CPU;
    the final abs_ turns the -0 of an all-zero block into +0 (1 / -0 would be -inf downstream).
    """
    dims = (2, 4)
    return torch.maximum(blocked.amax(dim=dims, keepdim=True), blocked.amin(dim=dims, keepdim=True).neg_()).abs_()


def tensor_amax(x: torch.Tensor, override: torch.Tensor | float | None = None) -> torch.Tensor:
    """0-d fp32 max |x| over the whole (non-empty) tensor (NaN if any element is NaN),
    or ``override`` (e.g. an amax all-reduced across tensor-parallel shards) on x's device;
    pass the override as a tensor on that device to avoid a host-to-device copy."""
    if override is not None:
        return torch.as_tensor(override, dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg()).abs_()  # abs_: +0, not -0, for an all-zero tensor


def from_blocks(blocked: torch.Tensor, view: BlockView) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: crop the padding and restore the original shape."""
    n, rb, br, cb, bc = blocked.shape
    matrices = blocked.reshape(n, rb * br, cb * bc)[:, : view.rows, : view.cols]
    return matrices.reshape(view.shape)


def to_grid(per_block: torch.Tensor, view: BlockView) -> torch.Tensor:
    """Per-block tensor (L, Rb, 1, Cb, 1) -> user-facing grid shape ``view.grid_shape``."""
    return per_block.reshape(view.grid_shape)


@dataclass(frozen=True)
class BlockScaled:
    """Result of a block-scaled quantizer with one decode scale per block (fp8_block, MXFP8, MXFP4).

    Attributes:
        dequantized: float32, shape of the input: ``elements * scales`` per block.
        elements: float32 values on the element grid (the scaled domain), shape of the input.
        scales: float32 decode scale per block (TE's ``scale_inv``; for MX the E8M0
            power of two), shape ``BlockView.grid_shape``; NaN for a block whose amax
            is not finite.
        block: (block_rows, block_cols) used.
    """

    dequantized: torch.Tensor
    elements: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]


def blocked_result(elements: torch.Tensor, scales: torch.Tensor, view: BlockView) -> BlockScaled:
    """Assemble a :class:`BlockScaled` from blocked elements (L, Rb, br, Cb, bc) and decode scales (L, Rb, 1, Cb, 1)."""
    return BlockScaled(
        dequantized=from_blocks(elements * scales, view),
        elements=from_blocks(elements, view),
        scales=to_grid(scales, view),
        block=view.block,
    )
