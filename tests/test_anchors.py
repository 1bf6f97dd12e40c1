"""Anchors: the prompt tokens its own queries attend to most, kept exact beside their codes (kvpack/cache/anchors.py).

Attention over an anchored layer must equal plain attention over the decoded cache with those tokens' original
rows written back, on every decode path (C++ kernels that leave the anchors out, the torch paths that mask them,
the device ops that cancel them); the anchors must follow crop, eviction, batch edits and save/load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvpack
from kvpack import kernels
from kvpack.attention import fused_decode, segmented_attention
from kvpack.cache.layer import KVPackLayer
from kvpack.kernels import cpu_lut
from kvpack.models import tiny_random_model
from kvpack.primitives.attention_mass import most_attended, received_attention
from kvpack.registry import get_method

# Every per-token method (KIVI's channel-grouped keys cannot anchor one token).
ANCHORED = ["turboquant:k3v2", "turboquant:k3v3+qjl", "int8", "shard", "qjl", "kvquant:2", "polarquant-int4", "subspace:2"]


class _Cfg:
    _attn_implementation = "kvpack"


def _anchored_layer(method: str, seed: int = 0, b: int = 2, hk: int = 2, gqa: int = 3, d: int = 64, n: int = 4 + 64 * 5 + 37):
    """A layer holding an `n`-token prompt (4% anchors, chosen from 128 prompt queries) plus one decoded token; the
    prompt's original K/V; a decode query `(b, hk * gqa, 1, d)`. Token 100 is planted where the queries look."""
    torch.manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    layer = KVPackLayer(get_method(f"{method}@anchors=4%"), 0, _Cfg(), (inv_freq, 1.0))
    k, v = torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
    u = torch.nn.functional.normalize(torch.randn(d), dim=0)
    queries = torch.randn(b, hk * gqa, 128, d) + 3 * u  # the queries share a direction ...
    k[:, :, 100] = 20 * u  # ... and token 100 lies along it: about 7 standard deviations above every other score
    layer.update(k, v)
    layer.observe_queries(queries, d**-0.5)
    layer.flush()
    layer.update(torch.randn(b, hk, 1, d), torch.randn(b, hk, 1, d))
    return layer, k, v, torch.randn(b, hk * gqa, 1, d)


