"""Perplexity through the cache vs an independent full-forward cross-entropy; the runner's rows carry the interval."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvpack.eval.perplexity import PerplexityResult, delta, delta_ci, perplexity
from kvpack.eval.runner import EvalConfig, run


def _reference_ppl(model, ids, prefix, n_score):
    """exp(mean CE) from one plain forward without any cache: tokens prefix+1 .. prefix+n_score."""
    with torch.no_grad():
        logits = model(ids[None, : prefix + n_score]).logits[0].double()
    targets = ids[prefix + 1 : prefix + n_score + 1]
    return math.exp(F.cross_entropy(logits[prefix:], targets).item())


@pytest.mark.parametrize("chunk", [1, 32, 1000])
def test_chunked_uncompressed_matches_full_forward(eval_tiny, eval_tiny_ids, chunk):
    model, _ = eval_tiny
    prefix, n_score = 200, 40 if chunk == 1 else 150
    result = perplexity(model, eval_tiny_ids, DynamicCache(), prefix=prefix, chunk=chunk, n_score=n_score, progress=False)
    expected = _reference_ppl(model, eval_tiny_ids, prefix, n_score)
    assert result.tokens == n_score
    assert result.ppl == pytest.approx(expected, rel=1e-4)
    assert result.nll == pytest.approx(math.log(expected), rel=1e-4)


def test_per_token_nlls_match_the_full_forward_token_by_token(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    prefix, n_score = 200, 150
    result = perplexity(model, eval_tiny_ids, DynamicCache(), prefix=prefix, chunk=32, n_score=n_score, progress=False)
    with torch.no_grad():
        logits = model(eval_tiny_ids[None, : prefix + n_score]).logits[0].double()
    expected = F.cross_entropy(logits[prefix:], eval_tiny_ids[prefix + 1 : prefix + n_score + 1], reduction="none")
    assert result.token_nll.shape == (n_score,)
    torch.testing.assert_close(result.token_nll, expected, rtol=1e-4, atol=1e-5)
    assert result.nll == pytest.approx(result.token_nll.mean().item(), rel=1e-12)


def test_scored_tokens_read_the_cache(eval_tiny, eval_tiny_ids):
    """Damaging the prefilled cache must change the score: the protocol reads what the cache holds."""
    model, _ = eval_tiny
    clean = perplexity(model, eval_tiny_ids, DynamicCache(), prefix=200, chunk=50, n_score=100, progress=False)

    def damage(cache):
        for layer in cache.layers:
            layer.values.mul_(-1.0)

    damaged = perplexity(model, eval_tiny_ids, DynamicCache(), prefix=200, chunk=50, n_score=100, after_prefill=damage, progress=False)
    assert abs(damaged.ppl - clean.ppl) / clean.ppl > 1e-3
    lo, hi = delta_ci(damaged, clean)
    assert hi - lo > 0  # a cache that changes the NLLs gets an interval, not a point


def test_the_same_cache_twice_gives_the_zero_interval(eval_tiny, eval_tiny_ids):
    """Same tokens, same uncompressed cache: every per-token difference is 0, so is every resample."""
    runs = [perplexity(eval_tiny[0], eval_tiny_ids, DynamicCache(), prefix=200, chunk=50, n_score=100, progress=False) for _ in range(2)]
    assert delta_ci(*runs) == (0.0, 0.0)


def test_delta_ci_refuses_runs_on_different_tokens(eval_tiny, eval_tiny_ids):
    a = perplexity(eval_tiny[0], eval_tiny_ids, DynamicCache(), prefix=200, chunk=50, n_score=100, progress=False)
    b = perplexity(eval_tiny[0], eval_tiny_ids, DynamicCache(), prefix=300, chunk=50, n_score=100, progress=False)
    with pytest.raises(ValueError, match="same scored tokens"):
        delta_ci(a, b)
    with pytest.raises(ValueError, match="per-token"):
        delta_ci(PerplexityResult(a.ppl, a.nll, a.tokens, a.prefix, a.chunk), a)


def test_after_prefill_sees_exactly_the_prefix(eval_tiny, eval_tiny_ids):
    seen = []
    perplexity(eval_tiny[0], eval_tiny_ids, DynamicCache(), prefix=64, chunk=16, n_score=16, after_prefill=lambda c: seen.append(c.get_seq_length()), progress=False)
    assert seen == [64]


def test_rejects_too_few_tokens(eval_tiny, eval_tiny_ids):
    with pytest.raises(ValueError, match="prefix"):
        perplexity(eval_tiny[0], eval_tiny_ids[:100], DynamicCache(), prefix=64, n_score=36, progress=False)


def test_delta_percent_and_absolute():
    base = PerplexityResult(ppl=20.0, nll=math.log(20.0), tokens=10, prefix=5, chunk=5)
    worse = PerplexityResult(ppl=21.0, nll=math.log(21.0), tokens=10, prefix=5, chunk=5)
    assert delta(worse, base) == pytest.approx((5.0, 1.0))


def test_runner_rows_carry_the_interval_and_the_needle_summary_as_json(eval_tiny):
    model, tok = eval_tiny
    cfg = EvalConfig(model="tiny-random", methods=["kivi:4"], context=192, ppl_tokens=64, chunk=16, needle_lengths=[300],
                     needle_depths=[0.0, 1.0], needle_trials=1, needle_tokens=2, decode_tokens=2, fidelity_steps=2)
    base, row = json.loads(json.dumps(run(model, tok, cfg, progress=False, log=lambda _: None)))  # JSON-ready: no tensors
    assert base["ppl_delta_ci"] == [0.0, 0.0]  # the baseline against itself
    lo, hi = row["ppl_delta_ci"]
    assert lo < hi and "token_nll" not in row and "token_nll" not in base
    assert (row["needle_total"], len(row["needle_cells"])) == (4, 2)  # 1 length x 2 depths x 2 kinds x 1 trial
    assert {k: v["total"] for k, v in row["needle_kinds"].items()} == {"passkey": 2, "fact": 2}
    assert 0.0 <= row["needle_ci"][0] <= row["needle_found"] / 4 <= row["needle_ci"][1] <= 1.0


def test_eval_config_checks_the_grid_and_the_bootstrap():
    for kwargs, match in [({"needle_kinds": ["riddle"]}, "passkey, fact"), ({"needle_trials": 0}, "needle_trials"),
                          ({"ppl_ci_block": 0}, "block"), ({"ppl_ci_resamples": 1}, "resamples")]:
        with pytest.raises(ValueError, match=match):
            EvalConfig(**kwargs)
    assert EvalConfig(context=2048).lengths == [512, 1024, 2048]
    assert EvalConfig().needle_depths == [0.0, 0.25, 0.5, 0.75, 1.0]
