"""kvpack's custom ops: the torch references against dense math and the codecs, bounded temporaries,
backend dispatch and fallbacks, and registration (`opcheck`, `torch.compile(fullgraph=True)`).

The input builders here are shared with test_triton_kernels.py (which imports them).
"""

# ruff: noqa: I001  (triton_device is imported first, before anything can import triton)
from __future__ import annotations

import functools

import triton_device  # noqa: F401  first: it turns Triton's interpreter on unless KVPACK_TEST_DEVICE=cuda

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvpack.codecs.base import group_query, ungroup
from kvpack.codecs.int8 import Int8Codec, Int8Config, Int8Packed
from kvpack.codecs.kivi import KiviCodec, KiviConfig, KiviPacked
from kvpack.codecs.turboquant import TurboQuantCodec, TurboQuantConfig
from kvpack.kernels import cpu_lut, ops, reference
from kvpack.primitives.lloyd_max import lloyd_max_codebook
from kvpack.primitives.packing import pack_bits, unpack_bits

B, H, T = 3, 2, 217
# Codebooks are the closed-form Gaussian ones: the exact Beta solve costs ~0.1 s per (d, bits) and the
# ops do not depend on which table they read.
PAD = 100  # batch row 1 is left-padded: its first PAD tokens are masked


# -- shared input builders ---------------------------------------------------------------------------
def make_bias(b: int, q_len: int, t: int, masked_row: int | None = None) -> torch.Tensor:
    """`(b, 1, q_len, t)` float32 additive mask: row 1 left-padded by PAD tokens; with q_len > 1 also
    causal (query i sees tokens <= t - q_len + i); `masked_row` masks a whole batch row."""
    bias = torch.zeros(b, 1, q_len, t)
    bias[1, :, :, :PAD] = float("-inf")
    if q_len > 1:
        causal = torch.arange(t)[None, :] > (t - q_len + torch.arange(q_len))[:, None]
        bias = bias.masked_fill(causal, float("-inf"))
    if masked_row is not None:
        bias[masked_row] = float("-inf")
    return bias


