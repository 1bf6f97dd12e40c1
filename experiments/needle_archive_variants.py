"""Which side of a fitted archive loses a needle: one needle trial per archive variant, the same needle and draw.

    python experiments/needle_archive_variants.py --model qwen2.5-0.5b --length 32768 --depth 0.5 --cell 1 --seed 0 \
        --variants base,values-256,keys-e1 --json bench/results/needle-archive-variants-qwen2.5-0.5b-32k.json

The trial is one cell of `kvpack.eval.needle`'s grid (`--cell`: its index in the grid of `archive_needles.py`, whose
needles are seeded by cell: cell 1 of `--lengths 32768 --depths 0,0.5,1` is the passkey at depth 0.5), run through
`tiered:1024:shard` at rotation draw `--seed` with one side of its archive changed at a time:

- `base`: the archive as registered (PCA keys at the latest queries' 3% score error, 64 value codewords per 4 channels);
- `values-256`: 256 value codewords (2 bits per value instead of 1.5; the archive ~9x instead of ~10.5x);
- `keys-e1`: the keys' rank at 1% score error instead of 3% (more components kept).

A variant that finds a needle the registered archive misses names the side whose error lost it. About 10 minutes a
trial at 32K on 2 cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import kvpack
from kvpack import CodecSpec, Tier
from kvpack.bench.env import environment, write_json
from kvpack.eval.memory import memory_report
from kvpack.eval.needle import make_needles, needle_trial
from kvpack.registry import ARCHIVE_CODEBOOK, ARCHIVE_FIT_TOKENS, ARCHIVE_KEY_BITS, ARCHIVE_REFIT, get_method
from kvpack.text import token_stream

METHOD = "tiered:1024:shard"


def variants(boundary: int) -> dict:
    """The registered archive and one-side changes of it, as method configs."""
    base = get_method(METHOD)

    def archive(key: dict | None = None, value: dict | None = None):
        k = CodecSpec("pca", {"bits": ARCHIVE_KEY_BITS, **(key or {})})
        v = CodecSpec("vq", {"token_norm": True, "codebook_size": ARCHIVE_CODEBOOK, **(value or {})})
        return base.with_options(tiers=(Tier(k, v, boundary, fit_tokens=ARCHIVE_FIT_TOKENS, refit=ARCHIVE_REFIT),))

    return {"base": base, "values-256": archive(value={"codebook_size": 256}), "keys-e1": archive(key={"score_error": 0.01})}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--cell", type=int, default=1, help="the grid cell whose needle to hide (needles are seeded by cell)")
    p.add_argument("--seed", type=int, default=0, help="the rotation draw")
    p.add_argument("--variants", default="base,values-256,keys-e1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    known = variants(get_method(METHOD).tiers[0].after)
    chosen = [v for v in args.variants.split(",") if v]
    if not chosen or any(v not in known for v in chosen):
        raise SystemExit(f"--variants takes a comma-separated subset of {sorted(known)}, got {args.variants!r}")
    torch.set_num_threads(args.threads)
    env = environment("python experiments/needle_archive_variants.py", argv)
    model, tok = kvpack.load_model(args.model)
    kvpack.enable(model)
    filler = token_stream(tok, "news", args.length)
    needle = make_needles("passkey", 1, args.cell, tok.decode(filler))[0]  # needle_grid's seed 0: seed * 1000 + cell
    rows = []
    for name in chosen:
        start = time.perf_counter()
        cache = kvpack.KVCache(model, known[name].with_seed(args.seed))
        trial = needle_trial(model, tok, cache, filler, args.length, args.depth, needle)
        mem = memory_report(cache, model.config)  # every tensor held after the answer, fitted state included
        rows.append({"variant": name, "ratio_vs_fp16": mem["ratio"], "archive_ratio_vs_fp16": mem.get("archive", {}).get("ratio"),
                     "seconds": round(time.perf_counter() - start), **trial.as_dict()})
        print(f"{name}: {'found' if trial.found else 'missed'} ({trial.answer!r} for {needle.key}), "
              f"{mem['ratio']:.2f}x fp16, the archive {rows[-1]['archive_ratio_vs_fp16'] or float('nan'):.2f}x", flush=True)
    out = {"config": vars(args) | {"json": str(args.json)}, "environment": env, "needle": needle.key, "rows": rows}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
