"""Where a decode step's time goes in kvpack's cache and attention, part by part, per layer kind.

    python experiments/decode_step_parts.py --model gemma3-270m --context 2048 --steps 128 \
        --methods "turboquant:k3v2+ropemean@anchors=0.5%@window=32,turboquant:k3v2+ropemean@anchors=0.5%@window=32@sliding=int8" \
        --json bench/results/step-parts-gemma3-270m-2k.json

Each method prefills `--context` tokens of news, takes 16 warm-up steps, then `--steps` teacher-forced steps (the text's
next tokens), timed whole and with wall-clock accumulators around kvpack's parts: the attention entry point, the
fused decode step, a segment's kernel-table partial (per key codec) and the C++ kernel inside it (dense or
TurboQuant), the merge with the exact rows, the cache update, the flush, and a sliding layer's drop of the tokens
its window left. The methods run one after the other, so the step times are only indicative: the ratios between
methods come from `python -m kvpack.bench.decode`, which interleaves them. Per part: milliseconds a step and calls a step.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time
from pathlib import Path

import torch

from kvpack import attention
from kvpack.bench.env import environment, write_json
from kvpack.cache.layer import KVPackLayer
from kvpack.eval.generate import forward
from kvpack.eval.methods import attention_for, make_cache
from kvpack.kernels import cpu_lut, table
from kvpack.models import load_model
from kvpack.text import token_stream


@contextlib.contextmanager
def timed_parts(seconds: dict, calls: dict):
    """Wrap kvpack's parts with accumulators of wall seconds and calls; restored on exit."""
    patched = []

    def wrap(owner, name: str, label, key_of=None):
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                key = label if key_of is None else f"{label} ({key_of(*args)})"
                seconds[key] += time.perf_counter() - start
                calls[key] += 1

        setattr(owner, name, timed)
        patched.append((owner, name, original))

    wrap(attention, "kvpack_attention_forward", "attention entry point")
    wrap(attention, "fused_decode", "fused decode step")
    wrap(table, "segment_partial", "segment partial", lambda q, seg, *a: type(seg.key_codec).__name__)
    wrap(table, "merge_with_exact", "exact rows and merge")
    wrap(cpu_lut, "dense_attention", "C++ dense kernel", lambda q, k, *a: str(k.dtype).removeprefix("torch."))
    wrap(cpu_lut, "tq_attention", "C++ TurboQuant kernel")
    wrap(KVPackLayer, "update", "cache update")
    wrap(KVPackLayer, "flush", "flush")
    wrap(KVPackLayer, "_slide", "sliding drop")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--methods", required=True, help="comma-separated kvpack method names")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment("python experiments/decode_step_parts.py", argv)
    model, tokenizer = load_model(args.model)
    warm = 16
    ids = token_stream(tokenizer, "news", args.context + warm + args.steps)
    rows = []
    for method in args.methods.split(","):
        seconds: dict = collections.defaultdict(float)
        calls: dict = collections.defaultdict(int)
        # Wrapped before `attention_for` registers the attention function, so the registered entry point is the timed one.
        with timed_parts(seconds, calls), attention_for(model, method):
            cache = make_cache(model, method)
            forward(model, ids[: args.context], cache)
            for t in range(args.context, args.context + warm):
                forward(model, ids[t : t + 1], cache)
            seconds.clear()
            calls.clear()
            start = time.perf_counter()
            for t in range(args.context + warm, args.context + warm + args.steps):
                forward(model, ids[t : t + 1], cache)
            total = time.perf_counter() - start
        parts = {k: {"ms_per_step": 1000 * v / args.steps, "calls_per_step": calls[k] / args.steps} for k, v in sorted(seconds.items())}
        rows.append({"method": method, "ms_per_step": 1000 * total / args.steps, "parts": parts})
        print(f"{method}: {1000 * total / args.steps:.1f} ms a step (timed)")
        for k, v in parts.items():
            print(f"  {k:40s} {v['ms_per_step']:7.3f} ms  {v['calls_per_step']:5.1f} calls")
    out = {"config": vars(args) | {"json": str(args.json)}, "environment": env, "rows": rows}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
