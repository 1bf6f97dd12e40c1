"""Shard's codecs: PCA keys (scores on coefficients through the RoPE identity) and Hadamard + VQ values."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvpack.codecs.base import ByteBudget
from kvpack.codecs.pca import PCAConfig, PCAKeyCodec
from kvpack.codecs.vq import VQConfig, VQValueCodec
from kvpack.primitives.affine import dequantize_affine, quantize_affine
from kvpack.primitives.packing import packed_length, unpack_bits
from kvpack.registry import CodecSpec

D, KV = 64, 3
INV_FREQ = 1.0 / (1e5 ** (torch.arange(0, D, 2).float() / D))


def hf_cos_sin(positions, scaling):
    # transformers' LlamaRotaryEmbedding arithmetic, written out here as the reference
    freqs = positions[..., None].float() * INV_FREQ
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos() * scaling, emb.sin() * scaling


def low_rank_keys(batch, tokens, rank=10, noise=0.02, seed=0, start=4, scaling=1.0):
    """RoPE'd keys whose un-RoPEd form is rank-`rank` (across heads) plus noise; positions per batch row."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(rank, KV * D, generator=gen) * torch.linspace(3, 0.5, rank)[:, None]
    k0 = torch.randn(batch, tokens, rank, generator=gen) @ mix + 0.5 + noise * torch.randn(batch, tokens, KV * D, generator=gen)
    k0 = k0.view(batch, tokens, KV, D).transpose(1, 2)
    positions = torch.arange(start, start + tokens)[None] + 17 * torch.arange(batch)[:, None]
    cos, sin = hf_cos_sin(positions, scaling)
    keys, _ = apply_rotary_pos_emb(k0, k0, cos, sin)
    return keys, positions


def reference_keys(codec: PCAKeyCodec, packed, positions):
    """Dequantize in plain torch from the codec's stored state, then RoPE with transformers' function."""
    parts, start = [], 0
    for n, bits in codec.segments:
        nbytes = packed_length(n, bits)
        parts.append(unpack_bits(packed.codes[..., start : start + nbytes], bits, n).float() - ((1 << (bits - 1)) - 1))
        start += nbytes
    levels = torch.cat(parts, -1)
    # Components times their coefficient scale, requantized to int8 per row with a scale of 12 mantissa bits.
    folded = codec.basis.double() * (codec.basis_scale.double() * codec.coef_scale.double())[:, None]
    amax = folded.abs().amax(2, keepdim=True) / 127
    exponent = torch.floor(torch.log2(amax)) + 1  # amax = m * 2**exponent, m in [0.5, 1)
    row = torch.round(amax / 2**exponent * 4096) / 4096 * 2**exponent
    basis = (folded / row).round().clamp(-127, 127) * row
    k0 = levels.double() @ basis.transpose(1, 2) + codec.mean.double()[None, :, None]  # (b, groups, t, group_dim)
    b, _, t, _ = k0.shape
    k0 = k0.float().transpose(1, 2).reshape(b, t, KV, D).transpose(1, 2)
    cos, sin = hf_cos_sin(positions, codec.rope.scaling)
    return apply_rotary_pos_emb(k0, k0, cos, sin)[0]


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("scope,tokens,q_len,batch", [("layer", 37, 1, 2), ("layer", 129, 5, 1), ("head", 37, 3, 2)])
def test_pca_scores_equal_dequantize_rope_matmul(group, scope, tokens, q_len, batch):
    keys, positions = low_rank_keys(batch, tokens, scaling=1.2)
    codec = PCAKeyCodec(PCAConfig(rank=20, bits=4, group_size=8, scope=scope), D, KV)
    codec.set_rope(INV_FREQ, 1.2)
    packed = codec.encode(keys, positions)
    q_pos = positions[:, -1:] + 1 + torch.arange(q_len)  # queries after the keys
    query = torch.randn(batch, KV * group, q_len, D)
    q_cos, q_sin = hf_cos_sin(q_pos, 1.2)
    query, _ = apply_rotary_pos_emb(query, query, q_cos, q_sin)
    ref_keys = reference_keys(codec, packed, positions)
    ref = query.reshape(batch, KV, group * q_len, D) @ ref_keys.transpose(-1, -2)
    ref = ref.reshape(batch, KV * group, q_len, tokens)
    got = codec.scores(query, packed, q_pos, positions)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-4 * ref.abs().max().item())
    torch.testing.assert_close(codec.decode(packed, positions), ref_keys, rtol=0, atol=1e-4 * ref_keys.abs().max().item())


