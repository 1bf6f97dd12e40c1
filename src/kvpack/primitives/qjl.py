"""Quantized Johnson-Lindenstrauss sketches: sign(S k) with an unbiased inner-product estimator.

ProdQJL(q, k) = sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>   (QJL, Lemma 3.2: unbiased).
"""

from __future__ import annotations

import math

import torch

from .rotation import _generator


def qjl_matrix(m: int, dim: int, seed: int, orthogonalize: bool = True) -> torch.Tensor:
    """Sketch matrix `(m, dim)` whose rows are each exactly N(0, I_dim) in distribution.

    With `orthogonalize`, rows are orthogonal within each block of `dim` rows (QR), then given
    chi(dim)-distributed norms: each row stays marginally Gaussian, so the estimator stays
    unbiased, while orthogonality lowers its variance (QJL §4.2).
    """
    gen = _generator(seed)
    gauss = torch.randn(m, dim, generator=gen, dtype=torch.float64)
    if not orthogonalize:
        return gauss.float()
    blocks = []
    for start in range(0, m, dim):
        block = gauss[start : start + dim]
        q, r = torch.linalg.qr(block.T)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T)
    rows = torch.cat(blocks)
    norms = torch.randn(m, dim, generator=gen, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (rows * norms).float()


def qjl_scale(m: int) -> float:
    """The estimator's constant sqrt(pi/2) / m."""
    return math.sqrt(math.pi / 2) / m


def qjl_signs(x: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """Bits `(..., m)` uint8, 1 where (S x) >= 0, for `x (..., dim)` and `sketch (m, dim)`."""
    return (x.float() @ sketch.T >= 0).to(torch.uint8)


def qjl_inner_product(q: torch.Tensor, bits: torch.Tensor, norm: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """Unbiased estimate of <q, k> from k's sign bits `(..., m)` and norm `(...)`; `q (..., dim)`."""
    signs = bits.float() * 2 - 1
    return qjl_scale(sketch.shape[0]) * norm * ((q.float() @ sketch.T) * signs).sum(-1)
