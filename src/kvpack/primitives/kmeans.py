"""Seeded, batched k-means (Lloyd's algorithm with k-means++ init) in float32.

`x (groups, N, dim)` runs `groups` independent clusterings at once: one codebook per layer is
`groups=1`, one per kv head is `groups=kv_heads`. Everything random comes from one
`torch.Generator` seeded by the caller, so a seed reproduces the codebook bit for bit.
Distances are computed in chunks of points so the `(N, k)` distance matrix never exists whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_CHUNK_ELEMENTS = 1 << 22  # distance-matrix entries per chunk (16 MiB of float32)


@dataclass(frozen=True)
class KMeansResult:
    """centroids `(groups, k, dim)` float32; distortion `(groups, n_iter)`: mean squared distance to the
    nearest centroid at each iteration's assignment step (non-increasing)."""

    centroids: torch.Tensor
    distortion: torch.Tensor


def _sqdist_shifted(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """`(G, n, dim), (G, k, dim) -> (G, n, k)` squared distances minus `|x|²` (same argmin, one pass fewer)."""
    return torch.baddbmm((centroids * centroids).sum(-1).unsqueeze(1), x, centroids.transpose(1, 2), alpha=-2.0)


def assign(x: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of every point: `x (G, N, dim)` -> indices `(G, N)` long, squared distances `(G, N)`."""
    x, centroids = x.float(), centroids.float()
    step = max(1, _CHUNK_ELEMENTS // max(1, x.shape[0] * centroids.shape[1]))
    best, index = [], []
    for start in range(0, x.shape[1], step):
        part = x[:, start : start + step]
        d, i = _sqdist_shifted(part, centroids).min(-1)
        best.append((d + (part * part).sum(-1)).clamp_min_(0))
        index.append(i)
    return torch.cat(index, 1), torch.cat(best, 1)


def d2_picks(x: torch.Tensor, first: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """k-means++ (D² sampling) as indices, its randomness drawn up front: `x (G, N, dim)`, `first (G,)` the first
    seed, `u (G, k - 1)` float64 uniforms in [0, 1), draw i taking the point where the cumulative D² weights cross
    `u[:, i] * total` -> `(G, k)` long. A group whose points all coincide with its seeds draws uniformly (`u * N`).

    Each draw inverts the cumulative weights (a cumsum and a binary search): the distribution of
    `torch.multinomial`, which cost ~0.7 ms per draw over 32K points (docs/notes/speed.md)."""
    groups, n, _ = x.shape
    rows = torch.arange(groups)
    picks = [first]
    nearest = ((x - x[rows, first].unsqueeze(1)) ** 2).sum(-1)
    for i in range(u.shape[1]):
        cdf = nearest.double().cumsum(-1)
        total = cdf[:, -1:]
        draw = u[:, i : i + 1]
        # right=True skips zero-weight points (already seeds): their cdf equals the previous entry.
        pick = torch.searchsorted(cdf, draw * total, right=True).clamp_max_(n - 1)
        pick = torch.where(total > 0, pick, (draw * n).long().clamp_max_(n - 1)).squeeze(1)
        picks.append(pick)
        nearest = torch.minimum(nearest, ((x - x[rows, pick].unsqueeze(1)) ** 2).sum(-1))
    return torch.stack(picks, 1)


Seeder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator, picks: Seeder = d2_picks) -> torch.Tensor:
    """k-means++ seeding for every group: `(G, N, dim) -> (G, k, dim)`; `picks` is `d2_picks` or a kernel with its
    signature (`kernels.cpu_lut.d2_picks`), fed the same draws so either gives the same seeds."""
    groups, n, _ = x.shape
    first = torch.randint(0, n, (groups,), generator=generator)
    u = torch.rand(k - 1, groups, generator=generator, dtype=torch.float64).T  # draw-major: one draw per group at a time
    return x[torch.arange(groups)[:, None], picks(x, first, u)]


# k-means++ seeds from at most this many points per cluster (a seeded sample); Lloyd's iterations then see every
# point. Seeding is k sequential passes over its points, so over 32K points it was 2/3 of Shard's k-means.
SEED_POINTS_PER_CLUSTER = 32


Assign = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def kmeans(x: torch.Tensor, k: int, n_iter: int = 20, seed: int = 0, nearest: Assign = assign, picks: Seeder = d2_picks) -> KMeansResult:
    """Cluster each group of `x (groups, N, dim)` into `k` centroids with `n_iter` Lloyd iterations.

    `nearest` is the assignment step and `picks` the seeding (the torch references, or the kernels with their
    signatures, `kernels.cpu_lut.nearest_codeword` and `kernels.cpu_lut.d2_picks`).

    An empty cluster is re-seeded at the point farthest from its centroid, which keeps the
    distortion non-increasing (that point's error drops to zero, no other point's rises).
    """
    if x.dim() != 3:
        raise ValueError(f"x must be (groups, points, dim), got shape {tuple(x.shape)}")
    if k < 1 or n_iter < 1:
        raise ValueError(f"k and n_iter must be >= 1, got k={k}, n_iter={n_iter}")
    x = x.float()
    groups, _, dim = x.shape
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    seeding = x
    if x.shape[1] > SEED_POINTS_PER_CLUSTER * k:
        seeding = x[:, torch.randperm(x.shape[1], generator=generator)[: SEED_POINTS_PER_CLUSTER * k]]
    centroids = kmeans_plus_plus(seeding, k, generator, picks)
    history = []
    for _ in range(n_iter):
        index, dist = nearest(x, centroids)
        history.append(dist.mean(1))
        # One flat index_add_ / bincount (index_put_ with accumulate sorted the indices: a quarter of the fit).
        flat = (index + torch.arange(groups)[:, None] * k).flatten()
        sums = torch.zeros(groups * k, dim).index_add_(0, flat, x.reshape(-1, dim)).view(groups, k, dim)
        counts = torch.bincount(flat, minlength=groups * k).view(groups, k).float()
        centroids = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp_min(1).unsqueeze(-1), centroids)
        centroids = _reseed_empty(x, centroids, counts, dist)
    return KMeansResult(centroids, torch.stack(history, 1))


def _reseed_empty(x: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """Move each group's empty centroids onto its points farthest from their centroids."""
    empty = counts == 0
    if not empty.any():
        return centroids
    centroids = centroids.clone()
    for g in empty.any(1).nonzero().flatten().tolist():
        slots = empty[g].nonzero().flatten()
        far = dist[g].topk(min(len(slots), dist.shape[1])).indices
        centroids[g, slots[: len(far)]] = x[g, far]
    return centroids
