"""`auto:<target>` against its targets and the fixed TurboQuant widths: bytes, perplexity delta, and measured vs predicted KL.

    python -m kvpack.bench.auto --model smollm2-135m --json bench/results/auto-smollm2-135m-2k.json \
        --plot bench/results/auto-smollm2-135m-2k.png

Protocol: the perplexity protocol of `kvpack compare` (a `--context`-token news prefix prefilled into the cache,
then `--ppl-tokens` scored in chunks of `--chunk` that read the compressed cache, kvpack attention on), one fresh
cache per method; the uncompressed `dynamic` cache runs first. Per method: real bytes after the prefill (the
cache's own tensors, sinks and window included) and their ratio to an fp16 cache, the perplexity delta with the
paired block-bootstrap interval of `compare`, and the mean KL of every scored token's next-token distribution from
the baseline's. For an auto method also its mean bits and the KL its profile predicts (the sum of the probes'), so
the additive model behind the allocation is checked where it is used: measured KL vs predicted, and the
perplexity delta vs the target (met: the point estimate is within the target; met_ci: the whole interval is).

Peers (`--targets '' --fixed kivi:2,hf-quanto:4 --merge <earlier json>`) run later are merged beside an earlier run
when its uncompressed baseline scored the same perplexity, so one plot shows auto, fixed widths and peers.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpack import auto
from kvpack.eval.memory import memory_report
from kvpack.eval.methods import BASELINE, MethodUnavailable, attention_for, make_cache
from kvpack.eval.perplexity import delta, delta_ci, perplexity
from kvpack.eval.stats import BootstrapConfig
from kvpack.models import load_model
from kvpack.text import token_stream

from .env import environment

PROG = "python -m kvpack.bench.auto"
FIXED = ["turboquant:k4v4", "turboquant:k4v3", "turboquant:k3v3", "turboquant:k4v2", "turboquant:k3v2", "turboquant:k2v2"]


def _run(model, ids, method: str, args, reference: list[torch.Tensor] | None) -> tuple[dict, object, list[torch.Tensor]]:
    """One method's row, its PerplexityResult and its chunks' log-probabilities (kept for the baseline only)."""
    chunks: list[torch.Tensor] = []
    kl: list[torch.Tensor] = []
    probe: dict = {}

    def on_logits(logits: torch.Tensor) -> None:
        logp = F.log_softmax(logits.double(), dim=-1)  # float64: KLs of 1e-4 nats are differences of nearly equal sums
        if reference is None:
            chunks.append(logp.float())
        else:
            ref = reference[len(kl)].double()
            kl.append(F.kl_div(logp, ref, log_target=True, reduction="none").sum(-1).clamp_min(0))

    start = time.perf_counter()
    cache = make_cache(model, method)
    with attention_for(model, method):
        result = perplexity(model, ids, cache, args.context, args.chunk, args.ppl_tokens, after_prefill=lambda c: probe.update(memory_report(c, model.config)),
                            progress=False, on_logits=on_logits)
    mem = probe
    row = {"method": method, "status": "ok", "tokens": mem["tokens"], "total_bytes": mem["total_bytes"], "fp16_bytes": mem["fp16_bytes"],
           "ratio_vs_fp16": mem["fp16_bytes"] / mem["total_bytes"], "ppl": result.ppl, "nll": result.nll, "seconds": time.perf_counter() - start}
    if "archive" in mem:  # a method with older tiers: its oldest tier's own ratio, fitted state included
        row |= {"archive_tokens": mem["archive"]["tokens"], "archive_ratio_vs_fp16": mem["archive"]["ratio"]}
    if kl:
        per_token = torch.cat(kl)
        row |= {"kl": per_token.mean().item(), "kl_se": (per_token.std() / len(per_token) ** 0.5).item()}
    if method.startswith("auto:"):
        target, _ = auto.parse_auto(method.removeprefix("auto:"))
        row |= {"target_pct": 100 * target, "kl_budget": math.log1p(target), **auto.summary(cache.method, auto.load_profile(model))}
    return row, result, chunks


def _with_delta(row: dict, result, base, args) -> dict:
    row["ppl_delta_pct"], _ = delta(result, base)
    row["ppl_delta_ci"] = list(delta_ci(result, base, BootstrapConfig(seed=args.seed)))
    if "target_pct" in row:
        row["met"] = row["ppl_delta_pct"] <= row["target_pct"]
        row["met_ci"] = row["ppl_delta_ci"][1] <= row["target_pct"]
        row["kl_met"] = row["kl"] <= row["kl_budget"]
    return row


def _group(method: str) -> str:
    return "auto" if method.startswith("auto:") else "fixed" if method.startswith("turboquant:") else "peer"


def merge(earlier_path: str, args, base_ppl: float) -> list[dict]:
    """The method rows of an earlier run of the same protocol, to place beside this run's. Its baseline must have
    scored the same perplexity as this run's (the protocol is deterministic): anything else means the runs differ."""
    earlier = json.loads(Path(earlier_path).read_text())
    same = ("model", "context", "ppl_tokens", "chunk", "text", "dtype")
    diff = [k for k in same if earlier["config"][k] != getattr(args, k)]
    if diff:
        raise SystemExit(f"--merge {earlier_path}: that run differs in {', '.join(diff)}; merge only runs of the same protocol")
    base = earlier["rows"][0]  # every run writes its uncompressed baseline first
    if not math.isclose(base["ppl"], base_ppl, rel_tol=1e-6):
        raise SystemExit(f"--merge {earlier_path}: its uncompressed perplexity {base['ppl']:.6f} differs from this run's {base_ppl:.6f}")
    return [r | {"merged_from": earlier_path} for r in earlier["rows"] if r is not base]