def test_pca_stores_small_dtypes_and_reconstructs_low_rank_keys():
    keys, positions = low_rank_keys(2, 200)
    codec = PCAKeyCodec(PCAConfig(rank=24, bits=4, group_size=8), D, KV)
    codec.set_rope(INV_FREQ)
    packed = codec.encode(keys, positions)  # fits on first use
    assert codec.basis.dtype == torch.int8 and codec.basis_scale.dtype == torch.float16
    assert codec.coef_scale.dtype == torch.float16 and codec.mean.dtype == torch.float16
    assert packed.codes.dtype == torch.uint8 and packed.codes.shape[:3] == (2, 1, 200)
    err = (codec.decode(packed, positions) - keys).norm() / keys.norm()
    assert err < 0.05
    with pytest.raises(ValueError, match="positions"):
        codec.encode(keys)


def test_pca_far_below_same_bytes_scalar_quantizer():
    keys, positions = low_rank_keys(1, 512, rank=12, noise=0.02)
    # 48 components x 8 bits = 384 bits per token = 2 bits per element, vs 2-bit codes + fp16 scale/zero per 64 = 2.5
    codec = PCAKeyCodec(PCAConfig(rank=48, bits=8, group_size=48), D, KV)
    codec.set_rope(INV_FREQ)
    packed = codec.encode(keys, positions)
    assert packed.codes.shape[-1] * 8 <= 2 * KV * D
    pca_err = (codec.decode(packed, positions) - keys).norm() / keys.norm()
    scalar = dequantize_affine(quantize_affine(keys, 2, D), D)
    scalar_err = (scalar - keys).norm() / keys.norm()
    assert pca_err < 0.25 * scalar_err, (pca_err, scalar_err)


