"""A memory budget on a real model: bytes held against the limit, what eviction costs in perplexity, rematerialization time.

    python -m kvpack.bench.budget --model smollm2-135m --method turboquant:k3v2 --fractions 1.0,0.75,0.5 \
        --out bench/results/budget-smollm2-135m.json

Protocol: the perplexity protocol of `kvpack compare` (a `--context`-token news prefix prefilled into the
cache, then `--ppl-tokens` scored in chunks of `--chunk` that read the compressed cache and are added to it),
first without a budget, then with `MemoryBudget(fraction x the bytes the unlimited cache ended with)`.
The scored tokens are the same, so the deltas are paired (bootstrap interval as in compare). Per run: the
most bytes any compressed layer held after any forward against its share (read by a hook after every
forward), the evicted tokens, the budget events, and the seconds `rematerialize` takes to recompute the
evicted tokens with the budget lifted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvpack
from kvpack.eval.perplexity import perplexity
from kvpack.eval.stats import ppl_delta_ci
from kvpack.models import load_model
from kvpack.text import token_stream

from .env import environment

PROG = "python -m kvpack.bench.budget"


def _run(model, ids, method: str, budget, args) -> dict:
    cache = kvpack.KVCache(model, method, budget=budget)
    peak = [0]
    hook = model.register_forward_hook(lambda *_: peak.__setitem__(0, max(peak[0], sum(layer.nbytes() for layer in cache.compressed_layers()))))
    try:
        result = perplexity(model, ids, cache, prefix=args.context, chunk=args.chunk, n_score=args.ppl_tokens, progress=False)
    finally:
        hook.remove()
    row = {"method": method, "max_bytes": budget.max_bytes if budget else None, "ppl": result.ppl, "peak_bytes": peak[0],
           "layer_shares": [layer.budget.limit for layer in cache.compressed_layers()] if budget else None, "held_bytes": cache.memory_report()["total_bytes"],
           "evicted_tokens": cache.memory_report()["evicted_tokens"], "events": {}}
    for e in cache.budget_events:
        row["events"][e.action] = row["events"].get(e.action, 0) + 1
    if row["evicted_tokens"]:
        cache.set_budget(None)
        start = time.perf_counter()
        cache.rematerialize(model)
        row["rematerialize_s"] = time.perf_counter() - start
    return row, result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default=kvpack.DEFAULT_METHOD)
    p.add_argument("--fractions", default="1.0,0.75,0.5", help="budgets as fractions of what the unlimited cache ends with")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/budget-smollm2-135m.json")
    args = p.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    if not all(0 < f <= 1 for f in fractions):
        p.error("--fractions must be in (0, 1]")
    kvpack.get_method(args.method)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    kvpack.enable(model)
    ids = token_stream(tok, "news", args.context + args.ppl_tokens + 1)
    base, base_ppl = _run(model, ids, args.method, None, args)
    print(f"{args.method} without a budget: ppl {base['ppl']:.3f}, {base['held_bytes']:,} bytes", flush=True)
    rows = [base]
    for fraction in fractions:
        if fraction == 1.0:
            continue
        row, result = _run(model, ids, args.method, kvpack.MemoryBudget(int(fraction * base["held_bytes"])), args)
        row["fraction"] = fraction
        row["ppl_delta_pct"] = 100.0 * (result.ppl / base_ppl.ppl - 1)  # against the same method without a budget
        row["ppl_delta_ci"] = list(ppl_delta_ci(result.token_nll, base_ppl.token_nll))
        rows.append(row)
        print(f"  budget {fraction:.2f}: ppl {row['ppl']:.3f} ({row['ppl_delta_pct']:+.2f}%), peak {row['peak_bytes']:,} of "
              f"{row['max_bytes']:,} bytes, evicted {row['evicted_tokens']} tokens, rematerialized in {row.get('rematerialize_s', 0):.2f} s", flush=True)
    out = {"environment": environment(PROG), "model": args.model, "context": args.context, "ppl_tokens": args.ppl_tokens,
           "chunk": args.chunk, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
