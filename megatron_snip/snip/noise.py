"""Layout-invariant noise for the probe passes: a counter-based hash of (key, global element index).

The value drawn for an element depends only on the noise key and the element's index
in the *unsharded* tensor, so every tensor-/context-/pipeline-parallel layout draws the
same noise and nothing needs storing or communicating.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core import parallel_state

_M32 = 0xFFFFFFFF


def _int32(c: int) -> int:
    """The 32-bit pattern of ``c`` (in [0, 2^32)) as a signed int32 value."""
    return c - (1 << 32) if c >= 1 << 31 else c


_C1, _C2 = _int32(0x7FEB352D), _int32(0x846CA68B)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash on an int32 tensor holding 32-bit patterns, in place.

    int32 arithmetic is uint32's on the same bits (two's complement): products wrap mod 2^32, and
    a logical right shift is the arithmetic one with the sign's copies masked off. About 4x fewer
    memory passes than emulating uint32 in int64 (torch has no uint32 shifts on CPU), which made the
    noise ~40% of a probe cycle on a CPU. ``tests/test_snip_probes.py`` checks the bits against a
    plain-Python lowbias32."""
    x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF)).mul_(_C1)
    x.bitwise_xor_((x >> 15).bitwise_and_(0x1FFFF)).mul_(_C2)
    return x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF))


def noise_key(*parts) -> int:
    """A 64-bit key for one noise tensor from its description (seed, pass, name, ...)."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def _hash_index(index: torch.Tensor, key: int) -> torch.Tensor:
    """32 hashed bits (int32) of (key, global element index), for int64 indices."""
    h = _hash32((index & _M32).to(torch.int32).bitwise_xor_(_int32(key & _M32)))
    return _hash32(h.bitwise_xor_((index >> 32).to(torch.int32)).bitwise_xor_(_int32((key >> 32) & _M32)))


def rademacher(index: torch.Tensor, key: int) -> torch.Tensor:
    """+-1 (fp32) for each global element index (int64), a hash of (key, index): the same value
    for an element whichever rank holds it and in whatever order it is drawn."""
    return (_hash_index(index, key) < 0).float().mul_(-2.0).add_(1.0)  # the top bit: -1 where set


def rademacher_bits(index: torch.Tensor, key: int) -> torch.Tensor:
    """Eight independent +-1 draws per global element index (int64) from one hash of (key, index): uint8, bit j
    set where draw j is -1 (the hash's top byte; bit 7 is :func:`rademacher`'s sign). One hash for eight draws
    rather than eight: the perturbation's signs were ~7% of a probe cycle on a CPU."""
    return (_hash_index(index, key) >> 24).bitwise_and_(0xFF).to(torch.uint8)