def test_pca_without_rope_is_plain_linear_codec():
    keys, _ = low_rank_keys(1, 50)
    codec = PCAKeyCodec(PCAConfig(rank=16), D, KV)  # no set_rope: keys are taken as RoPE-free
    packed = codec.encode(keys)
    query = torch.randn(1, KV * 2, 2, D)
    ref = (query.reshape(1, KV, 4, D) @ codec.decode(packed).transpose(-1, -2)).reshape(1, KV * 2, 2, 50)
    torch.testing.assert_close(codec.scores(query, packed), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_bytes_per_token_match_hand_count():
    tokens = 8192
    keys, positions = low_rank_keys(1, tokens, rank=8)
    pca = CodecSpec("pca", {"rank": 48, "bits": 4, "group_size": 48}).build(D, KV)
    pca.set_rope(INV_FREQ)
    packed = pca.encode(keys, positions)
    assert pca.segments == ((48, 4),)  # one group, the whole budget at 4 bits
    assert packed.nbytes() == tokens * 48 * 4 // 8  # 24 B/token for the layer, vs 384 B in fp16
    # int8 basis 192x48, fp16 column and coefficient scales (48 each), fp16 mean (192), float32 level offsets (48, cached)
    assert pca.state_nbytes() == 192 * 48 + 2 * 48 + 2 * 48 + 2 * 192 + 4 * 48
    values = torch.randn(1, KV, tokens, D)
    vq = CodecSpec("vq", {"n_iter": 2, "fit_points": 4096}).build(D, KV)
    packed_v = vq.encode(values)
    assert packed_v.nbytes() == tokens * KV * (D // 4)  # one uint8 index per 4 channels: 48 B/token
    # fp16 codebook 256x4, fp16 per-channel scale 3x64, int8 rotation signs 3x64
    assert vq.state_nbytes() == 256 * 4 * 2 + KV * D * 2 + KV * D
    fp16 = tokens * KV * D * 2 * 2
    total = packed.nbytes() + pca.state_nbytes() + packed_v.nbytes() + vq.state_nbytes()
    assert abs(fp16 / total - 2 * 384 / (24 + 48 + (9984 + 2624) / tokens)) < 1e-9


def vq_codec(scope="layer", group=4, seed=0, token_norm=False):
    return VQValueCodec(
        VQConfig(group_size=group, codebook_size=64, n_iter=6, seed=seed, fit_points=2048, scope=scope, token_norm=token_norm),
        D, KV, layer_idx=2,
    )


@pytest.mark.parametrize("scope,token_norm", [("layer", False), ("head", False), ("layer", True)])
@pytest.mark.parametrize("q_group,q_len,tokens", [(1, 1, 37), (3, 4, 129), (7, 2, 5)])
def test_vq_hadamard_after_sum_equals_per_token_inverse(scope, token_norm, q_group, q_len, tokens):
    values = torch.randn(2, KV, tokens, D) * torch.rand(2, KV, tokens, 1).mul(3).exp()  # uneven token magnitudes
    codec = vq_codec(scope, token_norm=token_norm)
    codec.fit(torch.randn(2, KV, 300, D))
    packed = codec.encode(values)  # a block the codec was not fit on
    probs = torch.rand(2, KV * q_group, q_len, tokens).softmax(-1)
    per_token = codec.decode(packed)  # inverse rotation applied to every token
    ref = (probs.reshape(2, KV, q_group * q_len, tokens) @ per_token).reshape(2, KV * q_group, q_len, D)
    torch.testing.assert_close(codec.weighted_sum(probs, packed), ref, rtol=0, atol=1e-5)


def test_vq_reconstruction_reproducibility_and_state():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(1, KV, 400, D, generator=gen) * torch.linspace(0.2, 3, D)  # uneven channels
    a, b, c = vq_codec(seed=1), vq_codec(seed=1), vq_codec(seed=2)
    pa, pb = a.encode(values), b.encode(values)
    assert torch.equal(a.codebooks, b.codebooks) and torch.equal(pa.indices, pb.indices)
    c.fit(values)
    assert not torch.equal(a.codebooks, c.codebooks)
    assert a.codebooks.dtype == torch.float16 and pa.indices.dtype == torch.uint8
    assert pa.indices.shape == (1, KV, 400, D // 4 * 6 // 8)  # 64 entries: 6-bit indices, packed
    err = (a.decode(pa) - values).norm() / values.norm()
    assert err < 0.45  # 1.5 bits per element on Gaussian data (the rate-distortion bound is 2^-1.5 = 0.35)


def test_vq_token_norm_follows_token_magnitudes():
    gen = torch.Generator().manual_seed(3)
    # Values whose per-token magnitude spans ~e^4: one shared codebook must spend codewords on sizes.
    values = torch.randn(1, KV, 600, D, generator=gen) * torch.randn(1, KV, 600, 1, generator=gen).mul(1.0).exp()
    plain, normed = vq_codec(), vq_codec(token_norm=True)
    pp, pn = plain.encode(values), normed.encode(values)

    def per_token_error(codec, packed):
        return ((codec.decode(packed) - values).norm(dim=-1) / values.norm(dim=-1)).mean()

    assert per_token_error(normed, pn) < 0.8 * per_token_error(plain, pp)
    assert pn.norm.dtype == torch.float16 and pn.nbytes() == pp.nbytes() + KV * 600 * 2  # one fp16 RMS per token and head


def test_configs_validate():
    with pytest.raises(ValueError, match="scope"):
        PCAConfig(scope="token")
    with pytest.raises(ValueError, match="bits"):
        PCAConfig(bits=1)
    with pytest.raises(ValueError, match="codebook_size"):
        VQConfig(codebook_size=512)
    with pytest.raises(ValueError, match="token_norm"):
        VQConfig(token_norm="yes")
    with pytest.raises(ValueError, match="divide"):
        VQValueCodec(VQConfig(group_size=5), D, KV)


def _keys_with_a_weak_direction_queries_read(tokens=240, batch=2):
    """Rank-10 un-RoPEd keys plus one orthogonal direction with ~0.1% of their variance, and queries
    that read mostly that direction (both RoPE'd)."""
    gen = torch.Generator().manual_seed(3)
    ch = (D - 8, D // 2 - 8)  # a low-frequency RoPE pair of head 0
    mix = torch.randn(10, KV * D, generator=gen) * torch.linspace(3, 0.5, 10)[:, None]
    mix[:, list(ch)] = 0.0  # the strong subspace leaves the pair empty
    k0 = torch.randn(batch, tokens, 10, generator=gen) @ mix + 0.01 * torch.randn(batch, tokens, KV * D, generator=gen)
    k0[..., ch[0]] += 0.4 * torch.randn(batch, tokens, generator=gen)
    k0 = k0.view(batch, tokens, KV, D).transpose(1, 2)
    positions = torch.arange(4, 4 + tokens)[None] + 17 * torch.arange(batch)[:, None]
    cos, sin = hf_cos_sin(positions, 1.0)
    keys = apply_rotary_pos_emb(k0, k0, cos, sin)[0]
    q0 = 0.1 * torch.randn(batch, KV * 2, 16, D, generator=gen)
    q0[:, :2, :, ch[0]] += 30.0  # the query heads of kv head 0
    q_cos, q_sin = hf_cos_sin(positions[:, -16:], 1.0)
    return keys, positions, apply_rotary_pos_emb(q0, q0, q_cos, q_sin)[0]


def _centered_score_error(queries, keys, approx):
    """Σ (q·k̂ - q·k)² / Σ (q·k - mean over keys)², plain torch with transformers' GQA convention."""
    b, hq, m, d = queries.shape
    kv = keys.shape[1]
    q = queries.reshape(b, kv, hq // kv * m, d)
    exact, got = q @ keys.mT, q @ approx.mT
    return ((got - exact).square().sum() / (exact - exact.mean(-1, keepdim=True)).square().sum()).item()


def _truncated_keys(keys, positions, rank):
    """Reference truncation: eigendecomposition of the un-RoPEd keys' covariance (all heads as one vector)."""
    cos, sin = hf_cos_sin(positions, 1.0)
    k0 = apply_rotary_pos_emb(keys, keys, cos, -sin)[0].double()  # RoPE undone (rotation by -θ)
    b, kv, t, d = k0.shape
    x = k0.transpose(1, 2).reshape(b * t, kv * d)
    mean = x.mean(0)
    _, vecs = torch.linalg.eigh((x - mean).mT @ (x - mean))
    top = vecs[:, -rank:]
    x = (x - mean) @ top @ top.mT + mean
    k0 = x.view(b, t, kv, d).transpose(1, 2).float()
    return apply_rotary_pos_emb(k0, k0, cos, sin)[0]


@pytest.mark.parametrize("tau", [0.03, 0.01])
def test_pca_rank_from_queries_is_the_smallest_within_the_score_error(tau):
    keys, positions, queries = _keys_with_a_weak_direction_queries_read()
    codec = PCAKeyCodec(PCAConfig(bits=8, group_size=4, score_error=tau), D, KV)
    codec.set_rope(INV_FREQ)
    codec.fit(keys, positions, queries=queries)
    errors = {r: _centered_score_error(queries, keys, _truncated_keys(keys, positions, r)) for r in range(4, 25, 4)}
    expected = min(r for r, e in errors.items() if e <= tau)
    assert codec.rank_source == "queries" and codec.rank == expected, (codec.rank, errors)


def test_pca_rank_from_queries_keeps_what_key_energy_drops():
    """Key variance alone drops the weak direction the queries read (Qwen2.5's failure, docs/notes/shard.md)."""
    keys, positions, queries = _keys_with_a_weak_direction_queries_read()
    by_energy = PCAKeyCodec(PCAConfig(group_size=4), D, KV)
    by_queries = PCAKeyCodec(PCAConfig(group_size=4), D, KV)
    for codec, q in ((by_energy, None), (by_queries, queries)):
        codec.set_rope(INV_FREQ)
        codec.fit(keys, positions, queries=q)
    assert by_energy.rank_source == "energy" and by_queries.rank_source == "queries"
    err = {c.rank_source: _centered_score_error(queries, keys, c.decode(c.encode(keys, positions), positions)) for c in (by_energy, by_queries)}
    assert err["energy"] > 0.3 and err["queries"] < 0.05, err


def test_shard_value_codebook_sizes():
    """`shard:vqN` sets the value codebook's entries (log2 N bits per group of 4 channels); the stream codec
    still combines with it, in either order, under one canonical name."""
    from kvpack.registry import get_method

    for name, canonical, size, stream in [("shard", "shard", 256, "int8"), ("shard:vq64", "shard:vq64", 64, "int8"),
                                          ("shard:vq64+tq4", "shard:tq4+vq64", 64, "turboquant"), ("shard:vq256", "shard", 256, "int8"),
                                          ("shard:vq64+k3v2", "shard:k3v2+vq64", 64, "turboquant")]:
        config = get_method(name)
        assert config.name == canonical and config.key.codec == stream
        codec = config.prefill_value.build(64, 2)
        assert codec.config.codebook_size == size and codec.bits == (size - 1).bit_length()


def test_shard_turboquant_streams_are_the_turboquant_methods():
    """`shard:k3v2` / `shard:k4v2` code the tokens after the prompt with `turboquant:k3v2`'s / `k4v2`'s own key and
    value codecs (keys centered and channel-scaled), while the prompt keeps Shard's PCA keys and VQ values."""
    from kvpack.registry import get_method

    for stream, bits in (("k3v2", [3, 2]), ("k4v2", [4, 2])):
        config, tq = get_method(f"shard:{stream}+e1"), get_method(f"turboquant:{stream}")
        assert (config.key, config.value) == (tq.key, tq.value) and config.name == f"shard:{stream}+e1"
        assert config.prefill_key.codec == "pca" and config.prefill_value.codec == "vq"
        codecs = config.key.build(64, 2), config.value.build(64, 2)
        assert [c.config.bits for c in codecs] == bits


def test_shard_key_score_error_names():
    """`shard:eN` sets the key rank's score error to N% (`e3` is plain `shard`), combinable with the other tokens
    under one canonical name; anything else is refused with the allowed values."""
    from kvpack.registry import get_method

    for name, canonical, error in [("shard", "shard", 0.03), ("shard:e1", "shard:e1", 0.01), ("shard:e3", "shard", 0.03),
                                   ("shard:e1+vq64", "shard:vq64+e1", 0.01), ("shard:e0.5+tq4", "shard:tq4+e0.5", 0.005)]:
        config = get_method(name)
        assert config.name == canonical and config.prefill_key.build(64, 2).config.score_error == pytest.approx(error)


def test_shard_byte_target_names():
    """`shard:Rx` sets `MethodConfig.prompt_ratio` (any R in (1, 64]), combinable with the other tokens under one canonical
    name; a bad R, two targets, or a target on a method whose prompt value codec cannot size itself are refused."""
    from kvpack.registry import MethodConfig, get_method

    for name, canonical, ratio in [("shard", "shard", 0.0), ("shard:10x", "shard:10x", 10.0), ("shard:7.5x+k3v2", "shard:k3v2+7.5x", 7.5),
                                   ("shard:10x+e1+vq128", "shard:vq128+e1+10x", 10.0), ("shard:10x@window=32", "shard:10x@window=32", 10.0)]:
        config = get_method(name)
        assert config.name == canonical and config.prompt_ratio == ratio
    for bad in ("shard:1x", "shard:65x", "shard:10x+8x", "shard:0.5x"):
        with pytest.raises(ValueError, match="byte target"):
            get_method(bad)
    with pytest.raises(ValueError, match=r"sizes itself to a byte budget \(\['vq'\]\)"):
        get_method("turboquant:k3v2").with_options(prompt_ratio=10.0)
    with pytest.raises(ValueError, match="prompt_ratio must be 0"):
        MethodConfig("x", CodecSpec("int8"), CodecSpec("int8"), prompt_ratio=-2)


def _measured_vq_bytes(entries: int, values: torch.Tensor) -> tuple[int, int]:
    """(encoded tokens, state) bytes a VQ codec with `entries` codewords holds for `values`, measured."""
    codec = VQValueCodec(VQConfig(codebook_size=entries, n_iter=4, fit_points=2048, token_norm=True), D, KV)
    return codec.encode(values).nbytes(), codec.state_nbytes()


def test_vq_fits_the_largest_codebook_within_a_byte_budget():
    """Given (bytes, tokens), `fit` keeps the largest codebook whose encoded tokens and state fit, as measured by
    encoding with codecs of each size; the chosen codebook encodes, decodes and round-trips its state like a fixed one."""
    values = torch.randn(1, KV, 500, D, generator=torch.Generator().manual_seed(4))
    parts = {e: _measured_vq_bytes(e, values) for e in (16, 32, 64, 128, 256)}
    measured = {e: sum(p) for e, p in parts.items()}
    for allowed, expected in [(measured[64], 64), (measured[128] - 1, 64), (measured[256] + 10, 256), (measured[16], 16)]:
        codec = VQValueCodec(VQConfig(n_iter=4, fit_points=2048, token_norm=True), D, KV)
        codec.fit(values, byte_budget=ByteBudget(allowed, 500, 0))
        packed = codec.encode(values)
        assert codec.entries == expected and packed.nbytes() + codec.state_nbytes() == measured[expected] <= allowed
        fresh = VQValueCodec(codec.config, D, KV)
        fresh.load_state_dict(codec.state_dict())
        assert fresh.entries == expected and torch.equal(fresh.decode(packed), codec.decode(packed))
        assert codec.budget_met
    # Nothing fits. 16 entries' tokens alone would fit the layer's own share but for the fixed parts (a short prompt,
    # whatever other layers owe): the full codebook, since a smaller one would miss the target anyway. They would not
    # fit even so (the keys took too much): 16 entries.
    tokens_16 = parts[16][0]
    for allowed, fixed, carry, expected in [(measured[16] - 1, 0, 0, 256), (tokens_16 // 2, tokens_16, 0, 256),
                                            (tokens_16 // 2, 0, -tokens_16, 256), (tokens_16 // 2, 0, 0, 16), (tokens_16 // 2, 0, 10, 16)]:
        codec = VQValueCodec(VQConfig(n_iter=4, fit_points=2048, token_norm=True), D, KV)
        codec.fit(values, byte_budget=ByteBudget(allowed, 500, fixed, carry))
        assert codec.entries == expected and codec.budget_met is False
    with pytest.raises(ValueError, match="codebooks"):  # a size no budget chooses is refused on load
        VQValueCodec(VQConfig(), D, KV).load_state_dict({"scale": codec.scale, "codebooks": torch.zeros(1, 100, 4, dtype=torch.float16)})


def test_shard_byte_target_holds_the_cache_measured():
    """`shard:Rx` on a prompt long enough to reach R: once the prompt is encoded the cache holds at most 1/R of its fp16
    bytes (every tensor, measured, plus the copy of the key basis the CPU kernel derives), where plain Shard misses it,
    and the last layer, which takes what the others left, could not have used the next larger value codebook."""
    import warnings

    from tests.test_cache import _tiny

    import kvpack

    model = _tiny("llama")
    ids = torch.randint(0, 128, (2, 1200), generator=torch.Generator().manual_seed(5))
    caches = {}
    kvpack.enable(model)
    try:
        for method in ("shard:4.3x@window=16", "shard@window=16"):
            caches[method] = kvpack.KVCache(model, method)
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # the target is reachable: no warning
                with torch.no_grad():
                    model(ids, past_key_values=caches[method])
    finally:
        kvpack.disable(model)
    with pytest.warns(UserWarning, match=r"holds \d\.\d\dx fewer bytes than fp16 .*short of the method's 4.3x target: 2 of 2 layers"):
        kvpack.enable(model)
        try:
            with torch.no_grad():  # a short prompt: the exact sinks and window alone hold more than 1/4.3 of it
                model(ids[:, :200], past_key_values=kvpack.KVCache(model, "shard:4.3x@window=16"))
        finally:
            kvpack.disable(model)
    layers, plain = caches["shard:4.3x@window=16"].layers, caches["shard@window=16"].layers
    fp16 = sum(layer.batch * layer.kv_heads * layer.length * (layer.head_dim + layer.v_head_dim) * 2 for layer in layers)
    spent = sum(layer.nbytes() + layer._codecs["prefill_key"].state_nbytes() for layer in layers)
    assert spent <= fp16 / 4.3 < sum(layer.nbytes() for layer in plain)  # plain Shard (256 entries) misses the target
    last = layers[-1]
    vc = last._codecs["prefill_value"]
    indices = last.segments[0].values.indices  # (batch, kv_heads, tokens, bytes): 16 groups of 4 channels per row
    rows = indices.shape[0] * indices.shape[1] * indices.shape[2]
    grown = rows * (packed_length(16, vc.bits + 1) - packed_length(16, vc.bits)) + vc.entries * 4 * 2  # indices, codebook
    assert vc.entries < 256 and spent + grown > fp16 / 4.3
