"""The archive codecs, KVQuant and subspace (SQuat-style), against independent references:
the Gaussian Lloyd-Max optimum, a uniform quantizer of the same width, exact fp16 outliers,
transformers' own RoPE, plain decode-then-matmul, hand-counted byte layouts and the cache's flush."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvpack.cache import KVPackLayer
from kvpack.codecs import concat_packed, slice_packed
from kvpack.codecs import kvquant as kvquant_module
from kvpack.codecs import subspace as subspace_module
from kvpack.codecs.kvquant import KVQuantConfig, KVQuantKeyCodec, KVQuantValueCodec
from kvpack.codecs.subspace import SubspaceCodec, SubspaceConfig
from kvpack.primitives.affine import dequantize_affine, quantize_affine
from kvpack.primitives.lloyd_max import gaussian_unit_mse
from kvpack.primitives.scalar_codebook import lloyd_1d
from kvpack.registry import CodecSpec, get_method

torch.set_num_threads(1)


def inv_freq(d: int) -> torch.Tensor:
    return 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))


def hf_rope(x: torch.Tensor, positions: torch.Tensor, d: int, scaling: float = 1.0) -> torch.Tensor:
    """transformers' Llama RoPE, with cos/sin written out as LlamaRotaryEmbedding computes them."""
    freqs = positions[..., None].float() * inv_freq(d)
    emb = torch.cat((freqs, freqs), -1)
    return apply_rotary_pos_emb(x, x, emb.cos() * scaling, emb.sin() * scaling)[0]


def student_t(shape, df=3.0, seed=0) -> torch.Tensor:
    """Heavy-tailed samples: a normal over the root of a chi-square / df."""
    gen = torch.Generator().manual_seed(seed)
    chi2 = torch.randn(*shape, int(df), generator=gen).square().sum(-1)
    return torch.randn(*shape, generator=gen) / (chi2 / df).sqrt()


def key_codec(bits=4, d=64, kv=2, fraction=0.01, rope=True, scaling=1.0) -> KVQuantKeyCodec:
    codec = KVQuantKeyCodec(KVQuantConfig(bits, fraction), d, kv)
    if rope:
        codec.set_rope(inv_freq(d), scaling)
    return codec


def positions(batch: int, tokens: int, start: int = 4) -> torch.Tensor:
    return torch.arange(start, start + tokens)[None] + 29 * torch.arange(batch)[:, None]  # rows at different offsets


# -- KVQuant: outliers, codebooks, error -------------------------------------------------------------
def test_kvquant_key_outliers_are_found_and_stored_exactly():
    d, kv, t = 64, 2, 400
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, kv, t, d, generator=gen) * torch.linspace(0.5, 2.0, d)
    hit = torch.rand(1, kv, t, generator=gen) < 0.1  # 10% of tokens carry one planted outlier: 0.16% of entries
    where = torch.randint(0, d, (1, kv, t, 1), generator=gen)
    planted = (20 + 10 * torch.rand(1, kv, t, 1, generator=gen)) * torch.sign(torch.randn(1, kv, t, 1, generator=gen))
    x.scatter_(-1, where, torch.where(hit[..., None], planted, x.gather(-1, where)))
    x = x.half().float()  # fp16-representable, so "exact" means bit-equal
    codec = key_codec(bits=2, rope=False)  # no RoPE: the stored un-RoPEd values are the inputs themselves
    packed = codec.encode(x)
    index = packed.outlier_index.long()
    assert packed.outlier_index.dtype == torch.uint8 and index.shape == (1, kv, t, 1)
    assert torch.equal(index[hit], where[hit])  # every planted entry is its token's outlier
    decoded = codec.decode(packed)
    assert torch.equal(decoded.gather(-1, index), x.gather(-1, index))  # exact at the sparse entries
    # The same dense width without the sparse part: the codebooks spend levels on the planted tails.
    dense_only = KVQuantKeyCodec(KVQuantConfig(2, 0.0), d, kv)
    assert (dense_only.decode(dense_only.encode(x)) - x).norm() > 1.3 * (decoded - x).norm()


