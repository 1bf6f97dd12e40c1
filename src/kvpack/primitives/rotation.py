"""Seeded random rotations: dense Haar-orthogonal (QR) and randomized Hadamard (FWHT).

Every rotation is reproducible from an integer seed, so encoder and decoder (and the query side
of compressed-domain attention) rebuild the same matrix without storing it.
"""

from __future__ import annotations

import functools
import math

import torch

_SEED_MIX = 0x9E3779B1  # golden-ratio constant: spreads (layer, head) pairs over the seed space


def derive_seed(base: int, layer: int, head: int) -> int:
    """A distinct, reproducible seed per (layer, head)."""
    return (base * 1_000_003 + layer * _SEED_MIX + head * 7919) % (2**31 - 1)


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def random_orthogonal(dim: int, seed: int) -> torch.Tensor:
    """Haar-distributed orthogonal matrix `(dim, dim)` in float32.

    QR of a Gaussian matrix, with the signs of R's diagonal folded into Q: without that fix
    the distribution is not Haar and the rotated coordinates are not exactly Beta-distributed.
    """
    gauss = torch.randn(dim, dim, generator=_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(torch.float32)


def random_signs(dim: int, seed: int) -> torch.Tensor:
    """Vector `(dim,)` of random ±1 in float32."""
    bits = torch.randint(0, 2, (dim,), generator=_generator(seed))
    return (bits * 2 - 1).to(torch.float32)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def power_of_two_blocks(dim: int) -> list[int]:
    """Split `dim` into descending powers of two, e.g. 96 -> [64, 32], 80 -> [64, 16]."""
    return [1 << b for b in reversed(range(dim.bit_length())) if dim >> b & 1]


# Up to this size the transform is one matmul with the dense (symmetric, orthonormal) Hadamard
# matrix: a single GEMM call beats log2(d) rounds of small butterfly ops at head sizes (d <= 256),
# and the matrix (at most 256 KB) is built once per size, device and dtype.
DENSE_HADAMARD_MAX = 256


def _butterflies(x: torch.Tensor) -> torch.Tensor:
    dim = x.shape[-1]
    lead = x.shape[:-1]
    y = x.reshape(-1, dim)
    h = 1
    while h < dim:
        y = y.view(-1, dim // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(*lead, dim) / math.sqrt(dim)


@functools.cache
def dense_hadamard(dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix `(dim, dim)`: `fwht(x) == x @ H` (H is symmetric)."""
    return _butterflies(torch.eye(dim, dtype=torch.float64)).to(device=device, dtype=dtype)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dim (a power of two).

    Scaled by 1/sqrt(d) so the transform is its own inverse; O(d log d) butterflies above
    DENSE_HADAMARD_MAX, one matmul at or below it.
    """
    dim = x.shape[-1]
    if not is_power_of_two(dim):
        raise ValueError(f"fwht needs a power-of-two last dim, got {dim}; use hadamard_transform")
    if dim <= DENSE_HADAMARD_MAX and x.dtype.is_floating_point:
        return x @ dense_hadamard(dim, x.device, x.dtype)
    return _butterflies(x)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Hadamard over the last dim; block-diagonal for non-power-of-two dims.

    A head dim of 96 is transformed as a 64-block and a 32-block. The blocks do not mix with
    each other, which is why callers that need full mixing (TurboQuant) default to QR rotations.
    """
    dim = x.shape[-1]
    if is_power_of_two(dim):
        return fwht(x)
    parts = torch.split(x, power_of_two_blocks(dim), dim=-1)
    return torch.cat([fwht(p) for p in parts], dim=-1)


@functools.cache
def hadamard_dense(dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`(dim, dim)` H with `hadamard_transform(x) == x @ H` for any dim (block-diagonal past powers of two), built once
    per size, device and dtype: a per-step transform of a few rows is then one matmul (H is symmetric: its own inverse)."""
    if is_power_of_two(dim) and dim <= DENSE_HADAMARD_MAX:
        return dense_hadamard(dim, device, dtype)
    return hadamard_transform(torch.eye(dim, dtype=torch.float64)).to(device=device, dtype=dtype)


def randomized_hadamard(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Rotate rows of `x (..., d)` by H·diag(signs) (orthonormal)."""
    return hadamard_transform(x * signs)


def randomized_hadamard_inverse(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of `randomized_hadamard`: diag(signs)·H (H is symmetric and self-inverse)."""
    return hadamard_transform(y) * signs


def hadamard_matrix(dim: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """The dense `(dim, dim)` matrix R with `randomized_hadamard(x) == x @ R.T`."""
    eye = torch.eye(dim, dtype=torch.float32)
    if signs is None:
        signs = torch.ones(dim)
    return randomized_hadamard(eye, signs).T.contiguous()
