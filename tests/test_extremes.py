"""Extreme magnitudes in the stream: every registered method, fed finite keys/values from 1e-8 up to fp32's and bf16's
extremes after a normal prompt, either stores them and returns finite K/V, dequantized cache and attention output, or
refuses the update with a ValueError naming the range before storing anything. Never a silent NaN/Inf.

Keys whose norm passes float16's range (entries of 1e4 at d = 64 have norm 8e4) used to come back NaN/inf from
TurboQuant's and QJL's fp16 norms once the window flushed them. The hypothesis profile follows
`KVPACK_HYPOTHESIS_PROFILE` (test_properties.py): a few dozen examples by default, 10,000 with `nightly`.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpack import kernels
from kvpack.attention import fused_decode, segmented_attention
from kvpack.cache import KVPackLayer
from kvpack.codecs.base import FP16_MAX, MAX_ENTRY
from kvpack.registry import get_method, list_methods

# `KVPACK_EXTREMES_EXAMPLES=n` runs n examples (a long run outside the profile's two sizes).
EXAMPLES = int(os.environ.get("KVPACK_EXTREMES_EXAMPLES", 10_000 if os.environ.get("KVPACK_HYPOTHESIS_PROFILE") == "nightly" else 40))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Refusals name the range they enforce: the exact window's float16, the codecs' bound, or non-finite input.
REFUSALS = ("float16 range", "store as finite numbers", "NaN or Inf")
PROMPT = 4 + 64 + 72  # sinks + window + more than a block: the prompt is encoded at once


class _NoEnable:
    _attn_implementation = "sdpa"  # update returns the dequantized cache, and flushes at once


def _layer(method: str, exact: str, head_dim: int) -> KVPackLayer:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return KVPackLayer(get_method(method).with_options(exact_dtype=exact), 0, _NoEnable(), (inv_freq, 1.0))


def _tokens(gen: torch.Generator, n: int, head_dim: int, magnitude: float, dtype: torch.dtype) -> torch.Tensor:
    """`(1, 2, n, d)` entries uniform in [-magnitude, magnitude] (never past it, so bf16's extreme stays finite)."""
    x = (torch.rand(1, 2, n, head_dim, generator=gen, dtype=torch.float64) * 2 - 1) * magnitude
    return x.to(dtype)


def _all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _drive(method: str, dtype: torch.dtype, magnitude: float, exact: str, head_dim: int = 64, seed: int = 0) -> list[str]:
    """A normal prompt, 3 decode steps of entries up to `magnitude`, then a 130-token update that flushes two blocks (the
    prompt's window and one holding the decode steps) to the stream codecs. Every step is either refused cleanly or gives finite K/V; afterwards the dequantized
    cache and attention (torch and fused decode) are finite. Returns the refusals' messages."""
    gen = torch.Generator().manual_seed(seed)
    layer = _layer(method, exact, head_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the no-enable path's dequantize advice
        layer.update(_tokens(gen, PROMPT, head_dim, 1.0, dtype), _tokens(gen, PROMPT, head_dim, 1.0, dtype))
        refusals = []
        for n in (1, 1, 1, 130):
            k, v = _tokens(gen, n, head_dim, magnitude, dtype), _tokens(gen, n, head_dim, magnitude, dtype)
            before = layer.length
            try:
                keys, values = layer.update(k, v)
            except ValueError as err:
                assert any(r in str(err) for r in REFUSALS), str(err)
                assert layer.length == before
                refusals.append(str(err))
                continue
            assert _all_finite(keys, values), f"{method} {dtype} {magnitude:g}: update returned NaN/Inf"
    keys, values = layer.dequantized()
    assert _all_finite(keys, values), f"{method} {dtype} {magnitude:g}: dequantized cache holds NaN/Inf"
    q = torch.randn(1, 4, 1, head_dim, generator=gen)
    out = segmented_attention(layer, q, None, head_dim**-0.5)
    assert _all_finite(out), f"{method} {dtype} {magnitude:g}: attention output NaN/Inf"
    if kernels.available():
        fused = fused_decode(layer, q, head_dim**-0.5)
        assert fused is None or _all_finite(fused), f"{method} {dtype} {magnitude:g}: fused decode NaN/Inf"
    return refusals


# Entries of 1e4 at d = 64: norms of 8e4 past float16, entries inside it (the case that returned NaN before).
@pytest.mark.parametrize("method", list_methods())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norms_past_fp16_range_are_stored_finite(method, dtype):
    assert _drive(method, DTYPES[dtype], 1e4, "float16") == []


@pytest.mark.parametrize("method", list_methods())
@pytest.mark.parametrize("magnitude", [1e-8, 1e6, 1e15, 1e30])
def test_fp32_extremes_with_a_native_window_are_stored_or_refused(method, magnitude):
    refusals = _drive(method, torch.float32, magnitude, "native")
    if magnitude <= FP16_MAX / 10:
        assert refusals == []  # small entries are never refused
    if magnitude > MAX_ENTRY:
        assert len(refusals) == 4  # every extreme update: the codecs cannot square them in float32


@pytest.mark.parametrize("method", list_methods())
def test_bf16_largest_finite_entries_are_refused_not_stored_as_inf(method):
    refusals = _drive(method, torch.bfloat16, float(torch.finfo(torch.bfloat16).max), "native")
    assert len(refusals) == 4


@pytest.mark.parametrize("method", ["turboquant:k3v2", "turboquant:k3v3+qjl", "int8"])
def test_wide_norms_cost_nothing_for_normal_inputs_and_widen_only_their_run(method):
    """Normal entries keep float16 norms/scales (the bytes and fused kernels of the usual layout); a block past fp16's
    range widens its run to float32, read back within the codec's usual error."""
    gen = torch.Generator().manual_seed(1)
    layer = _layer(method, "native", 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        layer.update(_tokens(gen, PROMPT, 64, 1.0, torch.float32), _tokens(gen, PROMPT, 64, 1.0, torch.float32))
        meta = [t.dtype for seg in layer.segments for p in (seg.keys, seg.values) for t in p.tensors() if t.is_floating_point()]
        assert meta and all(t == torch.float16 for t in meta)
        big_k, big_v = _tokens(gen, 130, 64, 1e8, torch.float32), _tokens(gen, 130, 64, 1e8, torch.float32)
        layer.update(big_k, big_v)  # flushes the prompt's window and the first 64 big tokens
    keys, values = layer.dequantized()
    assert any(t.dtype == torch.float32 for t in layer.segments[-1].keys.tensors())
    for got, want in ((keys, big_k), (values, big_v)):
        got, want = got[:, :, PROMPT : PROMPT + 64], want[:, :, :64]
        rel = float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())
        assert rel < 0.6  # the codec's own error at its bit width, not overflow (inf, NaN, or 1.0 from a zero scale)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(list_methods()),
    dtype=st.sampled_from(sorted(DTYPES)),
    exponent=st.floats(-8.0, 38.5),
    exact=st.sampled_from(["float16", "native"]),
    head_dim=st.sampled_from([64, 128]),
    seed=st.integers(0, 2**16),
)
def test_any_finite_magnitude_is_stored_finite_or_refused(method, dtype, exponent, exact, head_dim, seed):
    limit = {"float32": 1e30, "bfloat16": float(torch.finfo(torch.bfloat16).max), "float16": FP16_MAX}[dtype]
    magnitude = min(10.0**exponent, limit)
    assert math.isfinite(magnitude)
    _drive(method, DTYPES[dtype], magnitude, exact, head_dim, seed)
