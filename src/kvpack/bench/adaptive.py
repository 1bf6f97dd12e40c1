"""The adaptive boundary on a real model: where it converges, after how many samples, and what that costs.

    python -m kvpack.bench.adaptive --model smollm2-135m --method tiered:512:tq --tokens 1536 --targets 0.04,0.08 \
        --fixed 128,512,1024 --rungs 2x2,3x2,3x3,4x4 --out bench/results/adaptive-smollm2-135m.json

Protocol: a short prompt (`--context` news tokens: a system prompt) is prefilled, then `--tokens` tokens of
the text that follows are scored one at a time (teacher-forced decode: each token reads the compressed
cache and is added to it), so tokens flow through hot -> warm -> archive as in a long chat. One token
per forward because the tracker's decode estimates come from kvpack's fused one-token decode step.
Every run keeps a `QualityTracker(--fraction)` on the cache. Fixed runs hold the archive boundary at
each of `--fixed` tokens and report the decode estimates' mean error over their second half (the
controller's signal) and perplexity. Adaptive runs start at `--start` and call `adapt` after every
forward, with `AdaptiveConfig.for_method(method, target)`; they report the boundary after every
forward, the sample at which the controller last moved and the one at which it converged, and
perplexity over the same tokens (paired deltas against the uncompressed cache, bootstrap interval).
With `--rungs`, each target also runs with `AdaptiveArchive`, which moves the archive's bits as well.

The boundary only decides where *decoded* tokens go: prompt tokens past it at prefill go straight to
the archive and stay there (demotion is one way), which is why thresholds are learned once and saved
per model (`save_thresholds`) rather than re-learned per request.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvpack
from kvpack.cache.adaptive import AdaptiveArchive, AdaptiveConfig, AdaptiveThresholds, adapt
from kvpack.eval.perplexity import perplexity
from kvpack.eval.stats import ppl_delta_ci
from kvpack.models import load_model
from kvpack.text import token_stream

from .env import environment

PROG = "python -m kvpack.bench.adaptive"


def _run(model, ids, method: str, args, controller=None) -> tuple[dict, object]:
    """One pass over the scored tokens; with `controller`, `adapt` runs after every forward."""
    cache = kvpack.KVCache(model, method, tracker=kvpack.QualityTracker(args.fraction, seed=args.seed))
    trace: list[tuple] = []  # (tokens held, boundary, samples, converged, archive bits or None) after each forward

    def after_forward(*_):
        if controller is not None:
            adapt(cache, controller)
            c = getattr(controller, "boundary", None)
            c = c if isinstance(c, AdaptiveThresholds) else controller
            bits = list(controller.bits) if c is not controller else None
            trace.append((cache.get_seq_length(), c.boundary, c.samples, c.converged, bits))

    hook = model.register_forward_hook(after_forward)
    try:
        result = perplexity(model, ids, cache, prefix=args.context, chunk=args.chunk, n_score=args.tokens, progress=False)
    finally:
        hook.remove()
    errors = [e.error for e in cache.tracker.estimates]
    late = errors[len(errors) // 2 :]
    row = {"method": method, "ppl": result.ppl, "estimates": len(errors), "late_mean_error": sum(late) / max(len(late), 1),
           "bytes": cache.memory_report()["total_bytes"]}
    if controller is not None:
        row |= _convergence(trace, controller)
    return row, result


def _archive_bits(method) -> tuple[int, int]:
    tier = method.tiers[-1]
    return tier.key.options.get("bits"), tier.value.options.get("bits")


def _convergence(trace: list[tuple], controller) -> dict:
    """The boundary's (and archive bits') path and when it settled: the sample count at the last move of either,
    and at the first step the boundary controller reported converged."""
    c = controller.boundary if hasattr(controller, "rungs") else controller
    moved = [i for i in range(1, len(trace)) if trace[i][1] != trace[i - 1][1] or trace[i][4] != trace[i - 1][4]]
    last_move = trace[moved[-1]][2] if moved else 0
    first_converged = next((t[2] for t in trace if t[3]), None)
    out = {"target_error": c.config.target_error, "final_boundary": c.boundary, "converged": c.converged, "samples": c.samples,
           "last_move_at_sample": last_move, "converged_at_sample": first_converged, "trace": [list(t) for t in trace]}
    if c is not controller:
        out["final_archive_bits"] = list(controller.bits)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="tiered:512:tq", help="a method with an older tier (kvpack methods lists tiered:*)")
    p.add_argument("--targets", default="0.03,0.05", help="target errors (relative attention-output error) of the adaptive runs")
    p.add_argument("--fixed", default="128,512,1024,2048", help="archive boundaries of the fixed runs")
    p.add_argument("--start", type=int, default=512, help="the adaptive runs' initial boundary")
    p.add_argument("--rungs", default="", help="archive bit rungs, fewest bytes first, e.g. 2x2,3x2,3x3,4x4 (key x value bits; the "
                   "method's own archive bits must be one of them): each target also runs with AdaptiveArchive on them")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=1, help="tokens per forward; the tracker's decode estimates come from one-token steps "
                   "(kvpack's fused decode), so only --chunk 1 adapts")
    p.add_argument("--fraction", type=float, default=0.1, help="QualityTracker fraction of flushes and decode steps sampled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/adaptive-smollm2-135m.json")
    args = p.parse_args(argv)
    method = kvpack.get_method(args.method)
    targets, fixed = [float(t) for t in args.targets.split(",")], [int(b) for b in args.fixed.split(",") if b]
    rungs = tuple(tuple(int(b) for b in r.split("x")) for r in args.rungs.split(",") if r)
    if rungs and _archive_bits(method) not in rungs:
        p.error(f"--rungs must include the method's archive bits {_archive_bits(method)}")
    base_name = args.method.split(":")[0]
    fixed_methods = [f"{base_name}:{b}" + (":tq" if args.method.endswith(":tq") else "") for b in fixed]
    for m in fixed_methods:
        kvpack.get_method(m)  # bad boundaries fail before the model loads
    AdaptiveConfig.for_method(method, targets[0])
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    kvpack.enable(model)
    ids = token_stream(tok, "news", args.context + args.tokens + 1)

    base = perplexity(model, ids, kvpack.KVCache(model, "fp16"), prefix=args.context, chunk=args.chunk, n_score=args.tokens, progress=False)
    print(f"{args.model}: fp16 ppl {base.ppl:.3f} over {args.tokens} tokens after a {args.context}-token prompt", flush=True)
    rows = []

    def finish(row: dict, result) -> None:
        row["ppl_delta_pct"] = 100.0 * (result.ppl / base.ppl - 1)
        row["ppl_delta_ci"] = list(ppl_delta_ci(result.token_nll, base.token_nll))
        rows.append(row)
        extra = f", boundary {row['final_boundary']} (last move at sample {row['last_move_at_sample']})" if "trace" in row else ""
        print(f"  {row['method']}: ppl {row['ppl_delta_pct']:+.2f}%, late mean error {row['late_mean_error']:.4f}{extra}", flush=True)
        _write(args, base.ppl, rows)

    for m in fixed_methods:
        finish(*_run(model, ids, m, args))
    for target in targets:
        for with_bits in (False, True) if rungs else (False,):
            controller = AdaptiveThresholds(AdaptiveConfig.for_method(method, target), initial=args.start)
            if with_bits:
                controller = AdaptiveArchive(controller, rungs, rungs.index(_archive_bits(method)))
            row, result = _run(model, ids, args.method, args, controller)
            finish(row | {"method": f"{args.method} adaptive {target}" + (" + archive bits" if with_bits else "")}, result)
    print(f"wrote {args.out}")
    return 0


def _write(args, base_ppl: float, rows: list[dict]) -> None:
    out = {"environment": environment(PROG), "model": args.model, "method": args.method, "context": args.context, "tokens": args.tokens,
           "chunk": args.chunk, "fraction": args.fraction, "fp16_ppl": base_ppl, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