def _reference(layer: KVPackLayer, k0: torch.Tensor, v0: torch.Tensor, q: torch.Tensor, scaling: float, upto: int | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Softmax attention over the cache decoded part by part by the codecs, with the anchors' original rows (rounded to
    the exact dtype, as sinks and window are) in place of their codes' decoding: independent of the cache's own paths.
    `upto`: attend to the first `upto` tokens only. `dtype`: the matmuls' operands (float16 gives the error an fp16
    computation of the same attention makes)."""
    ks, vs = [layer.sink_k.float()], [layer.sink_v.float()]
    for seg in layer.segments:
        pos = layer.positions(seg.start, seg.length)
        ks.append(seg.key_codec.decode(seg.keys, pos))
        vs.append(seg.value_codec.decode(seg.values, pos))
    k, v = torch.cat([*ks, layer.win_k.float()], 2), torch.cat([*vs, layer.win_v.float()], 2)
    idx = layer.anchors.index
    k[:, :, idx], v[:, :, idx] = k0[:, :, idx].to(layer.exact_dtype).float(), v0[:, :, idx].to(layer.exact_dtype).float()
    group = q.shape[1] // k.shape[1]
    k, v = k[:, :, :upto].repeat_interleave(group, 1), v[:, :, :upto].repeat_interleave(group, 1)
    p = torch.softmax((q.to(dtype) @ k.to(dtype).mT).float() * scaling, -1)
    return (p.to(dtype) @ v.to(dtype)).float()


@pytest.mark.parametrize("block", [None, 2 * 3 * 12 * 2])  # the whole score block at once, or two query rows at a time
def test_received_attention_equals_explicit_softmax(monkeypatch, block):
    from kvpack.primitives import attention_mass

    if block is not None:
        monkeypatch.setattr(attention_mass, "BLOCK_ELEMENTS", block)
    torch.manual_seed(0)
    b, hq, hk, m, t, d = 2, 6, 2, 5, 12, 8
    q, k = torch.randn(b, hq, m, d), torch.randn(b, hk, t, d)
    first_valid = torch.tensor([0, 3])
    mass = received_attention(q, k, 0.3, first_valid)
    ref = torch.zeros(b, t)
    for row in range(b):
        for h in range(hq):
            for i in range(m):
                seen = torch.arange(first_valid[row], t - m + i + 1)  # real keys up to the query's own token
                p = torch.softmax(k[row, h // (hq // hk), seen] @ q[row, h, i] * 0.3, 0)
                ref[row, seen] += p
    torch.testing.assert_close(mass, ref)
    assert torch.allclose(mass.sum(-1), torch.full((b,), float(hq * m)))  # each query row spends exactly 1


def test_most_attended_takes_the_heaviest_tokens_over_the_batch():
    mass = torch.tensor([[0.0, 5.0, 1.0, 0.0, 4.0], [0.0, 0.5, 9.0, 0.0, 0.5]])
    # Rows normalized first: shares 0/0.5/0.1/0/0.4 and 0/0.05/0.9/0/0.05 -> token 2 (1.0), 1 (0.55), 4 (0.45).
    assert most_attended(mass, 3).tolist() == [1, 2, 4]
    with pytest.raises(ValueError, match="cannot choose"):
        most_attended(mass, 6)


@pytest.mark.parametrize("method", ANCHORED)
def test_anchored_attention_equals_reference_with_original_rows(method):
    layer, k0, v0, q = _anchored_layer(method)
    a = layer.anchors
    n_flushed = sum(seg.length for seg in layer.segments)
    assert a.count == round(0.04 * n_flushed) and 100 in a.index.tolist() and torch.equal(a.index, a.index.sort().values)
    assert torch.equal(a.k, k0[:, :, a.index].to(layer.exact_dtype)) and torch.equal(a.v, v0[:, :, a.index].to(layer.exact_dtype))
    scaling = q.shape[-1] ** -0.5
    ref = _reference(layer, k0, v0, q, scaling)
    outs = {"segmented": segmented_attention(layer, q, None, scaling)}
    outs["ops"] = fused_decode(layer, q, scaling)
    if kernels.available():
        outs["fused"] = fused_decode(layer, q, scaling)
    for path, out in outs.items():
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-3, msg=lambda m, path=path: f"{path}: {m}")
    layer.anchors = None  # the same layer read through its codes only: the anchors must have changed the output
    assert (segmented_attention(layer, q, None, scaling) - ref).abs().max() > 1e-3


def test_prompt_attention_reads_anchors_under_a_causal_mask():
    """A second prefill chunk (several queries, causal inside the window) over an anchored layer."""
    layer, k0, v0, _ = _anchored_layer("turboquant:k3v2")
    layer.flush()
    b, hk, d = k0.shape[0], k0.shape[1], k0.shape[3]
    layer.update(torch.randn(b, hk, 5, d), torch.randn(b, hk, 5, d))
    q = torch.randn(b, hk * 3, 5, d)
    out = segmented_attention(layer, q, None, d**-0.5)
    for i in range(5):  # query i sees the tokens up to its own
        ref = _reference(layer, k0, v0, q[:, :, i : i + 1], d**-0.5, upto=layer.length - 5 + i + 1)
        torch.testing.assert_close(out[:, :, i : i + 1], ref, atol=2e-4, rtol=1e-3)


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("kind", ["tq", "int8", "fp16"])
def test_kernels_skip_exactly_the_listed_tokens(kind):
    """A kernel told to skip tokens equals the same kernel over the other tokens only."""
    torch.manual_seed(1)
    b, h, r, t, d = 2, 3, 4, 700, 64  # two 512-token splits: a skip list across a split boundary
    skip = torch.tensor([0, 37, 511, 512, 699])
    rest = torch.tensor([i for i in range(t) if i not in skip.tolist()])
    q = torch.randn(b, h, r, d)
    if kind == "tq":
        codec = get_method("turboquant:k3v2").key.build(d, h)
        packed = codec.encode(torch.randn(b, h, t, d))
        cent = codec.codebook.centroids

        def call(idx, s):
            return cpu_lut.tq_attention(q, None, packed.codes[:, :, idx], packed.norm[:, :, idx], cent, 3, packed.codes[:, :, idx],
                                        packed.norm[:, :, idx], cent, 3, 0.125, skip=s)
    else:
        dtype = torch.int8 if kind == "int8" else torch.float16
        kk = (torch.randn(b, h, t, d) * 40).to(dtype)
        vv = (torch.randn(b, h, t, d) * 40).to(dtype)
        sc = torch.rand(b, h, t, 1).half() / 40 if kind == "int8" else None

        def call(idx, s):
            scale = None if sc is None else sc[:, :, idx]
            return cpu_lut.dense_attention(q, kk[:, :, idx], scale, vv[:, :, idx], scale, 0.125, skip=s)

    got = call(torch.arange(t), skip)
    want = call(rest, None)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="ascending, distinct"):
        call(torch.arange(t), torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="ascending, distinct"):
        call(torch.arange(t), torch.tensor([t]))


def _feed(layer: KVPackLayer, n: int, planted: int, gqa: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of `n` new tokens `(b, kv, n, d)` whose own queries (the last 128 rows) all look along the direction
    of the chunk's token `planted`; the layer observes them and flushes, as kvpack attention does. Returns the K/V fed."""
    b, hk, d = 2, 2, 64
    u = torch.nn.functional.normalize(torch.randn(d), dim=0)
    k, v = torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
    k[:, :, planted] = 20 * u
    layer.update(k, v)
    layer.observe_queries(torch.randn(b, hk * gqa, n, d) + 3 * u, d**-0.5)
    layer.flush()
    return k, v