def context_parallel_positions(n_local: int, rank: int, size: int,
                               device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions in the whole sequence of the ``n_local`` tokens a context-parallel rank holds, in its order.

    megatron-core's ``get_batch_on_this_cp_rank`` cuts the sequence into ``2 * size`` chunks of
    ``n_local / 2`` tokens and gives rank r chunks r and ``2 * size - 1 - r`` (the load balance of
    causal attention: an early chunk with a late one).

    Returns:
        int64 [n_local]: for rank 1 of 2 and 4 local tokens, [2, 3, 4, 5] of a sequence of 8.
    """
    if n_local % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; {n_local} tokens cannot be")
    half = n_local // 2
    i = torch.arange(n_local, dtype=torch.int64, device=device)
    chunk = torch.where(i < half, rank, 2 * size - 1 - rank)
    return chunk * half + i % half


def _split_positions(n_local: int, stride: int, rank: int, size: int, device) -> torch.Tensor:
    """Positions in the whole dim of a tensor-parallel shard's ``n_local`` rows: the full dim cut into
    chunks of ``n_local / stride``, rank r holding chunks r, r + size, r + 2 size, ...
    (``_initialize_affine_weight_cpu``; SwiGLU's fc1 has stride 2)."""
    d = torch.arange(n_local, dtype=torch.int64, device=device)
    chunk = n_local // stride
    return ((d // chunk) * size + rank) * chunk + d % chunk


@dataclass(frozen=True)
class ShardIndex:
    """Where a shard's elements lie in the unsharded tensor (row-major), the shard seen as a view
    ``[len(rows), mid, len(cols), inner]``: element (i, m, d, w) is the full tensor's element
    ``((rows[i] * mid + m) * full_cols + cols[d]) * inner + w``.

    ``rows``: dim 0's positions in the full dim 0 (the sequence of activations, which context
    parallelism cuts, and sequence parallelism within that); ``cols``: the positions of the dim
    tensor parallelism splits elsewhere. ``mapped`` False: the shard is the whole tensor.
    """

    rows: torch.Tensor  # int64
    mid: int
    cols: torch.Tensor  # int64
    full_cols: int
    inner: int
    mapped: bool

    @classmethod
    def of(cls, shape: Sequence[int], *, partition_dim: int | None = None, stride: int = 1, rank: int = 0,
           size: int = 1, cp_rank: int = 0, cp_size: int = 1, device: torch.device | str = "cpu") -> ShardIndex:
        """The index of a shard of ``shape`` (arguments as :func:`global_flat_index`'s)."""
        numel = math.prod(shape)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        split, context = partition_dim is not None and size > 1, cp_size > 1
        if not (split or context):
            return cls(zero, 1, zero, 1, numel, False)
        dim = partition_dim % len(shape) if split else None
        if not context:  # the dims before the split one, flattened, as rows in order
            rows = torch.arange(math.prod(shape[:dim]), dtype=torch.int64, device=device)
            return cls(rows, 1, _split_positions(shape[dim], stride, rank, size, device), shape[dim] * size,
                       math.prod(shape[dim + 1:]), True)
        # Dim 0 is the sequence; sequence parallelism (a TP split of dim 0) cuts the context-parallel rank's part.
        rows = (_split_positions(shape[0], stride, rank, size, device) if dim == 0
                else torch.arange(shape[0], dtype=torch.int64, device=device))
        rows = context_parallel_positions(shape[0] * (size if dim == 0 else 1), cp_rank, cp_size, device)[rows]
        if dim is None or dim == 0:
            return cls(rows, 1, zero, 1, math.prod(shape[1:]), True)
        return cls(rows, math.prod(shape[1:dim]), _split_positions(shape[dim], stride, rank, size, device),
                   shape[dim] * size, math.prod(shape[dim + 1:]), True)

    def flat(self, start: int, end: int) -> torch.Tensor:
        """int64 [end - start]: the full tensor's flat indices of elements ``start:end`` of the flattened shard."""
        device = self.rows.device
        if not self.mapped:
            return torch.arange(start, end, dtype=torch.int64, device=device)
        n0, n_cols = len(self.rows), len(self.cols)
        if (start, end) == (0, n0 * self.mid * n_cols * self.inner):
            # The whole shard: broadcast sums of small index vectors (per-element divisions cost more
            # than the hash on the outputs of the probe passes).
            outer = self.rows[:, None] * self.mid + torch.arange(self.mid, dtype=torch.int64, device=device)
            outer = outer[:, :, None] * self.full_cols + self.cols
            within = torch.arange(self.inner, dtype=torch.int64, device=device)
            return (outer[..., None] * self.inner + within).reshape(-1)
        p = torch.arange(start, end, dtype=torch.int64, device=device)
        w, p = p % self.inner, p // self.inner
        d, p = p % n_cols, p // n_cols
        m, i = p % self.mid, p // self.mid
        return ((self.rows[i] * self.mid + m) * self.full_cols + self.cols[d]) * self.inner + w


def global_flat_index(shape: Sequence[int], *, partition_dim: int | None = None, stride: int = 1, rank: int = 0,
                      size: int = 1, cp_rank: int = 0, cp_size: int = 1, start: int = 0, end: int | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Indices, in the unsharded tensor, of elements ``start:end`` of a flattened shard.

    The shard is megatron's tensor-parallel split of dim ``partition_dim`` (None: not split) over
    ``size`` ranks (:func:`_split_positions`) and, with ``cp_size`` > 1, an activation's
    context-parallel part of the sequence, dim 0 (:func:`context_parallel_positions`), which
    sequence parallelism (``partition_dim`` 0) splits further.

    Returns:
        int64 tensor of ``end - start`` flat indices into the full tensor (row-major).
    """
    end = math.prod(shape) if end is None else end
    index = ShardIndex.of(shape, partition_dim=partition_dim, stride=stride, rank=rank, size=size, cp_rank=cp_rank,
                          cp_size=cp_size, device=device)
    return index.flat(start, end)


def layout_rademacher(shape: Sequence[int], key: int, *, partition_dim: int | None = None, stride: int = 1,
                      rank: int = 0, size: int = 1, cp_rank: int = 0, cp_size: int = 1, start: int = 0,
                      end: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """``rademacher(global_flat_index(shape, ...), key)``: the noise of elements ``start:end`` of a
    flattened shard (arguments as :func:`global_flat_index`'s). On CUDA one fused Triton kernel
    (``noise_triton``) computes the same values without the index tensor and the ~50 int64 passes."""
    end = math.prod(shape) if end is None else end
    index = ShardIndex.of(shape, partition_dim=partition_dim, stride=stride, rank=rank, size=size, cp_rank=cp_rank,
                          cp_size=cp_size, device=device)
    if torch.device(device).type == "cuda":
        try:
            from megatron_snip.snip import noise_triton
        except ImportError:  # no triton: the torch composition below
            noise_triton = None
        if noise_triton is not None:
            return noise_triton.rademacher(end - start, key, start=start, **vars(index))
    return rademacher(index.flat(start, end), key)


# Elements hashed at a time by param_sign_bits: its int64 index and int32 hash temporaries stay ~200 MB.
_SIGN_CHUNK = 1 << 24


def param_sign_bits(param: torch.nn.Parameter, key: int, start: int = 0, end: int | None = None) -> torch.Tensor:
    """:func:`rademacher_bits` of elements ``start:end`` of this rank's (flattened) shard of a megatron parameter,
    from its tensor-parallel attributes: eight draws' signs, the same for a parameter element on every layout
    and device. Hashed a chunk at a time, so a large parameter (a 128k-token embedding) never holds an index
    tensor of its own size."""
    end = param.numel() if end is None else end
    bits = torch.empty(end - start, dtype=torch.uint8, device=param.device)
    for first in range(start, end, _SIGN_CHUNK):
        last = min(first + _SIGN_CHUNK, end)
        bits[first - start:last - start] = rademacher_bits(param_global_index(param, first, last), key)
    return bits


def param_global_index(param: torch.nn.Parameter, start: int = 0, end: int | None = None) -> torch.Tensor:
    """:func:`global_flat_index` of elements ``start:end`` of this rank's (flattened) shard of a
    megatron parameter, from its tensor-parallel attributes."""
    split = getattr(param, "tensor_model_parallel", False)
    return global_flat_index(param.shape, partition_dim=param.partition_dim if split else None,
                             stride=getattr(param, "partition_stride", 1),
                             rank=parallel_state.get_tensor_model_parallel_rank(),
                             size=parallel_state.get_tensor_model_parallel_world_size(),
                             start=start, end=end, device=param.device)
