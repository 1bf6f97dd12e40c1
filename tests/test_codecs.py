"""Codecs against independent references: the numerical distortion integral and published figures,
the estimators' proven bias/variance bounds, hand-counted byte layouts, and plain-torch
decode-then-matmul for the compressed-domain attention paths."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.codecs import concat_packed, slice_packed
from kvpack.codecs.kivi import KiviCodec, KiviConfig
from kvpack.codecs.polarquant import PolarQuantCodec, PolarQuantConfig
from kvpack.codecs.qjl import QJLCodec, QJLConfig
from kvpack.codecs.turboquant import TurboQuantCodec, TurboQuantConfig
from kvpack.primitives.lloyd_max import expected_mse
from kvpack.primitives.rope import apply_rope, rope_cos_sin
from kvpack.registry import CodecSpec, get_method

torch.set_num_threads(1)

# (name, options, tokens): every codec option we ship; kivi per-channel needs whole token groups.
CODECS = [
    *[("turboquant", {"bits": b, "qjl": q}, 37) for b in (1, 2, 3, 4) for q in (False, True)],
    ("turboquant", {"bits": 3, "rotation": "hadamard"}, 37),
    ("turboquant", {"bits": 4, "center": True}, 37),
    ("turboquant", {"bits": 3, "center": True, "channel_scale": 1.0}, 37),
    ("turboquant", {"bits": 3, "qjl": True, "center": True, "rotation": "qr"}, 37),
    ("turboquant", {"bits": 2, "qjl": True, "rotation": "hadamard", "codebook": "gaussian"}, 37),
    ("turboquant", {"bits": 2, "center": True, "norm": "unbiased"}, 37),
    ("turboquant", {"bits": 3, "rotation": "hadamard", "channel_scale": 0.5, "center": True, "norm": "match"}, 37),
    ("polarquant-int4", {}, 37),
    ("qjl", {"sketch_ratio": 1}, 37),
    ("qjl", {"sketch_ratio": 2, "n_outliers": 0}, 37),
    ("kivi", {"bits": 2, "axis": "channel"}, 64),
    ("kivi", {"bits": 4, "axis": "channel", "group_size": 16}, 48),
    ("kivi", {"bits": 2, "axis": "token", "group_size": 16}, 37),
    ("kivi", {"bits": 4, "axis": "token"}, 37),
    ("int8_rotated", {"seed": 3}, 37),
    ("heads", {"heads": [1, 0], "codecs": [{"codec": "turboquant", "options": {"bits": 3, "center": True}}, {"codec": "int8", "options": {}}]}, 37),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o, _ in CODECS]


def build(name, options, head_dim=64, kv_heads=2, layer_idx=0):
    return CodecSpec(name, options).build(head_dim, kv_heads, layer_idx)


def unit_sphere(n, d, seed=0):
    x = torch.randn(1, 1, n, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


def storage_bytes(packed) -> int:
    """Bytes of the distinct storages behind the packed tensors (catches views into larger buffers)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed.tensors()}
    return sum(storages.values())


