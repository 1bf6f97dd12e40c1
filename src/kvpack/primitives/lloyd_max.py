"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector.

After a Haar rotation each coordinate of a unit vector in R^d follows the Beta-type density
f(x) ∝ (1 - x²)^((d-3)/2) on [-1, 1] (TurboQuant, Lemma 1), which tends to N(0, 1/d). The
Gaussian codebook has a closed-form centroid update; the exact one integrates f numerically and
matters for small d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
DISTRIBUTIONS = ("gaussian", "beta")


@dataclass(frozen=True)
class Codebook:
    """Sorted reconstruction levels and the decision boundaries between them.

    centroids: (2**bits,) float32; boundaries: (2**bits - 1,) float32 interior thresholds.
    """

    centroids: torch.Tensor
    boundaries: torch.Tensor

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Index of the nearest centroid for every element, as uint8."""
        return torch.bucketize(x.contiguous(), self.boundaries.to(x.device, x.dtype)).to(torch.uint8)

    def lookup(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.centroids.to(codes.device, dtype)[codes.long()]


def _check(dim: int, bits: int, distribution: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if dim < 2:
        raise ValueError(f"dim must be >= 2, got {dim}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")


def _phi(z: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _cdf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


def _gaussian_centroids(bounds: torch.Tensor, sigma: float) -> torch.Tensor:
    """E[X | a <= X < b] for X ~ N(0, sigma²), closed form: sigma·(φ(a)-φ(b)) / (Φ(b)-Φ(a))."""
    za, zb = bounds[:-1] / sigma, bounds[1:] / sigma
    mass = (_cdf(zb) - _cdf(za)).clamp_min(1e-300)
    return sigma * (_phi(za) - _phi(zb)) / mass


class _BetaGrid:
    """The exact coordinate density on a fine grid, for numerical conditional means."""

    def __init__(self, dim: int, points: int = 200_001):
        self.x = torch.linspace(-1.0, 1.0, points, dtype=torch.float64)
        log_f = 0.5 * (dim - 3) * torch.log1p(-self.x.pow(2)).clamp_min(-1e4)
        w = torch.exp(log_f - log_f.max())
        self.w = w / w.sum()

    def centroids(self, bounds: torch.Tensor) -> torch.Tensor:
        cell = torch.bucketize(self.x, bounds[1:-1])
        mass = torch.zeros(len(bounds) - 1, dtype=torch.float64).index_add_(0, cell, self.w)
        first = torch.zeros_like(mass).index_add_(0, cell, self.w * self.x)
        return first / mass.clamp_min(1e-300)

    def mse(self, centroids: torch.Tensor, boundaries: torch.Tensor) -> float:
        cell = torch.bucketize(self.x, boundaries)
        return float((self.w * (self.x - centroids[cell]).pow(2)).sum())


@lru_cache(maxsize=64)
def _solve(dim: int, bits: int, distribution: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    levels = 1 << bits
    sigma = 1.0 / math.sqrt(dim)
    normal = torch.distributions.Normal(0.0, 1.0)
    probs = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    c = normal.icdf(probs).to(torch.float64) * sigma
    grid = _BetaGrid(dim) if distribution == "beta" else None
    edge = torch.tensor([-1.0 if grid else -1e9], dtype=torch.float64)
    for _ in range(500):
        bounds = torch.cat([edge, (c[1:] + c[:-1]) / 2, -edge])
        new = grid.centroids(bounds) if grid else _gaussian_centroids(bounds, sigma)
        done = (new - c).abs().max() < 1e-12 * sigma
        c = new
        if done:
            break
    inner = (c[1:] + c[:-1]) / 2
    return tuple(c.tolist()), tuple(inner.tolist())


def lloyd_max_codebook(dim: int, bits: int, distribution: str = "beta") -> Codebook:
    """Optimal `bits`-bit scalar quantizer for one coordinate of a rotated unit vector in R^dim.

    `distribution="gaussian"` uses N(0, 1/dim) (closed form); `"beta"` the exact marginal.
    """
    _check(dim, bits, distribution)
    cents, bounds = _solve(dim, bits, distribution)
    return Codebook(torch.tensor(cents, dtype=torch.float32), torch.tensor(bounds, dtype=torch.float32))


def expected_mse(dim: int, bits: int, distribution: str = "beta") -> float:
    """Expected ‖x - x̂‖² for a unit vector uniform on the sphere (= dim × per-coordinate MSE),
    integrated numerically against the exact coordinate density: the theoretical optimum that
    measured distortion is compared with."""
    _check(dim, bits, distribution)
    book = lloyd_max_codebook(dim, bits, distribution)
    grid = _BetaGrid(dim)
    return dim * grid.mse(book.centroids.double(), book.boundaries.double())


def gaussian_unit_mse(bits: int) -> float:
    """Per-coordinate MSE of the Lloyd-Max quantizer for N(0, 1) (0.3634, 0.1175, 0.03454, ...)."""
    _check(2, bits, "gaussian")
    cents, bounds = _solve(1, bits, "gaussian")  # dim 1 means sigma 1: the standard normal
    c = torch.tensor(cents, dtype=torch.float64)
    inf = torch.tensor([40.0], dtype=torch.float64)
    b = torch.cat([-inf, torch.tensor(bounds, dtype=torch.float64), inf])
    za, zb = b[:-1], b[1:]
    # E[(X-c)²] over each cell = ∫x²φ - 2c∫xφ + c²∫φ, with ∫x²φ = Φ - zφ terms.
    second = (_cdf(zb) - _cdf(za)) - (zb * _phi(zb) - za * _phi(za))
    first = _phi(za) - _phi(zb)
    mass = _cdf(zb) - _cdf(za)
    return float((second - 2 * c * first + c * c * mass).sum())
