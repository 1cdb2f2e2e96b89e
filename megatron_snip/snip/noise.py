"""Layout-invariant noise for the probe passes: a counter-based hash of (key, global element index).

The value drawn for an element depends only on the noise key and the element's index
in the *unsharded* tensor, so every tensor-/pipeline-parallel layout draws the same
noise and nothing needs storing or communicating.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from megatron.core import parallel_state

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for x in [0, 2^32) held in int64, without overflowing int64.
    Overwrites ``x`` (in-place ops: the hash runs on every probe-pass output)."""
    high = (x >> 16).mul_(c).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.bitwise_and_(0xFFFF).mul_(c).add_(high).bitwise_and_(_M32)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash on int64 tensors holding 32-bit values."""
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x.bitwise_xor_(x >> 15), 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def noise_key(*parts) -> int:
    """A 64-bit key for one noise tensor from its description (seed, pass, name, ...)."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def rademacher(index: torch.Tensor, key: int) -> torch.Tensor:
    """+-1 (fp32) for each global element index (int64), a hash of (key, index): the same value
    for an element whichever rank holds it and in whatever order it is drawn."""
    h = _hash32((index & _M32) ^ (key & _M32))
    h = _hash32(h.bitwise_xor_(index >> 32).bitwise_xor_((key >> 32) & _M32))
    return (h >> 31).float().mul_(-2.0).add_(1.0)


def global_flat_index(shape: Sequence[int], *, partition_dim: int | None = None, stride: int = 1, rank: int = 0,
                      size: int = 1, start: int = 0, end: int | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Indices, in the unsharded tensor, of elements ``start:end`` of a flattened shard.

    The shard is megatron's tensor-parallel split of dim ``partition_dim`` (None: not split):
    the full dim is cut into chunks of ``shape[dim] / stride`` and rank r holds chunks
    r, r + size, r + 2 size, ... (``_initialize_affine_weight_cpu``; SwiGLU's fc1 has stride 2).

    Returns:
        int64 tensor of ``end - start`` flat indices into the full tensor (row-major).
    """
    numel = math.prod(shape)
    end = numel if end is None else end
    if partition_dim is None or size == 1:
        return torch.arange(start, end, dtype=torch.int64, device=device)
    dim = partition_dim % len(shape)
    n_local, inner = shape[dim], math.prod(shape[dim + 1:])
    chunk = n_local // stride

    def full_row(d: torch.Tensor) -> torch.Tensor:  # local index along dim -> index in the full dim
        return ((d // chunk) * size + rank) * chunk + d % chunk

    if (start, end) == (0, numel):
        # The whole shard: one broadcast sum of three small index vectors (the per-element
        # divisions below cost more than the hash on the outputs of the probe passes).
        outer = torch.arange(numel // (n_local * inner), dtype=torch.int64, device=device)
        d_full = full_row(torch.arange(n_local, dtype=torch.int64, device=device))
        within = torch.arange(inner, dtype=torch.int64, device=device)
        return ((outer[:, None, None] * (n_local * size) + d_full[None, :, None]) * inner
                + within[None, None, :]).reshape(-1)
    local = torch.arange(start, end, dtype=torch.int64, device=device)
    outer, rest = local // (n_local * inner), local % (n_local * inner)
    d, within = rest // inner, rest % inner
    return (outer * (n_local * size) + full_row(d)) * inner + within


def layout_rademacher(shape: Sequence[int], key: int, *, partition_dim: int | None = None, stride: int = 1,
                      rank: int = 0, size: int = 1, start: int = 0, end: int | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """``rademacher(global_flat_index(shape, ...), key)``: the noise of elements ``start:end`` of a
    flattened shard (arguments as :func:`global_flat_index`'s). On CUDA one fused Triton kernel
    (``noise_triton``) computes the same values without the index tensor and the ~50 int64 passes."""
    if torch.device(device).type == "cuda":
        try:
            from megatron_snip.snip import noise_triton
        except ImportError:  # no triton: the torch composition below
            noise_triton = None
        if noise_triton is not None:
            numel = math.prod(shape)
            end = numel if end is None else end
            split = partition_dim is not None and size > 1
            dim = partition_dim % len(shape) if split else 0
            n_local, inner = (shape[dim], math.prod(shape[dim + 1:])) if split else (1, 1)
            return noise_triton.rademacher(end - start, key, start=start, n_local=n_local, inner=inner,
                                           chunk=n_local // stride if split else 1, size=size, rank=rank,
                                           split=split, device=device)
    index = global_flat_index(shape, partition_dim=partition_dim, stride=stride, rank=rank, size=size, start=start,
                              end=end, device=device)
    return rademacher(index, key)


def param_noise(param: torch.nn.Parameter, key: int, start: int = 0, end: int | None = None) -> torch.Tensor:
    """:func:`layout_rademacher` of elements ``start:end`` of this rank's (flattened) shard of a megatron
    parameter, from its tensor-parallel attributes: the same values for a parameter element on every layout."""
    split = getattr(param, "tensor_model_parallel", False)
    return layout_rademacher(param.shape, key, partition_dim=param.partition_dim if split else None,
                             stride=getattr(param, "partition_stride", 1),
                             rank=parallel_state.get_tensor_model_parallel_rank(),
                             size=parallel_state.get_tensor_model_parallel_world_size(),
                             start=start, end=end, device=param.device)


def param_global_index(param: torch.nn.Parameter, start: int = 0, end: int | None = None) -> torch.Tensor:
    """:func:`global_flat_index` of elements ``start:end`` of this rank's (flattened) shard of a
    megatron parameter, from its tensor-parallel attributes."""
    split = getattr(param, "tensor_model_parallel", False)
    return global_flat_index(param.shape, partition_dim=param.partition_dim if split else None,
                             stride=getattr(param, "partition_stride", 1),
                             rank=parallel_state.get_tensor_model_parallel_rank(),
                             size=parallel_state.get_tensor_model_parallel_world_size(),
                             start=start, end=end, device=param.device)
