"""Saved caches under a fuzzer: random truncations, byte flips, raw header edits, header edits re-signed with a valid
header checksum (what the digest cannot catch: the loader's own checks must), headers claiming huge tensors, and
another model's file. Every case is refused with a `CacheFileError` naming the problem, within a time limit, with no
other exception, no hang and no large allocation; a re-signed edit of a field the loader does not need may load.

The short profile (`CASES`, a few hundred) runs with the test suite; `KVPACK_FUZZ_CASES=10000` runs the long one
(docs/guide/reliability.md records its last result).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import time
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpack
from kvpack.cache.serialize import CacheFileError, load_cache, save_cache
from kvpack.models import tiny_random_model

CASES = int(os.environ.get("KVPACK_FUZZ_CASES", "300"))
SECONDS_PER_CASE = 5.0  # a load of these files takes milliseconds; a hang or a huge allocation takes far longer
GROWTH_LIMIT = 512 << 20  # peak RSS may grow by at most this over the whole run (a claimed terabyte never allocated)
KINDS = ("truncate", "flip", "header_bytes", "resigned", "huge_shape", "huge_stream", "foreign")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny model, its saved caches {(method, compress): bytes}, and a cache file of another model."""
    model, _ = tiny_random_model(seed=0)
    root = tmp_path_factory.mktemp("fuzz")
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(0))
    out = {}
    for method in ("turboquant:k3v2", "shard"):
        cache = kvpack.KVCache(model, method)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        for compress in (False, True):
            path = root / f"{method.replace(':', '-')}-{compress}.kvpack"
            save_cache(cache, path, token_ids=ids, compress=compress)
            out[(method, compress)] = path.read_bytes()
    config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         head_dim=64, num_key_value_heads=2, rope_theta=5e5)
    other = LlamaForCausalLM(config).eval()
    cache = kvpack.KVCache(other, "turboquant:k3v2")
    with torch.no_grad():
        other(ids, past_key_values=cache, use_cache=True)
    save_cache(cache, root / "foreign.kvpack")
    return model, out, (root / "foreign.kvpack").read_bytes(), root


def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, payload: bytes, resign: bool) -> bytes:
    if resign:  # the loader's own header digest, recomputed: the edit passes the checksum
        meta = header["__metadata__"]
        body = {k: v for k, v in meta.items() if k != "header_sha256"}
        meta["header_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + payload


def _mutate_leaf(value, rng: random.Random):
    """A random edit somewhere inside a JSON value: a number changed (huge, negative, zero), a string or list altered."""
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        if rng.random() < 0.15:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: _mutate_leaf(value[key], rng)}
    if isinstance(value, list) and value:
        i = rng.randrange(len(value))
        if rng.random() < 0.15:
            return value[:i] + value[i + 1 :]
        return value[:i] + [_mutate_leaf(value[i], rng)] + value[i + 1 :]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return rng.choice([0, -1, -value, value + 1, value * 2, 2**40, 2**62, 1e300, None, "7"])
    if isinstance(value, str):
        return rng.choice(["", value[:-1], value + "x", "kvpack.codecs.base:Packed", "os:system", "nan", "[]"])
    return rng.choice([0, "", [], {}, None])


def _resigned(data: bytes, rng: random.Random) -> bytes:
    header, payload = _split(data)
    meta = header["__metadata__"]
    key = rng.choice(sorted(k for k in meta if k not in ("header_sha256", "format")))
    try:
        edited = json.dumps(_mutate_leaf(json.loads(meta[key]), rng))
    except json.JSONDecodeError:  # a plain string field (kvpack_version, format_version)
        edited = rng.choice(["", "2", meta[key] + "0"])
    meta[key] = edited
    return _join(header, payload, resign=True)


def _huge_shape(data: bytes, rng: random.Random) -> bytes:
    """A safetensors tensor entry claiming a terabyte (shape and offsets), the metadata re-signed."""
    header, payload = _split(data)
    name = rng.choice(sorted(k for k in header if k != "__metadata__"))
    entry = header[name]
    entry["shape"] = [2**40] + entry["shape"][1:]
    if rng.random() < 0.5:
        entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][0] + 2**40]
    return _join(header, payload, resign=True)


def _huge_stream(data: bytes, rng: random.Random) -> bytes:
    """A compressed file whose stream table claims a terabyte tensor (shape or byte count), re-signed."""
    header, payload = _split(data)
    meta = header["__metadata__"]
    if "compression" not in meta:
        return _huge_shape(data, rng)
    streams = json.loads(meta["compression"])
    name = rng.choice(sorted(streams))
    streams[name]["shape"] = [2**20, 2**20] + streams[name]["shape"][2:]
    meta["compression"] = json.dumps(streams)
    return _join(header, payload, resign=True)


def _case(kind: str, data: bytes, foreign: bytes, rng: random.Random) -> bytes:
    if kind == "truncate":
        return data[: rng.randrange(len(data))]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= rng.randint(1, 255)
        return bytes(out)
    if kind == "header_bytes":
        out = bytearray(data)
        end = 8 + int.from_bytes(data[:8], "little")
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(8, end)] = rng.choice(b'0123456789{}[]",: x')
        return bytes(out)
    if kind == "resigned":
        return _resigned(data, rng)
    if kind == "huge_shape":
        return _huge_shape(data, rng)
    if kind == "huge_stream":
        return _huge_stream(data, rng)
    return foreign if rng.random() < 0.5 else _case(rng.choice(["truncate", "flip"]), foreign, foreign, rng)


def _same_content(data: bytes, source: bytes) -> bool:
    try:
        return _split(data) == _split(source)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return False


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_fuzz(model, sources: dict, foreign: bytes, root, cases: int, seed: int = 0) -> Counter:
    """Load `cases` damaged files; returns outcome counts. Fails on any other exception, a slow case or RSS growth."""
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    path = root / "case.kvpack"
    rss0 = _peak_rss()
    for i in range(cases):
        kind = KINDS[i % len(KINDS)]
        source = rng.choice(sorted(sources))
        data = _case(kind, sources[source], foreign, rng)
        path.write_bytes(data)
        start = time.perf_counter()
        try:
            load_cache(path, model)
            outcome = "loaded"
        except CacheFileError as err:
            assert str(err), f"case {i} ({kind}): an empty message"
            outcome = "refused"
        elapsed = time.perf_counter() - start
        assert elapsed < SECONDS_PER_CASE, f"case {i} ({kind}, {source}) took {elapsed:.1f} s"
        # Only an edit the digest cannot see, of a field loading does not need, may load (or an edit of the header's
        # padding or of JSON whitespace, which changes no content).
        assert outcome == "refused" or kind == "resigned" or _same_content(data, sources[source]), f"case {i} ({kind}, {source}) loaded"
        outcomes[(kind, outcome)] += 1
    assert _peak_rss() - rss0 < GROWTH_LIMIT
    return outcomes


def test_damaged_saved_caches_are_refused(files):
    model, sources, foreign, root = files
    start = time.perf_counter()
    outcomes = run_fuzz(model, sources, foreign, root, CASES)
    seconds = time.perf_counter() - start
    assert sum(outcomes.values()) == CASES
    print(f"\n{CASES} cases in {seconds:.1f} s: " + ", ".join(f"{k}/{o} {n}" for (k, o), n in sorted(outcomes.items())))
