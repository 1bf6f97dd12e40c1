"""One codec per batch row: a row of a batch is stored, and read, as it would be in a batch of one.

The reference is the row run alone: a fresh cache (or codec) given that row only. Codecs that learn from the data
(TurboQuant's channel statistics, KVQuant's per-channel levels) used to fit one state pooled over the batch; now each
row's state comes from its own tokens, so a row's codes, state and logits do not depend on its batch mates.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpack
from kvpack.cache.serialize import load_cache, save_cache
from kvpack.codecs.rows import RowsCodec
from kvpack.kernels import table
from kvpack.registry import DEFAULT_METHOD, CodecSpec

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=4096)
# The default without its anchors: anchors are token positions shared by a batch's rows, chosen by the attention the
# rows' queries pay summed over rows (kvpack.cache.anchors), so with them a row reads as alone only up to that choice.
NO_ANCHORS = "turboquant:k3v2+ropemean@window=32"
LEARNING = [NO_ANCHORS, "turboquant:k3v3", "kvquant:3", "subspace:2"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **SMALL)).eval()
    yield m
    kvpack.disable(m)


def _logits(model, ids: torch.Tensor, cache, steps: torch.Tensor) -> torch.Tensor:
    """Prefill, then teacher-forced single tokens; logits `(batch, 1 + steps, vocab)`."""
    out = []
    with torch.no_grad():
        out.append(model(ids, past_key_values=cache).logits[:, -1])
        for t in range(steps.shape[1]):
            out.append(model(steps[:, t : t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out, dim=1)


def _rows(g: int, n: int = 200, b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(g)
    # Rows of different statistics: each row draws from its own slice of the vocabulary.
    ids = torch.stack([torch.randint(1 + 40 * r, 40 + 40 * r, (n,), generator=gen) for r in range(b)])
    return ids, torch.randint(1, 128, (b, 70), generator=gen)


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("method", LEARNING)
def test_a_row_in_a_batch_reads_as_it_does_alone(model, method, enabled):
    ids, steps = _rows(1)
    (kvpack.enable if enabled else kvpack.disable)(model)
    try:
        batched = _logits(model, ids, kvpack.KVCache(model, method), steps)
        alone = torch.cat([_logits(model, ids[r : r + 1], kvpack.KVCache(model, method), steps[r : r + 1]) for r in range(ids.shape[0])])
    finally:
        kvpack.disable(model)
    # The same tokens, the same codes: what is left is float32 rounding of batched against single-row products.
    torch.testing.assert_close(batched, alone, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("method", [DEFAULT_METHOD, *LEARNING[1:]])
def test_each_rows_state_is_fitted_on_that_row(model, method):
    ids, steps = _rows(2)
    cache = kvpack.KVCache(model, method)
    _logits(model, ids, cache, steps)
    layer = cache.layers[1]
    wrapped = [c for c in layer._codecs.values() if isinstance(c, RowsCodec)]
    assert wrapped and all(c.rows == ids.shape[0] for c in wrapped)
    for r in range(ids.shape[0]):
        alone = kvpack.KVCache(model, method)
        _logits(model, ids[r : r + 1], alone, steps[r : r + 1])
        for name, codec in layer._codecs.items():
            mine, ref = codec.inner[r].state_dict() if isinstance(codec, RowsCodec) else codec.state_dict(), alone.layers[1]._codecs[name].state_dict()
            assert mine.keys() == ref.keys() and mine
            for key in ref:
                torch.testing.assert_close(mine[key], ref[key], atol=1e-5, rtol=1e-5, msg=f"{name}.{key} of row {r}")


def test_codecs_that_learn_nothing_stay_one_per_layer(model):
    ids, steps = _rows(3)
    for method in ("int8", "kivi:4", "fp16"):
        cache = kvpack.KVCache(model, method)
        _logits(model, ids, cache, steps[:, :4])
        assert not any(isinstance(c, RowsCodec) for layer in cache.layers for c in layer._codecs.values()), method


def test_a_batch_of_one_gets_plain_codecs(model):
    ids, steps = _rows(4, b=1)
    cache = kvpack.KVCache(model, DEFAULT_METHOD)
    _logits(model, ids, cache, steps[:, :4])
    assert cache.layers[0]._codecs and not any(isinstance(c, RowsCodec) for c in cache.layers[0]._codecs.values())


def test_rows_kernel_entry_agrees_with_the_codecs_math(model):
    """The kernel table's rows entry (each row through its inner entry) against `scores` / `weighted_sum`."""
    ids, steps = _rows(5)
    cache = kvpack.KVCache(model, "turboquant:k3v3")
    _logits(model, ids, cache, steps[:, :4])
    seg = cache.layers[0].segments[0]
    assert seg.key_codec.kernel_kind == "rows"
    q = torch.randn(ids.shape[0], 4, 1, 16, generator=torch.Generator().manual_seed(0))
    m, denom, o = table.segment_partial(q.view(ids.shape[0], 2, 2, 16), seg, 0.25)
    s = seg.key_codec.scores(q, seg.keys) * 0.25  # (b, 4, 1, t)
    ref_m = s.amax(-1, keepdim=True)
    p = (s - ref_m).exp()
    ref_o = seg.value_codec.weighted_sum(p, seg.values)
    torch.testing.assert_close(m.view(ref_m.shape), ref_m, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(denom.view(ref_m.shape), p.sum(-1, keepdim=True), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o.view(ref_o.shape), ref_o, atol=1e-4, rtol=1e-4)


def test_batch_selection_keeps_each_rows_codec(model):
    """After beam-search style reordering and selection, a row still reads through its own state."""
    ids, steps = _rows(6)
    cache = kvpack.KVCache(model, "kvquant:3")
    _logits(model, ids, cache, steps[:, :2])
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    cache.batch_select_indices(torch.tensor([0]))  # old row 2
    after = _logits(model, steps[2:3, 2:3], cache, steps[2:3, 3:6])
    alone = kvpack.KVCache(model, "kvquant:3")
    _logits(model, ids[2:3], alone, steps[2:3, :2])
    ref = _logits(model, steps[2:3, 2:3], alone, steps[2:3, 3:6])
    torch.testing.assert_close(after, ref, atol=2e-4, rtol=2e-4)


def test_a_saved_batch_loads_with_its_rows_codecs(model, tmp_path):
    ids, steps = _rows(7)
    cache = kvpack.KVCache(model, DEFAULT_METHOD)
    _logits(model, ids, cache, steps[:, :2])
    path = tmp_path / "batch.kvpack"
    save_cache(cache, path)
    loaded = load_cache(path, model)
    assert all(isinstance(c, RowsCodec) for c in loaded.layers[0]._codecs.values())
    torch.testing.assert_close(_logits(model, steps[:, 2:3], loaded, steps[:, 3:5]), _logits(model, steps[:, 2:3], cache, steps[:, 3:5]))


def test_rows_codec_refuses_a_batch_of_another_size():
    spec = CodecSpec("turboquant", {"bits": 3, "center": True})
    codec = RowsCodec([spec.build(16, 2), spec.build(16, 2)])
    with pytest.raises(ValueError, match="holds 2 batch rows, got a batch of 3"):
        codec.encode(torch.randn(3, 2, 40, 16))
    with pytest.raises(ValueError, match="share one class and config"):
        RowsCodec([spec.build(16, 2), CodecSpec("turboquant", {"bits": 2, "center": True}).build(16, 2)])


class _Cfg:
    _attn_implementation = "kvpack"


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
@pytest.mark.parametrize("method", ["turboquant:k3v2+ropemean", "turboquant:k3v3", "turboquant:k3v2+ropemean+tcq"])
def test_tq_rows_in_one_call_equal_each_row_through_its_own_entry(monkeypatch, method, backend):
    """TurboQuant's batched rows form (the rows' maps and turning means stacked, one op call) against each row through the
    single-codec entry with its own codecs. Rows are left-padded differently (their segments start at different RoPE
    positions) and their keys carry constant components of different sizes before RoPE, so each row fits its own
    turning pairs, some rows more than others (the stack pads them with zero means)."""
    from kvpack.cache.layer import KVPackLayer
    from kvpack.codecs.base import group_query
    from kvpack.kernels import cpu_lut, ops
    from kvpack.kernels.table import SegmentData
    from kvpack.primitives.rope import apply_rope, rope_cos_sin
    from kvpack.registry import get_method

    if backend == "triton" and not ops.triton_available():
        pytest.skip("Triton is not installed")
    if backend == "cpu" and not cpu_lut.available():
        pytest.skip("CPU kernels unavailable")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops, "_override", ops.Backend(backend))
    gen = torch.Generator().manual_seed(11)
    b, hk, d, n = 3, 2, 64, 4 + 64 * 3 + 17
    pad = torch.tensor([0, 7, 19])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    layer = KVPackLayer(get_method(method), 0, _Cfg(), (inv_freq, 1.0))
    layer.set_padding(pad)
    offset = torch.randn(1, hk, 1, d, generator=gen) * torch.tensor([0.0, 2.0, 6.0])[:, None, None, None]  # row 0: no turning mean
    pos = (torch.arange(n)[None] - pad[:, None]).clamp_min(0)
    cos, sin = rope_cos_sin(pos, inv_freq, 1.0)
    layer.update(apply_rope(offset + torch.randn(b, hk, n, d, generator=gen), cos, sin), torch.randn(b, hk, n, d, generator=gen))
    layer.flush()
    seg = layer.segments[0]
    assert isinstance(seg.key_codec, RowsCodec) and seg.key_codec.rows == b
    q = group_query(torch.randn(b, hk * 3, 1, d, generator=gen), hk)
    first = lambda: layer.first_position(seg.start)  # noqa: E731
    batched = table.segment_partial(q, seg, d**-0.5, first)
    # Triton takes float16 products, and its turning table is as wide as the most pairs any row holds (a row alone: its
    # own), so sums round differently (1e-4 of a row's output seen); a row reading another row's state is off by O(1).
    tol = 2e-3 if backend == "triton" else 1e-5
    assert batched is not None
    for i, (kc, vc) in enumerate(zip(seg.key_codec.inner, seg.value_codec.inner, strict=True)):
        one = SegmentData(kc, vc, seg.keys.map_tensors(lambda t, i=i: t[i : i + 1]), seg.values.map_tensors(lambda t, i=i: t[i : i + 1]))
        alone = table.KERNELS[("tq", "tq")].partial(q[i : i + 1], one, table.Request(d**-0.5, lambda i=i: first()[i : i + 1]))
        for got, want in zip(batched, alone, strict=True):
            torch.testing.assert_close(got[i : i + 1], want, atol=tol, rtol=tol)
