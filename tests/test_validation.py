"""Bad input fails early and says what to do; awkward but valid input works.

Methods and codec options are checked when the cache is built (not at the first flush
mid-generate), head sizes that are not a multiple of 32 work, codecs reject integer or
mis-shaped tensors by name, NaN/Inf are refused where K/V are stored (and read nowhere else),
degenerate key blocks fit, and norms past fp16's range survive.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpack
from kvpack import _optional
from kvpack.cache.layer import check_new_states
from kvpack.codecs.base import group_query, ungroup
from kvpack.codecs.kivi import KiviCodec, KiviConfig
from kvpack.primitives import validation
from kvpack.primitives.rope import apply_rope, rope_cos_sin
from kvpack.registry import METHODS, CodecSpec, MethodConfig, get_method, list_methods, method

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _llama(head_dim: int = 64):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(head_dim=head_dim, **SMALL)).eval()


@pytest.fixture(scope="module")
def llama():
    return _llama()


# -- methods and options: rejected when the cache is built ------------------------------------------
@pytest.mark.parametrize(
    "name, match",
    [
        ("nope", r"unknown method 'nope'; available: fp16, int8, int8:rotated, turboquant:k4v4"),
        ("int8:foo", r"int8 takes no option or 'rotated' \(int8, int8:rotated\), got int8:foo"),
        ("fp16:1", r"'fp16' takes no options"),
        ("qjl:abc", r"qjl takes a sketch ratio.*positive number \(e.g. qjl:2, qjl:4\), got 'abc'"),
        ("qjl:0", r"qjl takes a sketch ratio"),
        ("kivi:3", r"kivi takes 2 or 4 bits \(kivi:2, kivi:4\), got '3'"),
        ("turboquant:k5v2", r"turboquant takes 'kXvY'"),
        ("shard:zip", r"shard takes a decode-stream codec in \['fp16', 'int8', 'k3v2', 'k4v2', 'tq4'\]"),
        ("shard:vq100", r"shard's value codebook vqN takes N in \(16, 32, 64, 128, 256\), got 'vq100'"),
        ("shard:vq64+vq32", r"shard takes a decode-stream codec .*, a value codebook vqN .* each at most once"),
        ("shard:e4", r"shard's key score error eN takes N in \('0.5', '1', '2', '3', '5'\) \(percent\), got 'e4'"),
        ("shard:e1+e2", r"shard takes a decode-stream codec .* key score error eN .* each at most once"),
    ],
)
def test_bad_method_names_fail_at_construction(llama, name, match):
    with pytest.raises(ValueError, match=match):
        kvpack.KVCache(llama, name)


def test_unknown_codec_option_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"codec 'kivi' has no option 'bitz'; its options are \['bits', 'axis', 'group_size'\]"):
        CodecSpec("kivi", {"bitz": 2})
    with pytest.raises(ValueError, match=r"codec 'int8' has no option 'scale'; its options are none"):
        CodecSpec("int8", {"scale": 1})


@pytest.mark.parametrize(
    "codec, options, match",
    [
        ("kivi", {"bits": 3}, r"codec 'kivi': bits must be one of \(2, 4\), got 3"),
        ("pca", {"scope": "row"}, r"codec 'pca': scope must be one of \['layer', 'head'\]"),
        ("vq", {"codebook_size": 1000}, r"codec 'vq': codebook_size must be in 2..256"),
        ("pca", {"rank": "high"}, r"codec 'pca'"),  # a TypeError inside the config becomes a ValueError naming the codec
    ],
)
def test_bad_codec_option_values_fail_when_the_spec_is_made(codec, options, match):
    with pytest.raises(ValueError, match=match):
        CodecSpec(codec, options)


def test_method_config_checks_its_fields():
    with pytest.raises(TypeError, match=r"key must be a CodecSpec"):
        MethodConfig("x", {"codec": "int8"}, CodecSpec("int8"))
    with pytest.raises(TypeError, match=r"window must be an int"):
        MethodConfig("x", CodecSpec("int8"), CodecSpec("int8"), window=6.5)


def test_options_that_need_the_head_size_fail_at_construction_not_mid_generate(llama):
    # group_size 5 does not divide head_dim 64: before, this surfaced at the first flush inside generate().
    method = MethodConfig("vq5", CodecSpec("int8"), CodecSpec("vq", {"group_size": 5}))
    with pytest.raises(ValueError, match=r"method 'vq5' cannot run on 'llama' with head_dim 64.*group_size 5 must divide head_dim 64"):
        kvpack.KVCache(llama, method)


@pytest.mark.parametrize("method", ["shard", "turboquant:k3v2+ropemean"])
def test_positions_reading_methods_from_a_config_read_the_rotary_module_transformers_builds(llama, method):
    """From the config alone, every layer's (inv_freq, attention scaling) is what the model's own rotary module holds."""
    from_config, from_model = kvpack.KVCache(llama.config, method), kvpack.KVCache(llama, method)
    for a, b in zip(from_config.layers, from_model.layers, strict=True):
        assert torch.equal(a.rope[0], b.rope[0]) and a.rope[1] == b.rope[1]


def test_a_config_without_a_readable_rotary_module_names_the_fix(llama, monkeypatch):
    from kvpack.cache import kvcache

    monkeypatch.setattr(kvcache, "rotary_from_config", lambda text: None)
    with pytest.raises(ValueError, match=r"reads token positions .* pass the model itself \(KVCache\(model, \.\.\.\)\)"):
        kvpack.KVCache(llama.config, "shard")
    kvpack.KVCache(llama.config, "int8")  # methods that keep RoPE'd keys need no rotary module


# -- list_methods is the registry -----------------------------------------------------------------
def test_list_methods_resolve_to_themselves():
    names = list_methods()
    assert names == ["fp16", "int8", "int8:rotated", "turboquant:k4v4", "turboquant:k3v3", "turboquant:k3v2", "turboquant:k3v3+qjl",
                     "turboquant:k3v2+ropemean", "turboquant:k3v2+ropemean+match", "polarquant-int4", "qjl", "kivi:4", "kivi:2", "shard", "kvquant:4", "kvquant:3", "kvquant:2", "subspace:2",
                     "tiered:512", "tiered:512:tq", "tiered:1024:shard", "int4"]
    assert [get_method(n).name for n in names] == names


def test_a_registered_method_is_listed(monkeypatch):
    monkeypatch.setattr("kvpack.registry._CANONICAL", list(list_methods()))
    monkeypatch.setitem(METHODS, "int8-long", None)

    @method("int8-long", "128", "256")
    def _build(arg: str) -> MethodConfig:
        return MethodConfig(f"int8-long:{arg}", CodecSpec("int8"), CodecSpec("int8"), window=int(arg))

    assert list_methods()[-2:] == ["int8-long:128", "int8-long:256"]
    assert get_method("int8-long:256").window == 256


# -- head sizes that are not a multiple of 32 -------------------------------------------------------
@pytest.mark.parametrize("head_dim", [48, 80])
@pytest.mark.parametrize("name", ["kivi:2", "kivi:4", "qjl"])
def test_odd_head_sizes_generate_like_the_uncompressed_cache(head_dim, name):
    model = _llama(head_dim)
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits[0, -1]

    @torch.no_grad()
    def last_logits(cache):
        model(ids[:, :149], past_key_values=cache, use_cache=True)  # 149 - 64 window - 4 sinks: a compressed segment
        return model(ids[:, 149:], past_key_values=cache, use_cache=True).logits[0, -1]

    cache = kvpack.KVCache(model, name)
    got = last_logits(cache)
    assert torch.isfinite(got).all()
    codec = "qjl" if name == "qjl" else "kivi"
    assert any(seg.startswith(f"stream:{codec}/kivi") for seg in cache.memory_report()["segments"])  # tokens were compressed
    kvpack.enable(model)  # compressed-domain attention (the padded channel group in scores / weighted_sum)
    try:
        torch.testing.assert_close(last_logits(kvpack.KVCache(model, name)), got, atol=1e-5, rtol=1e-4)
    finally:
        kvpack.disable(model)
    # A random 2-layer model: compressed logits stay close to the exact ones (cosine), far from noise.
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0) > 0.95


@pytest.mark.parametrize("head_dim, group", [(48, 32), (80, 32), (20, 8), (16, 32)])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_token_axis_partial_last_group(head_dim, group, bits):
    codec = KiviCodec(KiviConfig(bits, "token", group), head_dim, 2)
    x = torch.randn(2, 2, 37, head_dim, generator=torch.Generator().manual_seed(head_dim))
    packed = codec.encode(x)
    groups = -(-head_dim // min(group, head_dim))
    assert packed.codes.shape == (2, 2, 37, head_dim * bits // 8)
    assert packed.scale.shape == packed.zero.shape == (2, 2, 37, groups)
    y = codec.decode(packed)
    # Affine rounding: every value within half a step of its own group's (fp16-stored) scale.
    scale = packed.scale.float().repeat_interleave(min(group, head_dim), -1)[..., :head_dim]
    assert ((y - x).abs() <= scale / 2 + 1e-3).all()
    # The last, shorter group's range is its own channels' (padding repeats a channel, adds no range).
    last = x[..., (groups - 1) * min(group, head_dim):]
    torch.testing.assert_close(packed.zero.float()[..., -1], last.amin(-1), atol=2e-3, rtol=2e-3)
    # Compressed-domain attention equals decode-then-matmul.
    q, p = torch.randn(2, 4, 3, head_dim), torch.softmax(torch.randn(2, 4, 3, 37), -1)
    ref_scores = ungroup(group_query(q, 2) @ y.transpose(-1, -2), 4)
    torch.testing.assert_close(codec.scores(q, packed), ref_scores, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(codec.weighted_sum(p, packed), ungroup(group_query(p, 2) @ y, 4), atol=1e-4, rtol=1e-4)


# -- tensors a codec cannot take ------------------------------------------------------------------
@pytest.mark.parametrize("codec, options", [("int8", {}), ("turboquant", {"bits": 3}), ("kivi", {"bits": 2, "axis": "token"}), ("qjl", {}), ("pca", {}), ("vq", {})])
def test_codecs_reject_integer_and_3d_keys_by_name(codec, options):
    c = CodecSpec(codec, options).build(64, 2)
    with pytest.raises(TypeError, match=r"x must be float16, bfloat16, float32 or float64 .* got torch.int64"):
        c.encode(torch.ones(1, 2, 32, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x must have shape \(batch, kv_heads, tokens, head_dim\), got rank 3 shape \(2, 32, 64\)"):
        c.encode(torch.randn(2, 32, 64))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor"):
        c.encode([[0.0] * 64])


# -- NaN/Inf: refused where K/V are stored, read nowhere else -------------------------------------------
def test_nan_is_refused_where_it_would_be_stored_on_cpu():
    nan = torch.randn(1, 2, 5, 64).index_fill_(2, torch.tensor([3]), float("nan"))
    with pytest.raises(ValueError, match="contain NaN or Inf, so nothing was stored"):
        check_new_states(nan, torch.randn(1, 2, 5, 64), 0)
    with pytest.raises(ValueError, match="x contains 128 NaN/Inf values"):
        CodecSpec("int8").build(64, 2).encode(nan)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_non_finite_count_is_exact_when_the_fast_sum_overflows(dtype):
    """The count against `isfinite`, elementwise: finite values whose sum overflows (a false alarm to clear),
    NaN, and +Inf with -Inf (whose sum is NaN)."""
    big = torch.finfo(dtype).max
    cases = [torch.full((3, 5), big, dtype=dtype), torch.randn(3, 5).to(dtype)]
    cases.append(cases[1].clone().index_fill_(1, torch.tensor([2]), float("nan")))
    cases.append(torch.tensor([float("inf"), -float("inf"), 1.0], dtype=dtype))
    for x in cases:
        assert validation.count_non_finite(x) == int((~torch.isfinite(x)).sum())
    assert [validation.count_non_finite(x) for x in cases] == [0, 0, 3, 2]


def test_value_checks_read_nothing_off_the_cpu_unless_debug(monkeypatch):
    """A `meta` tensor has no values: reading one raises, as a host sync would cost on an accelerator. By default
    neither the cache's check nor a codec's encode reads any (structure is still checked); KVPACK_DEBUG=1 reads."""
    meta = torch.empty(1, 2, 5, 64, device="meta")
    codec = CodecSpec("int8").build(64, 2)
    check_new_states(meta, meta, 0)
    assert codec.encode(meta).codes.device.type == "meta"
    with pytest.raises(ValueError, match="3 kv heads"):
        codec.encode(torch.empty(1, 3, 5, 64, device="meta"))
    monkeypatch.setattr(validation, "DEBUG", True)
    for call in (lambda: check_new_states(meta, meta, 0), lambda: codec.encode(meta)):
        with pytest.raises(RuntimeError, match="meta tensors"):
            call()


def test_attention_calls_read_no_values_a_nan_query_row_stays_its_own():
    """No finiteness pass per `scores` call (one per segment, layer and decode step): a NaN query reaches only its
    own row of scores, which is all attention would have given it anyway; the cache is untouched."""
    codec = CodecSpec("turboquant", {"bits": 3}).build(64, 2)
    packed = codec.encode(torch.randn(1, 2, 40, 64))
    q = torch.randn(1, 4, 2, 64)
    q[0, 1, 0, 7] = float("nan")
    scores = codec.scores(q, packed)
    ref = ungroup(group_query(q, 2) @ codec.decode(packed).transpose(-1, -2), 4)
    assert scores[0, 1, 0].isnan().all() and scores.isnan().sum() == 40  # that row's 40 tokens, nothing else
    torch.testing.assert_close(scores.nan_to_num(), ref.nan_to_num(), atol=1e-4, rtol=1e-4)


# -- degenerate key blocks --------------------------------------------------------------------------
@pytest.mark.parametrize("keys", ["zeros", "constant"])
@pytest.mark.parametrize("scope", ["layer", "head"])
def test_pca_fits_a_degenerate_block_and_scores_it(keys, scope):
    """Zero keys, or keys whose un-RoPEd form is one constant vector: no variance for the PCA to find."""
    inv_freq = 1.0 / 10000 ** (torch.arange(32) / 32)
    codec = CodecSpec("pca", {"scope": scope}).build(64, 2)
    codec.set_rope(inv_freq)
    pos = torch.arange(40).expand(2, -1)
    x = torch.zeros(2, 2, 40, 64) if keys == "zeros" else apply_rope(torch.ones(2, 2, 40, 64), *rope_cos_sin(pos, inv_freq, 1.0))
    packed = codec.encode(x, pos)  # before: a rank-0 fit, then a reshape error in scores
    assert codec.rank >= 1
    decoded = codec.decode(packed, pos)
    q, q_pos = torch.randn(2, 4, 1, 64), torch.full((2, 1), 40)
    ref = ungroup(group_query(q, 2) @ decoded.transpose(-1, -2), 4)
    torch.testing.assert_close(codec.scores(q, packed, q_pos, pos), ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(decoded, x, atol=1e-2, rtol=0)


def test_shard_cache_with_all_zero_keys_decodes(llama):
    cache = kvpack.KVCache(llama, "shard")
    zeros = torch.zeros(1, 2, 200, 64)
    for layer in range(2):
        keys, values = cache.update(zeros, zeros, layer)
        assert torch.equal(keys, zeros) and torch.equal(values, zeros)
    keys, _ = cache.update(torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 64), 0)
    assert keys.shape == (1, 2, 201, 64) and torch.equal(keys, torch.zeros_like(keys))


# -- norms past fp16's range ------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["qjl", "polarquant-int4"])
def test_key_norm_past_fp16_range_round_trips(codec):
    """A key of norm 1e5 (> 65504) decodes finite, as the same key at unit norm scaled up (both codecs are scale-equivariant)."""
    c = CodecSpec(codec).build(64, 2)
    x = torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(0))
    c.fit(x)  # QJL picks its outlier channels from the normal block
    unit = x[:, :, 5:6] / x[:, :, 5:6].norm(dim=-1, keepdim=True)
    big = x.clone()
    big[:, :, 5:6] = unit * 1e5
    packed = c.encode(big)
    decoded = c.decode(packed)
    assert torch.isfinite(decoded).all()
    reference = c.decode(c.encode(unit)) * 1e5
    torch.testing.assert_close(decoded[:, :, 5:6], reference, rtol=1e-3, atol=1e-3 * 1e5 / 8)
    q = torch.randn(1, 4, 1, 64)
    scores = c.scores(q, packed)
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(scores, ungroup(group_query(q, 2) @ decoded.transpose(-1, -2), 4), rtol=1e-4, atol=1e-2)
    # The other tokens are coded as without the large one.
    # The other tokens are coded as without the large one (up to their norms' fp16 rounding, 2^-11).
    torch.testing.assert_close(decoded[:, :, :5], c.decode(c.encode(x[:, :, :5])), rtol=1e-3, atol=1e-3)


def test_qjl_keeps_fp16_norms_when_they_fit_and_concatenates_both():
    from kvpack.codecs import concat_packed

    c = CodecSpec("qjl").build(64, 2)
    x = torch.randn(1, 2, 8, 64)
    small, large = c.encode(x), c.encode(x * 1e5)
    assert small.norm.dtype == torch.float16 and large.norm.dtype == torch.float32
    both = concat_packed([small, large])
    torch.testing.assert_close(c.decode(both)[:, :, 8:], c.decode(small) * 1e5, rtol=1e-3, atol=1.0)


# -- optional dependencies --------------------------------------------------------------------------
def test_missing_optional_package_names_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r'progress needs the optional package .tqdm.*pip install "kvpack\[eval\]"') as err:
        _optional.require("tqdm.auto", "progress")
    assert 'pip install -e ".[eval]"' in str(err.value)
    monkeypatch.setitem(sys.modules, "optimum", None)
    monkeypatch.setitem(sys.modules, "optimum.quanto", None)
    with pytest.raises(ImportError, match=r"the peer hf-quanto:4 needs the optional package 'optimum-quanto'.*kvpack\[peers\]"):
        with _optional.install_hint("the peer hf-quanto:4"):
            import optimum.quanto  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="kvpack_no_such_module"), _optional.install_hint("x"):
        import kvpack_no_such_module  # noqa: F401  (not an optional package of ours: left as it is)


def test_peer_with_missing_backend_names_the_install_line(llama, monkeypatch):
    from kvpack.peers import PeerUnavailable, build_peer

    monkeypatch.setattr("transformers.cache_utils.is_hqq_available", lambda: False)  # how transformers sees hqq missing
    with pytest.raises(PeerUnavailable, match=r"hf-hqq:4: the peer hf-hqq:4 needs the optional package 'hqq'.*pip install \"kvpack\[peers\]\""):
        build_peer(llama, "hf-hqq:4")


def test_core_imports_and_runs_without_the_eval_extras():
    """`import kvpack` and the default method on a model, with every optional package made unimportable."""
    blocked = ["matplotlib", "gguf", "accelerate", "optimum", "optimum.quanto", "hqq", "scipy"]
    script = textwrap.dedent(f"""
        import sys
        for name in {blocked!r}:
            sys.modules[name] = None
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        import kvpack
        model = LlamaForCausalLM(LlamaConfig(**{SMALL!r})).eval()
        cache = kvpack.KVCache(model, "turboquant:k3v2")
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 100)), past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 100
        own = [m for m in sys.modules if m.startswith("kvpack")]
        assert not any(m.startswith(("kvpack.eval", "kvpack.cli", "kvpack.bench")) for m in own), own
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_abs_max_is_the_largest_magnitude_and_carries_nan_and_inf(dtype):
    """`abs_max` against `x.abs().max()` elementwise, with NaN wherever a NaN is (first, last, beside an Inf) and
    inf for +Inf or -Inf alone: one pass serves both of the cache's checks on new K/V."""
    x = torch.randn(2, 3, 7, 16).to(dtype)
    assert validation.abs_max(x) == float(x.abs().max()) and validation.abs_max(x[:, :, :0]) == 0.0
    for index in (0, -1):
        for bad, expected in ((float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "inf")):
            y = x.clone().flatten()
            y[index] = bad
            got = validation.abs_max(y.view_as(x))
            assert (got != got) if expected == "nan" else got == float("inf")
    both = torch.tensor([float("inf"), 1.0, float("nan")], dtype=dtype)
    assert validation.abs_max(both) != validation.abs_max(both)
