"""Seeded, batched k-means (Lloyd's algorithm with k-means++ init) in float32.

`x (groups, N, dim)` runs `groups` independent clusterings at once: one codebook per layer is
`groups=1`, one per kv head is `groups=kv_heads`. Everything random comes from one
`torch.Generator` seeded by the caller, so a seed reproduces the codebook bit for bit.
Distances are computed in chunks of points so the `(N, k)` distance matrix never exists whole.
"""

from __future__ import annotations

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


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (D² sampling) for every group: `(G, N, dim) -> (G, k, dim)`."""
    groups, n, _ = x.shape
    rows = torch.arange(groups)
    first = torch.randint(0, n, (groups,), generator=generator)
    centers = [x[rows, first]]
    nearest = ((x - centers[0].unsqueeze(1)) ** 2).sum(-1)
    for _ in range(k - 1):
        # All-duplicate groups have zero weight everywhere: fall back to uniform sampling.
        weights = torch.where(nearest.sum(-1, keepdim=True) > 0, nearest, torch.ones_like(nearest))
        pick = torch.multinomial(weights.double(), 1, generator=generator).squeeze(1)
        centers.append(x[rows, pick])
        nearest = torch.minimum(nearest, ((x - centers[-1].unsqueeze(1)) ** 2).sum(-1))
    return torch.stack(centers, 1)


def kmeans(x: torch.Tensor, k: int, n_iter: int = 20, seed: int = 0) -> KMeansResult:
    """Cluster each group of `x (groups, N, dim)` into `k` centroids with `n_iter` Lloyd iterations.

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
    centroids = kmeans_plus_plus(x, k, generator)
    history = []
    for _ in range(n_iter):
        index, dist = assign(x, centroids)
        history.append(dist.mean(1))
        sums = torch.zeros(groups, k, dim).index_put_((torch.arange(groups)[:, None], index), x, accumulate=True)
        counts = torch.zeros(groups, k).index_put_((torch.arange(groups)[:, None], index), torch.ones_like(dist), accumulate=True)
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
