"""Speed measurement bookkeeping (the numbers themselves depend on the machine)."""

import torch
from transformers import DynamicCache

from kvpack.eval.generate import forward, greedy
from kvpack.eval.speed import measure_speed, warmup


def test_prefill_then_decode_counts(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    cache = DynamicCache()
    result = measure_speed(model, eval_tiny_ids[:50], cache, new_tokens=5, progress=False)
    assert cache.get_seq_length() == 55
    assert result.prompt_tokens == 50 and result.new_tokens == 5
    assert result.prefill_tok_s == 50 / result.prefill_s > 0
    assert result.decode_tok_s == 1 / result.decode_step_s > 0


def test_decoding_continues_from_the_probe(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    calls = []

    def probe(cache):
        calls.append(cache.get_seq_length())
        return forward(model, eval_tiny_ids[50:53], cache)

    cache = DynamicCache()
    measure_speed(model, eval_tiny_ids[:50], cache, new_tokens=2, after_prefill=probe, progress=False)
    assert calls == [50] and cache.get_seq_length() == 55


def test_greedy_is_argmax_and_stops_at_eos(eval_tiny, eval_tiny_ids):
    model, _ = eval_tiny
    cache = DynamicCache()
    logits = forward(model, eval_tiny_ids[:20], cache)
    tokens = greedy(model, cache, logits, 4)
    with torch.no_grad():
        full = model(torch.cat([eval_tiny_ids[:20], torch.tensor(tokens[:-1])])[None]).logits[0, 19:]
    assert tokens == full.argmax(-1).tolist()
    assert greedy(model, DynamicCache(), logits, 4, eos_ids={tokens[0]}) == tokens[:1]


def test_warmup_leaves_nothing_behind(eval_tiny):
    caches = []
    warmup(eval_tiny[0], lambda: caches.append(DynamicCache()) or caches[-1], prompt_tokens=8, steps=2)
    assert caches[0].get_seq_length() == 10
