"""Random Hadamard transform (RHT) in 16-element blocks, as NVFP4 applies it to wgrad operands.

With H the normalised 16x16 Sylvester Hadamard matrix (entries +-1/4,
H H^T = I) and D = diag(signs) a random +-1 diagonal, the block transform is
M = H D, which is orthogonal: M^T M = D H^T H D = I. Applied blockwise along
the token (reduction) dimension of both wgrad operands dY (T x out) and
X (T x in):

    (M dY)^T (M X) = dY^T M^T M X = dY^T X

exactly in exact arithmetic, while spreading outliers across each 16-block
before FP4 quantization. The same ``signs`` must be used for both operands.

Transforms are computed in the input's dtype (use fp32/fp64); the matrix
entries +-1/4 are exact in every float dtype.
"""

from __future__ import annotations

import torch

HADAMARD_SIZE = 16


def hadamard_matrix(
    n: int = HADAMARD_SIZE, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Normalised n x n Sylvester Hadamard matrix (n a power of two): symmetric, H @ H.T = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64, device=device)  # built on the device: no host copy
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / n**0.5).to(dtype)


def random_signs(
    n: int = HADAMARD_SIZE,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """n random +-1 values (float32) from ``seed`` or ``generator`` (a CPU generator), on ``device``."""
    if seed is not None:
        if generator is not None:
            raise ValueError("pass seed or generator, not both")
        generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (n,), generator=generator)
    return (bits * 2 - 1).to(dtype=torch.float32, device=device)


def _block_matmul(x: torch.Tensor, matrix: torch.Tensor, dim: int) -> torch.Tensor:
    """Right-multiply every length-n block along ``dim`` (as a row vector) by ``matrix`` (n x n)."""
    n = matrix.shape[0]
    moved = x.movedim(dim, -1)
    if moved.shape[-1] % n:
        raise ValueError(f"dimension {dim} of size {moved.shape[-1]} is not divisible by {n}")
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // n, n)
    out = blocks @ matrix.to(dtype=x.dtype, device=x.device)
    return out.reshape(moved.shape).movedim(-1, dim)


def rht_matrix(signs: torch.Tensor) -> torch.Tensor:
    """The orthogonal block transform M = H diag(signs) (n x n, float64 for exactness)."""
    return hadamard_matrix(signs.numel(), dtype=torch.float64, device=signs.device) * signs.double()


def random_hadamard_transform(x: torch.Tensor, signs: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """y = M x for every 16-block of ``x`` along ``dim`` (size divisible by len(signs)); same shape/dtype."""
    return _block_matmul(x, rht_matrix(signs).T, dim)


def inverse_random_hadamard_transform(y: torch.Tensor, signs: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """x = M^T y blockwise along ``dim``: the inverse of :func:`random_hadamard_transform`."""
    return _block_matmul(y, rht_matrix(signs), dim)
