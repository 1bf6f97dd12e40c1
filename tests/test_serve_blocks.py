"""kvpack.serve.blocks: KV blocks <-> safetensors files through a kvpack method, without vLLM.

Errors are held to bounds computed from the data, not from the codec: int8 to half a quantization
step of each token's absmax, TurboQuant to the Lloyd-Max distortion of a unit-variance Gaussian at
its bit width (Max 1960; the TurboQuant paper's Table: 0.1175, 0.03454, 0.009497 at 2, 3, 4 bits).
"""

import hashlib
import json
import math
import os
import struct
import threading

import pytest
import safetensors.torch
import torch

from kvpack.cache.prompt_widths import placed_method
from kvpack.registry import DEFAULT_METHOD, CodecSpec, MethodConfig, get_method, list_methods
from kvpack.serve import blocks

LLOYD_MAX_GAUSSIAN = {2: 0.1175, 3: 0.03454, 4: 0.009497}  # MSE per coordinate, unit variance


def kv(layers=3, tokens=217, kv_heads=3, head_dim=96, seed=0, dtype=torch.float32):
    """Keys with a few large channels (as real keys have), Gaussian values; awkward sizes by default."""
    g = torch.Generator().manual_seed(seed)
    channel = torch.ones(head_dim)
    channel[:4] = 20.0
    k = torch.randn(layers, tokens, kv_heads, head_dim, generator=g) * channel
    v = torch.randn(layers, tokens, kv_heads, head_dim, generator=g)
    return k.to(dtype), v.to(dtype)


def plain_turboquant(bits: int) -> MethodConfig:
    """TurboQuant exactly as in the paper (no centering or channel scaling), no exact sinks."""
    spec = CodecSpec("turboquant", {"bits": bits})
    return MethodConfig(f"tq{bits}-plain", spec, spec, sink_tokens=0)


def test_int8_error_within_half_a_step_of_each_tokens_absmax():
    k, v = kv()
    tensors, meta = blocks.encode_kv(k, v, "int8", start=0)
    k2, v2 = blocks.decode_kv(tensors, meta, "int8")
    assert json.loads(meta["split"]) == [4, 213, 0]  # int8's 4 sinks exact, the rest int8
    for x, y in ((k, k2), (v, v2)):
        assert y.dtype == torch.float32 and y.shape == x.shape
        torch.testing.assert_close(y[:, :4], x[:, :4].half().float(), rtol=0, atol=0)  # sinks: fp16, exact
        step = x[:, 4:].abs().amax(-1, keepdim=True) / 127
        # The step is stored in fp16 (relative rounding <= 2^-11); allow 2^-10.
        assert ((y[:, 4:] - x[:, 4:]).abs() <= step / 2 * (1 + 2**-10)).all()
        assert (y[:, 4:] != x[:, 4:]).any()  # really quantized: the bound is not met by a copy