def test_kvquant_value_outliers_are_the_largest_magnitudes_and_exact():
    x = (student_t((2, 2, 300, 128), seed=2) * 3).half().float()
    codec = KVQuantValueCodec(KVQuantConfig(2, 0.02), 128, 2)  # round(0.02 * 128) = 3 per token
    packed = codec.encode(x)
    assert packed.outlier_index.shape[-1] == 3
    top = x.abs().topk(3, dim=-1).indices.sort(-1).values
    assert torch.equal(packed.outlier_index.long().sort(-1).values, top)
    index = packed.outlier_index.long()
    assert torch.equal(codec.decode(packed).gather(-1, index), x.gather(-1, index))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kvquant_per_channel_codebooks_reach_the_gaussian_lloyd_max_optimum(bits):
    # Keys with no outliers and a different scale per channel: each channel's fitted codebook must give
    # the Lloyd-Max error of N(0, 1) (0.1175, 0.03454, 0.009497 of the variance), whatever the scale.
    d, n = 16, 30_000
    sigma = torch.logspace(-1, 1, d)
    x = torch.randn(1, 1, n, d, generator=torch.Generator().manual_seed(bits)) * sigma
    codec = key_codec(bits, d, kv=1, fraction=0.0, rope=False)
    err = (codec.decode(codec.encode(x)) - x).square().mean((0, 1, 2)) / sigma.square()
    torch.testing.assert_close(err, torch.full((d,), gaussian_unit_mse(bits)), rtol=0.04, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kvquant_beats_a_uniform_quantizer_of_the_same_width_on_heavy_tails(bits):
    d, t = 64, 512
    keys = student_t((1, 2, t, d), seed=10 + bits) * torch.linspace(0.2, 4.0, d)  # heavy tails, uneven channels
    values = student_t((1, 2, t, d), seed=20 + bits)
    # Uniform references: KIVI's layouts (per-channel min/max over the block for keys, per-token for values).
    uniform_k = dequantize_affine(quantize_affine(keys, bits, t, axis=-2), t, axis=-2)
    uniform_v = dequantize_affine(quantize_affine(values, bits, d, axis=-1), d, axis=-1)
    kc, vc = key_codec(bits, rope=False), KVQuantValueCodec(KVQuantConfig(bits), d, 2)
    err_k = (kc.decode(kc.encode(keys)) - keys).norm() / (uniform_k - keys).norm()
    err_v = (vc.decode(vc.encode(values)) - values).norm() / (uniform_v - values).norm()
    assert err_k < 0.8 and err_v < 0.8, (err_k, err_v)


def test_kvquant_codes_keys_before_rope():
    """RoPE'd input is coded un-RoPEd: as accurate as coding the un-RoPEd keys directly, far more accurate
    than per-channel codebooks on the RoPE'd channels (KVQuant §3.1: RoPE mixes each outlier channel with
    its pair partner at a position-dependent angle), and decode puts transformers' RoPE back."""
    d, b, t = 64, 2, 400
    scales = torch.ones(d)
    scales[[3, 40, 50]] = 8.0  # outlier channels, as in real keys
    k0 = (torch.randn(b, 2, t, d, generator=torch.Generator().manual_seed(3)) * scales + scales).half().float()
    pos = positions(b, t)
    roped = hf_rope(k0, pos, d, scaling=1.3)
    pre, plain, post = key_codec(2, scaling=1.3), key_codec(2, rope=False), key_codec(2, rope=False)
    packed = pre.encode(roped, pos)
    err_pre = (pre.decode_unroped(packed) - k0).norm()
    err_plain = (plain.decode(plain.encode(k0)) - k0).norm()
    err_post = (post.decode(post.encode(roped)) - roped).norm() / 1.3  # same units as the un-RoPEd error
    assert err_pre < 1.01 * err_plain and err_pre < 0.8 * err_post, (err_pre, err_plain, err_post)
    index = packed.outlier_index.long()
    torch.testing.assert_close(packed.outlier_value.float(), k0.gather(-1, index), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(pre.decode(packed, pos), hf_rope(pre.decode_unroped(packed), pos, d, 1.3), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="pass positions"):
        pre.encode(roped)


# -- compressed-domain attention against decode-then-matmul -----------------------------------------
ATTENTION_CASES = [(64, 1, 1), (128, 4, 2), (80, 7, 3)]  # (head_dim, GQA group, query length)


@pytest.mark.parametrize("d,group,q_len", ATTENTION_CASES)
@pytest.mark.parametrize("bits", [2, 4])
def test_kvquant_scores_equal_explicit_rope_matmul(d, group, q_len, bits, monkeypatch):
    monkeypatch.setattr(kvquant_module, "_CHUNK_ELEMENTS", 2 * 2 * d * 16)  # 16-token chunks: the loop is exercised
    b, kv, t = 2, 2, 101
    pos = positions(b, t)
    keys = hf_rope(student_t((b, kv, t, d), seed=d) * 2, pos, d, 1.1)
    codec = key_codec(bits, d, kv, scaling=1.1)
    packed = codec.encode(keys, pos)
    q_pos = pos[:, -1:] + 1 + torch.arange(q_len)
    query = hf_rope(torch.randn(b, kv * group, q_len, d), q_pos, d, 1.1)
    # Reference: un-RoPEd decode, transformers' RoPE, a plain matmul with each kv head repeated (repeat_kv).
    ref_keys = hf_rope(codec.decode_unroped(packed), pos, d, 1.1).repeat_interleave(group, 1)
    ref = query @ ref_keys.transpose(-1, -2)
    got = codec.scores(query, packed, q_pos, pos)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("d,group,q_len", ATTENTION_CASES)
@pytest.mark.parametrize("name", ["kvquant-value", "subspace"])
def test_weighted_sums_and_subspace_scores_equal_decode_then_matmul(name, d, group, q_len, monkeypatch):
    for module in (kvquant_module, subspace_module):
        monkeypatch.setattr(module, "_CHUNK_ELEMENTS", 2 * 2 * d * 16)
    b, kv, t = 2, 2, 101
    codec = CodecSpec(name, {"bits": 2}).build(d, kv)
    x = student_t((b, kv, t, d), seed=d) + 0.5
    packed = codec.encode(x)
    dense = codec.decode(packed).repeat_interleave(group, 1)
    probs = torch.softmax(3 * torch.randn(b, kv * group, q_len, t), -1)
    torch.testing.assert_close(codec.weighted_sum(probs, packed), probs @ dense, rtol=1e-4, atol=1e-5)
    if name == "subspace":
        query = torch.randn(b, kv * group, q_len, d)
        ref = query @ dense.transpose(-1, -2)
        torch.testing.assert_close(codec.scores(query, packed), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["kvquant-key", "kvquant-value", "subspace"])
def test_blocks_concatenate_slice_and_zero_roundtrips(name):
    codec = CodecSpec(name, {"bits": 3}).build(64, 2)
    pos = positions(1, 74)
    a, b = torch.randn(1, 2, 37, 64), torch.randn(1, 2, 37, 64)
    pa, pb = codec.encode(a, pos[:, :37]), codec.encode(b, pos[:, 37:])
    for tensor in pa.tensors():
        assert tensor.shape[:3] == (1, 2, 37)
    both = concat_packed([pa, pb])
    torch.testing.assert_close(codec.decode(both, pos), torch.cat([codec.decode(pa, pos[:, :37]), codec.decode(pb, pos[:, 37:])], 2))
    assert torch.equal(codec.decode(slice_packed(both, 37, 74), pos[:, 37:]), codec.decode(pb, pos[:, 37:]))
    fresh = CodecSpec(name, {"bits": 3}).build(64, 2)
    zeros = torch.zeros(1, 2, 20, 64)
    assert torch.equal(fresh.decode(fresh.encode(zeros), pos[:, :20]), zeros)  # fitted on all-zero vectors


# -- subspace: the basis finds the data's subspace ---------------------------------------------------
def low_rank(rank: int, d: int = 64, kv: int = 2, t: int = 600, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.linalg.qr(torch.randn(kv, d, rank, generator=gen)).Q  # orthonormal columns per head
    coefs = torch.randn(2, kv, t, rank, generator=gen) * torch.linspace(4, 1, rank)
    return coefs @ mix.transpose(1, 2)[None] + torch.randn(kv, 1, d, generator=gen)  # plus a mean per head


@pytest.mark.parametrize("bits,factor", [(2, 0.1), (4, 0.02)])
def test_subspace_reconstructs_rank_one_data_nearly_exactly(bits, factor):
    """The one live coefficient of a token is its subspace's absmax: only fp16 scales and the int8
    basis's leakage (~1e-3 of the leading std, coded at `bits`) are left, far below the codec's own
    error on full-rank Gaussian data (34% at 2 bits, 8% at 4)."""
    x = low_rank(1)
    codec = SubspaceCodec(SubspaceConfig(bits=bits), 64, 2)
    err = (codec.decode(codec.encode(x)) - x).norm() / (x - x.mean(2, keepdim=True)).norm()
    gauss = torch.randn(2, 2, 600, 64, generator=torch.Generator().manual_seed(1))
    other = SubspaceCodec(SubspaceConfig(bits=bits), 64, 2)
    err_gauss = (other.decode(other.encode(gauss)) - gauss).norm() / gauss.norm()
    assert err < factor * err_gauss, (err, err_gauss)


@pytest.mark.parametrize("bits", [2, 4])
def test_subspace_beats_per_channel_codes_on_low_rank_data(bits):
    x = low_rank(6)
    codec = SubspaceCodec(SubspaceConfig(bits=bits), 64, 2)
    err = (codec.decode(codec.encode(x)) - x).norm()
    uniform = dequantize_affine(quantize_affine(x, bits, 64), 64)  # per-token min/max codes of the same width
    assert err < 0.6 * (uniform - x).norm()


# -- byte layouts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,options,d,per_token",
    [
        # KVQuant keys: ceil(d * bits / 8) code bytes + k outliers of (uint8 index, fp16 value).
        ("kvquant-key", {"bits": 2}, 64, 16 + 3),
        ("kvquant-key", {"bits": 3}, 128, 48 + 3),  # round(0.01 * 128) = 1
        ("kvquant-key", {"bits": 4, "outlier_fraction": 0.05}, 80, 40 + 4 * 3),
        ("kvquant-key", {"bits": 2, "outlier_fraction": 0.0}, 64, 16),
        # Values add an fp16 centre and radius per token.
        ("kvquant-value", {"bits": 2}, 64, 16 + 3 + 4),
        ("kvquant-value", {"bits": 3}, 80, 30 + 3 + 4),
        ("kvquant-value", {"bits": 4}, 128, 64 + 3 + 4),
        # Subspace: codes + one fp16 scale per subspace.
        ("subspace", {"bits": 2}, 64, 16 + 2 * 2),
        ("subspace", {"bits": 3, "n_subspaces": 4}, 80, 30 + 4 * 2),
        ("subspace", {"bits": 4, "n_subspaces": 8}, 128, 64 + 8 * 2),
    ],
)
def test_bytes_per_token_match_the_hand_count_and_real_storage(name, options, d, per_token):
    codec = CodecSpec(name, options).build(d, 3)
    packed = codec.encode(torch.randn(2, 3, 50, d), positions(2, 50))
    assert packed.nbytes() == 2 * 3 * 50 * per_token
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed.tensors()}
    assert sum(storages.values()) == packed.nbytes()


def test_fitted_state_bytes_match_the_hand_count():
    d, kv = 64, 3
    x = torch.randn(1, kv, 100, d)
    k, v, s = key_codec(2, d, kv, rope=False), KVQuantValueCodec(KVQuantConfig(2), d, kv), SubspaceCodec(SubspaceConfig(), d, kv)
    for codec in (k, v, s):
        codec.encode(x)
    assert k.state_nbytes() == kv * d * 4 * 2 + 2 * kv * d * 2  # fp16 codebook of 4 levels per channel, centre, radius
    assert v.state_nbytes() == kv * 4 * 2
    assert s.state_nbytes() == kv * d * d + 3 * kv * d * 2 + kv * 2 * 4 * 2  # int8 basis; fp16 column scale, mean, std; codebooks


# -- fitted state ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["kvquant-key", "kvquant-value", "subspace"])
def test_state_dict_round_trip_gives_identical_codes_and_decodes(name):
    spec = CodecSpec(name, {"bits": 3})
    first, second = spec.build(64, 2), spec.build(64, 2)
    for codec in (first, second):
        if codec.uses_positions:
            codec.set_rope(inv_freq(64))
    assert first.state_dict() == {}
    x, pos = student_t((2, 2, 90, 64), seed=5), positions(2, 90)
    packed = first.encode(x[:, :, :60], pos[:, :60])  # fits on the first block
    state = {key: value.clone() for key, value in first.state_dict().items()}
    assert all(t.dtype in (torch.float16, torch.int8) for t in state.values())
    second.load_state_dict(state)
    assert torch.equal(second.decode(packed, pos[:, :60]), first.decode(packed, pos[:, :60]))
    later_a, later_b = first.encode(x[:, :, 60:], pos[:, 60:]), second.encode(x[:, :, 60:], pos[:, 60:])
    assert all(torch.equal(a, b) for a, b in zip(later_a.tensors(), later_b.tensors(), strict=True))
    with pytest.raises(ValueError, match="state"):
        spec.build(64, 3).load_state_dict(state)  # built for 3 kv heads: shapes disagree


# -- configs, registry and the cache ----------------------------------------------------------------
@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        (KVQuantConfig, {"bits": 8}, r"bits must be one of \(2, 3, 4\), got 8"),
        (KVQuantConfig, {"outlier_fraction": 0.5}, r"outlier_fraction must be in \[0, 0.1\]"),
        (KVQuantConfig, {"outlier_fraction": "1%"}, r"outlier_fraction must be a number"),
        (SubspaceConfig, {"bits": 1}, r"bits must be one of \(2, 3, 4\), got 1"),
        (SubspaceConfig, {"n_subspaces": 0}, r"n_subspaces must be a positive integer"),
    ],
)
def test_bad_configs_list_the_allowed_values(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_shape_restrictions_are_explained():
    with pytest.raises(ValueError, match="n_subspaces 3 must divide head_dim 64"):
        SubspaceCodec(SubspaceConfig(n_subspaces=3), 64, 1)
    with pytest.raises(ValueError, match="head_dim must be <= 256"):
        KVQuantValueCodec(KVQuantConfig(), 512, 1)
    with pytest.raises(ValueError, match="kvquant takes 2, 3 or 4 bits"):
        get_method("kvquant:5")
    with pytest.raises(ValueError, match="subspace takes 2, 3 or 4 bits"):
        get_method("subspace")


def test_prompt_fits_the_codecs_and_decoded_blocks_reuse_them():
    """One codec pair per layer: fitted on the prompt's middle, then coding every decoded block into the same segment."""
    d = 64
    layer = KVPackLayer(get_method("kvquant:3"), 0, None, (inv_freq(d), 1.0))
    layer.update(torch.randn(1, 2, 300, d), torch.randn(1, 2, 300, d))
    book = layer.segments[0].key_codec.codebook
    assert book is not None and layer.segments[0].length == 300 - 4 - 64
    for _ in range(64):
        layer.update(torch.randn(1, 2, 1, d), torch.randn(1, 2, 1, d))
    assert len(layer.segments) == 1 and layer.segments[0].length == 300 - 4 - 64 + 64
    assert layer.segments[0].key_codec.codebook is book  # not refitted on the decoded block
    assert set(layer.memory()) >= {"stream:kvquant-key/kvquant-value"}


def test_lloyd_never_increases_the_error_of_its_initial_codebook():
    x = student_t((3, 5000), seed=9)
    init = torch.linspace(-3, 3, 8).expand(3, -1)
    fitted = lloyd_1d(x, init)

    def mse(levels):
        return (x.unsqueeze(-1) - levels.unsqueeze(1)).abs().amin(-1).square().mean(-1)

    assert (mse(fitted) <= mse(init) + 1e-9).all() and (mse(fitted) < 0.9 * mse(init)).all()
    assert math.isfinite(float(fitted.sum())) and torch.equal(fitted, fitted.sort(-1).values)
