"""First-token latency: the prompt's forward into a fresh cache, `DynamicCache` and kvpack methods interleaved.

    python experiments/first_token.py --model smollm2-135m --context 2048 --reps 3 \
        --methods 'shard:k3v2+e1@anchors=0.5%,turboquant:k3v2@anchors=0.5%@window=32,shard' \
        --json bench/results/ttft-smollm2-135m-2k.json

Each round runs every cache once in the same order (A B C A B C ...), so machine noise hits them alike. A kvpack
cache runs under `kvpack.enable` (the default and Shard fit on the prompt's queries); `DynamicCache` under the
model's own attention. Reported per method: every round's seconds and the median, and the median's ratio to
`DynamicCache`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpack
from kvpack.bench.env import environment
from kvpack.text import token_stream


def prefill_seconds(model, ids: torch.Tensor, method: str) -> float:
    """Seconds of one forward of `ids (1, T)` into a fresh cache of `method` ("dynamic": DynamicCache)."""
    if method == "dynamic":
        kvpack.disable(model)
        cache = DynamicCache(config=model.config)
    else:
        kvpack.enable(model)
        cache = kvpack.KVCache(model, method)
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--methods", required=True, help="comma-separated kvpack methods (DynamicCache always runs)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.reps < 1 or args.context < 1:
        p.error("--reps and --context must be >= 1")
    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    ids = token_stream(tok, "news", args.context)[None]
    names = ["dynamic", *[m for m in args.methods.split(",") if m]]
    seconds: dict[str, list[float]] = {m: [] for m in names}
    for r in range(args.reps):
        for m in names:
            seconds[m].append(prefill_seconds(model, ids, m))
            print(f"round {r}: {m:40s} {seconds[m][-1]:6.2f} s", flush=True)
    kvpack.disable(model)
    median = {m: statistics.median(v) for m, v in seconds.items()}
    result = {"environment": environment("python experiments/first_token.py", argv), "model": args.model, "context": args.context,
              "reps": args.reps, "seconds": seconds, "median_s": median,
              "x_dynamic": {m: median[m] / median["dynamic"] for m in names}}
    for m in names:
        print(f"{m:40s} median {median[m]:6.2f} s  {result['x_dynamic'][m]:.2f}x DynamicCache's")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
