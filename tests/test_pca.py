"""PCA and DP bit allocation primitives."""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.primitives.pca import BIT_OPTIONS, allocate_bits, group_variances, modelled_errors, pca, rank_for_energy


def test_pca_recovers_planted_subspace():
    gen = torch.Generator().manual_seed(0)
    planted, _ = torch.linalg.qr(torch.randn(96, 6, generator=gen))
    x = (torch.randn(4000, 6, generator=gen) * torch.tensor([9.0, 7, 5, 4, 3, 2])) @ planted.T
    x = x + 0.05 * torch.randn(4000, 96, generator=gen) + 3.0  # noise and an offset the mean must absorb
    result = pca(x[None], rank=6)
    # Cosines of the principal angles between the two subspaces are the singular values of U^T V.
    cosines = torch.linalg.svdvals(result.basis[0].T @ planted)
    assert cosines.min() > 0.999
    torch.testing.assert_close(result.basis[0].T @ result.basis[0], torch.eye(6), atol=1e-5, rtol=0)
    assert rank_for_energy(result.variances, 0.99) == 6


def test_pca_is_bit_reproducible_with_fixed_signs():
    x = torch.randn(2, 500, 32, generator=torch.Generator().manual_seed(1))
    a, b = pca(x, rank=8), pca(x.clone(), rank=8)
    assert torch.equal(a.basis, b.basis) and torch.equal(a.mean, b.mean)
    pivots = a.basis.gather(1, a.basis.abs().argmax(1, keepdim=True))
    assert (pivots > 0).all()
    assert (a.variances[:, :-1] >= a.variances[:, 1:]).all()


def test_group_variances_sums_consecutive_components():
    assert group_variances([5.0, 4, 3, 2, 1], 2) == [9.0, 5.0, 1.0]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e4), min_size=1, max_size=5),
    st.integers(1, 8),
    st.integers(0, 200),
    st.floats(0.5, 8.0),
)
def test_allocation_respects_budget_and_is_optimal(variances, size, budget, penalty):
    sizes = [size] * len(variances)
    errors = modelled_errors(variances, BIT_OPTIONS, penalty)
    alloc = allocate_bits(errors, sizes, budget)
    assert sum(b * s for b, s in zip(alloc, sizes, strict=True)) <= budget
    # Brute force over every feasible allocation.
    feasible = [
        c
        for c in itertools.product(BIT_OPTIONS, repeat=len(variances))
        if sum(b * s for b, s in zip(c, sizes, strict=True)) <= budget
    ]
    best = min(sum(row[b] for row, b in zip(errors, c, strict=True)) for c in feasible)
    assert sum(row[b] for row, b in zip(errors, alloc, strict=True)) <= best * (1 + 1e-12) + 1e-300


def test_drop_penalty_quantizes_where_naive_mse_drops():
    # Group 0 gains 1000 * 15 / (3 * 4^8) = 0.076 from going 6 -> 8 bits; dropping group 1 costs
    # 0.04 under plain MSE (worth it) but 0.16 with the 4x penalty (not worth it).
    variances, sizes, budget = [1000.0, 0.04], [16, 16], 8 * 16
    assert allocate_bits(modelled_errors(variances, drop_penalty=1.0), sizes, budget) == (8, 0)
    assert allocate_bits(modelled_errors(variances, drop_penalty=4.0), sizes, budget) == (6, 2)
