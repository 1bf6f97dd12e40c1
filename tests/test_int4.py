"""Per-token int4: the codec against an independent float64 quantizer and the 4-bit uniform error bound, its C++
kernel against the op's torch reference (awkward sizes, anchors skipped, capacity views), and a cache decode step
through the kernel table against attention over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from kvpack import attention, kernels
from kvpack.cache.layer import KVPackLayer
from kvpack.codecs.int4 import Int4Codec, Int4Config
from kvpack.kernels import int4, ops, table
from kvpack.registry import get_method

FP16_HALF_ULP = 2.0**-11  # relative rounding of a stored fp16 scale or zero


def _float64_quantizer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head) rows: float64 step (max - min) / 15 and the row's largest magnitude, computed here from x."""
    x = x.double()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return (hi - lo) / 15, torch.maximum(lo.abs(), hi.abs())


@pytest.mark.parametrize("shape,spread", [((2, 3, 217, 96), 1.0), ((1, 2, 33, 64), 40.0), ((1, 1, 5, 2), 1e-3)])
def test_round_trip_error_is_within_half_a_step(shape, spread):
    """Every value lands within half a quantization step of itself, up to the fp16 rounding of the stored scale
    and zero (which can move the ends of the grid by 2**-11 of the row's range and magnitude)."""
    gen = torch.Generator().manual_seed(shape[2])
    x = (torch.randn(shape, generator=gen) * spread + torch.randn(shape[:3] + (1,), generator=gen) * spread).float()
    codec = Int4Codec(Int4Config(), shape[-1], shape[1])
    packed = codec.encode(x)
    err = (codec.decode(packed).double() - x.double()).abs()
    step, mag = _float64_quantizer(x)
    bound = step / 2 * (1 + FP16_HALF_ULP) + FP16_HALF_ULP * (mag + 15 * step) + 1e-7 * mag
    assert bool((err <= bound).all()), (err - bound).max()
    assert packed.codes.shape == (*shape[:3], shape[-1] // 2) and packed.nbytes() == shape[0] * shape[1] * shape[2] * (shape[-1] // 2 + 4)


def test_uniform_data_has_the_uniform_quantizer_mse():
    """Values spread uniformly over each row's range: the error is uniform over half a step either way, so its
    mean square is step**2 / 12 (checked to 5% over 125K values)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 217, 96, generator=gen) * 4 - 2
    codec = Int4Codec(Int4Config(), 96, 3)
    mse = (codec.decode(codec.encode(x)).double() - x.double()).pow(2).mean()
    step, _ = _float64_quantizer(x)
    assert abs(mse / (step**2 / 12).mean() - 1) < 0.05


def test_odd_head_dim_is_refused():
    with pytest.raises(ValueError, match="head_dim must be even"):
        Int4Codec(Int4Config(), 63, 2)


def _segment(b: int, kv: int, t: int, d: int, cap: int, seed: int):
    """Int4 codes of random K/V, sliced to `t` tokens of a `cap`-token buffer (as the cache's capacity views)."""
    gen = torch.Generator().manual_seed(seed)
    codec = Int4Codec(Int4Config(), d, kv)
    k = codec.encode(torch.randn(b, kv, cap, d, generator=gen) * 2)
    v = codec.encode(torch.randn(b, kv, cap, d, generator=gen))
    return [x[:, :, :t] for x in (k.codes, k.scale, k.zero, v.codes, v.scale, v.zero)]


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("b,kv,rows,d,t", [(2, 2, 3, 96, 217), (1, 3, 16, 64, 1100), (3, 1, 1, 128, 513), (1, 2, 7, 8, 1)])
def test_cpp_kernel_matches_the_reference(b, kv, rows, d, t):
    """Awkward sizes (seq 217, head_dim 96, GQA 3: three query rows per kv head), a split boundary (t > 512), anchors
    left out (`skip`) and token-narrowed views: the C++ partial equals the reference's to float32 rounding."""
    seg = _segment(b, kv, t, d, t + 19, seed=t)
    q = torch.randn(b, kv, rows, d, generator=torch.Generator().manual_seed(rows))
    assert ops.implementation("int4_attention", q.device) is ops._CPU_ADAPTERS["int4_attention"]
    for skip in (None, torch.tensor(sorted({0, t // 2, t - 1}))):
        got = int4.int4_attention(q, *seg, d**-0.5, None, 0.0, skip)
        want = int4.int4_attention_reference(q, *seg, d**-0.5, skip=skip)
        for a, e in zip(got, want, strict=True):
            assert (a - e).abs().max() <= 1e-5 * (1 + e.abs().max())


def test_reference_equals_softmax_over_the_decoded_rows():
    """The op's reference against dense float64 attention over the codec's own decode, with anchors removed by hand."""
    b, kv, rows, d, t = 2, 2, 3, 96, 217
    seg = _segment(b, kv, t, d, t, seed=1)
    codec = Int4Codec(Int4Config(), d, kv)
    k = codec.decode(type(codec.encode(torch.zeros(1, kv, 1, d)))(t, *seg[:3])).double()
    v = codec.decode(type(codec.encode(torch.zeros(1, kv, 1, d)))(t, *seg[3:])).double()
    q = torch.randn(b, kv, rows, d, generator=torch.Generator().manual_seed(2))
    skip = torch.tensor([3, 100, 216])
    keep = torch.ones(t, dtype=torch.bool)
    keep[skip] = False
    p = torch.softmax((q.double() @ k[:, :, keep].mT) * d**-0.5, -1)
    m, denom, o = int4.int4_attention_reference(q, *seg, d**-0.5, skip=skip)
    torch.testing.assert_close((o / denom).double(), p @ v[:, :, keep], atol=1e-5, rtol=1e-5)


def test_op_registration():
    seg = _segment(2, 2, 40, 64, 40, seed=3)
    q = torch.randn(2, 2, 4, 64)
    results = torch.library.opcheck(torch.ops.kvpack.int4_attention.default, (q, *seg, 0.125))
    assert all(v == "SUCCESS" for v in results.values()), results


class _Cfg:
    _attn_implementation = "kvpack"


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("anchors", ["", "@anchors=5%"])
def test_cache_decode_equals_attention_over_the_dequantized_cache(monkeypatch, backend, anchors):
    """A decode step over an int4 cache (sinks, segments, window; with anchors, exact copies of some coded tokens whose
    codes the kernel skips) goes through the kernel table's int4 entry, and equals softmax attention over the layer's
    dequantized K/V (the anchors' exact rows in place of their codes)."""
    monkeypatch.setattr(ops, "_override", ops.Backend(backend))
    b, hk, gqa, d, n = 2, 2, 3, 96, 4 + 64 * 3 + 21
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    layer = KVPackLayer(get_method("int4" + anchors), 0, _Cfg(), (inv_freq, 1.0))
    layer.update(torch.randn(b, hk, n, d), torch.randn(b, hk, n, d))
    layer.observe_queries(torch.randn(b, hk * gqa, 64, d), d**-0.5)  # the prompt's queries pick the anchors
    layer.flush()
    layer.update(torch.randn(b, hk, 1, d), torch.randn(b, hk, 1, d))
    q = torch.randn(b, hk * gqa, 1, d)
    assert layer.segments and all(table.lookup(s.key_codec, s.value_codec) is int4.INT4 for s in layer.segments)
    assert (layer.anchors is not None) == bool(anchors)
    k, v = layer.dequantized()
    k, v = k.float().repeat_interleave(gqa, 1), v.float().repeat_interleave(gqa, 1)
    expected = torch.softmax(q @ k.mT * d**-0.5, dim=-1) @ v
    torch.testing.assert_close(attention.fused_decode(layer, q, d**-0.5), expected, atol=2e-4, rtol=1e-3)
