"""Decode throughput at a fixed KV memory budget: the batch each cache fits in it, and the tokens/s at that batch.

    python -m kvpack.bench.throughput --model smollm2-135m --context 2048 --kv-budget-mib 256 --steps 32
    python -m kvpack.bench.throughput --model DIR --random-weights --device cuda --dtype bfloat16 --context 32768 --kv-budget-gib 40

A smaller cache is worth what it buys: in the same memory, more sequences decode at once. Per method:

1. **Bytes per sequence, measured**: one row's prompt is prefilled (`DynamicCache`, in chunks), filled into the method's
   cache as `kvpack.bench.decode` fills it (the prompt's flush included), then `steps` tokens are decoded into it;
   `memory_report` counts every tensor it then holds. The ratio to fp16 grows with the context (sinks and window are a
   fixed cost), so it is measured at the run's context, not extrapolated from a shorter one.
2. **Batch** = budget // bytes per sequence (at most `--max-batch`).
3. That row's cache is replicated to the batch (`batch_repeat_interleave`: every row holds the same K/V, and a decode
   step's cost does not depend on their values), and `steps` greedy steps are timed after `--warmup` untimed ones,
   the methods interleaved step by step (A B A B ...) so machine noise hits them alike; on CUDA each step is synced.
4. Reported per method: batch, bytes per sequence, the KV bytes actually held at that batch after the last step
   (checked against the budget), mean / p50 / p99 step time, tokens/s (batch / mean step) and its ratio to the first
   method's; on CUDA the peak memory allocated during the run.

Random weights (`--random-weights`: `--model` is then a directory with a config.json) are fine for speed: a step's cost depends on the
architecture and on fixed code widths, not on the weights; methods that fit on the data (Shard, `auto`) need the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..attention import disable, enable
from ..eval.generate import forward
from ..eval.memory import memory_report
from ..models import load_model, random_weights_model
from ..registry import DEFAULT_METHOD
from .decode import _new_cache, _percentile, _prompt_ids, prefill_dynamic
from .env import environment

PROG = "python -m kvpack.bench.throughput"
GIB, MIB = 2**30, 2**20


def fit_batch(bytes_per_sequence: int, budget: int, max_batch: int) -> int:
    """Sequences of `bytes_per_sequence` that fit in `budget` bytes (at most `max_batch`); 0 when not even one does."""
    if bytes_per_sequence <= 0:
        raise ValueError(f"bytes_per_sequence must be positive, got {bytes_per_sequence}")
    return min(budget // bytes_per_sequence, max_batch)


@torch.no_grad()
def _one_row(model, method: str, source, ids: torch.Tensor, logits: torch.Tensor, steps: int):
    """(cache holding the prompt plus `steps` decoded tokens for one row, its last token (1, 1), bytes it holds)."""
    cache, _ = _new_cache(model, method, source, ids)
    last = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        last = forward(model, last, cache)[:, -1].argmax(-1, keepdim=True)
    return cache, last, memory_report(cache, model.config)["total_bytes"]


@torch.no_grad()
def run(model, ids: torch.Tensor, methods: list[str], budget: int, steps: int, warmup: int, max_batch: int, log=print) -> list[dict]:
    """Rows for `methods` on the one-row prompt `ids (context,)`, under kvpack attention (which reads a `DynamicCache` as
    the model's own SDPA does); see the module docstring."""
    enable(model)
    try:
        return _run(model, ids, methods, budget, steps, warmup, max_batch, log)
    finally:
        disable(model)


def _run(model, ids: torch.Tensor, methods: list[str], budget: int, steps: int, warmup: int, max_batch: int, log) -> list[dict]:
    source, logits = prefill_dynamic(model, ids)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    caches, last, sizes, batches = {}, {}, {}, {}
    for m in methods:
        # The per-sequence size after prompt + warmup + steps tokens: the most a row holds during the timed run.
        cache, tok, sizes[m] = _one_row(model, m, source, ids, logits, warmup + steps)
        batches[m] = fit_batch(sizes[m], budget, max_batch)
        log(f"  {m:44s} {sizes[m]:>14,} bytes per sequence -> batch {batches[m]}")
        if batches[m] == 0:
            continue
        # The timed run starts from the prompt again: a fresh row, replicated to the batch.
        cache, tok, _ = _one_row(model, m, source, ids, logits, 0)
        cache.batch_repeat_interleave(batches[m])
        caches[m], last[m] = cache, tok.repeat(batches[m], 1)
    del source
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times: dict[str, list[float]] = {m: [] for m in caches}
    for step in range(warmup + steps):
        for m in caches:
            sync()
            t0 = time.perf_counter()
            out = forward(model, last[m], caches[m])
            sync()
            if step >= warmup:
                times[m].append(time.perf_counter() - t0)
            last[m] = out[:, -1].argmax(-1, keepdim=True)
    rows, base = [], None
    for m in methods:
        row = {"method": m, "context": len(ids), "bytes_per_sequence": sizes[m], "batch": batches[m], "budget_bytes": budget}
        if m in caches:
            ts = times[m]
            mean = statistics.fmean(ts)
            held = memory_report(caches[m], model.config)["total_bytes"]
            tok_s = batches[m] / mean
            base = base or tok_s
            row |= {
                "kv_bytes_held": held, "within_budget": held <= budget, "steps": steps, "mean_ms": 1e3 * mean,
                "p50_ms": 1e3 * _percentile(ts, 0.5), "p99_ms": 1e3 * _percentile(ts, 0.99), "tok_s": tok_s,
                "tok_s_vs_first": tok_s / base, "step_ms": [round(1e3 * t, 3) for t in ts],
            }
            log(f"  {m:44s} batch {batches[m]:4d}  {1e3 * mean:8.1f} ms/step  {tok_s:9.1f} tok/s  x{tok_s / base:.2f}")
        rows.append(row)
    if model.device.type == "cuda":
        for row in rows:
            row["peak_allocated_bytes_all_methods"] = torch.cuda.max_memory_allocated()
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a kvpack model name, HF directory or .gguf (real weights)")
    p.add_argument("--random-weights", action="store_true",
                   help="the --model directory's architecture (its config.json) with random weights and random token ids")
    p.add_argument("--methods", default=f"dynamic,{DEFAULT_METHOD}", help="comma-separated; the first is the reference")
    p.add_argument("--context", type=int, default=2048)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-budget-gib", type=float)
    budget.add_argument("--kv-budget-mib", type=float)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (a 64-token block flush every 64)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the result here (default: print only)")
    args = p.parse_args(argv)
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.max_batch < 1:
        p.error("--context, --steps and --max-batch must be positive, --warmup >= 0")
    budget_bytes = int(args.kv_budget_gib * GIB) if args.kv_budget_gib else int((args.kv_budget_mib or 256) * MIB)
    if budget_bytes < 1:
        p.error("the KV budget must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.random_weights:
        model, tok = random_weights_model(args.model, dtype=dtype, device=args.device), None
    else:
        model, tok = load_model(args.model, dtype=dtype)
        model = model.to(args.device)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ids = _prompt_ids(tok, "news", args.context, 1, model.config.get_text_config(decoder=True).vocab_size).to(args.device)
    print(f"{PROG}: {args.context} tokens, KV budget {budget_bytes / GIB:.3g} GiB, {len(methods)} methods")
    rows = run(model, ids, methods, budget_bytes, args.steps, args.warmup, args.max_batch)
    result = {"environment": environment(PROG, argv), "config": vars(args), "model": args.model,
              "device": str(model.device), "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
