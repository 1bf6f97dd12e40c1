"""Saving and loading caches: bit-exact round trips for every method (plain and entropy-coded), generation that
continues exactly as without the round trip, codec state, and refusal of every file that must not load
(another model, another version, truncated, a flipped byte, missing, a failed write)."""

from __future__ import annotations

import copy
import dataclasses
import os
import stat
import sys
import warnings

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM
from transformers.cache_utils import DynamicSlidingWindowLayer

import kvpack
from kvpack import support
from kvpack.cache import KVPackLayer, serialize
from kvpack.cache.serialize import CacheFileError, MissingCacheFileError, load_cache, read_header, save_cache
from kvpack.codecs.base import Codec
from kvpack.codecs.pca import PCAConfig, PCAKeyCodec
from kvpack.codecs.qjl import QJLCodec, QJLConfig
from kvpack.codecs.turboquant import TurboQuantCodec, TurboQuantConfig
from kvpack.codecs.vq import VQConfig, VQValueCodec
from kvpack.models import tiny_random_model
from kvpack.registry import CodecSpec, LayerCodecs, MethodConfig

PROMPT, DECODE = 160, 64  # a prompt past sinks + window + a KIVI group; 64 decoded tokens flush one stream block


@pytest.fixture(scope="module")
def tiny():
    model, _ = tiny_random_model(seed=0)
    yield model
    kvpack.disable(model)


def _ids(n: int = PROMPT, batch: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(n))


@torch.no_grad()
def _generate(model, seq: torch.Tensor, cache, n: int, enabled: bool = True, **kwargs):
    """(sequence so far + n greedy tokens, the n score rows) with `cache` holding all of `seq` but its last token (or empty)."""
    (kvpack.enable if enabled else kvpack.disable)(model)
    try:
        out = model.generate(
            seq, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_scores=True, **kwargs
        )
    finally:
        kvpack.disable(model)
    return out.sequences, torch.stack(out.scores)


@torch.no_grad()
def _filled(model, method, enabled: bool = True, ids: torch.Tensor | None = None, decode: int = 0, **kwargs):
    """A cache holding a prompt (its prefill segment) and then `decode` greedy tokens, and the sequence it continues from."""
    cache = kvpack.KVCache(model, method)
    ids = _ids() if ids is None else ids
    if decode:
        return cache, _generate(model, ids, cache, decode, enabled, **kwargs)[0]
    (kvpack.enable if enabled else kvpack.disable)(model)
    try:
        model(ids[:, :-1], past_key_values=cache, use_cache=True, **{k: v[:, :-1] for k, v in kwargs.items()})
    finally:
        kvpack.disable(model)
    return cache, ids


def _snapshot(cache) -> dict:
    """Every piece of state a cache holds, read through the cache's own objects (not the file)."""
    out: dict = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            out[f"{i}"] = (layer.is_initialized, layer.cumulative_length, layer.record_past)
            out[f"{i}.kv"] = (layer.keys, layer.values) if layer.is_initialized else None
            continue
        out[f"{i}"] = layer.is_initialized
        if not layer.is_initialized:
            continue
        out[f"{i}.scalars"] = (layer.length, layer.updates, layer.batch, layer.kv_heads, layer.head_dim, layer.v_head_dim, layer.dtype, layer.exact_dtype)
        for part in ("sink_k", "sink_v", "win_k", "win_v", "pos_offset", "pad"):
            out[f"{i}.{part}"] = getattr(layer, part, None)
        for name, codec in layer._codecs.items():
            out[f"{i}.{name}"] = (type(codec), codec.config)
            out.update({f"{i}.{name}.{k}": v for k, v in codec.state_dict().items()})
        for j, seg in enumerate(layer.segments):
            out[f"{i}.{j}"] = (seg.kind, seg.start, seg.length, type(seg.keys), type(seg.values))
            for side, packed in (("k", seg.keys), ("v", seg.values)):
                out.update({f"{i}.{j}.{side}.{f.name}": getattr(packed, f.name) for f in dataclasses.fields(packed)})
        for n, a in enumerate(layer.anchors.parts if layer.anchors is not None else ()):  # one part per segment holding some
            out[f"{i}.anchors.{n}"] = (a.index, a.k, a.v, a.source_kind, type(a.key_codec), type(a.value_codec))
            for side, packed in (("k", a.keys), ("v", a.values)):
                out.update({f"{i}.anchors.{n}.{side}.{f.name}": getattr(packed, f.name) for f in dataclasses.fields(packed)})
        out[f"{i}.dequantized"] = layer.dequantized()  # every codec's full state (seeded rotations included) at work
    return out


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), where
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y, where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _assert_same_state(a, b) -> None:
    sa, sb = _snapshot(a), _snapshot(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        _assert_same(sa[key], sb[key], key)


# -- round trips -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [*kvpack.list_methods(), "turboquant:k3v2@anchors=5%", "shard@anchors=5%", "shard:k3v2@anchors=5%",
                                    "turboquant:k3v2+ropemean+tcq"])