def _assert_every_path_exact(layer, k0: torch.Tensor, v0: torch.Tensor, d: int) -> None:
    """A decode step's attention on every path (segmented, custom ops, fused kernels) equals the reference over the
    layer's dequantized cache with every anchor's original rows `k0`, `v0` `(b, kv, t, d)`."""
    q = torch.randn(2, 6, 1, d)
    ref = _reference(layer, k0, v0, q, d**-0.5)
    outs = {"segmented": segmented_attention(layer, q, None, d**-0.5)}
    outs["ops"] = fused_decode(layer, q, d**-0.5)
    if kernels.available():
        outs["fused"] = fused_decode(layer, q, d**-0.5)
    for path, out in outs.items():
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-3, msg=lambda m, path=path: f"{path}: {m}")


def test_later_flushes_keep_anchors_where_their_own_queries_look():
    """After the prompt, each flush keeps the method's fraction of the block it compresses (a fraction of a token owed
    to the next block), ranked by the queries of the forward that flushes it: a second chunk's planted token becomes an
    anchor, and attention over the layer equals the reference with every anchor's original rows."""
    torch.manual_seed(1)
    d = 64
    layer = KVPackLayer(get_method("turboquant:k3v2@anchors=4%"), 0, _Cfg(), (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.0))
    k1, v1 = _feed(layer, 4 + 64 * 4 + 37 + 64, planted=100)
    prompt, (seg,) = layer.anchors.index.tolist(), layer.segments
    assert len(prompt) == round(0.04 * seg.length) and 100 in prompt
    start = seg.start + seg.length
    k2, v2 = _feed(layer, 200, planted=20)  # the window (64) + 200 tokens: three blocks of 64 leave it
    flushed = 192
    later = layer.anchors.index.tolist()[len(prompt) :]
    assert seg.length == start - seg.start + flushed and len(later) == int(0.04 * flushed)
    assert layer.anchor_credit == pytest.approx(0.04 * flushed - len(later))
    assert 361 + 20 in later and all(start <= i < start + flushed for i in later)
    assert layer.fit_queries is None  # a forward's queries are dropped once its flush has used them
    _assert_every_path_exact(layer, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), d)


