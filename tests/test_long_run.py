"""A long decode: 10,000 steps through a tiny model. Memory grows linearly in tokens (compressed bytes per
token, plus bounded capacity slack), compressed tokens are copied O(1) times each (no copy of the whole
cache per step), step time grows at most linearly with context, and the process's resident memory does
not grow beyond what the cache holds."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpack
from kvpack.cache.blocks import BlockRun

STEPS, PROMPT = 10_000, 200
pytestmark = pytest.mark.slow


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture
def one_thread():
    """One intra-op thread: with two, a busy machine turns every small matmul into OpenMP barrier waits
    (100x slower steps here), which would measure the machine rather than the cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def copied_bytes(monkeypatch):
    """Bytes block runs copy when they grow (the only copies of compressed tokens after they are written)."""
    counter = [0]
    grow = BlockRun._grow

    def counting_grow(self, capacity):
        counter[0] += sum(b[:, :, : self.length].numel() * b.element_size() for b in self._bufs.values())
        grow(self, capacity)

    monkeypatch.setattr(BlockRun, "_grow", counting_grow)
    return counter


@pytest.mark.parametrize("method", ["turboquant:k3v2", "int8"])
def test_ten_thousand_decode_steps(method, one_thread, copied_bytes):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                      num_hidden_layers=1, max_position_embeddings=16_384)  # head_dim 64, as real models
    model = LlamaForCausalLM(cfg).eval()
    cache = kvpack.KVCache(model, method)
    kvpack.enable(model)
    held, rss = [], []
    try:
        with torch.no_grad():
            out = model(torch.randint(0, 128, (1, PROMPT)), past_key_values=cache)
            token = out.logits[:, -1:].argmax(-1)
            for step in range(STEPS):
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
                if step % 500 == 499:
                    held.append((cache.get_seq_length(), cache.memory_report()["total_bytes"]))
                    rss.append(_rss_bytes())
                    assert cache.layers[0].win_k.shape[2] < 64 + 64  # the exact window stays bounded (a block at most extra)
    finally:
        kvpack.disable(model)
    assert cache.get_seq_length() == PROMPT + STEPS
    # Resident memory: after the first checkpoint it grows at most by the cache's growth plus allocator noise.
    growth = rss[-1] - rss[0]
    assert growth <= (held[-1][1] - held[0][1]) + 32 * 2**20, growth
    # Memory: a compressed token costs what the codecs' own encoding of a block costs; held bytes are the
    # exact sinks and window plus that per compressed token, with capacity slack of at most a 32nd plus a block.
    layer = cache.layers[0]
    seg = layer.segments[0]
    probe = torch.randn(1, 2, 64, 64)
    per_token = (seg.key_codec.encode(probe).nbytes() + seg.value_codec.encode(probe).nbytes()) / 64
    exact_per_token = 2 * 2 * 64 * 2  # K and V, 2 kv heads, head_dim 64, fp16
    for tokens, total in held:
        n_exact = layer.sink_k.shape[2] + 64  # sinks plus at least the window (up to a block more)
        compressed = tokens - n_exact
        assert total >= n_exact * exact_per_token + (compressed - 64) * per_token
        assert total <= (n_exact + 64) * exact_per_token + (compressed * 33 / 32 + 64) * per_token
    # No quadratic copy: compressed tokens are copied only when a run grows its capacity, O(1) bytes per token
    # amortized. Growth by a 32nd copies a geometric series of ratio 32/33: at most 32x the run's final size. Until a
    # 32nd is a block (32 blocks) it grows by one block, copying 1 + 2 + ... + 32 = 528 blocks at most.
    final = sum(seg.nbytes() for seg in layer.segments)
    block_bytes = 64 * per_token
    assert copied_bytes[0] <= 32 * final + 528 * block_bytes, (copied_bytes[0], final)
    # Time, measured side by side so that machine noise hits both: a step at 10K context against a step of a
    # cache holding 1K, interleaved. Attention reads 10x the tokens, so at most 10x the time (linear per step).
    short = kvpack.KVCache(model, method)
    kvpack.enable(model)
    try:
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 1000)), past_key_values=short)
            pairs = []
            for _ in range(300):
                t0 = time.perf_counter()
                model(token, past_key_values=cache)
                t1 = time.perf_counter()
                model(token, past_key_values=short)
                pairs.append((t1 - t0, time.perf_counter() - t1))
    finally:
        kvpack.disable(model)
    long_median, short_median = (sorted(p[i] for p in pairs)[150] for i in (0, 1))
    assert long_median < 10 * short_median, (long_median, short_median)