def tq_inputs(d: int, rows: int, k_bits: int, v_bits: int, t: int = T, seed: int = 0) -> dict:
    """Random TurboQuant segment + rotated queries, keyword arguments of `tq_attention` (no bias)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q_rot=torch.randn(B, H, rows, d, generator=gen) * 2,
        k_codes=pack_bits(torch.randint(0, 2**k_bits, (B, H, t, d), generator=gen), k_bits),
        k_norm=(torch.rand(B, H, t, 1, generator=gen) * 3 + 0.1).half(),
        k_centroids=lloyd_max_codebook(d, k_bits, "gaussian").centroids,
        k_bits=k_bits,
        v_codes=pack_bits(torch.randint(0, 2**v_bits, (B, H, t, d), generator=gen), v_bits),
        v_norm=(torch.rand(B, H, t, 1, generator=gen) * 3 + 0.1).half(),
        v_centroids=lloyd_max_codebook(d, v_bits, "gaussian").centroids,
        v_bits=v_bits,
        d=d,
        scale=d**-0.5,
    )


def turning_inputs(d: int, rows: int, pairs: int, pos0: tuple[int, ...] = (0, 3000, 200_000), mean: float = 4.0, seed: int = 1) -> dict:
    """`tq_attention`'s `turn_*` arguments: keys centered on a turning mean over `pairs` RoPE pairs per head (distinct,
    unsorted; the second head repeats its last pair with a zero mean, as the codec pads heads with fewer pairs), RoPE's
    frequencies for `d`, and segments starting at the RoPE positions `pos0` (one per batch row; 200K tests the phase
    reduction)."""
    gen = torch.Generator().manual_seed(seed)
    pair = torch.stack([torch.randperm(d // 2, generator=gen)[:pairs] for _ in range(H)])
    mu = torch.randn(H, pairs, 2, generator=gen) * mean
    pair[1, -1], mu[1, -1] = pair[1, 0], 0.0
    return dict(turn_q=torch.randn(B, H, rows, d, generator=gen), turn_pair=pair, turn_mu=mu,
                turn_freq=1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)), turn_pos0=torch.tensor(pos0[:B]))


def int8_inputs(d: int, rows: int, t: int = T, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    codec = Int8Codec(Int8Config(), d, H)
    k, v = codec.encode(torch.randn(B, H, t, d, generator=gen)), codec.encode(torch.randn(B, H, t, d, generator=gen))
    return dict(q=torch.randn(B, H, rows, d, generator=gen), k_codes=k.codes, k_scale=k.scale, v_codes=v.codes, v_scale=v.scale, scale=d**-0.5)


def kivi_inputs(d: int, rows: int, k_bits: int, v_bits: int, v_group: int = 32, t: int = 224, seed: int = 0) -> dict:
    """KIVI keys (per channel, groups of 32 tokens: t a multiple of 32) and values, encoded by the codec."""
    gen = torch.Generator().manual_seed(seed)
    kc = KiviCodec(KiviConfig(k_bits, "channel", 32), d, H)
    vc = KiviCodec(KiviConfig(v_bits, "token", v_group), d, H)
    k = kc.encode(torch.randn(B, H, t, d, generator=gen) + torch.linspace(-2, 2, d))  # per-channel offsets, as real keys
    v = vc.encode(torch.randn(B, H, t, d, generator=gen))
    return dict(q=torch.randn(B, H, rows, d, generator=gen), k_codes=k.codes, k_scale=k.scale, k_zero=k.zero, k_bits=k_bits,
                k_group=32, v_codes=v.codes, v_scale=v.scale, v_zero=v.zero, v_bits=v_bits, v_group=vc.group, scale=d**-0.5)


def dense_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias=None, row_offset=None, softcap=0.0):
    """Unchunked float64 partial softmax over decoded `k (B, H, T, d)`, `v (B, H, T, dv)`."""
    s = q.double() @ k.double().mT
    if row_offset is not None:
        s = s + row_offset.double()
    s = s * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.double().repeat(1, 1, q.shape[2] // bias.shape[2], 1)
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)
    p = torch.exp(s - m)
    return m, p.sum(-1, keepdim=True), p @ v.double()


def assert_partial_close(actual, expected, rtol: float = 1e-5) -> None:
    for name, a, e in zip("mlo", actual, expected, strict=True):
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=rtol * float(e.abs().max()), msg=lambda m, n=name: f"{n}: {m}")


def tq_decode(codes, norm, centroids, bits: int, d: int) -> torch.Tensor:
    return norm.float() * centroids[unpack_bits(codes, bits, d).long()]


# -- references against dense math -------------------------------------------------------------------
@pytest.fixture
def small_chunk(monkeypatch):
    """Chunks of 32 tokens, so 217 tokens take 7 chunks with a ragged last one."""
    monkeypatch.setattr(reference, "TOKEN_CHUNK", 32)


@pytest.mark.parametrize("d,group,q_len", [(64, 1, 1), (96, 7, 1), (128, 4, 3)])
def test_tq_reference_matches_dense(small_chunk, d, group, q_len):
    x = tq_inputs(d, group * q_len, 3, 2)
    bias, offset = make_bias(B, q_len, T, masked_row=2), torch.randn(B, H, group * q_len, 1)
    got = reference.tq_attention(**x, row_offset=offset, bias=bias, softcap=30.0)
    k = tq_decode(x["k_codes"], x["k_norm"], x["k_centroids"], 3, d)
    v = tq_decode(x["v_codes"], x["v_norm"], x["v_centroids"], 2, d)
    assert_partial_close(got, dense_partial(x["q_rot"], k, v, x["scale"], bias, offset, 30.0))
    assert not any(t[2].any() for t in got)  # batch row 2 is fully masked: m = l = o = 0


def turned_means_scores(x: dict, tokens: int) -> torch.Tensor:
    """`<q, RoPE(μ, p_t)>` `(B, H, R, tokens)` from the turning inputs, in float64 with the means written out as full
    `(H, d)` vectors and turned by the rotate-half RoPE at each key position: the dense form of the op's turning term."""
    q, pair, mu, freq, pos0 = (x[k] for k in ("turn_q", "turn_pair", "turn_mu", "turn_freq", "turn_pos0"))
    h, d = pair.shape[0], q.shape[-1]
    full = torch.zeros(h, d, dtype=torch.float64)
    for head in range(h):
        for m, i in enumerate(pair[head].tolist()):
            full[head, i] += mu[head, m, 0].double()
            full[head, i + d // 2] += mu[head, m, 1].double()
    phase = (pos0.double()[:, None] + torch.arange(tokens, dtype=torch.float64))[..., None] * freq  # (B, T, d/2)
    cos, sin = torch.cat([phase.cos()] * 2, -1)[:, None], torch.cat([phase.sin()] * 2, -1)[:, None]  # (B, 1, T, d)
    turned = full[None, :, None] * cos + torch.cat([-full[:, d // 2 :], full[:, : d // 2]], -1)[None, :, None] * sin
    return q.double() @ turned.mT


def test_tq_reference_turning_term_matches_turned_means(small_chunk):
    """The turning-mean term the reference adds equals the query's product with each mean turned to its key's position."""
    d, rows = 64, 3
    x = tq_inputs(d, rows, 3, 2) | turning_inputs(d, rows, 9)
    got = reference.tq_attention(**x)
    k = tq_decode(x["k_codes"], x["k_norm"], x["k_centroids"], 3, d)
    v = tq_decode(x["v_codes"], x["v_norm"], x["v_centroids"], 2, d)
    assert_partial_close(got, dense_partial(x["q_rot"], k, v, x["scale"], row_offset=turned_means_scores(x, T)))


def test_int8_and_kivi_references_match_dense(small_chunk):
    x = int8_inputs(80, 4)
    bias = make_bias(B, 1, T)
    k, v = x["k_codes"].float() * x["k_scale"].float(), x["v_codes"].float() * x["v_scale"].float()
    assert_partial_close(reference.int8_attention(**x, bias=bias), dense_partial(x["q"], k, v, x["scale"], bias))
    y = kivi_inputs(80, 4, 2, 4, v_group=16)
    kc, vc = KiviCodec(KiviConfig(2, "channel", 32), 80, H), KiviCodec(KiviConfig(4, "token", 16), 80, H)
    k = kc.decode(KiviPacked(224, y["k_codes"], y["k_scale"], y["k_zero"]))
    v = vc.decode(KiviPacked(224, y["v_codes"], y["v_scale"], y["v_zero"]))
    bias = make_bias(B, 1, 224)
    assert_partial_close(reference.kivi_attention(**y, bias=bias), dense_partial(y["q"], k, v, y["scale"], bias))


def test_references_bound_temporaries(small_chunk):
    """No float tensor created while attending or encoding exceeds B·H·chunk·max(d, R) elements: never
    a whole segment's (T, d)."""

    class LargestFloat(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                    self.largest = max(self.largest, t.numel())
            return out

    d, rows = 64, 7
    bound = B * H * 32 * max(d, rows)
    x, y, z = tq_inputs(d, rows, 3, 3), int8_inputs(d, rows), kivi_inputs(d, rows, 2, 4)
    xs = torch.randn(B, H, 224, d)
    signs, bounds = torch.ones(H, d), lloyd_max_codebook(d, 3, "gaussian").boundaries
    for run in (
        lambda: reference.tq_attention(**x, bias=make_bias(B, 1, T)),
        lambda: reference.int8_attention(**y),
        lambda: reference.kivi_attention(**z),
        lambda: reference.tq_encode(xs, None, None, signs, bounds, 3),
        lambda: reference.kivi_encode(xs, 2, 32, "channel"),
        lambda: reference.kivi_encode(xs, 4, 32, "token"),
    ):
        with LargestFloat() as mode:
            run()
        assert 0 < mode.largest <= bound < B * H * T * d, f"largest float temporary {mode.largest} > bound {bound}"


def test_empty_segment_is_fully_masked():
    x = tq_inputs(64, 4, 2, 2, t=8)
    x.update({name: x[name][:, :, :0] for name in ("k_codes", "k_norm", "v_codes", "v_norm")})
    m, denom, o = ops.tq_attention(**x)
    assert m.shape == (B, H, 4, 1) and o.shape == (B, H, 4, 64)
    assert not m.any() and not denom.any() and not o.any()


# -- references against the codecs ----------------------------------------------------------------------
def test_tq_attention_matches_codec():
    """Wiring the op into a centered, channel-scaled TurboQuant codec reproduces its scores and weighted
    sums: q_rot = Π(q ⊙ σ), row_offset = q·μ, output unrotated, ⊙ σ, + μ·l."""
    d, group, q_len = 64, 4, 2
    gen = torch.Generator().manual_seed(1)
    k_codec = TurboQuantCodec(TurboQuantConfig(bits=3, codebook="gaussian", center=True, channel_scale=0.5), d, H)
    v_codec = TurboQuantCodec(TurboQuantConfig(bits=2, codebook="gaussian"), d, H)
    keys, values = torch.randn(B, H, T, d, generator=gen) + 1, torch.randn(B, H, T, d, generator=gen)
    kp, vp = k_codec.encode(keys), v_codec.encode(values)
    query = torch.randn(B, H * group, q_len, d, generator=gen)
    scaling, bias = d**-0.5, make_bias(B, q_len, T)

    q = group_query(query, H)
    q_rot = k_codec._rotate(q * k_codec._scale(q.device))
    offset = q @ k_codec._mean(q.device).mT
    _, denom, o = ops.tq_attention(
        q_rot, kp.codes, kp.norm, k_codec.codebook.centroids, 3, vp.codes, vp.norm, v_codec.codebook.centroids, 2, d, scaling, offset, bias
    )
    out = ungroup(v_codec._unrotate(o) / denom, H * group)

    s = k_codec.scores(query, kp) * scaling + bias
    p = torch.softmax(s, -1)
    torch.testing.assert_close(out, v_codec.weighted_sum(p, vp), rtol=1e-4, atol=1e-5)


def test_int8_and_kivi_attention_match_codecs():
    i8, kv = int8_inputs(64, 3), kivi_inputs(64, 3, 2, 4)
    for name, x, k_codec, v_codec, kp, vp, t in (
        ("int8", i8, Int8Codec(Int8Config(), 64, H), Int8Codec(Int8Config(), 64, H),
         Int8Packed(T, i8["k_codes"], i8["k_scale"]), Int8Packed(T, i8["v_codes"], i8["v_scale"]), T),
        ("kivi", kv, KiviCodec(KiviConfig(2, "channel"), 64, H), KiviCodec(KiviConfig(4, "token"), 64, H),
         KiviPacked(224, kv["k_codes"], kv["k_scale"], kv["k_zero"]), KiviPacked(224, kv["v_codes"], kv["v_scale"], kv["v_zero"]), 224),
    ):
        query = ungroup(x["q"], 3 * H)
        bias = make_bias(B, 1, t)
        _, denom, o = getattr(ops, f"{name}_attention")(**x, bias=bias)
        p = torch.softmax(k_codec.scores(query, kp) * x["scale"] + bias, -1)
        torch.testing.assert_close(ungroup(o / denom, 3 * H), v_codec.weighted_sum(p, vp), rtol=1e-4, atol=1e-5, msg=name)


def near_boundary(y: torch.Tensor, boundaries: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """Elements of `y` within `tol` of a codebook boundary: float32 rounding may put them in either cell."""
    return (y.unsqueeze(-1) - boundaries).abs().amin(-1) < tol


def assert_norms_equal_except_ties(norm: torch.Tensor, expected: torch.Tensor) -> None:
    """fp16 norms equal, except a float32 norm on an fp16 rounding midpoint (then one ulp apart)."""
    ulp_apart = (norm.float() - expected.float()).abs() <= torch.finfo(torch.float16).eps * expected.float().abs()
    assert ((norm == expected) | ulp_apart).all() and (norm != expected).float().mean() < 1e-3


def assert_codes_equal_except_ties(codes, expected, y, boundaries, bits: int) -> None:
    """Packed codes equal, except elements within float rounding of a boundary (one level apart)."""
    d = y.shape[-1]
    got, want = unpack_bits(codes, bits, d).long(), unpack_bits(expected, bits, d).long()
    ties = near_boundary(y, boundaries)
    assert ties.float().mean() < 1e-3, "too many near-ties for an exactness test"
    assert ((got == want) | (ties & ((got - want).abs() == 1))).all(), f"{int((got != want).sum())} codes differ"
    clean_rows = ~ties.any(-1)  # rows without a tie must match byte for byte
    assert torch.equal(codes[clean_rows], expected[clean_rows])


def test_tq_encode_matches_codec():
    """The op with the codec's fitted state reproduces `TurboQuantCodec.encode` (x ⊙ 1/σ vs x / σ can
    only move values that sit on a boundary)."""
    d, bits = 128, 3
    codec = TurboQuantCodec(TurboQuantConfig(bits=bits, codebook="gaussian", center=True, channel_scale=0.5), d, H)
    x = torch.randn(B, H, T, d, generator=torch.Generator().manual_seed(2)) * 3 + 1
    codec.fit(x)
    x[0, 1, 7] = codec.mean[1]  # a vector that centers to zero: norm 0, direction 0
    packed = codec.encode(x)
    signs = codec._hadamard_signs(x.device)[:, 0]
    args = (x, codec.mean, 1 / codec.scale, signs, codec.codebook.boundaries, bits)
    norm, codes = ops.tq_encode(*args)
    assert norm[0, 1, 7].item() == 0
    assert_norms_equal_except_ties(norm, packed.norm)
    _, y = reference.tq_rotated_unit(*args[:4])
    assert_codes_equal_except_ties(codes, packed.codes, y, codec.codebook.boundaries, bits)


CPU_ENCODE_CASES = [(8, 1, False, torch.float32, 300), (64, 3, True, torch.float32, 700), (64, 2, False, torch.bfloat16, 1100),
                    (128, 4, True, torch.float16, 90), (256, 3, True, torch.float32, 1100)]  # d, bits, fitted, dtype, tokens


@pytest.mark.skipif(not cpu_lut.available(), reason="the C++ kernels did not build")
@pytest.mark.parametrize("d,bits,fitted,dtype,t", CPU_ENCODE_CASES, ids=[f"d{c[0]}-b{c[1]}-{c[3]}-t{c[4]}" for c in CPU_ENCODE_CASES])
def test_tq_encode_cpu_kernel_matches_reference(d, bits, fitted, dtype, t):
    """The C++ encode (butterflies, one pass per row, rows split across threads above 64) against the torch reference
    (a dense Hadamard matmul): norms equal in fp16 and codes equal except within float rounding of a boundary; a vector
    that centers to zero codes with norm 0; a non-contiguous input (a serving engine's transposed step) is read as is."""
    gen = torch.Generator().manual_seed(d * 7 + bits)
    x = (torch.randn(2, t, H, d, generator=gen) * 2 + 0.5).to(dtype).transpose(1, 2)  # (B, H, T, d), not contiguous
    mean = torch.randn(H, d, generator=gen) if fitted else None
    inv_scale = torch.rand(H, d, generator=gen) + 0.5 if fitted else None
    x[1, 0, 3] = 0 if mean is None else mean[0].to(dtype)
    signs = (torch.randint(0, 2, (H, d), generator=gen) * 2 - 1).float()
    boundaries = lloyd_max_codebook(d, bits, "gaussian").boundaries
    args = (x, mean, inv_scale, signs, boundaries, bits)
    norm, codes = cpu_lut.tq_encode(*args)
    ref_norm, ref_codes = reference.tq_encode(*args)
    assert norm.dtype == torch.float16 and codes.dtype == torch.uint8 and codes.shape == ref_codes.shape == (2, H, t, d * bits // 8)
    if mean is None or dtype == torch.float32:  # a bf16 / fp16 copy of the mean does not center to exactly zero
        assert norm[1, 0, 3].item() == 0
    assert_norms_equal_except_ties(norm, ref_norm)
    _, y = reference.tq_rotated_unit(*args[:4])
    assert_codes_equal_except_ties(codes, ref_codes, y, boundaries, bits)
    assert ops.implementation("tq_encode", torch.device("cpu")) is cpu_lut.tq_encode
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        cpu_lut.tq_encode(torch.randn(1, H, 4, 12), None, None, torch.ones(H, 12), boundaries, bits)

def assert_match_encode(norm, codes, ref_norm, ref_codes, args, centroids) -> None:
    """`tq_encode` with centroids against the reference: codes equal except ties, stored scalars equal (to fp16's
    rounding) on rows without a tie; and, independently of either, every reconstruction norm·c[codes] as long as the
    centered, scaled input x' (the option's contract), to fp16's rounding of the scalar."""
    x, mean, inv_scale, signs, boundaries, bits = args
    _, y = reference.tq_rotated_unit(x, mean, inv_scale, signs)
    d = x.shape[-1]
    got, want, ties = unpack_bits(codes, bits, d).long(), unpack_bits(ref_codes, bits, d).long(), near_boundary(y, boundaries)
    assert ((got == want) | (ties & ((got - want).abs() == 1))).all(), f"{int((got != want).sum())} codes differ"
    clean = ~ties.any(-1, keepdim=True)
    assert clean.float().mean() > 0.9
    assert_norms_equal_except_ties(norm[clean], ref_norm[clean])
    xp = x.float() - (0 if mean is None else mean[None, :, None])
    xp = xp * (1 if inv_scale is None else inv_scale[None, :, None])
    length = norm.float() * centroids[unpack_bits(codes, bits, x.shape[-1]).long()].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(length, xp.norm(dim=-1, keepdim=True), rtol=2 * torch.finfo(torch.float16).eps, atol=1e-6)


MATCH_ENCODE_CASES = [(64, 3, True, 700), (64, 2, False, 300), (128, 4, True, 90), (256, 3, True, 130)]  # d, bits, fitted, tokens


@pytest.mark.skipif(not cpu_lut.available(), reason="the C++ kernels did not build")
@pytest.mark.parametrize("d,bits,fitted,t", MATCH_ENCODE_CASES, ids=[f"d{c[0]}-b{c[1]}-t{c[3]}" for c in MATCH_ENCODE_CASES])
def test_tq_encode_match_cpu_kernel_matches_reference(d, bits, fitted, t):
    """The stored scalar divided by the length of the row's centroids (`norm="match"`), C++ against the torch reference;
    a vector that centers to zero still stores 0."""
    gen = torch.Generator().manual_seed(d * 7 + bits)
    x = (torch.randn(2, H, t, d, generator=gen) * 2 + 0.5)
    mean = torch.randn(H, d, generator=gen) if fitted else None
    inv_scale = torch.rand(H, d, generator=gen) + 0.5 if fitted else None
    x[1, 0, 3] = 0 if mean is None else mean[0]
    signs = (torch.randint(0, 2, (H, d), generator=gen) * 2 - 1).float()
    book = lloyd_max_codebook(d, bits, "gaussian")
    args = (x, mean, inv_scale, signs, book.boundaries, bits)
    norm, codes = cpu_lut.tq_encode(*args, book.centroids)
    ref_norm, ref_codes = reference.tq_encode(*args, book.centroids)
    assert norm[1, 0, 3].item() == 0 and norm.dtype == torch.float16
    assert_match_encode(norm, codes, ref_norm, ref_codes, args, book.centroids)
    plain, _ = cpu_lut.tq_encode(*args)
    # Lloyd-Max centroids fall short of the unit input on average (their length is about sqrt(1 - mse)), though a
    # given row's may be longer: the scalars rise on the mean.
    live = plain.float() > 0
    assert (norm.float()[live] / plain.float()[live]).mean() > 1.0
    with pytest.raises(ValueError, match="centroids"):
        cpu_lut.tq_encode(*args, book.centroids[:-1])


def test_match_codec_stores_the_same_scalar_fused_and_in_torch():
    """A `norm="match"` codec's fused encode (the op given its centroids) and its torch path (codes first, then the
    scalar from their centroids) store the same codes and scalars, except at ties."""
    d, bits = 64, 2
    codec = TurboQuantCodec(TurboQuantConfig(bits=bits, center=True, channel_scale=0.5, norm="match"), d, H)
    x = torch.randn(B, H, 90, d, generator=torch.Generator().manual_seed(6)) * 2 - 1
    codec.fit(x)
    fused = codec.encode(x)
    torch_path = codec._encode_torch(x, codec._mean(x.device))
    assert fused.norm.dtype == torch_path.norm.dtype == torch.float16
    signs = codec._hadamard_signs(x.device)[:, 0]
    _, y = reference.tq_rotated_unit(x, codec.mean, 1 / codec.scale, signs)
    assert_codes_equal_except_ties(fused.codes, torch_path.codes, y, codec.codebook.boundaries, bits)
    clean = ~near_boundary(y, codec.codebook.boundaries).any(-1, keepdim=True)
    torch.testing.assert_close(fused.norm[clean].float(), torch_path.norm[clean].float(), rtol=2e-3, atol=0)


def test_codec_encodes_through_the_op_off_the_cpu_path(monkeypatch):
    """Under the "triton" backend (a GPU's path; here Triton's interpreter, or the CPU fallback it names) an MSE-only
    Hadamard codec encodes through `kvpack::tq_encode`, equal to its torch encode except values on a boundary; a
    QJL codec (the op has no residual stage) keeps its own path."""
    d, bits = 64, 3
    codec = TurboQuantCodec(TurboQuantConfig(bits=bits, codebook="gaussian", center=True, channel_scale=0.5), d, H)
    x = torch.randn(B, H, 70, d, generator=torch.Generator().manual_seed(4)) * 2 - 1
    codec.fit(x)
    expected = codec.encode(x)  # the default backend: the CPU path
    calls, real = [], ops.tq_encode
    monkeypatch.setattr(ops, "tq_encode", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(ops, "_override", ops.Backend.TRITON)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # without the interpreter: the one-line fallback notice
        got = codec.encode(x)
        qjl = TurboQuantCodec(TurboQuantConfig(bits=bits, codebook="gaussian", qjl=True), d, H)
        qjl.encode(x)
    assert len(calls) == 1
    assert_norms_equal_except_ties(got.norm, expected.norm)
    _, y = reference.tq_rotated_unit(x, codec.mean, 1 / codec.scale, codec._hadamard_signs(x.device)[:, 0])
    assert_codes_equal_except_ties(got.codes, expected.codes, y, codec.codebook.boundaries, bits)


@pytest.mark.parametrize("axis,group,bits", [("channel", 32, 2), ("token", 16, 4)])
def test_kivi_encode_matches_codec(axis, group, bits):
    x = torch.randn(B, H, 64, 80, generator=torch.Generator().manual_seed(3)) + torch.linspace(-2, 2, 80)
    packed = KiviCodec(KiviConfig(bits, axis, group), 80, H).encode(x)
    for got, want in zip(ops.kivi_encode(x, bits, group, axis), (packed.codes, packed.scale, packed.zero), strict=True):
        assert torch.equal(got, want)


# -- dispatch --------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Backend override cleared and warnings re-armed, restored afterwards."""
    monkeypatch.setattr(ops, "_override", None)
    monkeypatch.setattr(ops, "_warned", set())
    monkeypatch.delenv("KVPACK_BACKEND", raising=False)
    yield monkeypatch
    ops.set_backend(None)


def test_backend_choice_is_validated(fresh_dispatch):
    assert ops.get_backend() is ops.Backend.AUTO
    fresh_dispatch.setenv("KVPACK_BACKEND", "Torch")
    assert ops.get_backend() is ops.Backend.TORCH
    fresh_dispatch.setenv("KVPACK_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"KVPACK_BACKEND must be one of \('auto', 'torch', 'cpu', 'triton'\)"):
        ops.get_backend()
    ops.set_backend("cpu")  # an explicit choice wins over the environment
    assert ops.get_backend() is ops.Backend.CPU
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.set_backend("gpu")


def test_cpu_dispatch_prefers_the_cpp_kernel(fresh_dispatch):
    """kivi_attention has no C++ kernel: a launcher of that name with the op's parameters would be taken."""
    cpu = torch.device("cpu")
    fresh_dispatch.delattr(cpu_lut, "kivi_attention", raising=False)
    assert ops.implementation("kivi_attention", cpu) is reference.kivi_attention  # no C++ kernel
    fake_kernel = functools.wraps(reference.kivi_attention)(lambda *args: None)  # the op's parameters
    fresh_dispatch.setattr(cpu_lut, "kivi_attention", fake_kernel, raising=False)
    fresh_dispatch.setattr(cpu_lut, "available", lambda: True)
    assert ops.implementation("kivi_attention", cpu) is fake_kernel
    ops.set_backend("torch")
    assert ops.implementation("kivi_attention", cpu) is reference.kivi_attention
    fresh_dispatch.setattr(cpu_lut, "available", lambda: False)  # a failed build: the reference, silently under auto
    ops.set_backend("auto")
    assert ops.implementation("kivi_attention", cpu) is reference.kivi_attention


def test_cpu_kernel_with_other_parameters_is_not_called(fresh_dispatch):
    def other_order(q, k_codes, k_scale, k_zero, k_group, k_bits, v_codes, v_scale, v_zero, v_bits, v_group, scale):
        raise AssertionError("called with the op's arguments in the wrong places")

    fresh_dispatch.setattr(cpu_lut, "kivi_attention", other_order, raising=False)
    fresh_dispatch.setattr(cpu_lut, "available", lambda: True)
    with pytest.warns(RuntimeWarning, match=r"cpu_lut.kivi_attention\(.*\) does not take the op's arguments"):
        assert ops.implementation("kivi_attention", torch.device("cpu")) is reference.kivi_attention


@pytest.mark.parametrize("op", ["tq_attention", "int8_attention"])
def test_cpu_ops_run_the_cpp_kernels(op):
    """On CPU the op runs its C++ kernel through an adapter (the launchers take other arguments), which agrees
    with the reference; masked or softcapped calls, which the kernel cannot take, are the reference's exactly."""
    if not cpu_lut.available():
        pytest.skip("the C++ kernels did not build")
    x = tq_inputs(64, 4, 3, 2) if op == "tq_attention" else int8_inputs(64, 4)
    fn, ref = getattr(ops, op), getattr(reference, op)
    assert ops.implementation(op, torch.device("cpu")) is ops._CPU_ADAPTERS[op]
    if op == "tq_attention":
        x["row_offset"] = torch.randn(B, H, 4, 1)
        kernel = cpu_lut.tq_attention(x["q_rot"], x["row_offset"], x["k_codes"], x["k_norm"], x["k_centroids"], 3, x["v_codes"],
                                      x["v_norm"], x["v_centroids"], 2, x["scale"])
    else:
        kernel = cpu_lut.dense_attention(x["q"], x["k_codes"], x["k_scale"], x["v_codes"], x["v_scale"], x["scale"])
    out = fn(**x)
    for a, e in zip(out, kernel, strict=True):
        assert torch.equal(a, e)
    assert_partial_close(out, ref(**x))
    for extra in ({"bias": make_bias(B, 1, T)}, {"softcap": 4.0}):
        for a, e in zip(fn(**x, **extra), ref(**x, **extra), strict=True):
            assert torch.equal(a, e)
    if op == "tq_attention":  # keys centered on a turning mean: the C++ kernel's phasor tiles against the float64 reference
        turn = turning_inputs(64, 4, 9)
        assert_partial_close(fn(**x, **turn), ref(**x, **turn), rtol=2e-5)
        with pytest.raises(ValueError, match="go together"):
            fn(**x, turn_q=turn["turn_q"])


def test_fallbacks_warn_once(fresh_dispatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fresh_dispatch.delattr(cpu_lut, "kivi_attention", raising=False)
    ops.set_backend("cpu")
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ kernel for kivi_attention"):
        assert ops.implementation("kivi_attention", cpu) is reference.kivi_attention
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        ops.implementation("kivi_attention", cpu)
    ops.set_backend("triton")
    fresh_dispatch.setattr(ops, "triton_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="Triton is not installed"):
        assert ops.implementation("tq_encode", cuda) is reference.tq_encode
    fresh_dispatch.delenv("TRITON_INTERPRET")
    with pytest.warns(RuntimeWarning, match="runs CUDA tensors"):  # the CPU path: the C++ kernel where it builds
        assert ops.implementation("tq_encode", cpu) is (cpu_lut.tq_encode if cpu_lut.available() else reference.tq_encode)


def test_triton_backend_runs_the_interpreter_on_cpu(fresh_dispatch):
    pytest.importorskip("triton", reason="Triton not installed: the interpreter path cannot run")
    from kvpack.kernels import triton_attention

    if not triton_attention.INTERPRETED:  # the kernels themselves are covered by test_triton_kernels.py
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (whole-suite run): no interpreter in this process")
    ops.set_backend("triton")
    x = int8_inputs(64, 4, t=40)
    fn = ops.implementation("int8_attention", torch.device("cpu"))
    assert fn.__module__.endswith("triton_attention")
    exact, low = reference.int8_attention(**x), reference.int8_attention(**x, compute_dtype=torch.float16)
    for out, e, lo in zip(ops.int8_attention(**x), exact, low, strict=True):  # fp16 dot operands: fp16's error at most
        assert (out - e).abs().max() <= 2 * (lo - e).abs().max()


def test_run_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton", reason="Triton not installed")
    from kvpack.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "INTERPRETED", False)  # as if triton was imported without TRITON_INTERPRET=1
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 before triton is first imported"):
        ops.run_triton("int8_attention", **int8_inputs(64, 1, t=8))


# -- registration ------------------------------------------------------------------------------------------
def _op_samples():
    x = tq_inputs(64, 4, 3, 2, t=40)
    tq = (*x.values(), torch.randn(B, H, 4, 1), make_bias(B, 1, 40), 20.0, *turning_inputs(64, 4, 9).values())
    i8 = tuple(int8_inputs(64, 4, t=40).values()) + (make_bias(B, 1, 40),)
    kv = tuple(kivi_inputs(64, 4, 2, 4, t=64).values())
    enc = (torch.randn(B, H, 40, 64), torch.randn(H, 64), torch.rand(H, 64) + 0.5, torch.ones(H, 64), lloyd_max_codebook(64, 3, "gaussian").boundaries, 3)
    kenc = (torch.randn(B, H, 64, 80), 2, 32, "channel")
    pool = torch.randint(0, 255, (6, H, 8, 44), dtype=torch.uint8)
    pool[..., 0:4] = torch.tensor([0, 60, 0, 60], dtype=torch.uint8)  # fp16 norms of 1.0
    paged = (torch.randn(B, H, 4, 64), torch.randn(B, H, 4, 1), pool, torch.tensor([[3, 1, 0], [5, 2, 4], [0, 1, 2]]), torch.zeros(B, dtype=torch.long),
             torch.tensor([20, 13, 7]), [0, 2, 4, 28], lloyd_max_codebook(64, 3, "gaussian").centroids, 3,
             lloyd_max_codebook(64, 2, "gaussian").centroids, 2, 0.125)
    pool8 = torch.randint(0, 255, (6, H, 8, 132), dtype=torch.uint8)
    pool8[..., 0:4] = torch.tensor([0, 36, 0, 36], dtype=torch.uint8)  # fp16 scales of 1/64
    paged8 = (torch.randn(B, H, 4, 64), pool8, *paged[3:6], [0, 2, 4, 68], 0.125)
    parts = [reference.exact_attention(torch.randn(B, H, 4, 64), torch.randn(B, H, 9, 64), torch.randn(B, H, 9, 64), 0.125) for _ in range(2)]
    merge = (torch.randn(B, H, 4, 64), torch.randn(B, H, 7, 64), torch.randn(B, H, 7, 64), 0.125, *(list(x) for x in zip(*parts, strict=True)))
    return {"tq_attention": tq, "int8_attention": i8, "kivi_attention": kv, "tq_encode": enc, "kivi_encode": kenc, "tq_paged_attention": paged,
            "int8_paged_attention": paged8, "exact_merge": merge}


@pytest.mark.parametrize("op", ["tq_attention", "int8_attention", "kivi_attention", "tq_encode", "kivi_encode", "tq_paged_attention",
                                "int8_paged_attention", "exact_merge"])
def test_opcheck(op):
    # opcheck raises on a failure; the result names each check and says whether it passed.
    results = torch.library.opcheck(getattr(torch.ops.kvpack, op).default, _op_samples()[op])
    assert results and all(v == "SUCCESS" for v in results.values()), results


def test_torch_compile_fullgraph():
    samples = _op_samples()

    def step(tq, i8, kv, enc, kenc):
        _, denom, o = torch.ops.kvpack.tq_attention(*tq)
        _, denom2, o2 = torch.ops.kvpack.int8_attention(*i8)
        _, l3, _ = torch.ops.kvpack.kivi_attention(*kv)
        norm, codes = torch.ops.kvpack.tq_encode(*enc)
        kcodes, kscale, _ = torch.ops.kvpack.kivi_encode(*kenc)
        return o / denom + o2 / denom2, l3, norm.float().sum() + codes.sum(), kcodes.sum() + kscale.float().sum()

    args = tuple(samples[op] for op in ("tq_attention", "int8_attention", "kivi_attention", "tq_encode", "kivi_encode"))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # Dynamo + fake tensors, no C++ codegen
    for got, want in zip(compiled(*args), step(*args), strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)  # batch row 1 is fully masked: 0 / 0


def test_exact_merge_is_softmax_attention_over_every_row():
    """`exact_merge`'s reference against plain softmax attention over all rows at once: the exact rows' partial merged with
    partials of the other rows (one of them a part no row attends to) is attention over the union."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, 5, 64, generator=gen)
    chunks = [(torch.randn(B, H, n, 64, generator=gen), torch.randn(B, H, n, 48, generator=gen)) for n in (11, 30, 4)]
    bias = torch.zeros(1, 1, 1, 4).fill_(float("-inf"))  # the last chunk: fully masked
    parts = [reference.exact_attention(q, *chunks[1], 0.125), reference.exact_attention(q, *chunks[2], 0.125, bias)]
    got = reference.exact_merge(q, *chunks[0], 0.125, *(list(x) for x in zip(*parts, strict=True)))
    k, v = torch.cat([c[0] for c in chunks[:2]], 2), torch.cat([c[1] for c in chunks[:2]], 2)
    want = torch.softmax(q @ k.mT * 0.125, -1) @ v
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="same partials"):
        reference.exact_merge(q, *chunks[0], 0.125, [parts[0][0]], [], [])
    # The op on CPU (its C++ kernel when built: the exact rows' partial and the merge in one call), fp32 and fp16 rows,
    # against the same softmax; with no other part it is attention over the exact rows alone.
    if cpu_lut.available():
        assert ops.implementation("exact_merge", torch.device("cpu")) is ops._CPU_ADAPTERS["exact_merge"]
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        rows = [c.to(dtype) for c in chunks[0]]
        exact = torch.cat([rows[0].float(), chunks[1][0]], 2), torch.cat([rows[1].float(), chunks[1][1]], 2)
        want = torch.softmax(q @ exact[0].mT * 0.125, -1) @ exact[1]
        got = ops.run("exact_merge", q, *rows, 0.125, *(list(x) for x in zip(*parts, strict=True)))
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        alone = torch.softmax(q @ rows[0].float().mT * 0.125, -1) @ rows[1].float()
        torch.testing.assert_close(ops.run("exact_merge", q, *rows, 0.125, [], [], []), alone, rtol=tol, atol=tol)