def test_decode_steps_keep_no_queries_until_a_block_leaves_the_window():
    """After the prompt a decode step's query is held only when its flush will compress a block (no per-step copy)."""
    torch.manual_seed(2)
    d = 64
    layer = KVPackLayer(get_method("turboquant:k3v2@anchors=4%"), 0, _Cfg(), (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.0))
    _feed(layer, 4 + 64 * 4 + 64, planted=100)
    count, held = layer.anchors.count, []
    for _ in range(64):
        layer.update(torch.randn(2, 2, 1, d), torch.randn(2, 2, 1, d))
        layer.observe_queries(torch.randn(2, 6, 1, d), d**-0.5)
        held.append(layer.fit_queries is not None)
        layer.flush()
    assert held == [False] * 63 + [True]  # the 64th step overflows the window by a block
    assert layer.anchors.count == count + int(0.04 * 64)


def test_a_prompt_codec_keeps_later_anchors_in_the_stream_segment():
    """Shard's later blocks go to its stream codec's segment: their anchors are a second part of the layer's anchors
    (the prompt's stay in the prompt's segment), each segment leaves out only its own, and attention over the layer
    equals the reference with every anchor's original rows on every path (segmented, custom ops, fused kernels)."""
    torch.manual_seed(3)
    d = 64
    layer = KVPackLayer(get_method("shard:k3v2@anchors=4%"), 0, _Cfg(), (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.0))
    k1, v1 = _feed(layer, 4 + 64 * 4 + 37 + 64, planted=100)
    prompt = layer.anchors.index.tolist()
    k2, v2 = _feed(layer, 200, planted=20)
    prefill, stream = layer.segments
    assert (prefill.kind, stream.kind) == ("prefill", "stream") and len(layer.anchors.parts) == 2
    later = layer.anchors.index.tolist()[len(prompt) :]
    assert layer.anchors.index.tolist()[: len(prompt)] == prompt and len(later) == int(0.04 * 192)
    assert 361 + 20 in later and all(stream.start <= i < stream.start + stream.length for i in later)
    assert layer.anchors.skip_in(prefill).tolist() == [i - prefill.start for i in prompt]
    assert layer.anchors.skip_in(stream).tolist() == [i - stream.start for i in later]
    _assert_every_path_exact(layer, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), d)
    layer.truncate(stream.start + 10)  # a crop inside the stream keeps the prompt's part whole
    assert layer.anchors.index.tolist() == prompt + [i for i in later if i < stream.start + 10]