def test_round_trip_is_bit_exact_and_generation_continues_identically(tiny, method, tmp_path):
    cache, seq = _filled(tiny, method)
    assert bool(cache.method.anchors) == all(layer.anchors is not None for layer in cache.compressed_layers())
    plain = save_cache(cache, tmp_path / "plain.kvpack")
    packed = save_cache(cache, tmp_path / "z.kvpack", compress=True)
    assert plain["bytes_on_disk"] == (tmp_path / "plain.kvpack").stat().st_size and plain["tokens"] == PROMPT - 1
    assert packed["bytes_on_disk"] < plain["bytes_on_disk"]  # fp16 scales and windows alone have low-entropy high bytes
    assert not read_header(tmp_path / "plain.kvpack")["compressed"] and read_header(tmp_path / "z.kvpack")["compressed"]
    loaded = load_cache(tmp_path / "plain.kvpack", tiny)
    _assert_same_state(cache, loaded)
    _assert_same_state(cache, load_cache(tmp_path / "z.kvpack", tiny))
    # 64 more tokens: the loaded cache flushes a stream block with its restored (not refitted) codecs.
    expected, expected_scores = _generate(tiny, seq, cache, DECODE)
    got, got_scores = _generate(tiny, seq, loaded, DECODE)
    assert torch.equal(got, expected) and torch.equal(got_scores, expected_scores)
    _assert_same_state(cache, loaded)


@pytest.mark.parametrize("method", ["int8", "shard", "kivi:2"])
def test_round_trip_without_kvpack_attention(tiny, method, tmp_path):
    cache, seq = _filled(tiny, method, enabled=False)
    save_cache(cache, tmp_path / "c")
    loaded = load_cache(tmp_path / "c", tiny)
    _assert_same_state(cache, loaded)
    assert torch.equal(_generate(tiny, seq, loaded, 8, enabled=False)[1], _generate(tiny, seq, cache, 8, enabled=False)[1])


@pytest.fixture(scope="module")
def shard(tiny):
    """(a Shard cache with prefill and stream segments, its sequence): shared read-only, its fit is the slow part."""
    return _filled(tiny, "shard", decode=DECODE)


def test_segments_share_the_layer_codecs_after_loading(tiny, shard, tmp_path):
    cache, seq = shard
    save_cache(cache, tmp_path / "c")
    loaded = load_cache(tmp_path / "c", tiny)
    _assert_same_state(cache, loaded)
    expected = _generate(tiny, seq, copy.deepcopy(cache), 8)[1]
    assert torch.equal(_generate(tiny, seq, loaded, 8)[1], expected)
    for layer in loaded.layers:
        assert [seg.kind for seg in layer.segments] == ["prefill", "stream"]
        codecs = layer._codecs
        prefill, stream = layer.segments
        assert prefill.key_codec is codecs["prefill_key"] and prefill.value_codec is codecs["prefill_value"]
        assert stream.key_codec is codecs["stream_key"] and stream.value_codec is codecs["stream_value"]