def test_block_after_the_sinks_has_no_exact_tokens():
    k, v = kv(tokens=64)
    _, meta = blocks.encode_kv(k, v, "int8", start=128)
    assert json.loads(meta["split"]) == [0, 64, 0]
    _, meta = blocks.encode_kv(k, v, "int8", start=2)  # a block holding the last two sink positions
    assert json.loads(meta["split"]) == [2, 62, 0]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_turboquant_relative_mse_at_the_lloyd_max_distortion(bits, head_dim):
    # A rotated unit vector has coordinates ~ N(0, 1/d): the relative MSE of a vector is the per-coordinate
    # Lloyd-Max distortion of a unit Gaussian. The exact (Beta) codebook at finite d sits slightly below it
    # (measured 0.97-0.99x); more than 10% below would mean more than `bits` bits were spent.
    g = torch.Generator().manual_seed(bits)
    k, v = (torch.randn(2, 512, 4, head_dim, generator=g) for _ in range(2))  # isotropic Gaussian, as the bound assumes
    method = plain_turboquant(bits)
    tensors, meta = blocks.encode_kv(k, v, method)
    k2, v2 = blocks.decode_kv(tensors, meta, method)
    for x, y in ((k, k2), (v, v2)):
        rel = ((y - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
        assert 0.9 * LLOYD_MAX_GAUSSIAN[bits] <= rel <= 1.02 * LLOYD_MAX_GAUSSIAN[bits]


def _needs_positions(method: MethodConfig) -> bool:
    specs = (method.key, method.value, method.prefill_key, method.prefill_value)
    return any(s is not None and s.uses_positions for s in specs)


POSITION_METHODS = [m for m in [DEFAULT_METHOD, *list_methods()] if _needs_positions(get_method(m))]
# Each layer's (inv_freq, attention scaling), layer 2's scaled as YaRN-style models scale cos/sin.
ROPES = [(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), s) for s in (1.0, 1.0, 1.25)]


@pytest.mark.parametrize("name", [DEFAULT_METHOD, *list_methods()])
def test_file_round_trip_adds_nothing_to_the_codecs_error(name, tmp_path):
    # A file decodes bit-identically to the in-memory codecs fitted on the same block: saving and loading
    # (fitted state included: TurboQuant's mean and channel scales) is exact. Codecs that read positions get the
    # block's (it starts at token 37) and each layer's rotary embedding.
    method = get_method(name)
    k, v = kv(tokens=256, head_dim=64)
    start = 37
    blocks.save_kv(tmp_path / "b.safetensors", k, v, name, start=start, ropes=ROPES)
    k2, v2 = blocks.load_kv(tmp_path / "b.safetensors", name, ropes=ROPES)
    kspec, vspec = method.prefill_key or method.key, method.prefill_value or method.value
    head = min(max(method.sink_tokens - start, 0), 256)
    multiple = math.lcm(kspec.build(64, 3).token_multiple, vspec.build(64, 3).token_multiple)  # K and V split alike
    middle = (256 - head) // multiple * multiple
    for x, y, spec in ((k, k2, kspec), (v, v2, vspec)):
        torch.testing.assert_close(y[:, head + middle :], x[:, head + middle :].half().float(), rtol=0, atol=0)  # exact tail
        for layer in range(3):
            codec = spec.build(64, 3, layer)
            if codec.uses_positions:
                codec.set_rope(*ROPES[layer])
            part = x[layer, head:].permute(1, 0, 2).unsqueeze(0)
            pos = torch.arange(start + head, start + head + middle)[None]
            codec.fit(part[:, :, :middle], pos)
            expected = codec.decode(codec.encode(part[:, :, :middle], pos), pos)[0].permute(1, 0, 2)
            assert torch.equal(y[layer, head : head + middle], expected)


def test_int8_file_bytes_are_the_hand_count(tmp_path):
    layers, tokens, heads, d = 3, 217, 3, 96
    k, v = kv(layers, tokens, heads, d)
    size = blocks.save_kv(tmp_path / "b.safetensors", k, v, "int8")
    sinks = 4 * heads * d * 2  # fp16
    compressed = (tokens - 4) * heads * (d * 1 + 2)  # int8 codes + one fp16 scale per token and head
    payload = layers * 2 * (sinks + compressed)
    assert size == os.path.getsize(tmp_path / "b.safetensors")
    header = int.from_bytes((tmp_path / "b.safetensors").read_bytes()[:8], "little")
    assert size == 8 + header + payload
    assert size < 0.27 * k.numel() * 4 * 2  # vs the fp32 K and V: int8 plus scales and header


def test_dtype_is_kept():
    k, v = kv(tokens=40, dtype=torch.bfloat16)
    k2, v2 = blocks.decode_kv(*blocks.encode_kv(k, v, "int8"), "int8")
    assert k2.dtype == v2.dtype == torch.bfloat16


def test_values_beyond_fp16_refused_for_fp16_sinks():
    k, v = kv(tokens=16)
    k[0, 0, 0, 0] = 1e5
    with pytest.raises(ValueError, match="float16 range"):
        blocks.encode_kv(k, v, "int8")
    native = get_method("int8").with_options(exact_dtype="native")
    k2, _ = blocks.decode_kv(*blocks.encode_kv(k, v, native), native)
    assert k2[0, 0, 0, 0] == 1e5


def test_widths_placed_per_prompt_are_refused_and_a_placed_caches_method_stored():
    k, v = kv(tokens=516, head_dim=64)  # 4 exact sinks, then 8 whole blocks of codes
    with pytest.raises(ValueError, match=r"per prompt by running the model.*without '@fisher'"):
        blocks.encode_kv(k, v, "turboquant:k3v2@fisher=32")
    # what a placed cache holds: layer 1's keys at 4 bits, the others at the method's 3; its blocks store and read back
    placed = placed_method(get_method("turboquant:k3v2"), [1], [])
    k2, _ = blocks.decode_kv(*blocks.encode_kv(k, v, placed), placed)
    err = [float((k2[i, 4:] - k[i, 4:]).square().sum() / k[i, 4:].square().sum()) for i in range(3)]  # after the exact sinks
    assert err[1] < 0.5 * min(err[0], err[2])  # Lloyd-Max: 4 bits 0.0095, 3 bits 0.034 of the variance


@pytest.mark.parametrize("name", POSITION_METHODS)
def test_codec_needing_positions_is_refused_without_the_rotary_embedding(name):
    k, v = kv(tokens=64, head_dim=64)
    with pytest.raises(ValueError, match=r"rotary embedding.*pass ropes="):
        blocks.encode_kv(k, v, name)


def test_a_reader_with_other_rotary_parameters_is_refused():
    k, v = kv(tokens=64, head_dim=64)
    tensors, meta = blocks.encode_kv(k, v, DEFAULT_METHOD, ropes=ROPES)
    assert "rope" in meta
    other = [(inv * 0.5, s) for inv, s in ROPES]
    for ropes in (other, None):
        with pytest.raises(blocks.BlockMismatch, match="other rotary parameters"):
            blocks.decode_kv(tensors, meta, DEFAULT_METHOD, ropes=ropes)
    assert "rope" not in blocks.encode_kv(k, v, "turboquant:k3v2", ropes=ROPES)[1]  # codes that read no positions


def test_codec_whose_state_dict_misses_fitted_state_refused(monkeypatch):
    # TurboQuant with centering fits a mean; a state_dict without it would write files that decode wrong.
    from kvpack.codecs.turboquant import TurboQuantCodec

    monkeypatch.setattr(TurboQuantCodec, "state_dict", lambda self: {})
    monkeypatch.setattr(TurboQuantCodec, "load_state_dict", lambda self, state: None)
    k, v = kv(tokens=64, head_dim=64)
    with pytest.raises(NotImplementedError, match="state_dict"):
        blocks.encode_kv(k, v, "turboquant:k4v4")


def test_chunk_keys_stable_chained_and_salted():
    ids = list(range(1000, 1100))
    keys = blocks.chunk_keys(ids, 32)
    assert len(keys) == 3  # the trailing 4 tokens form no whole chunk
    assert keys == blocks.chunk_keys(tuple(ids), 32) == blocks.chunk_keys(torch.tensor(ids).tolist(), 32)
    # The documented format (keys name files shared across processes and releases): sha256 of the salt,
    # a NUL byte, then every token of the prefix as little-endian int64.
    for i, key in enumerate(keys):
        assert key == hashlib.sha256(b"\0" + struct.pack(f"<{32 * (i + 1)}q", *ids[: 32 * (i + 1)])).hexdigest()
    assert len(set(keys)) == 3
    later = ids.copy()
    later[40] += 1  # a token in chunk 1
    assert blocks.chunk_keys(later, 32)[0] == keys[0] and blocks.chunk_keys(later, 32)[1:] != keys[1:]
    earlier = ids.copy()
    earlier[0] += 1  # a token in chunk 0 changes every later key (chained)
    assert all(a != b for a, b in zip(blocks.chunk_keys(earlier, 32), keys, strict=True))
    assert all(a != b for a, b in zip(blocks.chunk_keys(ids, 32, salt="other-model"), keys, strict=True))


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    k, v = kv(tokens=16)
    path = tmp_path / "b.safetensors"

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(blocks.os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        blocks.save_kv(path, k, v, "int8")
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temporary


def test_failed_replace_keeps_the_old_file(tmp_path, monkeypatch):
    k, v = kv(tokens=16)
    path = tmp_path / "b.safetensors"
    blocks.save_kv(path, k, v, "int8")
    before = path.read_bytes()

    def fail(*args):
        raise OSError("interrupted")

    monkeypatch.setattr(blocks.os, "replace", fail)
    with pytest.raises(OSError, match="interrupted"):
        blocks.save_kv(path, k * 2, v, "int8")
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


def test_other_method_or_shape_refused(tmp_path):
    k, v = kv(tokens=64, head_dim=64)
    path = tmp_path / "b.safetensors"
    blocks.save_kv(path, k, v, "int8", start=128, extra={"model": "smollm2-135m"})
    with pytest.raises(blocks.BlockMismatch, match="method"):
        blocks.load_kv(path, "turboquant:k4v4")
    with pytest.raises(blocks.BlockMismatch, match="method"):  # same name, other options
        blocks.load_kv(path, get_method("int8").with_options(sink_tokens=0))
    for key, value in (("layers", 30), ("head_dim", 128), ("start", 0), ("model", "qwen2-0.5b")):
        with pytest.raises(blocks.BlockMismatch, match=key):
            blocks.load_kv(path, "int8", expect={key: value})
    k2, _ = blocks.load_kv(
        path, "int8", expect={"layers": 3, "kv_heads": 3, "head_dim": 64, "tokens": 64, "start": 128, "model": "smollm2-135m"}
    )
    assert k2.shape == k.shape


def test_foreign_safetensors_file_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    safetensors.torch.save_file({"kv_cache": torch.zeros(2, 2)}, str(path))
    with pytest.raises(blocks.BlockMismatch, match="format"):
        blocks.load_kv(path, "int8")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_file_refused(tmp_path, damage):
    k, v = kv(tokens=16)
    path = tmp_path / "b.safetensors"
    blocks.save_kv(path, k, v, "int8")
    data = path.read_bytes()
    path.write_bytes(b"not a safetensors file" if damage == "garbage" else data[: len(data) - 100])
    with pytest.raises(blocks.BlockMismatch, match="safetensors"):
        blocks.load_kv(path, "int8")


def test_missing_codes_refused():
    k, v = kv(tokens=16)
    tensors, meta = blocks.encode_kv(k, v, "int8")
    del tensors["L1.v.codes"]
    with pytest.raises(blocks.BlockMismatch, match="codes"):
        blocks.decode_kv(tensors, meta, "int8")


# -- damaged, half-written and concurrent files; eviction --------------------------------------------------------
def _tensor_span(path) -> tuple[int, int]:
    data = path.read_bytes()
    return 8 + int.from_bytes(data[:8], "little"), len(data)


def test_every_flipped_tensor_byte_is_detected(tmp_path):
    """A byte of tensor data changed anywhere (codes, scales, exact sinks) fails the checksum: never decoded."""
    k, v = kv(tokens=40, head_dim=64)
    path = tmp_path / "b.safetensors"
    blocks.save_kv(path, k, v, "int8")
    data = path.read_bytes()
    first, end = _tensor_span(path)
    gen = torch.Generator().manual_seed(0)
    for pos in [first, end - 1, *torch.randint(first, end, (40,), generator=gen).tolist()]:
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(blocks.BlockMismatch, match="checksum"):
            blocks.load_kv(path, "int8")


def test_edited_metadata_is_detected(tmp_path):
    """A metadata value changed consistently enough for safetensors (same length) fails the checksum too."""
    k, v = kv(tokens=40, head_dim=64)
    path = tmp_path / "b.safetensors"
    blocks.save_kv(path, k, v, "int8", start=128)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"start":"128"', b'"start":"192"', 1))
    assert path.read_bytes() != data
    with pytest.raises(blocks.BlockMismatch, match="checksum"):
        blocks.load_kv(path, "int8")


@pytest.mark.parametrize("keep", [0.0, 0.3, 0.9, 0.999])
def test_truncated_or_half_written_file_is_refused(tmp_path, keep):
    k, v = kv(tokens=40, head_dim=64)
    path = tmp_path / "b.safetensors"
    blocks.save_kv(path, k, v, "turboquant:k3v2")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(blocks.BlockMismatch):
        blocks.load_kv(path, "turboquant:k3v2")


def test_file_without_checksum_is_refused(tmp_path):
    """A file written without the checksum (by hand, or an older writer) is not trusted."""
    k, v = kv(tokens=40, head_dim=64)
    tensors, meta = blocks.encode_kv(k, v, "int8")
    path = tmp_path / "b.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata=meta)
    with pytest.raises(blocks.BlockMismatch, match="checksum"):
        blocks.load_kv(path, "int8")


def test_two_writers_of_one_prefix_never_leave_a_corrupt_file(tmp_path):
    """Two threads write different encodings of one key 400 times each while a third reads it: every read is one of the
    two whole files (its checksum matches), and no temporary is left. A reader that took a file's header and its
    tensors through two opens of the path (as `safetensors.safe_open` does) mixed two files in about 1 read in 500:
    the writers here replace the file as fast as they can (encoded once, then `write_atomic`) to give it the chance."""
    path = tmp_path / "b.safetensors"
    pairs = [kv(tokens=48, head_dim=64, seed=s) for s in (1, 2)]
    blocks.save_kv(path, *pairs[0], "int8")
    encoded = [blocks.encode_kv(*p, "int8") for p in pairs]
    expected = [blocks.decode_kv(*e, "int8")[0] for e in encoded]
    done, seen, errors = threading.Event(), [], []

    def write(pair):
        try:
            for _ in range(400):
                blocks.write_atomic(path, *pair)
        except BaseException as err:
            errors.append(err)

    def read():
        while not done.is_set():
            try:
                seen.append(blocks.load_kv(path, "int8")[0])
            except BaseException as err:
                errors.append(err)

    writers = [threading.Thread(target=write, args=(e,)) for e in encoded]
    reader = threading.Thread(target=read)
    reader.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    done.set()
    reader.join(timeout=120)
    assert not errors, errors[:3]
    assert seen and all(any(torch.equal(s, e) for e in expected) for s in seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.safetensors"]


def test_evict_keeps_the_most_recently_used_within_the_limit(tmp_path):
    k, v = kv(tokens=16, head_dim=64)
    paths = [tmp_path / f"{i}.safetensors" for i in range(5)]
    for i, p in enumerate(paths):
        blocks.save_kv(p, k, v, "int8")
        os.utime(p, (1_000 + i, 1_000 + i))  # written in order 0..4
    blocks.load_kv(paths[0], "int8")  # used again: now the most recent
    size = paths[0].stat().st_size
    stale = tmp_path / ".9.safetensors.123.abc.tmp"  # a writer that died
    stale.write_bytes(b"partial")
    os.utime(stale, (1_000, 1_000))
    fresh = tmp_path / ".8.safetensors.456.def.tmp"  # a writer still at work
    fresh.write_bytes(b"partial")
    removed = blocks.evict(tmp_path, 2 * size)
    assert sorted(p.name for p in removed) == sorted([stale.name, "1.safetensors", "2.safetensors", "3.safetensors"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, "0.safetensors", "4.safetensors"])
    assert blocks.evict(tmp_path, 10 * size) == []
    with pytest.raises(ValueError, match="max_bytes"):
        blocks.evict(tmp_path, -1)