@pytest.mark.parametrize("method", ["tiered:256:tq", "tiered:256:shard"])
def test_anchors_follow_their_blocks_into_an_older_tier(method):
    """A block demoted into an older tier is re-encoded there: its anchors keep their exact rows, their codes are
    gathered again from the tier's segment, and each segment leaves out exactly the anchors it holds (the prompt's
    flush routes its oldest tokens straight into the tier, later flushes demote whole blocks), on every path."""
    torch.manual_seed(4)
    d = 64
    rope = (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.0)
    base = get_method(method)
    tier = dataclasses.replace(base.tiers[0], fit_tokens=min(base.tiers[0].fit_tokens, 128))  # a fit on few random tokens
    layer = KVPackLayer(base.with_options(anchors=0.04, window=64, tiers=(tier,)), 0, _Cfg(), rope)
    k1, v1 = _feed(layer, 4 + 64 * 6 + 37, planted=30)  # the planted token goes straight to the tier
    assert [s.kind for s in layer.segments] == ["tier1", "stream"]
    k2, v2 = _feed(layer, 192, planted=10)
    k3, v3 = _feed(layer, 192, planted=100)  # ... and these blocks demote tokens the stream anchored
    archive, warm = layer.segments[0], layer.segments[-1]
    index = layer.anchors.index.tolist()
    assert 30 in index and 4 + 64 * 6 + 37 + 10 in index and index == sorted(index)
    assert any(archive.start <= i < archive.start + archive.length for i in index[1:] if i > 4 + 64 * 6 + 37)  # demoted anchors
    for seg in layer.segments:
        inside = [i - seg.start for i in index if seg.start <= i < seg.start + seg.length]
        skip = layer.anchors.skip_in(seg)
        assert (skip.tolist() if skip is not None else []) == inside, seg.kind
    assert sum(len(p.index) for p in layer.anchors.parts) == len(index)
    _assert_every_path_exact(layer, torch.cat([k1, k2, k3], 2), torch.cat([v1, v2, v3], 2), d)
    assert warm.start + warm.length <= layer.length


def test_crop_drops_anchors_past_the_cut_and_attention_stays_exact():
    layer, k0, v0, q = _anchored_layer("turboquant:k3v2")
    idx = layer.anchors.index.tolist()
    keep = idx[len(idx) // 2] + 1  # keeps the anchors up to the middle one
    layer.truncate(keep)
    assert layer.anchors.index.tolist() == [i for i in idx if i < keep]
    torch.testing.assert_close(segmented_attention(layer, q, None, 0.125), _reference(layer, k0, v0, q, 0.125), atol=2e-4, rtol=1e-3)
    if kernels.available():
        torch.testing.assert_close(fused_decode(layer, q, 0.125), _reference(layer, k0, v0, q, 0.125), atol=2e-4, rtol=1e-3)
    layer.truncate(idx[0])
    assert layer.anchors is None


def test_eviction_drops_the_anchors_it_evicts():
    layer, _, _, _ = _anchored_layer("int8")
    idx = layer.anchors.index.tolist()
    seg = layer.segments[0]
    layer.replace_front(seg, 64)
    layer.note_evicted(seg.start, 64, seg.kind)
    assert layer.anchors.index.tolist() == [i for i in idx if i >= seg.start + 64]
    assert layer.anchors.skip_in(layer.segments[0]).tolist() == [i - layer.segments[0].start for i in idx if i >= seg.start + 64]


def test_memory_counts_the_anchors_bytes():
    layer, _, _, _ = _anchored_layer("turboquant:k3v2")
    a = layer.anchors
    b, hk, h, d = a.k.shape
    codes = sum(t.numel() * t.element_size() for p in a.parts for t in (*p.keys.tensors(), *p.values.tensors()))
    assert layer.memory()["anchors"] == 2 * b * hk * h * d * 2 + h * 8 + codes  # fp16 rows, int64 index, gathered codes


def test_batch_select_keeps_each_rows_anchors():
    layer, k0, v0, q = _anchored_layer("turboquant:k3v2")
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.anchors.k, k0[1:, :, layer.anchors.index].half())
    torch.testing.assert_close(segmented_attention(layer, q[1:], None, 0.125), _reference(layer, k0[1:], v0[1:], q[1:], 0.125),
                               atol=2e-4, rtol=1e-3)


