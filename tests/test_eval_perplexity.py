"""Perplexity through the cache vs an independent full-forward cross-entropy."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvpack.eval.perplexity import PerplexityResult, delta, perplexity


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


def test_scored_tokens_read_the_cache(eval_tiny, eval_tiny_ids):
    """Damaging the prefilled cache must change the score: the protocol reads what the cache holds."""
    model, _ = eval_tiny
    clean = perplexity(model, eval_tiny_ids, DynamicCache(), prefix=200, chunk=50, n_score=100, progress=False)

    def damage(cache):
        for layer in cache.layers:
            layer.values.mul_(-1.0)

    damaged = perplexity(model, eval_tiny_ids, DynamicCache(), prefix=200, chunk=50, n_score=100, after_prefill=damage, progress=False)
    assert abs(damaged.ppl - clean.ppl) / clean.ppl > 1e-3


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
