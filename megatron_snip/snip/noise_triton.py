"""The probes' Rademacher noise in one fused Triton kernel: the same values as ``noise.rademacher``.

``noise.rademacher(global_flat_index(...), key)`` runs about 50 element-wise int64 operations
through memory, each a kernel on a GPU; a cycle hashes every module output of every micro-batch
six times (three Hutchinson keys in the clean pass, one per Hutchinson pass), billions of
elements at the TinyLlama shape. This kernel computes each element's global index (the
tensor-parallel layout of ``global_flat_index``) and its hash in registers, and writes the fp32
+-1 alone. Integer arithmetic is exact, so the values are bit for bit the reference's
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
    """Chris Wellons' lowbias32 on uint32 (multiplication wraps mod 2^32, as ``noise._mul32`` computes)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


# Scalars stay runtime values: Triton would make a 1 (an unsplit layout's) a constant without ``.to``.
@triton.jit(do_not_specialize=["n", "start", "n_local", "inner", "chunk", "size", "rank", "key_lo", "key_hi"])
def _rademacher_kernel(out_ptr, n, start, n_local, inner, chunk, size, rank, key_lo, key_hi,
                       SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = offs + start  # the element's place in this rank's flattened shard
    n_local, inner, chunk = n_local.to(tl.int64), inner.to(tl.int64), chunk.to(tl.int64)
    size, rank = size.to(tl.int64), rank.to(tl.int64)
    if SPLIT:  # noise.global_flat_index: rank r holds chunks r, r + size, ... of the split dim
        outer = p // (n_local * inner)
        rest = p % (n_local * inner)
        d = rest // inner
        within = rest % inner
        full = ((d // chunk) * size + rank) * chunk + d % chunk
        index = (outer * (n_local * size) + full) * inner + within
    else:
        index = p
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    h = _hash32(lo ^ key_lo.to(tl.uint32))
    h = _hash32(h ^ hi ^ key_hi.to(tl.uint32))
    z = 1.0 - 2.0 * (h >> 31).to(tl.float32)
    tl.store(out_ptr + offs, z, mask=mask)


def rademacher(numel: int, key: int, *, start: int = 0, n_local: int = 1, inner: int = 1, chunk: int = 1,
               size: int = 1, rank: int = 0, split: bool = False, device: torch.device | str = "cuda") -> torch.Tensor:
    """``numel`` values +-1 (fp32) of elements ``start:start + numel`` of a flattened shard: the
    layout as ``noise.global_flat_index`` takes it (``split``: dim of length ``n_local`` on this rank,
    ``inner`` elements after it, cut in chunks of ``chunk`` over ``size`` ranks, this one ``rank``)."""
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel:
        key &= 0xFFFFFFFFFFFFFFFF
        _rademacher_kernel[(triton.cdiv(numel, _BLOCK),)](
            out, numel, start, n_local, inner, chunk, size, rank, key & 0xFFFFFFFF, key >> 32,
            SPLIT=split, BLOCK=_BLOCK)
    return out
