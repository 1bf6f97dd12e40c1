"""Property-based tests: every registered method, driven by random update sequences next to transformers'
`DynamicLayer`, keeps the same sequence length, never holds non-finite data it did not receive, and
reads back within its codecs' own error.

Profiles: `ci` (default, a few hundred examples) and `nightly` (10,000), chosen with
`KVPACK_HYPOTHESIS_PROFILE=nightly`.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from kvpack.cache import KVPackLayer
from kvpack.registry import get_method, list_methods

settings.register_profile("ci", max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVPACK_HYPOTHESIS_PROFILE", "ci"))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _NoEnable:
    _attn_implementation = "sdpa"  # the no-enable path: update returns the dequantized cache


def _layer(method: str, head_dim: int) -> KVPackLayer:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return KVPackLayer(get_method(method), 0, _NoEnable(), (inv_freq, 1.0))


@st.composite
def scenarios(draw):
    method = draw(st.sampled_from(list_methods()))
    head_dim = draw(st.sampled_from([16, 32, 48, 64, 80, 128]))
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    pad = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    ops = [("update", draw(st.integers(1, 400)))]
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["update", "decode", "crop", "reorder", "select"]))
        if kind == "update":
            ops.append(("update", draw(st.integers(1, 150))))
        elif kind == "decode":
            ops.append(("decode", draw(st.integers(1, 80))))  # this many single-token steps
        elif kind == "crop":
            ops.append(("crop", -draw(st.integers(1, 300))))
        elif kind == "reorder":
            ops.append(("reorder", draw(st.permutations(range(batch)))))
        else:
            ops.append(("select", draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch, unique=True))))
    seed = draw(st.integers(0, 2**16))
    return method, head_dim, batch, kv_heads, dtype, pad, ops, seed


def _drive(layer: KVPackLayer, ref: DynamicLayer, op, args, gen, shape, dtype) -> tuple[int, int, int]:
    """Apply one operation to both layers; returns the new (batch, kv_heads, head_dim) shape."""
    b, h, d = shape
    if op in ("update", "decode"):
        for n in [args] if op == "update" else [1] * args:
            k = torch.randn(b, h, n, d, generator=gen).to(dtype)
            v = torch.randn(b, h, n, d, generator=gen).to(dtype)
            layer.update(k, v)
            ref.update(k, v)
    elif op == "crop":
        layer.crop(args)
        ref.crop(args)
    elif ref.get_seq_length() == 0:
        pass  # batch operations on an empty cache: transformers' layer keeps a stale batch size, kvpack's resets
    elif op == "reorder":
        idx = torch.tensor([i for i in args if i < b])  # the drawn permutation, restricted to the current batch
        layer.reorder_cache(idx)
        ref.reorder_cache(idx)
    else:
        idx = torch.tensor([i for i in args if i < b])
        if len(idx):
            layer.batch_select_indices(idx)
            ref.batch_select_indices(idx)
            b = len(idx)
    return b, h, d


def _errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """`[mean, worst]` per-vector relative error of `got` against `want`."""
    err = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-6)
    return torch.stack([err.mean(), err.max()]) if err.numel() else torch.zeros(2)


# How far the cache's error may sit above its codecs' own on the same vectors: the mean within 1.2x, the worst vector
# within 1.5x. The worst is a tail statistic of which tokens share a group in codecs that group tokens (KIVI's
# per-channel key groups start where the cache's blocks do: after sinks and padding, after a crop), and one grouping's
# worst vector is up to ~25% above another's at head dim 16 (the nightly profile's counterexamples, kivi:4 in
# bfloat16: 1.21-1.22x); a cache that lost or mixed up tokens is off by far more, in both statistics.
MEAN_SLACK, WORST_SLACK = 1.2, 1.5


@given(scenarios())
def test_cache_follows_dynamic_layer_within_codec_error(scenario):
    method, head_dim, batch, kv_heads, dtype, pad, ops, seed = scenario
    try:
        layer = _layer(method, head_dim)
        get_method(method).key.build(head_dim, kv_heads)
    except ValueError:
        assume(False)  # the method refuses this head size at construction (tested in test_validation)
    gen = torch.Generator().manual_seed(seed)
    ref = DynamicLayer()
    layer.set_padding(torch.tensor(pad))
    shape = (batch, kv_heads, head_dim)
    for op, args in ops:
        shape = _drive(layer, ref, op, args, gen, shape, DTYPES[dtype])
        assert layer.get_seq_length() == ref.get_seq_length()
    if not layer.is_initialized or layer.length == 0:
        return
    keys, values = layer.dequantized()
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert keys.shape == ref.keys.shape and values.shape == ref.values.shape
    # The codecs' own error on the same vectors: the layer's own (fitted) codec objects encoding every token.
    # The cache's operations (windowing, blocks, crop, reorder, select) must add nothing beyond it.
    for side, got, want in (("key", keys, ref.keys), ("value", values, ref.values)):
        (mean, worst), (codec_mean, codec_worst) = _errors(got, want), _codec_error(layer, side, want)
        assert mean <= MEAN_SLACK * codec_mean + 2e-3, (side, float(mean), float(codec_mean))
        assert worst <= WORST_SLACK * codec_worst + 2e-3, (side, float(worst), float(codec_worst))


def _codec_error(layer: KVPackLayer, side: str, x: torch.Tensor) -> torch.Tensor:
    """`[mean, worst]` per-vector error of `layer`'s `side` codecs on `x (b, h, t, d)` (tiled to a whole token multiple),
    each the largest over the side's codecs."""
    worst = torch.zeros(2)
    for name, codec in layer._codecs.items():
        if not name.endswith(side):
            continue
        t = x.shape[2]
        reps = -(-max(t, codec.token_multiple) // codec.token_multiple) * codec.token_multiple // t + 1
        data = x.repeat(1, 1, reps, 1)[:, :, : (t * reps) // codec.token_multiple * codec.token_multiple]
        pos = layer.positions(0, t).repeat(1, reps)[:, : data.shape[2]]
        worst = torch.maximum(worst, _errors(codec.decode(codec.encode(data.float(), pos), pos), data))
    return worst