def plot(rows: list[dict], path: str, title: str) -> None:
    """Perplexity delta (with its interval) against the compression ratio: the auto curve and the fixed widths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"auto": "auto:<target>", "fixed": "fixed turboquant", "peer": "KIVI, transformers' quantized caches"}
    for group, style, color in (("auto", "o-", "tab:blue"), ("fixed", "s", "tab:gray"), ("peer", "^", "tab:red")):
        pts = sorted((r for r in rows if r.get("ppl_delta_pct") is not None and _group(r["method"]) == group), key=lambda r: r["ratio_vs_fp16"])
        if not pts:
            continue
        x, y = [r["ratio_vs_fp16"] for r in pts], [r["ppl_delta_pct"] for r in pts]
        err = [[v - r["ppl_delta_ci"][0] for v, r in zip(y, pts, strict=True)], [r["ppl_delta_ci"][1] - v for v, r in zip(y, pts, strict=True)]]
        ax.errorbar(x, y, yerr=err, fmt=style, color=color, capsize=3, label=labels[group])
        for r in pts:
            ax.annotate(r["method"].removeprefix("turboquant:"), (r["ratio_vs_fp16"], r["ppl_delta_pct"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
        for r in pts if group == "auto" else ():
            ax.plot([r["ratio_vs_fp16"] - 0.08, r["ratio_vs_fp16"] + 0.08], [r["target_pct"]] * 2, color=color, lw=1, alpha=0.6)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("compression vs an fp16 cache (real bytes after the prefill)")
    ax.set_ylabel("perplexity delta, % (95% paired bootstrap)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--targets", default="0.5,1,2,4", help="comma-separated perplexity targets in percent")
    p.add_argument("--grains", default="layer", help="auto widths per layer and K/V ('layer') and/or per kv head ('head'), comma-separated")
    p.add_argument("--fixed", default=",".join(FIXED), help="comma-separated fixed methods to place beside them")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--text", default="news")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--merge", help="an earlier JSON of this protocol on this model: its method rows are kept beside these (e.g. peers run later)")
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    grains = [g for g in args.grains.split(",") if g]
    if any(g not in auto.GRAINS for g in grains):
        raise SystemExit(f"--grains takes {' and/or '.join(auto.GRAINS)} (comma-separated), got {args.grains!r}")
    methods = [auto.target_name(float(t) / 100, g) for t in args.targets.split(",") if t for g in grains] + [m for m in args.fixed.split(",") if m]
    requested = set(methods)  # what this run answers for, infeasible targets included: a merge keeps only the rest
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    out = {"environment": environment(PROG, argv), "config": vars(args), "rows": []}
    if any(m.startswith("auto:") for m in methods):  # only auto methods read a profile (fixed ones alone run without)
        profile = auto.load_profile(model)  # a missing profile fails now, not after the baseline
        out["profile"] = {"path": str(auto.profile_path(model)), "calibration": profile["calibration"], "kvpack_version": profile["kvpack_version"]}
    for m in [m for m in methods if m.startswith("auto:")]:
        try:
            auto.auto_method(model, m)
        except ValueError as err:  # a target below what the widest width everywhere is predicted to reach: recorded, not run
            out["rows"].append({"method": m, "status": f"infeasible: {err}"})
            methods.remove(m)
            print(f"{m}: {err}", flush=True)
    ids = token_stream(tokenizer, args.text, args.context + args.ppl_tokens + 1)
    base_row, base, reference = _run(model, ids, BASELINE, args, None)
    out["rows"].insert(0, base_row)
    if args.merge:
        merged = merge(args.merge, args, base.ppl)
        out["rows"][1:1] = [r for r in merged if r["method"] not in requested]
    print(f"{BASELINE}: ppl {base.ppl:.4f} in {base_row['seconds']:.0f} s", flush=True)
    for method in methods:
        try:
            row, result, _ = _run(model, ids, method, args, reference)
        except MethodUnavailable as err:  # a peer this model cannot run (e.g. quanto on sliding-window layers): recorded
            out["rows"].append({"method": method, "status": f"unavailable: {err}"})
            Path(args.json).write_text(json.dumps(out, indent=1))
            print(f"{method}: unavailable: {err}", flush=True)
            continue
        out["rows"].append(_with_delta(row, result, base, args))
        Path(args.json).write_text(json.dumps(out, indent=1))  # after every method: a long run keeps what it measured
        extra = f", predicted KL {row['predicted_kl']:.5f}, met {row['met']}" if "target_pct" in row else ""
        print(f"{method}: {row['ratio_vs_fp16']:.2f}x, ppl {row['ppl_delta_pct']:+.2f}% [{row['ppl_delta_ci'][0]:+.2f}, {row['ppl_delta_ci'][1]:+.2f}], "
              f"KL {row['kl']:.5f}{extra} ({row['seconds']:.0f} s)", flush=True)
    if args.plot:
        plot(out["rows"], args.plot, f"{args.model}: {args.context}-token {args.text} prefix, {args.ppl_tokens} scored tokens ({args.dtype})")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
