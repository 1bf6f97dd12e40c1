"""Data-fitted scalar codebooks: batched 1-D Lloyd iterations (k-means on a line) and nearest-level codes.

One codebook per group of samples `x (groups, N)`: per (kv head, channel) for KVQuant's keys, per kv
head for its per-token-normalized values, per (kv head, subspace) for the subspace codec. In 1-D the
nearest level is a `searchsorted` against the midpoints, so a Lloyd step costs O(N log L) per group
and needs no `(N, L)` distance matrix. Everything is deterministic (quantile or uniform
initialization, no random draws), so the same data always gives the same codebook.
"""

from __future__ import annotations

import torch


def sorted_quantiles(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-group quantiles of `x (groups, N)` at probabilities `q (k,)` -> `(groups, k)` (nearest-rank, no size limit).

    `torch.quantile` refuses inputs past 2^24 elements; a prompt's keys for all heads and channels exceed that.
    """
    n = x.shape[-1]
    ranks = (q.to(x.device, torch.float64) * (n - 1)).round().long().clamp(0, n - 1)
    return x.sort(-1).values[..., ranks]


def nearest_level(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted `levels (groups, L)` for every entry of `x (groups, N)` -> long `(groups, N)`."""
    mid = (levels[..., 1:] + levels[..., :-1]) / 2
    return torch.searchsorted(mid.contiguous(), x.contiguous())


def lloyd_1d(x: torch.Tensor, init: torch.Tensor, weights: torch.Tensor | None = None, n_iter: int = 300) -> torch.Tensor:
    """MSE-optimal scalar levels per group by Lloyd's algorithm: `x (groups, N)`, `init (groups, L)` -> sorted `(groups, L)`.

    weights `(groups, N)`: per-sample weights (0 drops a sample, e.g. an outlier kept exactly elsewhere).
    Each step assigns samples to their nearest level and moves every level to its cell's weighted
    mean, so the weighted squared error never increases from the initial codebook's. An empty cell
    keeps its level. The samples are sorted once and a step reads cell sums from prefix sums at the
    `L - 1` cut points, O(L log N) per group instead of O(N): 16-level codebooks need ~100 steps to
    settle (their tail levels creep), which a pass over every sample per step would make slow.
    Iterations stop early once no level moves by more than 1e-6 of its group's sample range.
    """
    if x.dim() != 2 or init.dim() != 2 or init.shape[0] != x.shape[0]:
        raise ValueError(f"x must be (groups, N) and init (groups, L) with the same groups, got {tuple(x.shape)}, {tuple(init.shape)}")
    xs, order = x.double().sort(-1)
    xs = xs.contiguous()  # sort keeps a transposed input's strides; searchsorted wants rows contiguous
    w = torch.ones_like(xs) if weights is None else weights.double().gather(-1, order)
    zero = xs.new_zeros(xs.shape[0], 1)
    mass_sum = torch.cat([zero, w.cumsum(-1)], -1)  # (groups, N + 1) prefix sums, float64 for long inputs
    first_sum = torch.cat([zero, (w * xs).cumsum(-1)], -1)
    n = torch.full_like(zero, xs.shape[-1], dtype=torch.long)
    levels = init.double().sort(-1).values
    tol = 1e-6 * (xs[..., -1:] - xs[..., :1])
    for _ in range(n_iter):
        # Samples <= a midpoint go to the lower level, as `nearest_level` assigns them.
        cut = torch.searchsorted(xs, (levels[..., 1:] + levels[..., :-1]) / 2, right=True)
        edges = torch.cat([n * 0, cut, n], -1)
        mass = mass_sum.gather(-1, edges[..., 1:]) - mass_sum.gather(-1, edges[..., :-1])
        first = first_sum.gather(-1, edges[..., 1:]) - first_sum.gather(-1, edges[..., :-1])
        new = torch.where(mass > 0, first / mass.clamp_min(1e-300), levels).sort(-1).values
        settled = bool(((new - levels).abs() <= tol).all())
        levels = new
        if settled:
            break
    return levels.float()
