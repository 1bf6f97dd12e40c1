"""Seeded batched k-means."""

import torch

from kvpack.primitives.kmeans import assign, kmeans, kmeans_plus_plus


def data(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(2, 12, 4, generator=gen) * 4
    return centers[:, torch.randint(0, 12, (3000,), generator=gen)] + torch.randn(2, 3000, 4, generator=gen)


def test_distortion_is_monotone_and_low():
    result = kmeans(data(), k=16, n_iter=12, seed=3)
    d = result.distortion
    assert (d[:, 1:] <= d[:, :-1] * (1 + 1e-5)).all()
    assert d[:, -1].max() < d[:, 0].min()
    assert d[:, -1].max() < 4.5  # within-cluster variance is 4 (unit noise in 4 dims)


def test_reproducible_by_seed():
    x = data()
    a, b, c = kmeans(x, 32, 5, seed=7), kmeans(x, 32, 5, seed=7), kmeans(x, 32, 5, seed=8)
    assert torch.equal(a.centroids, b.centroids)
    assert not torch.equal(a.centroids, c.centroids)


def test_assign_matches_brute_force_and_handles_duplicates():
    x = data(1)
    centroids = kmeans(x, 8, 3, seed=0).centroids
    index, dist = assign(x, centroids)
    brute = torch.cdist(x, centroids).square()
    torch.testing.assert_close(dist, brute.min(-1).values, atol=1e-3, rtol=1e-4)
    assert (brute.gather(-1, index[..., None]).squeeze(-1) <= brute.min(-1).values + 1e-3).all()
    same = torch.ones(1, 10, 4)  # fewer distinct points than clusters
    result = kmeans(same, 4, 2, seed=0)
    assert torch.isfinite(result.centroids).all() and result.distortion.max() == 0


def test_kmeans_plus_plus_draws_by_squared_distance():
    """The second seed's distribution against D² sampling written out: points 0, 1, 3 on a line, 30,000
    independent groups in one call; P(first = i) = 1/3 and P(second = j | first = i) = d(i, j)² / Σ_j d(i, j)²."""
    groups, line = 30000, torch.tensor([0.0, 1.0, 3.0])
    x = line[None, :, None].expand(groups, 3, 1).contiguous()
    seeds = kmeans_plus_plus(x, 2, torch.Generator().manual_seed(0))[..., 0]
    first, second = ((seeds[:, i, None] == line).float().argmax(-1) for i in (0, 1))
    d2 = (line[:, None] - line[None, :]).square()
    expected = d2 / d2.sum(1, keepdim=True) / 3  # joint P(first = i, second = j)
    observed = torch.zeros(3, 3).index_put_((first, second), torch.ones(groups), accumulate=True) / groups
    assert (observed - expected).abs().max() < 0.01  # 4.5 standard errors at the largest cell (p ~ 0.3)
    assert (observed.diagonal() == 0).all()  # a point already chosen has zero weight


def test_kmeans_takes_the_assignment_step_it_is_given():
    """A supplied assignment step replaces `assign` (the codecs pass the C++ kernel): an exact equal gives the same
    codebook, bit for bit."""
    calls = []
    def counted(x, c):
        calls.append(1)
        return assign(x, c)
    a, b = kmeans(data(), 8, 4, seed=1), kmeans(data(), 8, 4, seed=1, nearest=counted)
    assert torch.equal(a.centroids, b.centroids) and len(calls) == 4
