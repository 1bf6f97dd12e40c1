"""Confidence intervals against statistical theory: coverage at a known truth, 1/sqrt(n) shrinkage, Wilson's score equation."""

import math
from statistics import NormalDist

import pytest
import torch

from kvpack.eval.report import format_table, markdown_table
from kvpack.eval.stats import DEFAULT_BLOCK, BootstrapConfig, ppl_delta_ci, resample_indices, wilson_interval

TRUE_SHIFT = 0.02  # nats per token: the method's perplexity is exp(0.02) - 1 = +2.02% above the baseline's


def _paired_nlls(n: int, seed: int, ar: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Baseline NLLs ~ Gamma(2, 1.5) (mean 3 nats, like a small LM on news) and method = baseline + d, where d has
    mean TRUE_SHIFT, a right skew (a shifted exponential), and lag-k autocorrelation ar**k."""
    g = torch.Generator().manual_seed(seed)
    base = -1.5 * torch.log(torch.rand(n, 2, generator=g, dtype=torch.float64)).sum(dim=1)  # Gamma(2, 1.5): two exponentials
    noise = (-torch.log(torch.rand(n, generator=g, dtype=torch.float64)) - 1.0).tolist()  # Exp(1) - 1: mean 0, variance 1
    d = [noise[0]]
    for e in noise[1:]:  # AR(1), scaled to keep unit variance
        d.append(ar * d[-1] + math.sqrt(1 - ar * ar) * e)
    return base + TRUE_SHIFT + 0.3 * torch.tensor(d, dtype=torch.float64), base


def _coverage(n: int, seeds: int, cfg: BootstrapConfig, ar: float = 0.0) -> float:
    truth = 100 * math.expm1(TRUE_SHIFT)  # exp(E nll_method) / exp(E nll_base) - 1, in percent
    hits = 0
    for seed in range(seeds):
        lo, hi = ppl_delta_ci(*_paired_nlls(n, seed, ar), cfg)
        hits += lo <= truth <= hi
    return hits / seeds


@pytest.mark.parametrize("block", [1, DEFAULT_BLOCK])
def test_95_interval_covers_the_true_ratio_about_95_percent_of_the_time(block):
    # 300 independent data sets: a 95% interval should miss the truth 15 times (binomial sd 3.8 misses); over
    # 1000 other seeds the i.i.d. interval covered 94.5%.
    coverage = _coverage(n=400, seeds=300, cfg=BootstrapConfig(resamples=500, block=block))
    assert 0.90 <= coverage <= 0.99, coverage


def test_block_bootstrap_keeps_coverage_on_autocorrelated_tokens_where_iid_loses_it():
    # With lag-1 correlation 0.6 the variance of the mean is (1 + 0.6) / (1 - 0.6) = 4x the i.i.d. one, so an
    # i.i.d. interval is half as wide as it should be (theory: coverage P(|Z| < 0.98) = 0.67).
    iid = _coverage(n=512, seeds=120, cfg=BootstrapConfig(resamples=400, block=1), ar=0.6)
    block = _coverage(n=512, seeds=120, cfg=BootstrapConfig(resamples=400, block=DEFAULT_BLOCK), ar=0.6)
    assert iid < 0.82, iid  # measured 0.73
    assert block >= 0.85, block  # measured 0.92: blocks of 16 hold all but 0.6**16 of the correlation


def test_interval_shrinks_as_one_over_sqrt_tokens():
    def mean_width(n):
        widths = [hi - lo for lo, hi in (ppl_delta_ci(*_paired_nlls(n, s), BootstrapConfig(resamples=1000)) for s in range(6))]
        return sum(widths) / len(widths)

    ratio = mean_width(500) / mean_width(8000)  # 16x the tokens: sqrt(16) = 4x narrower
    assert 3.3 < ratio < 4.8, ratio


@pytest.mark.parametrize("block", [1, DEFAULT_BLOCK])
def test_identical_nlls_give_a_zero_width_interval_at_zero(block):
    nll, _ = _paired_nlls(300, 0)
    assert ppl_delta_ci(nll, nll.clone(), BootstrapConfig(block=block)) == (0.0, 0.0)


def test_a_constant_shift_gives_exactly_that_ratio():
    """d_t = c for every token: every resample's mean is c, so the interval is the single point exp(c) - 1."""
    _, base = _paired_nlls(300, 1)
    lo, hi = ppl_delta_ci(base + 0.05, base)
    assert lo == pytest.approx(100 * math.expm1(0.05), abs=1e-9) and hi == pytest.approx(lo, abs=1e-9)


def test_reproducible_from_the_seed_and_seed_dependent():
    nll, base = _paired_nlls(300, 2)
    assert ppl_delta_ci(nll, base, BootstrapConfig(seed=3)) == ppl_delta_ci(nll, base, BootstrapConfig(seed=3))
    assert ppl_delta_ci(nll, base, BootstrapConfig(seed=3)) != ppl_delta_ci(nll, base, BootstrapConfig(seed=4))


def test_batching_does_not_change_the_draws(monkeypatch):
    """The resamples are drawn in batches to bound memory; the batch size must not change the interval."""
    from kvpack.eval import stats

    nll, base = _paired_nlls(256, 5)
    whole = ppl_delta_ci(nll, base, BootstrapConfig(resamples=500, block=1))
    monkeypatch.setattr(stats, "_MAX_ELEMENTS", 256 * 7)  # 7 resamples per batch
    batched = ppl_delta_ci(nll, base, BootstrapConfig(resamples=500, block=1))
    # Other draws from the same distribution: the endpoints agree within Monte Carlo error (~3% of the width each).
    width = whole[1] - whole[0]
    assert abs(whole[0] - batched[0]) < 0.1 * width and abs(whole[1] - batched[1]) < 0.1 * width


def test_circular_blocks_are_consecutive_and_every_position_equally_likely():
    idx = resample_indices(10, 20_000, 4, torch.Generator().manual_seed(0))  # [20000, 10]: 3 blocks, the last cut to 2
    assert idx.shape == (20_000, 10)
    steps = (idx[:, 1:] - idx[:, :-1]) % 10
    assert (steps[:, [0, 1, 2, 4, 5, 6, 8]] == 1).all()  # inside a block: the next position, wrapping 9 -> 0
    counts = torch.bincount(idx.flatten(), minlength=10).double()
    assert (counts / counts.mean() - 1).abs().max() < 0.03  # uniform: no position under-drawn, not even the ends


def test_rejects_unpaired_inputs_and_bad_options():
    with pytest.raises(ValueError, match="same length"):
        ppl_delta_ci(torch.zeros(10), torch.zeros(11))
    for kwargs, match in [({"resamples": 1}, "resamples"), ({"level": 1.0}, "level"), ({"block": 0}, "block"), ({"seed": -1}, "seed")]:
        with pytest.raises(ValueError, match=match):
            BootstrapConfig(**kwargs)


@pytest.mark.parametrize("found, total", [(1, 3), (7, 30), (29, 30), (50, 60), (400, 1000)])
def test_wilson_endpoints_solve_the_score_equation(found, total):
    """Wilson's interval is {p : (p_hat - p)^2 <= z^2 p (1 - p) / n}: both endpoints satisfy it with equality."""
    z, p_hat = NormalDist().inv_cdf(0.975), found / total
    for p in wilson_interval(found, total):
        assert (p_hat - p) ** 2 == pytest.approx(z * z * p * (1 - p) / total, rel=1e-9)


def test_wilson_at_the_edges_and_against_scipy():
    z2 = NormalDist().inv_cdf(0.975) ** 2
    assert wilson_interval(0, 20) == (0.0, pytest.approx(z2 / (20 + z2)))  # the score equation at p_hat = 0
    assert wilson_interval(20, 20) == (pytest.approx(20 / (20 + z2)), 1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    stats = pytest.importorskip("scipy.stats")
    ci = stats.binomtest(7, 30).proportion_ci(0.95, method="wilson")
    assert wilson_interval(7, 30) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))


def test_wilson_coverage_is_near_nominal_by_exact_binomial_sums():
    n = 30
    coverage = []
    for p in [i / 20 for i in range(1, 20)]:
        coverage.append(sum(math.comb(n, x) * p**x * (1 - p) ** (n - x) for x in range(n + 1) if _inside(p, wilson_interval(x, n))))
    assert min(coverage) > 0.9 and 0.94 < sum(coverage) / len(coverage) < 0.97, coverage


def _inside(p, interval):
    return interval[0] <= p <= interval[1]


def test_tables_show_the_intervals_and_leave_older_rows_unchanged():
    row = {"method": "m", "status": "ok", "ppl_delta_pct": 1.27, "ppl_delta_ci": [0.81, 1.74], "needle_found": 58, "needle_total": 60,
           "needle_ci": [0.886, 0.991]}
    table = format_table([row])
    assert "+1.27% [+0.8, +1.7]" in table and "58/60 [89-99%]" in table and "ppl delta [95% CI]" in table
    old = {k: v for k, v in row.items() if not k.endswith("_ci")}
    assert "| +1.27% | 58/60 |" in markdown_table([old]) and "CI" not in markdown_table([old])
