"""Threads: generations in two threads, each with its own cache, on one kvpack-enabled model give the tokens each gives
alone; one cache used by two threads at once raises instead of mixing two sequences into it."""

from __future__ import annotations

import threading

import pytest
import torch

import kvpack
from kvpack.models import tiny_random_model
from kvpack.registry import DEFAULT_METHOD
from kvpack.text import load_text

NEW_TOKENS = 6


def _greedy(model, ids: torch.Tensor, method: str) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, past_key_values=kvpack.KVCache(model, method), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False)[:, ids.shape[1]:]


def _in_threads(fns) -> list:
    results, errors = [None] * len(fns), []
    start = threading.Barrier(len(fns))

    def run(i, fn):
        try:
            start.wait()
            results[i] = fn()
        except BaseException as err:  # reported in the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


@pytest.mark.slow  # loads the real model, as the suite's other real-model tests
def test_two_threads_with_their_own_caches_generate_what_each_generates_alone(eval_smollm2):
    """SmolLM2, the default method, two news prompts past sinks + window + a block (so both caches compress), greedy,
    kvpack attention on."""
    method = DEFAULT_METHOD
    model, tok = eval_smollm2
    text = load_text("news")
    prompts = [tok(text[i : i + 4000], return_tensors="pt").input_ids[:, :150] for i in (0, 20_000)]
    kvpack.enable(model)
    try:
        alone = [_greedy(model, ids, method) for ids in prompts]
        together = _in_threads([lambda ids=ids: _greedy(model, ids, method) for ids in prompts])
    finally:
        kvpack.disable(model)
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)


def test_a_cache_used_by_two_threads_at_once_raises_and_the_first_use_is_intact():
    """Thread A's forward is held inside its first layer while thread B runs a forward through the same cache: B is
    refused with a RuntimeError naming the fix, and A's cache ends as a cache that only A used."""
    model, _ = tiny_random_model(seed=0)
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(0))
    other = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    reference = kvpack.KVCache(model, "turboquant:k3v2")
    with torch.no_grad():
        want = model(ids, past_key_values=reference, use_cache=True).logits
    shared = kvpack.KVCache(model, "turboquant:k3v2")
    a_inside, b_done = threading.Event(), threading.Event()

    def hold(_module, _args):
        if threading.current_thread().name == "A" and not a_inside.is_set():
            a_inside.set()
            assert b_done.wait(60)

    handle = model.model.layers[0].register_forward_pre_hook(hold)
    results: dict = {}

    def a():
        with torch.no_grad():
            results["a"] = model(ids, past_key_values=shared, use_cache=True).logits

    def b():
        assert a_inside.wait(60)
        try:
            with torch.no_grad():
                model(other, past_key_values=shared, use_cache=True)
        except RuntimeError as err:
            results["b"] = err
        finally:
            b_done.set()

    threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        handle.remove()
    assert isinstance(results.get("b"), RuntimeError) and "in use by another thread" in str(results["b"])
    assert "own KVCache" in str(results["b"])
    torch.testing.assert_close(results["a"], want)
    assert shared.get_seq_length() == ids.shape[1]
    with torch.no_grad():  # once A's forward returned, the cache is free again: later use from this thread works
        model(other[:, :1], past_key_values=shared, use_cache=True)
    assert shared.get_seq_length() == ids.shape[1] + 1


def test_a_direct_update_from_another_thread_during_a_forward_is_refused():
    """`cache.update` called outside a model forward claims the cache for the update: another thread holding it refuses."""
    model, _ = tiny_random_model(seed=0)
    cache = kvpack.KVCache(model, "int8")
    assert cache.claim()  # this thread holds it, as a running forward would
    errors = []

    def other():
        try:
            cache.update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), 0)
        except RuntimeError as err:
            errors.append(err)

    t = threading.Thread(target=other)
    t.start()
    t.join(timeout=60)
    cache.release()
    assert len(errors) == 1 and cache.get_seq_length() == 0
    cache.update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), 0)  # free again, and usable
    assert cache.get_seq_length() == 3