def test_method_names_take_anchors_window_and_seed_suffixes():
    m = get_method("turboquant:k3v2@anchors=0.5%")
    assert m.anchors == 0.005 and m.name == "turboquant:k3v2@anchors=0.5%" and m.window == 64
    w = get_method("turboquant:k3v2@seed=1@window=32@anchors=0.5%")  # any order in, one order out
    assert (w.window, w.anchors, w.key.options["seed"]) == (32, 0.005, 1) and w.name == "turboquant:k3v2@anchors=0.5%@window=32@seed=1"
    assert get_method(w.name) == w
    assert get_method("turboquant:k3v2@anchors=0.005").anchors == 0.005
    both = get_method("turboquant:k3v2@anchors=1%@seed=2")
    assert both == get_method("turboquant:k3v2@seed=2@anchors=1%") and both.anchors == 0.01 and both.key.options["seed"] == 2
    for bad in ("turboquant:k3v2@anchors=30%", "turboquant:k3v2@anchors=x", "turboquant:k3v2@anchors=1%@anchors=2%", "int8@foo=1", "int8@window=x"):
        with pytest.raises(ValueError, match="anchors|suffixes|integer"):
            get_method(bad)


def test_cache_refuses_anchors_on_grouped_codecs():
    model, _ = tiny_random_model(seed=0)
    with pytest.raises(ValueError, match="codes groups of 32 tokens"):
        kvpack.KVCache(model, "kivi:2@anchors=1%")


@torch.no_grad()
def test_generate_with_anchors_matches_the_dequantized_reference_model():
    """End to end on a small model: greedy tokens through kvpack attention over an anchored cache equal those of the same
    model over plain K/V built from the cache after the prompt (decoded codes, anchors' original rows)."""
    model, _ = tiny_random_model(seed=0)
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    cache = kvpack.KVCache(model, "turboquant:k3v2@anchors=2%")
    kvpack.enable(model)
    try:
        logits = model(ids, past_key_values=cache).logits[:, -1]
        assert all(layer.anchors is not None and layer.anchors.count == round(0.02 * 232) for layer in cache.compressed_layers())
        nxt = logits.argmax(-1, keepdim=True)
        step = model(nxt, past_key_values=cache).logits[:, -1]
    finally:
        kvpack.disable(model)
    from transformers import DynamicCache

    plain = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.compressed_layers()):
        k, v = layer.dequantized()  # includes the step's own token, which is exact in the window
        plain.update(k[:, :, :-1], v[:, :, :-1], i)
    ref = model(nxt, past_key_values=plain).logits[:, -1]
    torch.testing.assert_close(step, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("method", ["turboquant:k3v2", "int8", "shard"])
def test_device_ops_leave_the_anchors_codes_out(monkeypatch, backend, method):
    """The CUDA route (the `kvpack::` ops: Triton under its CPU interpreter here, or the torch references), which
    mask the anchors' codes with a bias built from the segment's `skip` offsets."""
    from kvpack.kernels import ops

    if backend == "triton" and not ops.triton_available():
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops, "_override", ops.Backend(backend))
    layer, k0, v0, q = _anchored_layer(method)
    out = fused_decode(layer, q, 0.125)
    expected = _reference(layer, k0, v0, q, 0.125)
    if backend == "triton":  # fp16 tensor-core operands (the kernels' tests bound them by the fp16 reference's error)
        fp16_error = (_reference(layer, k0, v0, q, 0.125, dtype=torch.float16) - expected).abs().max().item()
        assert (out - expected).abs().max().item() <= max(2 * fp16_error, 2e-4)
    else:
        torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-3)


@torch.no_grad()
def test_metrics_count_anchor_bytes_once_and_no_tokens_twice():
    from kvpack.metrics import collect

    model, _ = tiny_random_model(seed=0)
    cache = kvpack.KVCache(model, "turboquant:k3v2@anchors=2%")
    kvpack.enable(model)
    try:
        model(torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(3)), past_key_values=cache)
    finally:
        kvpack.disable(model)
    m = collect(cache)
    held = sum(layer.anchors.nbytes() for layer in cache.compressed_layers())
    assert m.tier("anchors").bytes == held > 0 and m.tier("anchors").fp16_bytes == 0
    assert m.total_bytes == cache.memory_report()["total_bytes"] and cache.memory_report()["segments"]["anchors"] == held
    assert m.fp16_bytes == cache.memory_report()["fp16_bytes"]
