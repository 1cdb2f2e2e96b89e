"""The probes' Rademacher noise in one fused Triton kernel: the same values as ``noise.rademacher``.

``noise.rademacher(global_flat_index(...), key)`` runs about 50 element-wise int64 operations
through memory, each a kernel on a GPU; a cycle hashes every module output of every micro-batch
six times (three Hutchinson keys in the clean pass, one per Hutchinson pass), billions of
elements at the TinyLlama shape. This kernel computes each element's global index (the
tensor- and context-parallel layout of a ``noise.ShardIndex``, whose fields it takes: its two
small position tables are read, the rest is arithmetic) and its hash in registers, and writes the fp32 +-1 alone.
Integer arithmetic is exact, so the values are bit for bit the reference's
(``tests/test_snip_probes.py`` checks it in Triton's interpreter on CPU). Used on CUDA tensors
(``noise.layout_rademacher``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _hash32(x):
    """Chris Wellons' lowbias32 on uint32 (multiplication wraps mod 2^32, as ``noise._hash32``'s int32 products do)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


# Scalars stay runtime values: Triton would make a 1 (an unsplit layout's) a constant without ``.to``.
@triton.jit(do_not_specialize=["n", "start", "mid", "n_cols", "full_cols", "inner", "key_lo", "key_hi"])
def _rademacher_kernel(out_ptr, rows_ptr, cols_ptr, n, start, mid, n_cols, full_cols, inner, key_lo, key_hi,
                       MAPPED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = offs + start  # the element's place in this rank's flattened shard
    if MAPPED:  # noise.ShardIndex.flat: the shard as [rows, mid, cols, inner]
        mid, n_cols = mid.to(tl.int64), n_cols.to(tl.int64)
        full_cols, inner = full_cols.to(tl.int64), inner.to(tl.int64)
        w = p % inner
        q = p // inner
        d = q % n_cols
        q = q // n_cols
        m = q % mid
        i = q // mid
        row = tl.load(rows_ptr + i, mask=mask, other=0)
        col = tl.load(cols_ptr + d, mask=mask, other=0)
        index = ((row * mid + m) * full_cols + col) * inner + w
    else:
        index = p
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    h = _hash32(lo ^ key_lo.to(tl.uint32))
    h = _hash32(h ^ hi ^ key_hi.to(tl.uint32))
    z = 1.0 - 2.0 * (h >> 31).to(tl.float32)
    tl.store(out_ptr + offs, z, mask=mask)


def rademacher(numel: int, key: int, *, rows: torch.Tensor, mid: int, cols: torch.Tensor, full_cols: int,
               inner: int, mapped: bool, start: int = 0) -> torch.Tensor:
    """``numel`` values +-1 (fp32, on ``rows``' device) of elements ``start:start + numel`` of a flattened
    shard laid out as the ``noise.ShardIndex`` with these fields says (``**vars(index)``)."""
    out = torch.empty(numel, dtype=torch.float32, device=rows.device)
    if numel:
        key &= 0xFFFFFFFFFFFFFFFF
        _rademacher_kernel[(triton.cdiv(numel, _BLOCK),)](
            out, rows, cols, numel, start, mid, len(cols), full_cols, inner, key & 0xFFFFFFFF, key >> 32,
            MAPPED=mapped, BLOCK=_BLOCK)
    return out