def test_left_padded_batch_round_trip(tiny, tmp_path):
    ids = _ids(batch=2)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0  # row 1 is left padded
    cache, seq = _filled(tiny, "turboquant:k3v2", ids=ids, decode=8, attention_mask=mask)
    assert cache.layers[0].pad.tolist() == [0, 23]  # the snapshot compares pad and pos_offset
    save_cache(cache, tmp_path / "c")
    loaded = load_cache(tmp_path / "c", tiny)
    _assert_same_state(cache, loaded)
    full = torch.cat([mask, torch.ones(2, seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    expected = _generate(tiny, seq, cache, 8, attention_mask=full)[1]
    assert torch.equal(_generate(tiny, seq, loaded, 8, attention_mask=full)[1], expected)


def _hybrid():
    """Gemma3 text with one sliding and one full-attention layer (window 16)."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("method", ["int8", "shard", "int8@sliding=exact", "shard@sliding=exact"])
def test_sliding_window_layers_round_trip(method, tmp_path):
    model = _hybrid()
    cache = kvpack.KVCache(model, method)
    seq, _ = _generate(model, _ids(vocab=64), cache, 20)
    first = cache.layers[0]
    if method.endswith("exact"):
        assert isinstance(first, DynamicSlidingWindowLayer) and first.cumulative_length == seq.shape[1] - 1
    else:  # coded windows by default
        assert isinstance(first, KVPackLayer) and first.sliding_window and first.length == seq.shape[1] - 1
    save_cache(cache, tmp_path / "c", compress=True)
    loaded = load_cache(tmp_path / "c", model)
    _assert_same_state(cache, loaded)
    assert torch.equal(_generate(model, seq, loaded, 20)[1], _generate(model, seq, cache, 20)[1])


def test_a_method_saved_before_windows_could_be_coded_loads_with_exact_windows():
    """Files written before `MethodConfig.sliding` existed have no such field; their sliding layers were exact."""
    from kvpack.cache.serialize import method_from_json, method_to_json

    saved = method_to_json(kvpack.get_method("int8@sliding=exact"))
    del saved["sliding"]
    assert method_from_json(saved).sliding_method() is None
    assert method_from_json(method_to_json(kvpack.get_method("int8"))).sliding_method().key.codec == "int8_rotated"


def test_a_cache_saved_when_auto_windows_were_plain_int8_loads_them_as_plain_int8(tmp_path, monkeypatch):
    """"auto" names what the release codes windows with. A file written while it meant plain int8 rows (and did not
    record it) must load those rows with the plain int8 codec, not today's rotated one, and continue alike."""
    import kvpack.cache.serialize as serialize
    from kvpack import registry

    model = _hybrid()
    with monkeypatch.context() as m:  # the earlier release: "auto" was plain int8, and files did not say so
        m.setattr(registry, "AUTO_SLIDING_METHOD", "int8")
        to_json = serialize.method_to_json
        m.setattr(serialize, "method_to_json", lambda method: {k: v for k, v in to_json(method).items() if k != "sliding_auto"})
        cache = kvpack.KVCache(model, "int8")
        assert cache.layers[0].method.key.codec == "int8"
        seq, _ = _generate(model, _ids(vocab=64), cache, 20)
        save_cache(cache, tmp_path / "c")
    loaded = load_cache(tmp_path / "c", model)
    assert loaded.method.sliding == "int8" and loaded.layers[0].method.key.codec == "int8"
    _assert_same_state(cache, loaded)
    assert torch.equal(_generate(model, seq, loaded, 20)[1], _generate(model, seq, cache, 20)[1])
    # today's files record it, and load as they were written
    fresh = kvpack.KVCache(model, "int8")
    _generate(model, _ids(vocab=64), fresh, 20)
    save_cache(fresh, tmp_path / "d")
    again = load_cache(tmp_path / "d", model)
    assert again.method == fresh.method and again.layers[0].method.key.codec == "int8_rotated"


def test_all_sliding_model_round_trip(tmp_path):
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "every layer is sliding-window": expected here
        cache = kvpack.KVCache(model, "int8")
        seq, _ = _generate(model, _ids(60, vocab=64), cache, 10)
        save_cache(cache, tmp_path / "c")
        loaded = load_cache(tmp_path / "c", model)
    _assert_same_state(cache, loaded)
    assert torch.equal(_generate(model, seq, loaded, 10)[1], _generate(model, seq, cache, 10)[1])


def test_empty_cache_round_trip(tiny, tmp_path):
    save_cache(kvpack.KVCache(tiny, "int8"), tmp_path / "c")
    loaded = load_cache(tmp_path / "c", tiny)
    assert not any(layer.is_initialized for layer in loaded.layers)
    assert torch.equal(_generate(tiny, _ids(), loaded, 4)[1], _generate(tiny, _ids(), kvpack.KVCache(tiny, "int8"), 4)[1])


def test_custom_method_config_round_trips(tiny, tmp_path):
    method = MethodConfig(
        "mine", CodecSpec("turboquant", {"bits": 3, "center": True, "channel_scale": 0.25}), CodecSpec("int8"),
        prefill_key=CodecSpec("pca", {"energy": 0.8, "scope": "head"}), prefill_value=CodecSpec("vq", {"group_size": 8, "token_norm": True}),
        sink_tokens=2, window=32, block_size=16, exact_dtype="bfloat16",
    )
    cache, seq = _filled(tiny, method)
    save_cache(cache, tmp_path / "c", compress=True)
    loaded = load_cache(tmp_path / "c", tiny)
    assert loaded.method == method and read_header(tmp_path / "c")["method"]["registered"] is False
    _assert_same_state(cache, loaded)
    assert torch.equal(_generate(tiny, seq, loaded, 20)[1], _generate(tiny, seq, cache, 20)[1])


def test_per_layer_codecs_round_trip(tiny, tmp_path):
    """An auto-style method (TurboQuant widths per layer and per K/V) saves and loads bit for bit, and continues identically."""
    tq = lambda side, bits: getattr(kvpack.get_method(f"turboquant:k{bits}v{bits}"), side)  # noqa: E731
    method = MethodConfig(
        "mixed", tq("key", 4), tq("value", 4), layer_codecs=(LayerCodecs((1,), tq("key", 3), tq("value", 2)), LayerCodecs((0,), tq("key", 2), tq("value", 4)))
    )
    cache, seq = _filled(tiny, method)
    save_cache(cache, tmp_path / "c")
    loaded = load_cache(tmp_path / "c", tiny)
    assert loaded.method == method and [layer.method for layer in loaded.layers] == [method.for_layer(0), method.for_layer(1)]
    assert [layer._codecs["stream_value"].config.bits for layer in loaded.layers] == [4, 2]
    _assert_same_state(cache, loaded)
    expected, expected_scores = _generate(tiny, seq, cache, DECODE)
    got, got_scores = _generate(tiny, seq, loaded, DECODE)
    assert torch.equal(got, expected) and torch.equal(got_scores, expected_scores)
    _assert_same_state(cache, loaded)


def test_token_ids_are_kept_in_the_header(tiny, tmp_path):
    cache, seq = _filled(tiny, "int8")
    save_cache(cache, tmp_path / "c", token_ids=seq[:, :-1])
    header = read_header(tmp_path / "c")
    assert torch.equal(header["token_ids"], seq[:, :-1]) and header["tokens"] == seq.shape[1] - 1
    assert header["kvpack_version"] == kvpack.__version__ and header["format_version"] == serialize.FORMAT_VERSION
    with pytest.raises(ValueError, match=f"token_ids hold {seq.shape[1]} tokens but the cache holds {seq.shape[1] - 1}"):
        save_cache(cache, tmp_path / "d", token_ids=seq)


def test_layer_attributes_are_all_saved_or_rebuilt(shard):
    """A new KVPackLayer attribute fails here until serialize.py saves it (or lists it as rebuilt)."""
    assert set(vars(shard[0].layers[0])) - serialize.LAYER_ATTRIBUTES == set()


def test_save_refuses_a_layer_mid_forward(tiny, tmp_path):
    cache, _ = _filled(tiny, "int8")
    cache.layers[1].pending_attention = True
    with pytest.raises(ValueError, match="between forward passes"):
        save_cache(cache, tmp_path / "c")
    assert not (tmp_path / "c").exists()


# -- refusals ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(shard, tmp_path_factory):
    """{compress: path} of one shard cache, plain and entropy-coded."""
    root = tmp_path_factory.mktemp("saved")
    paths = {c: root / f"shard-{c}.kvpack" for c in (False, True)}
    for c, p in paths.items():
        save_cache(shard[0], p, compress=c)
    return paths


def _copy(src, dst, data: bytes | None = None):
    dst.write_bytes(src.read_bytes() if data is None else data)
    return dst


@pytest.mark.parametrize("make", [lambda: tiny_random_model(seed=0)[0], _hybrid], ids=["llama", "gemma3-hybrid"])
def test_model_fingerprint_is_what_a_cache_for_it_records(make):
    model = make()
    assert serialize.model_fingerprint(model) == serialize.fingerprint(kvpack.KVCache(model, "shard"))
    assert any(serialize.model_fingerprint(model)["rope"])


def test_refuses_another_architecture(saved, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, head_dim=64, num_key_value_heads=2)
    other = LlamaForCausalLM(config).eval()
    with pytest.raises(CacheFileError, match=r"num_hidden_layers: file 2, model 3"):
        load_cache(saved[False], other)


def test_refuses_other_rotary_parameters(saved):
    model, _ = tiny_random_model(seed=0)
    model.model.rotary_emb.inv_freq.mul_(0.5)  # same config fields, other frequencies
    with pytest.raises(CacheFileError, match=r"rotary parameters .* layers \[0, 1\]"):
        load_cache(saved[False], model)


def test_refuses_another_dtype(saved):
    model, _ = tiny_random_model(seed=0, dtype=torch.bfloat16)
    with pytest.raises(CacheFileError, match=r"float32 model, this model runs bfloat16: load the model with dtype=torch.float32"):
        load_cache(saved[True], model)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("keep", [0.5, 0.99, 8, 3])
def test_refuses_a_truncated_file(tiny, saved, tmp_path, compress, keep):
    data = saved[compress].read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    path = _copy(saved[compress], tmp_path / "c", data[:n])
    with pytest.raises(CacheFileError, match="truncated or corrupted"):
        load_cache(path, tiny)


@pytest.mark.parametrize("compress", [False, True])
def test_refuses_any_flipped_byte(tiny, saved, tmp_path, compress):
    data = saved[compress].read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    gen = torch.Generator().manual_seed(0)
    picks = [0, 5, 9, header // 2, header - 1, header, len(data) // 2, len(data) - 1]
    picks += torch.randint(0, header, (24,), generator=gen).tolist() + torch.randint(header, len(data), (24,), generator=gen).tolist()
    for pos in picks:
        flipped = bytearray(data)
        flipped[pos] ^= 0xFF
        with pytest.raises(CacheFileError):
            load_cache(_copy(saved[compress], tmp_path / "c", bytes(flipped)), tiny)


def test_refuses_another_format_version(tiny, tmp_path, monkeypatch):
    cache, _ = _filled(tiny, "int8")
    monkeypatch.setattr(serialize, "FORMAT_VERSION", 2)
    save_cache(cache, tmp_path / "c")
    monkeypatch.undo()
    with pytest.raises(CacheFileError, match=r"format version 2 .* reads version 1"):
        load_cache(tmp_path / "c", tiny)


def test_refuses_a_missing_file(tiny, tmp_path):
    with pytest.raises(MissingCacheFileError, match="no cache file at") as err:
        load_cache(tmp_path / "nope", tiny)
    assert isinstance(err.value, ValueError) and isinstance(err.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        read_header(tmp_path / "nope")


def test_refuses_a_safetensors_file_that_is_not_a_cache(tiny, tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(3)}, tmp_path / "model.safetensors")
    with pytest.raises(CacheFileError, match="not a kvpack cache file"):
        load_cache(tmp_path / "model.safetensors", tiny)


@pytest.mark.parametrize("spec", ["os:system", "kvpack.codecs.base:Codec", "kvpack.codecs.int8:Int8Codec", "kvpack.not_a_module:X", "kvpack.codecs.int8:__class__"])
def test_only_kvpack_packed_classes_are_rebuilt(spec):
    with pytest.raises(CacheFileError, match="not a kvpack Packed dataclass"):
        serialize._packed_class(spec)
    from kvpack.codecs.int8 import Int8Packed

    assert serialize._packed_class("kvpack.codecs.int8:Int8Packed") is Int8Packed


def _failing_write(f, data: bytes) -> None:
    f.write(data[: len(data) // 2])
    raise OSError("disk full (simulated)")


def test_failed_write_leaves_no_file(tiny, tmp_path, monkeypatch):
    cache, _ = _filled(tiny, "int8")
    monkeypatch.setattr(support, "write_bytes", _failing_write)
    with pytest.raises(OSError, match="simulated"):
        save_cache(cache, tmp_path / "c")
    assert os.listdir(tmp_path) == []  # neither the file nor a temporary one


def test_failed_write_keeps_the_old_file(tiny, saved, tmp_path, monkeypatch):
    path = _copy(saved[False], tmp_path / "c")
    before = path.read_bytes()
    cache, _ = _filled(tiny, "int8")
    monkeypatch.setattr(support, "write_bytes", _failing_write)
    with pytest.raises(OSError, match="simulated"):
        save_cache(cache, path, compress=True)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["c"]
    assert load_cache(path, tiny).method.name == "shard"


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_saved_file_gets_the_mode_a_plain_open_would_give(tiny, tmp_path):
    save_cache(kvpack.KVCache(tiny, "int8"), tmp_path / "c")  # the temporary file is made with 0o666 minus the umask
    (tmp_path / "reference").write_bytes(b"")
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == stat.S_IMODE((tmp_path / "reference").stat().st_mode)


def test_compress_without_zstandard_names_the_extra(tiny, saved, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(ImportError, match=r"kvpack\[store\]"):
        save_cache(kvpack.KVCache(tiny, "int8"), tmp_path / "c", compress=True)
    with pytest.raises(ImportError, match=r"kvpack\[store\]"):
        load_cache(saved[True], tiny)


# -- the entropy-coded form --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", serialize.LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 3, 17, 5), (1, 1, 0, 64), (4,), (), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int8, torch.int64])
def test_byte_layouts_invert(layout, shape, dtype):
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)
    chunks = serialize._layout(t, layout)
    data = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    assert data.dtype == torch.uint8 and data.numel() == t.numel() * t.element_size()
    assert torch.equal(serialize._unlayout(data.clone(), dtype, list(shape), layout), t)


def test_channel_layout_brings_zstd_to_the_entropy_of_each_channel():
    """2-bit codes, 4 per byte, in 4 byte columns (channel groups) each with its own code distribution.

    Laid out by channel, every zstd block holds one column's i.i.d. bytes, so its Huffman literals cost at most
    the byte entropy 4·H(p) plus Gallager's redundancy bound p_max + 0.086 bits per byte (p_max: the likeliest
    byte's probability), plus a few hundred bytes of headers and tables; and no coder beats the entropy.
    """
    zstd = pytest.importorskip("zstandard")
    gen = torch.Generator().manual_seed(0)
    tokens = 1 << 15
    probs = [torch.tensor(p) for p in ([0.7, 0.1, 0.1, 0.1], [0.25] * 4, [0.05, 0.45, 0.45, 0.05], [0.97, 0.01, 0.01, 0.01])]
    cols = []
    for p in probs:
        codes = torch.multinomial(p, tokens * 4, replacement=True, generator=gen).view(tokens, 4)
        cols.append((codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6).to(torch.uint8))
    t = torch.stack(cols, -1).view(1, 1, tokens, len(probs))  # (batch, heads, tokens, byte columns)
    entropy = sum(tokens * 4 * float(-(p * p.log2()).sum()) for p in probs) / 8
    huffman = entropy + sum(tokens * (float(p.max()) ** 4 + 0.086) for p in probs) / 8
    compressor = zstd.ZstdCompressor(level=serialize.ZSTD_LEVEL)
    size = len(serialize._frame(serialize._layout(t, "channels"), compressor, zstd))
    assert entropy <= size + 100 and size <= huffman + 400
    raw = len(serialize._frame(serialize._layout(t, "raw"), compressor, zstd))
    assert size < 0.95 * raw  # interleaved columns share one table per block: the mixture costs more
    packed, streams = serialize._compress({"t": t}, zstd)
    assert streams["t"]["layout"] == "channels" and packed["t"].numel() == size + 4  # + the frame checksum


# -- codec state -------------------------------------------------------------------------------------------
KV, D = 2, 64


def _codecs() -> list[tuple[str, Codec, Codec]]:
    """(id, fitted-to-be codec, a fresh twin) pairs over every codec with fitted state."""
    cases = [
        ("turboquant-center-scale", lambda: TurboQuantCodec(TurboQuantConfig(bits=3, center=True, channel_scale=0.5), D, KV, 1)),
        ("turboquant-qjl-center", lambda: TurboQuantCodec(TurboQuantConfig(bits=3, qjl=True, center=True), D, KV, 1)),
        ("qjl", lambda: QJLCodec(QJLConfig(), D, KV, 1)),
        ("vq-layer", lambda: VQValueCodec(VQConfig(codebook_size=16, n_iter=4, token_norm=True), D, KV, 1)),
        ("vq-head", lambda: VQValueCodec(VQConfig(codebook_size=16, n_iter=4, scope="head"), D, KV, 1)),
        ("pca-int8-basis", lambda: PCAKeyCodec(PCAConfig(), D, KV, 1)),
        ("pca-fp16-basis-head", lambda: PCAKeyCodec(PCAConfig(basis_bits=16, scope="head", rank=24), D, KV, 1)),
    ]
    return [(name, make(), make()) for name, make in cases]


@pytest.mark.parametrize("name, codec, twin", _codecs(), ids=[c[0] for c in _codecs()])
def test_codec_state_dict_restores_the_fitted_codec(name, codec, twin):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, KV, 300, D, generator=gen) * torch.linspace(0.1, 3, D) + 0.5
    pos = torch.arange(300).expand(2, -1)
    codec.fit(x, pos)
    state = codec.state_dict()
    assert state and all(isinstance(t, torch.Tensor) for t in state.values())
    assert twin.state_dict() == {}
    twin.load_state_dict({k: v.clone() for k, v in state.items()})
    y = torch.randn(2, KV, 40, D, generator=gen) * 2
    a, b = codec.encode(y, pos[:, :40]), twin.encode(y, pos[:, :40])
    for f in dataclasses.fields(a):
        _assert_same(getattr(a, f.name), getattr(b, f.name), f.name)
    assert torch.equal(codec.decode(a, pos[:, :40]), twin.decode(a, pos[:, :40]))


@pytest.mark.parametrize("name, codec, twin", _codecs(), ids=[c[0] for c in _codecs()])
def test_codec_load_state_dict_refuses_wrong_state(name, codec, twin):
    codec.fit(torch.randn(1, KV, 300, D, generator=torch.Generator().manual_seed(1)), torch.arange(300).view(1, -1))
    state = codec.state_dict()
    with pytest.raises(ValueError, match="has no fitted state"):
        twin.load_state_dict(state | {"bogus": torch.zeros(1)})
    key = sorted(state)[0]
    with pytest.raises(ValueError, match="must be a|segments"):
        twin.load_state_dict(state | {key: state[key].flatten()[:3]})
    if len(state) > 1:
        with pytest.raises(ValueError, match="incomplete"):
            twin.load_state_dict({k: v for k, v in state.items() if k != key})


@pytest.mark.parametrize("codec", ["fp16", "int8", "kivi", "polarquant-int4"])
def test_stateless_codecs_save_nothing(codec):
    c = CodecSpec(codec).build(D, KV)
    c.encode(torch.randn(1, KV, 64, D))
    assert c.state_dict() == {}
    with pytest.raises(ValueError, match="keeps no fitted state"):
        c.load_state_dict({"x": torch.zeros(1)})


def test_saved_size_counts_no_regenerable_state(tiny, tmp_path):
    """A QR-rotation TurboQuant holds a dense (head_dim, head_dim) rotation per head, rebuilt from its seed: the file has none."""
    method = MethodConfig("tq-qr", CodecSpec("turboquant", {"bits": 3, "rotation": "qr"}), CodecSpec("int8"))
    cache, _ = _filled(tiny, method)
    codec = cache.layers[0]._codecs["stream_key"]
    assert codec._rotation is not None and codec.state_dict() == {}
    save_cache(cache, tmp_path / "c")
    assert not any(".codecs." in name for name in _tensor_names(tmp_path / "c"))


def _tensor_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return list(f.keys())


# -- the real model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(eval_smollm2):
    model, tok = eval_smollm2
    yield model, tok
    kvpack.disable(model)


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("method", [kvpack.DEFAULT_METHOD, "shard", "int8"])
def test_real_model_reload_generates_like_the_original(smol, method, enabled, tmp_path):
    """SmolLM2, a 700-token news prompt: plain and entropy-coded files reload every tensor bit for bit, and 20 greedy
    tokens from each reloaded cache equal those from the cache that never left memory (scores included)."""
    from kvpack.text import token_stream

    model, tok = smol
    ids = token_stream(tok, "news", 700).view(1, -1)
    cache = kvpack.KVCache(model, method)
    (kvpack.enable if enabled else kvpack.disable)(model)
    try:
        with torch.no_grad():
            model(ids[:, :-1], past_key_values=cache, use_cache=True)
    finally:
        kvpack.disable(model)
    save_cache(cache, tmp_path / "plain", token_ids=ids[:, :-1])
    save_cache(cache, tmp_path / "z", compress=True)
    loaded = [load_cache(tmp_path / name, model) for name in ("plain", "z")]
    for other in loaded:
        _assert_same_state(cache, other)
    expected, expected_scores = _generate(model, ids, cache, 20, enabled)
    for other in loaded:
        got, scores = _generate(model, ids, other, 20, enabled)
        assert torch.equal(got, expected) and torch.equal(scores, expected_scores)
    assert torch.equal(read_header(tmp_path / "plain")["token_ids"], ids[:, :-1])


def test_byte_target_shard_round_trip(tiny, tmp_path):
    """`shard:Rx` fits smaller value codebooks than its config names; a saved cache loads them and continues identically."""
    cache, seq = _filled(tiny, "shard:6.5x@window=16", ids=_ids(1500))
    assert {layer._codecs["prefill_value"].entries for layer in cache.layers} < {16, 32, 64, 128}  # a budget chose them
    save_cache(cache, tmp_path / "c")
    loaded = load_cache(tmp_path / "c", tiny)
    _assert_same_state(cache, loaded)
    assert [layer._codecs["prefill_value"].entries for layer in loaded.layers] == [layer._codecs["prefill_value"].entries for layer in cache.layers]
    expected = _generate(tiny, seq, copy.deepcopy(cache), 8)[1]
    assert torch.equal(_generate(tiny, seq, loaded, 8)[1], expected)