# -- compressed-domain attention equals decode-then-matmul -------------------------------------------
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("name,options,tokens", CODECS, ids=IDS)
def test_scores_and_weighted_sum_match_decode(name, options, tokens, group):
    torch.manual_seed(0)
    d, kv = (80, 2) if options.get("rotation") == "hadamard" else (64, 2)
    codec = build(name, options, d, kv, layer_idx=3)
    x = torch.randn(2, kv, tokens, d) * 2
    packed = codec.encode(x)
    dense = codec.decode(packed)  # (b, kv, t, d)
    q = torch.randn(2, kv * group, 3, d)
    probs = torch.softmax(torch.randn(2, kv * group, 3, tokens), -1)
    # Reference with plain torch: repeat each kv head for its query heads (transformers' repeat_kv).
    k_rep = dense.repeat_interleave(group, dim=1)
    torch.testing.assert_close(codec.scores(q, packed), q @ k_rep.transpose(-1, -2), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(codec.weighted_sum(probs, packed), probs @ k_rep, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name,options,tokens", CODECS, ids=IDS)
def test_blocks_concatenate_and_slice_along_tokens(name, options, tokens):
    codec = build(name, options)
    a, b = torch.randn(1, 2, tokens, 64), torch.randn(1, 2, tokens, 64)
    pa, pb = codec.encode(a), codec.encode(b)
    for t in pa.tensors():  # a heads codec's tensors hold its groups' heads (1 each here)
        assert t.shape[:3] == (1, 1 if name == "heads" else 2, tokens)
    both = concat_packed([pa, pb])
    assert both.num_tokens == 2 * tokens
    torch.testing.assert_close(codec.decode(both), torch.cat([codec.decode(pa), codec.decode(pb)], 2))
    torch.testing.assert_close(codec.decode(slice_packed(both, tokens, 2 * tokens)), codec.decode(pb))


@pytest.mark.parametrize("name,options,tokens", CODECS, ids=IDS)
def test_zero_vectors_roundtrip_to_zero(name, options, tokens):
    codec = build(name, options)
    x = torch.zeros(1, 2, tokens, 64)
    if name == "qjl":
        codec.fit(torch.randn(1, 2, 8, 64))
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize("name,options,tokens", CODECS, ids=IDS)
def test_bad_input_names_the_problem(name, options, tokens):
    codec = build(name, options)
    good = torch.randn(1, 2, tokens, 64)
    for bad, match in [
        (good.clone().index_fill_(2, torch.tensor([0]), float("nan")), "NaN/Inf"),
        (good.clone().index_fill_(2, torch.tensor([0]), float("inf")), "NaN/Inf"),
        (good[0], "rank 3"),
        (torch.randn(1, 2, tokens, 32), "head_dim 32"),
        (torch.randn(1, 3, tokens, 64), "3 kv heads"),
    ]:
        with pytest.raises(ValueError, match=match):
            codec.encode(bad)
    packed = codec.encode(good)
    with pytest.raises(ValueError, match="not a multiple"):
        codec.scores(torch.randn(1, 3, 1, 64), packed)


@pytest.mark.parametrize(
    "config_cls,kwargs,match",
    [
        (TurboQuantConfig, {"bits": 5}, r"bits must be one of \(1, 2, 3, 4\)"),
        (TurboQuantConfig, {"bits": 0}, r"bits must be one of"),
        (TurboQuantConfig, {"rotation": "dct"}, r"rotation must be one of \('auto', 'qr', 'hadamard'\)"),
        (TurboQuantConfig, {"codebook": "uniform"}, r"codebook must be one of"),
        (TurboQuantConfig, {"qjl": 1}, r"qjl must be True or False"),
        (QJLConfig, {"sketch_ratio": 0}, r"sketch_ratio must be a positive number"),
        (QJLConfig, {"n_outliers": -1}, r"n_outliers must be an integer >= 0"),
        (KiviConfig, {"bits": 3}, r"bits must be one of \(2, 4\)"),
        (KiviConfig, {"axis": "head"}, r"axis must be one of \('channel', 'token'\)"),
        (KiviConfig, {"group_size": 0}, r"group_size must be a positive integer"),
    ],
)
def test_bad_config_lists_allowed_values(config_cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        config_cls(**kwargs)


def test_shape_restrictions_are_explained():
    with pytest.raises(ValueError, match="multiple of group_size 32, got 37"):
        KiviCodec(KiviConfig(2, "channel"), 64, 1).encode(torch.randn(1, 1, 37, 64))
    with pytest.raises(ValueError, match="positive integer"):
        QJLCodec(QJLConfig(sketch_ratio=0.3), 64, 1)
    with pytest.raises(ValueError, match="not fitted"):
        QJLCodec(QJLConfig(), 64, 1).sketch(torch.device("cpu"))


def test_registry_methods_build_our_codecs():
    for method in ("turboquant:k3v3", "turboquant:k3v3+qjl", "turboquant:k1v1+qjl", "polarquant-int4", "qjl", "kivi:2", "kivi:4"):
        cfg = get_method(method)
        for spec in (cfg.key, cfg.value):
            codec = spec.build(64, 2)
            x = torch.randn(1, 2, 64, 64)
            assert codec.decode(codec.encode(x)).shape == x.shape


# -- byte layouts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "codec,d,expected",
    [
        # TurboQuant seed layout: 2 B norm + 32 B 2-bit codes + 2 B residual norm + 16 B signs.
        (TurboQuantCodec(TurboQuantConfig(3, qjl=True), 128, 1), 128, 52),
        (TurboQuantCodec(TurboQuantConfig(3), 64, 1), 64, 24 + 2),  # 3-bit codes not padded to 4
        (TurboQuantCodec(TurboQuantConfig(4), 128, 1), 128, 64 + 2),
        (TurboQuantCodec(TurboQuantConfig(1, qjl=True), 64, 1), 64, 2 + 0 + 2 + 8),
        (PolarQuantCodec(PolarQuantConfig(), 128, 1), 128, 64 + 4),  # fp32 scale, as in the design
        (QJLCodec(QJLConfig(2, n_outliers=4), 128, 1), 128, 32 + 2 + 8),
        (KiviCodec(KiviConfig(2, "channel"), 128, 1), 128, 32 + 2 * 2 * 128 // 32),
        (KiviCodec(KiviConfig(2, "token"), 128, 1), 128, 32 + 2 * 2 * 128 // 32),
        (KiviCodec(KiviConfig(4, "token"), 64, 1), 64, 32 + 2 * 2 * 64 // 32),
    ],
)
def test_nbytes_matches_hand_count_and_real_storage(codec, d, expected):
    packed = codec.encode(torch.randn(2, 1, 64, d))
    assert codec.nbytes(packed) == expected * 2 * 64
    assert codec.nbytes(packed) == storage_bytes(packed)


def test_rotations_built_once_and_reproducible_per_layer_head():
    a = TurboQuantCodec(TurboQuantConfig(3, rotation="qr"), 64, 4, layer_idx=2)
    x = torch.randn(1, 4, 10, 64)
    rot = a.rotation(x.device)
    a.encode(x)
    assert a.rotation(x.device) is rot and rot.shape == (4, 64, 64)
    assert len({tuple(r[0, :3].tolist()) for r in rot}) == 4  # distinct per head
    b = TurboQuantCodec(TurboQuantConfig(3, rotation="qr"), 64, 4, layer_idx=2)
    assert torch.equal(b.encode(x).codes, a.encode(x).codes)
    c = TurboQuantCodec(TurboQuantConfig(3, rotation="qr"), 64, 4, layer_idx=5)
    assert not torch.equal(c.rotation(x.device), rot)
    assert a.state_nbytes() == 4 * 64 * 64 * 4


def test_auto_rotation_is_fwht_hadamard_holding_only_signs():
    x = torch.randn(1, 4, 10, 64)
    auto = TurboQuantCodec(TurboQuantConfig(3), 64, 4, layer_idx=2)
    assert auto.rotation_kind == "hadamard"
    packed = auto.encode(x)
    assert auto.state_nbytes() == 4 * 64 * 4  # one ±1 vector per head, no dense matrix
    dense = auto.rotation(x.device)  # the same map as an explicit matrix, built independently
    torch.testing.assert_close(auto._rotate(x), x @ dense.mT, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense @ dense.mT, torch.eye(64).expand(4, 64, 64), atol=1e-5, rtol=0)
    explicit = TurboQuantCodec(TurboQuantConfig(3, rotation="hadamard"), 64, 4, layer_idx=2)
    assert torch.equal(explicit.encode(x).codes, packed.codes)
    assert TurboQuantCodec(TurboQuantConfig(3), 96, 1).rotation_kind == "qr"


# -- distortion against theory -----------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
def test_turboquant_mse_matches_numerical_optimum(d):
    x = unit_sphere(12_000, d, seed=d)
    for bits in (1, 2, 3, 4):
        codec = TurboQuantCodec(TurboQuantConfig(bits), d, 1)
        mse = (codec.decode(codec.encode(x)) - x).pow(2).sum(-1).mean().item()
        assert mse == pytest.approx(expected_mse(d, bits), rel=0.02)
        assert mse < math.sqrt(3) * math.pi / 2 * 4.0**-bits  # Theorem 1 upper bound


def test_turboquant_mse_large_dim_matches_published():
    # TurboQuant §3.1: for large d the distortion tends to 0.363, 0.117, 0.03, 0.009 (Gaussian Lloyd-Max).
    x = unit_sphere(1500, 1024, seed=1)
    for bits, published in zip((1, 2, 3, 4), (0.3634, 0.1175, 0.03454, 0.009497), strict=True):
        codec = TurboQuantCodec(TurboQuantConfig(bits, codebook="gaussian"), 1024, 1)
        mse = (codec.decode(codec.encode(x)) - x).pow(2).sum(-1).mean().item()
        assert mse == pytest.approx(published, rel=0.02)


def test_polarquant_renormalized_distortion():
    # Renormalizing centroids to the unit sphere can only help on unit vectors... up to ±2% of the
    # plain 4-bit optimum; and the reconstruction norm is the input norm (fp32 scale).
    x = unit_sphere(8000, 128, seed=5) * 3.0
    codec = PolarQuantCodec(PolarQuantConfig(), 128, 1)
    xh = codec.decode(codec.encode(x))
    torch.testing.assert_close(xh.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)
    mse = ((xh - x).pow(2).sum(-1) / 9).mean().item()
    assert mse < expected_mse(128, 4, "gaussian") * 1.02


# -- inner-product estimators: bias and variance ----------------------------------------------------
def _pairs(d, heads, n, rho=0.6, seed=0):
    """Unit keys and unit queries with <q, k> = rho exactly, rotation-invariant jointly."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, heads, n, d, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True)
    u = torch.randn(1, heads, n, d, generator=gen)
    u = u - (u * k).sum(-1, keepdim=True) * k
    u = u / u.norm(dim=-1, keepdim=True)
    return rho * k + math.sqrt(1 - rho**2) * u, k


def _paired_errors(codec, q, k, true=0.6):
    s = codec.scores(q, codec.encode(k))  # (1, heads, n, n): row i of head h vs key i of head h
    est = torch.diagonal(s, dim1=-2, dim2=-1)
    return (est - true).flatten().double()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_turboquant_prod_unbiased_with_bounded_variance(bits):
    d, heads, n = 128, 128, 160  # 20480 pairs over 128 independent (rotation, sketch) draws
    q, k = _pairs(d, heads, n, seed=bits)
    err = _paired_errors(TurboQuantCodec(TurboQuantConfig(bits, qjl=True), d, heads), q, k)
    se = err.std().item() / math.sqrt(err.numel())
    assert abs(err.mean().item()) < 3 * se
    assert err.pow(2).mean().item() <= math.sqrt(3) * math.pi**2 / d * 4.0**-bits  # Theorem 2, ||y|| = 1


@pytest.mark.parametrize("bits", [1, 3])
def test_turboquant_mse_stage_shrinks_inner_products(bits):
    # The MSE quantizer is biased for inner products: E<q, k̂> = (1 - mse) <q, k> (centroid condition).
    d, heads, n = 128, 128, 160
    q, k = _pairs(d, heads, n, seed=10 + bits)
    err = _paired_errors(TurboQuantCodec(TurboQuantConfig(bits), d, heads), q, k)
    se = err.std().item() / math.sqrt(err.numel())
    assert err.mean().item() < -20 * se
    assert err.mean().item() == pytest.approx(-0.6 * expected_mse(d, bits), rel=0.1)


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_turboquant_unbiased_norm_removes_the_shrink(bits):
    # norm="unbiased" stores ||x|| / <u, c>: the reconstruction's component along k is k itself, so <q, k̂> is unbiased
    # (the MSE stage alone is off by -mse·<q, k>, the test above) and its error is the orthogonal part only, of squared
    # length mse / (1 - mse) per unit vector, isotropic over the other d - 1 directions.
    d, heads, n = 128, 128, 160
    q, k = _pairs(d, heads, n, seed=30 + bits)
    err = _paired_errors(TurboQuantCodec(TurboQuantConfig(bits, norm="unbiased"), d, heads), q, k)
    se = err.std().item() / math.sqrt(err.numel())
    assert abs(err.mean().item()) < 3 * se
    mse = expected_mse(d, bits)
    assert err.pow(2).mean().item() == pytest.approx((1 - 0.6**2) * mse / (1 - mse) / (d - 1), rel=0.1)


def test_turboquant_match_norm_keeps_each_vector_length():
    # norm="match" stores ||x|| / ||c||: every reconstruction as long as its input (to fp16's rounding of the scalar),
    # the shrink along x cut to sqrt(1 - mse) of the input's length from 1 - mse, and no more error than the paper's norm.
    d = 128
    x = unit_sphere(6000, d, seed=4) * torch.linspace(0.5, 40.0, 6000)[:, None]
    for bits in (2, 3):
        plain = TurboQuantCodec(TurboQuantConfig(bits), d, 1)
        match = TurboQuantCodec(TurboQuantConfig(bits, norm="match"), d, 1)
        xh, xp = match.decode(match.encode(x)), plain.decode(plain.encode(x))
        torch.testing.assert_close(xh.norm(dim=-1), x.norm(dim=-1), rtol=1e-3, atol=0)
        along = ((xh * x).sum(-1) / x.square().sum(-1)).mean().item()
        assert along == pytest.approx(math.sqrt(1 - expected_mse(d, bits)), abs=0.005)
        rel = lambda y: ((y - x).square().sum(-1) / x.square().sum(-1)).mean().item()  # noqa: E731
        assert rel(xh) <= rel(xp) * 1.03


def test_turboquant_norm_option_is_checked():
    with pytest.raises(ValueError, match=r"norm must be one of \('input', 'match', 'unbiased'\)"):
        TurboQuantConfig(3, norm="preserve")
    with pytest.raises(ValueError, match="use norm='input' with qjl"):
        TurboQuantConfig(3, qjl=True, norm="unbiased")
    both = get_method("turboquant:k3v2+ropemean+unbiased")
    assert both.key.options["norm"] == both.value.options["norm"] == "unbiased"
    values = get_method("turboquant:k3v2+matchv")
    assert "norm" not in values.key.options and values.value.options["norm"] == "match"
    with pytest.raises(ValueError, match="turboquant takes"):
        get_method("turboquant:k3v3+qjl+unbiased")


@pytest.mark.parametrize("ratio", [1, 2])
def test_qjl_unbiased_with_bounded_variance(ratio):
    d, heads, n = 128, 128, 160
    q, k = _pairs(d, heads, n, seed=20 + ratio)
    err = _paired_errors(QJLCodec(QJLConfig(ratio, n_outliers=0), d, heads), q, k)
    se = err.std().item() / math.sqrt(err.numel())
    assert abs(err.mean().item()) < 3 * se
    assert err.pow(2).mean().item() <= math.pi / (2 * ratio * d)  # Lemma 3.5 variance, unit q and k


def test_qjl_outlier_channels_are_found_and_cut_the_error():
    d, heads, n = 128, 4, 256
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(1, heads, n, d, generator=gen)
    planted = torch.tensor([[3, 40, 77, 120], [0, 1, 2, 127], [10, 20, 30, 40], [5, 6, 90, 91]])
    k.scatter_(-1, planted[None, :, None, :].expand(1, heads, n, 4), 20 * torch.randn(1, heads, n, 4, generator=gen))
    q = torch.randn(1, heads, 16, d, generator=gen)
    exact = q @ k.mT
    errors = {}
    for n_out in (0, 4):
        codec = QJLCodec(QJLConfig(2, n_outliers=n_out), d, heads)
        errors[n_out] = (codec.scores(q, codec.encode(k)) - exact).pow(2).mean().item()
    assert torch.equal(codec.outlier_idx, planted)
    assert errors[4] < errors[0] / 5


def _sylvester(d: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix, built by doubling [[H, H], [H, -H]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def test_rotated_int8_spreads_an_outlier_channel_and_reads_back_through_its_rotation():
    """One channel 40x the others sets a plain int8 token's scale; rotated first, the same bytes hold the token ~100x
    more closely (MSE). The codes are per-token int8 of x·diag(signs)·H, read back by H·diag(signs)."""
    x = torch.randn(1, 2, 200, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64).float()
    x[..., 5] *= 40
    rotated, plain = build("int8_rotated", {"seed": 3}, layer_idx=2), build("int8", {})
    packed = rotated.encode(x)
    signs, h = rotated.signs.double()[None, :, None], _sylvester(64)
    rot = (x.double() * signs) @ h
    scale = rot.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(packed.scale.double(), scale, rtol=1e-3)
    codes = packed.codes.double()
    assert ((codes - rot / packed.scale.double()).abs() <= 0.5 + 1e-3).all()  # rounding, within half a level
    want = ((codes * packed.scale.double()) @ h) * signs
    torch.testing.assert_close(rotated.decode(packed).double(), want, rtol=1e-5, atol=1e-5)
    err = lambda y: ((y.double() - x.double()).square().sum() / x.double().square().sum()).item()  # noqa: E731
    assert err(rotated.decode(packed)) * 30 < err(plain.decode(plain.encode(x)))
    assert rotated.nbytes(packed) == plain.nbytes(plain.encode(x))  # the same bytes
    rotated.scores(torch.randn(1, 4, 1, 64), packed)
    assert rotated.state_nbytes() <= 2 * 64 * 5  # its signs (int8, and float32 for the step), not a 64x64 matrix per codec


def test_kivi_error_within_half_step_of_its_groups():
    # KIVI's guarantee: every value is within half a quantization step of its group's [min, max] grid.
    x = torch.randn(1, 2, 64, 64) * torch.linspace(0.2, 8, 64)  # outlier-ish channels
    for axis, dim in (("channel", 2), ("token", 3)):
        for bits in (2, 4):
            codec = KiviCodec(KiviConfig(bits, axis), 64, 2)
            xh = codec.decode(codec.encode(x))
            g = x.unflatten(dim, (-1, 32))
            step = (g.amax(dim + 1, keepdim=True) - g.amin(dim + 1, keepdim=True)) / ((1 << bits) - 1)
            err = (xh - x).unflatten(dim, (-1, 32)).abs()
            assert (err <= step / 2 * 1.002 + 2e-3 * g.abs().amax(dim + 1, keepdim=True)).all()


# -- properties over shapes and bit widths ----------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    bits=st.integers(1, 4),
    qjl=st.booleans(),
    batch=st.integers(1, 2),
    kv=st.integers(1, 3),
    group=st.integers(1, 3),
    tokens=st.integers(1, 19),
    d=st.sampled_from([16, 24, 64, 96]),
    seed=st.integers(0, 1000),
)
def test_turboquant_properties(bits, qjl, batch, kv, group, tokens, d, seed):
    codec = TurboQuantCodec(TurboQuantConfig(bits, qjl=qjl, seed=seed), d, kv)
    x = torch.randn(batch, kv, tokens, d, generator=torch.Generator().manual_seed(seed)) * 5
    packed = codec.encode(x)
    xh = codec.decode(packed)
    assert xh.dtype == torch.float32 and xh.shape == x.shape and torch.isfinite(xh).all()
    assert codec.nbytes(packed) == batch * kv * tokens * (2 + math.ceil(d * codec.mse_bits / 8) + (2 + math.ceil(d / 8)) * qjl)
    # Per vector, the MSE reconstruction of a unit direction is never further than 2 from it.
    assert ((xh - x).norm(dim=-1) <= (2 + 1e-3) * x.norm(dim=-1) * (1 + math.sqrt(d) * qjl)).all()
    q = torch.randn(batch, kv * group, 2, d)
    torch.testing.assert_close(codec.scores(q, packed), q @ xh.repeat_interleave(group, 1).mT, atol=1e-3, rtol=1e-4)


@settings(max_examples=15, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    axis=st.sampled_from(["channel", "token"]),
    kv=st.integers(1, 3),
    blocks=st.integers(1, 3),
    d=st.sampled_from([16, 32, 64]),
    seed=st.integers(0, 1000),
)
def test_kivi_properties(bits, axis, kv, blocks, d, seed):
    codec = KiviCodec(KiviConfig(bits, axis, group_size=16), d, kv)
    x = torch.randn(1, kv, 16 * blocks + (axis == "token") * 3, d, generator=torch.Generator().manual_seed(seed))
    packed = codec.encode(x)
    xh = codec.decode(packed)
    assert xh.shape == x.shape and codec.nbytes(packed) == storage_bytes(packed)
    probs = torch.softmax(torch.randn(1, kv, 2, x.shape[2]), -1)
    torch.testing.assert_close(codec.weighted_sum(probs, packed), probs @ xh, atol=1e-5, rtol=1e-4)


def test_centering_removes_shared_offset_error_and_stays_exact_in_compressed_domain():
    """Keys with a large shared component (Qwen2's QKV bias): centering cuts the error relative to the
    token-to-token variation several-fold, and scores/weighted sums still equal decode-then-matmul."""
    gen = torch.Generator().manual_seed(0)
    offset = 20 * torch.randn(1, 2, 1, 64, generator=gen)
    x = offset + torch.randn(2, 2, 256, 64, generator=gen)
    variation = (x - x.mean(dim=(0, 2), keepdim=True)).norm()
    errors = {}
    for center in (False, True):
        codec = TurboQuantCodec(TurboQuantConfig(4, center=center), 64, 2)
        packed = codec.encode(x)
        errors[center] = ((codec.decode(packed) - x).norm() / variation).item()
    assert errors[True] < errors[False] / 4
    assert codec.mean is not None and codec.state_nbytes() == 2 * 64 * 4 + 2 * 64 * 4  # signs + mean
    q, p = torch.randn(2, 8, 3, 64), torch.rand(2, 8, 3, 256)
    keys = codec.decode(packed)
    ref_s = (q.reshape(2, 2, 12, 64) @ keys.mT).reshape(2, 8, 3, 256)
    torch.testing.assert_close(codec.scores(q, packed), ref_s, rtol=1e-4, atol=1e-3)
    ref_o = (p.reshape(2, 2, 12, 256) @ keys).reshape(2, 8, 3, 64)
    torch.testing.assert_close(codec.weighted_sum(p, packed), ref_o, rtol=1e-4, atol=1e-3)


def _roped_keys_with_constant_component(tokens=512, d=64, kv=2, seed=0):
    """Keys RoPE(offset + noise) at positions 7..: a constant un-RoPEd component (a QKV bias, a massive
    channel) that RoPE turns with position. Returns keys, positions, inv_freq and the offset."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.arange(7, 7 + tokens)[None].expand(2, -1)
    offset = 5 * torch.randn(kv, d, generator=gen)
    cos, sin = rope_cos_sin(positions, inv_freq)
    keys = apply_rope(offset[None, :, None, :] + torch.randn(2, kv, tokens, d, generator=gen), cos, sin)
    return keys, positions, inv_freq, offset


def test_rope_center_fits_the_unroped_mean_and_cuts_the_error_of_a_turning_component():
    """A post-RoPE mean cannot remove a component that turns with position; the un-RoPEd mean can. Checked
    against the known offset, and against post-RoPE centering on the same keys."""
    keys, positions, inv_freq, offset = _roped_keys_with_constant_component()
    errors = {}
    for rope_center in (False, True):
        codec = TurboQuantCodec(TurboQuantConfig(3, center=True, channel_scale=0.5, rope_center=rope_center), 64, 2)
        if rope_center:
            codec.set_rope(inv_freq)
        packed = codec.encode(keys, positions)
        errors[rope_center] = ((codec.decode(packed, positions) - keys).norm() / keys.norm()).item()
    # What is left after its center is about the noise the keys were built from (64 per token, unit variance):
    # the offset is gone, turned to each position on the pairs that turn, as a constant on those that barely do.
    left = (keys - codec._center(positions, 2, keys.shape[2], keys.device)).pow(2).sum(-1).mean()
    constant_left = (keys - keys.mean(dim=(0, 2), keepdim=True)).pow(2).sum(-1).mean()
    assert left < 64 * 1.1 and constant_left > 64 * 4, (left, constant_left)
    turning = codec.rope_mean[:, :32] != 0
    assert turning[:, :8].all() and not turning[:, -4:].any()  # fast pairs turn, the slowest stay constant
    assert codec.uses_positions and codec.kernel_kind == "tq"
    assert errors[True] < errors[False] / 2, errors


def test_rope_center_scores_equal_decoded_keys_at_their_positions():
    keys, positions, inv_freq, _ = _roped_keys_with_constant_component(tokens=100)
    codec = TurboQuantCodec(TurboQuantConfig(3, center=True, channel_scale=0.5, rope_center=True), 64, 2)
    codec.set_rope(inv_freq)
    packed = codec.encode(keys, positions)
    q = torch.randn(2, 6, 3, 64)
    dense = codec.decode(packed, positions).repeat_interleave(3, dim=1)
    torch.testing.assert_close(codec.scores(q, packed, None, positions), q @ dense.mT, atol=2e-4, rtol=1e-4)
    # A later block, decoded alone at its own positions, reads the same as the matching tokens of the whole.
    part = slice_packed(packed, 40, 70)
    torch.testing.assert_close(codec.decode(part, positions[:, 40:70]), codec.decode(packed, positions)[:, :, 40:70])
    with pytest.raises(ValueError, match="positions"):
        codec.scores(q, packed)
    with pytest.raises(ValueError, match="key option"):
        codec.weighted_sum(torch.rand(2, 6, 3, 100), packed)


def test_rope_center_config_and_method_name():
    with pytest.raises(ValueError, match="needs center=True"):
        TurboQuantConfig(3, rope_center=True)
    with pytest.raises(ValueError, match="rope_center must be True or False"):
        TurboQuantConfig(3, center=True, rope_center=1)
    method = get_method("turboquant:k3v2+ropemean")
    assert method.key.options["rope_center"] and "rope_center" not in method.value.options
    assert "rope_center" not in get_method("turboquant:k3v2").key.options
    assert method.key.uses_positions and not method.value.uses_positions and not get_method("turboquant:k3v2").key.uses_positions
    with pytest.raises(ValueError, match=r"\+ropemean"):
        get_method("turboquant:k3v2+ropemean+qjl")


def test_rope_center_keeps_at_most_the_kernels_bound_of_turning_pairs():
    """A head dim of 256 (Gemma's) whose every pair carries a large pre-RoPE constant: the fit keeps the 64 pairs that
    gain most (the CPU kernel's bound), never the near-still slowest, and the rest stay centered on the constant mean."""
    from kvpack.codecs.turboquant import MAX_TURNING_PAIRS

    keys, positions, inv_freq, _ = _roped_keys_with_constant_component(tokens=1024, d=256, kv=1)
    codec = TurboQuantCodec(TurboQuantConfig(3, center=True, rope_center=True), 256, 1)
    codec.set_rope(inv_freq)
    codec.fit(keys, positions)
    turning = codec.rope_mean[0, :128] != 0
    assert int(turning.sum()) == MAX_TURNING_PAIRS == 64
    assert not turning[-16:].any()  # pair i turns at θ_i = 10000^(-i/128): the last turn < 0.4 rad over 1024 tokens
    assert bool(((codec.rope_mean != 0) & (codec.mean != 0)).sum() == 0)  # each coordinate has one center, not two
    pair, mu, freq, table = codec._turning_state()
    assert pair.shape == (1, 64) and table.shape == (128, 2, 64)
