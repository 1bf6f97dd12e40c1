"""Block runs, crop by truncation, all-or-nothing updates, and the fused decode path against the
plain-softmax reference over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from kvpack.attention import fused_decode, segmented_attention
from kvpack.cache import KVPackLayer
from kvpack.cache.blocks import BlockRun
from kvpack.codecs.int8 import Int8Codec, Int8Config
from kvpack.kernels import cpu_lut
from kvpack.registry import get_method


class _Cfg:
    _attn_implementation = "kvpack"


def _layer(method: str, n: int, b: int = 1, hk: int = 2, d: int = 64, seed: int = 0) -> tuple[KVPackLayer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    layer = KVPackLayer(get_method(method), 0, _Cfg(), (inv_freq, 1.0))
    k, v = torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
    layer.update(k, v)
    layer.flush()
    return layer, k, v


def test_block_run_appends_without_copying_earlier_blocks_and_truncates_by_offset():
    codec = Int8Codec(Int8Config(), 64, 2)
    blocks = [codec.encode(torch.randn(1, 2, 64, 64)) for _ in range(20)]
    run = BlockRun(blocks[0])
    for blk in blocks[1:]:
        run.append(blk)
    assert run.length == 20 * 64 and run.blocks == [64 * i for i in range(20)]
    assert torch.equal(run.view().codes, torch.cat([b.codes for b in blocks], dim=2))
    live = sum(b.nbytes() for b in blocks)
    assert live <= run.nbytes() <= live * 33 / 32 + blocks[0].nbytes()  # slack under a 32nd plus a block
    before = run.view().codes[:, :, :300].clone()
    run.truncate(300)
    assert run.length == 300 and torch.equal(run.view().codes, before)


def test_compact_frees_the_slack_and_keeps_the_live_tokens_and_an_earlier_view():
    codec = Int8Codec(Int8Config(), 64, 2)
    blocks = [codec.encode(torch.randn(1, 2, 64, 64)) for _ in range(6)]
    run = BlockRun(blocks[0])
    for blk in blocks[1:4]:  # 256 tokens in buffers grown to 320
        run.append(blk)
    live = sum(b.nbytes() for b in blocks[:4])
    held = run.nbytes()
    earlier = run.view()  # what a rollback snapshot or a running forward may hold
    before = earlier.codes.clone()
    assert held > live and run.compact() == held - live and run.nbytes() == live
    assert torch.equal(run.view().codes, before) and torch.equal(earlier.codes, before)
    assert run.compact() == 0
    for blk in blocks[4:]:  # it grows again from the compacted buffers
        run.append(blk)
    assert torch.equal(run.view().codes, torch.cat([b.codes for b in blocks], dim=2))


@pytest.mark.parametrize("method", ["turboquant:k3v2", "int8", "shard", "kivi:2"])
def test_crop_keeps_compressed_prefix_bit_identical_and_matches_dynamic_semantics(method):
    layer, _, _ = _layer(method, 4 + 64 * 6 + 10)
    for _ in range(70):  # decode tokens: one more block leaves the window
        layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
        layer.flush()
    first = layer.segments[0]
    keep = first.start + first.length - 100  # cut inside the compressed tokens
    before = [t.clone() for t in first.keys.tensors()]
    total = layer.length
    layer.crop(keep - total)
    assert layer.get_seq_length() == keep
    seg = layer.segments[-1]
    mult = seg.token_multiple
    kept = (keep - seg.start) // mult * mult
    for old, new in zip(before, seg.keys.tensors(), strict=True):
        assert torch.equal(new, old[:, :, :kept])  # never decoded and re-encoded
    assert layer.win_k.shape[2] == keep - seg.start - kept  # only a partial group (KIVI) returns to the window
    layer.crop(-10**6)  # more than held: everything goes, sinks included (DynamicLayer semantics)
    assert layer.get_seq_length() == 0 and not layer.segments


def test_crop_on_an_empty_layer_is_a_no_op_and_positive_counts_are_refused():
    layer = KVPackLayer(get_method("int8"), 0, _Cfg())
    layer.crop(-5)
    assert layer.get_seq_length() == 0
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(3)


def test_rejected_update_leaves_the_layer_unchanged():
    layer, _, _ = _layer("turboquant:k3v2", 300)
    before = layer.dequantized()
    length = layer.get_seq_length()
    bad = torch.randn(1, 2, 1, 64)
    bad[0, 0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="nothing was stored"):
        layer.update(bad, torch.randn(1, 2, 1, 64))
    with pytest.raises(TypeError, match="floating point"):
        layer.update(torch.ones(1, 2, 1, 64, dtype=torch.int64), torch.randn(1, 2, 1, 64))
    assert layer.get_seq_length() == length
    after = layer.dequantized()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_an_update_that_attention_never_read_is_a_loud_error():
    layer, _, _ = _layer("int8", 300)
    layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))  # attention (flush) never ran
    with pytest.raises(RuntimeError, match="never read"):
        layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))


@pytest.mark.skipif(not cpu_lut.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("method", ["turboquant:k3v2", "turboquant:k4v4", "turboquant:k3v3", "int8", "int8:rotated", "shard", "kivi:4", "fp16"])
@pytest.mark.parametrize("gqa", [1, 3])
def test_fused_decode_equals_segmented_attention(method, gqa):
    layer, _, _ = _layer(method, 4 + 64 * 9 + 21, b=2)
    for _ in range(65):
        layer.update(torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64))
        layer.flush()
    q = torch.randn(2, 2 * gqa, 1, 64)
    fused = fused_decode(layer, q, 0.125)
    assert fused is not None
    torch.testing.assert_close(fused, segmented_attention(layer, q, None, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not cpu_lut.available(), reason="CPU kernels not built")
def test_fused_decode_declines_multi_token_queries():
    layer, _, _ = _layer("int8", 300)
    assert fused_decode(layer, torch.randn(1, 2, 3, 64), 0.125) is None


def test_values_beyond_fp16_in_the_exact_window_are_refused_not_stored_as_inf():
    layer, _, _ = _layer("int8", 300)
    length = layer.get_seq_length()
    big = torch.randn(1, 2, 1, 64)
    big[0, 1, 0, 0] = 1e5
    with pytest.raises(ValueError, match="float16 range"):
        layer.update(big, torch.randn(1, 2, 1, 64))
    assert layer.get_seq_length() == length
    wide = KVPackLayer(get_method("int8").with_options(exact_dtype="bfloat16"), 0, _Cfg())
    wide.update(big, torch.randn(1, 2, 1, 64))
    assert torch.isfinite(wide.dequantized()[0]).all()
