"""KV at rest: bytes of every method's cache in memory, on disk plain and entropy-coded, and save/load speed.

    python -m kvpack.bench.storage --context 2048 --out bench/results/storage-smollm2-135m.json

Protocol: the first `context` tokens of the news text are prefilled once into a `DynamicCache`
(chunked, exact attention: `bench.decode.prefill_dynamic`); each method's cache is filled from those
same post-RoPE K/V and compressed as the model's own prefill would (`bench.decode.fill_kvpack`).
Per method: `memory_report()` bytes, then `save_cache` plain and with `compress=True` into a temporary
directory, each reloaded with `load_cache` and checked tensor for tensor against the original (a
mismatch aborts the run). Ratios are against the fp16 `DynamicCache` bytes of the same tokens; MB/s
is the cache's in-memory MB over the wall time of one save or load (including fsync, the digests
and, on load, rebuilding the codecs), a single run: a rough figure, not a peak. Saves and loads run
with `--io-threads` torch threads (1): on a shared 2-core machine a second intra-op thread that is
descheduled stalls every small copy (cloning one cache's 330 tensors took 1-5 ms with 1 thread,
0.24-1.0 s with 2), which would time the neighbours, not the format.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from .. import list_methods
from ..cache.serialize import ZSTD_LEVEL, _zstd, collect, load_cache, save_cache
from ..models import load_model
from ..registry import get_method
from ..text import token_stream
from .decode import fill_kvpack, prefill_dynamic
from .env import environment

PROG = "python -m kvpack.bench.storage"
GOAL = ("shard", 15.0)  # the goal for the PCA/Shard path: >= 15x fp16 on disk


def _part(name: str) -> str:
    """Which part of a cache a stored tensor belongs to: compressed codes, fitted codec state, or exact tokens."""
    return "codes" if ".segments." in name else "codec_state" if ".codecs." in name else "exact"


def _parts(path: Path) -> dict[str, int]:
    """Bytes on disk per part (payload only; the header is counted in the file size)."""
    out = {"codes": 0, "codec_state": 0, "exact": 0}
    with safe_open(path, "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            out[_part(name)] += t.numel() * t.element_size()
    return out


def _same(a, b) -> bool:
    """Every tensor a file would hold is equal (and the layouts too) between two caches."""
    (ta, la), (tb, lb) = collect(a), collect(b)
    return la == lb and ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def measure(model, cache, directory: Path, io_threads: int = 1) -> dict:
    """One row: memory, plain and compressed files (bytes, parts, save/load seconds), checked bit-exact."""
    threads = torch.get_num_threads()
    torch.set_num_threads(io_threads)
    try:
        return _measure(model, cache, directory, load_cache, save_cache)
    finally:
        torch.set_num_threads(threads)


def _measure(model, cache, directory: Path, load_cache, save_cache) -> dict:
    mem = cache.memory_report()
    mb = mem["total_bytes"] / 1e6
    row = {"method": mem["method"], "tokens": mem["tokens"], "fp16_bytes": mem["fp16_bytes"], "memory_bytes": mem["total_bytes"],
           "memory_ratio": mem["ratio"]}
    for tag, compress in (("plain", False), ("zstd", True)):
        path = directory / f"{tag}.kvpack"
        saved = save_cache(cache, path, compress=compress)
        start = time.perf_counter()
        loaded = load_cache(path, model)
        load_s = time.perf_counter() - start
        if not _same(cache, loaded):
            raise RuntimeError(f"{mem['method']}: the {tag} file did not reload bit-exact")
        row[tag] = {
            "disk_bytes": saved["bytes_on_disk"], "disk_ratio": mem["fp16_bytes"] / saved["bytes_on_disk"], "parts": _parts(path),
            "save_s": saved["seconds"], "load_s": load_s, "save_mb_s": mb / saved["seconds"], "load_mb_s": mb / load_s,
        }
        path.unlink()
    row["zstd_gain"] = row["plain"]["disk_bytes"] / row["zstd"]["disk_bytes"]
    return row


def _print_row(row: dict) -> None:
    p, z = row["plain"], row["zstd"]
    print(
        f"  {row['method']:20s} memory {row['memory_bytes'] / 1e6:7.2f} MB ({row['memory_ratio']:5.2f}x)  disk {p['disk_bytes'] / 1e6:7.2f} MB "
        f"({p['disk_ratio']:5.2f}x)  zstd {z['disk_bytes'] / 1e6:7.2f} MB ({z['disk_ratio']:5.2f}x)  save/load {p['save_mb_s']:6.0f}/{p['load_mb_s']:6.0f} "
        f"MB/s, zstd {z['save_mb_s']:5.0f}/{z['load_mb_s']:5.0f} MB/s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--methods", default=",".join(list_methods()))
    p.add_argument("--text", default="news")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the prefill and the compression")
    p.add_argument("--io-threads", type=int, default=1, help="torch threads while saving and loading (see the module docstring)")
    p.add_argument("--out", default="bench/results/storage-smollm2-135m.json")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        get_method(m)  # unknown names fail here, before the model loads
    _zstd(PROG)  # the entropy-coded rows need zstandard: fail before any work
    if args.context < 128 or args.threads < 1 or args.io_threads < 1:
        p.error("--context must be >= 128 and --threads, --io-threads >= 1")
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids = token_stream(tok, args.text, args.context)
    source, _ = prefill_dynamic(model, ids)
    out = {"environment": environment(PROG), "model": args.model, "context": args.context, "text": args.text, "dtype": "float32",
           "zstd_level": ZSTD_LEVEL, "io_threads": args.io_threads, "rows": []}
    print(f"{args.model}: {args.context} tokens of {args.text!r}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for m in methods:
            cache, _ = fill_kvpack(model, m, source, ids)  # Shard fits its prompt codecs on the prefill's queries
            out["rows"].append(measure(model, cache, Path(tmp), args.io_threads))
            _print_row(out["rows"][-1])
            del cache
            _write(out, args.out)  # saved after every method
    goal = next((r for r in out["rows"] if r["method"] == GOAL[0]), None)
    if goal is not None:
        ratio = goal["zstd"]["disk_ratio"]
        out["goal"] = {"method": GOAL[0], "target_ratio": GOAL[1], "disk_ratio_zstd": ratio, "reached": ratio >= GOAL[1]}
        print(f"goal: {GOAL[0]} at >= {GOAL[1]}x fp16 on disk: {ratio:.2f}x, {'reached' if ratio >= GOAL[1] else 'not reached'}")
    _write(out, args.out)
    print(f"wrote {args.out}")
    return 0


def _write(out: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
