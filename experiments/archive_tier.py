"""An archive tier that holds a growing context at >= 10x: quality, bytes per tier, and the archive's fits, over draws.

    python experiments/archive_tier.py --model smollm2-135m --prompt 1024 --follow 7168 --seeds 0,1,2 \
        --methods 'turboquant:k3v2+ropemean@anchors=0.5%@window=32,shard:10x@window=32,tiered:1024:shard' \
        --json bench/results/archive-tier-smollm2-135m.json --plot bench/results/archive-tier-smollm2-135m.png

The context grows after a short prompt, as a conversation does: `--follow` tokens of news text are scored in chunks
of 256 that read the compressed cache and then join it (the perplexity protocol of `kvpack compare`, with a prompt
shorter than what follows). So most tokens reach the archive by demotion from the warm tier, not straight from the
prompt, and a prompt-only codec (Shard's) holds only the first `--prompt` tokens. Each method runs once per draw
(`@seed=N`) beside one uncompressed run; deltas are paired per draw, and the mean and range over draws are reported.

`NAME|budget=R` runs NAME under a `MemoryBudget` of 1/R of the fp16 bytes of the whole run's tokens (the bytes every
layer's K and V would take in fp16 at the end): past it the cache first demotes warm blocks into the archive, then
evicts; the row counts both. `NAME|bytes-of=OTHER` runs NAME under a budget of the most bytes OTHER (listed before it)
held after any forward of the same draw: a placement set by the budget against a fixed boundary, at equal peak bytes.
`NAME|max-bytes=N` runs NAME under a budget of N bytes (e.g. a fixed boundary's peak from an earlier run's file).

An archive variant is `archive:AFTER[/kB][/eE|/sS][/vqN][/fitF][/refitR][/warm=METHOD]`: the `tiered:AFTER:shard`
layout with the PCA keys' average bits B, their rank chosen by key energy E or by a score error of S% on the latest
queries (the method's rule: 3%), N value codewords per 4 channels, fits on F tokens, refit at a rise R (0: never), and
METHOD's codecs as the warm tier.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvpack
from kvpack import CodecSpec, Tier
from kvpack.bench.env import environment
from kvpack.cache import tiers
from kvpack.eval.methods import make_cache
from kvpack.eval.perplexity import delta, delta_ci, perplexity
from kvpack.metrics import collect
from kvpack.registry import ARCHIVE_CODEBOOK, ARCHIVE_FIT_TOKENS, ARCHIVE_KEY_BITS, ARCHIVE_REFIT, MethodConfig, get_method
from kvpack.text import token_stream


def archive_variant(text: str) -> MethodConfig:
    """`archive:AFTER[/kB][/eE|/sS][/vqN][/fitF][/refitR]` -> the `tiered:AFTER:shard` method with those archive options."""
    after, *opts = text.split(":", 1)[1].split("/")
    key, value = {"bits": ARCHIVE_KEY_BITS}, {"token_norm": True, "codebook_size": ARCHIVE_CODEBOOK}
    fit, refit, warm = ARCHIVE_FIT_TOKENS, ARCHIVE_REFIT, None
    for opt in opts:
        if opt.startswith("warm="):
            warm = get_method(opt[5:])
        elif opt.startswith("refit"):
            refit = float(opt[5:])
        elif opt.startswith("fit"):
            fit = int(opt[3:])
        elif opt.startswith("vq"):
            value["codebook_size"] = int(opt[2:])
        elif opt.startswith("k"):
            key["bits"] = float(opt[1:])
        elif opt.startswith("e"):
            key["energy"], key["score_error"] = float(opt[1:]), None
        elif opt.startswith("s"):
            key["score_error"] = float(opt[1:]) / 100
        else:
            raise SystemExit(f"{text!r}: unknown archive option {opt!r} (kB, eE, sS, vqN, fitF, refitR, warm=METHOD)")
    base = get_method(f"tiered:{after}:shard")
    tier = Tier(CodecSpec("pca", key), CodecSpec("vq", value), int(after), fit_tokens=fit, refit=refit)
    stream = {"key": warm.key, "value": warm.value} if warm is not None else {}
    return base.with_options(name=text, tiers=(tier,), **stream)


def resolve(name: str, seed: int) -> MethodConfig:
    method = archive_variant(name) if name.startswith("archive:") else get_method(name)
    return method.with_seed(seed)


def key_ranks(cache) -> dict[str, list]:
    """Each fitted archive key codec's kept components and the rule that chose them, over layers and fits."""
    ranks, sources = [], set()
    for layer in cache.layers:
        for name, codec in getattr(layer, "_codecs", {}).items():
            if name.startswith("tier") and name.endswith("_key") and getattr(codec, "segments", None):
                ranks.append(sum(n for n, _ in codec.segments))
                sources.add(getattr(codec, "rank_source", "?"))
    return {"ranks": sorted(ranks), "sources": sorted(sources)}


def bytes_by_age(cache) -> list[tuple[int, int, float]]:
    """Runs of tokens held alike, oldest first: (age of the run's oldest token, age of its newest, bytes per token over
    every layer). Codec state and the anchors' exact rows are not included: they are per fit and per anchor."""
    length = cache.get_seq_length()
    per_token = torch.zeros(length, dtype=torch.float64)
    for layer in cache.layers:
        if not hasattr(layer, "segments") or not layer.is_initialized:
            continue
        exact = sum(t[:, :, :1].numel() * t.element_size() for t in (layer.sink_k, layer.sink_v))
        per_token[: layer.sink_k.shape[2]] += exact
        for seg in layer.segments:
            per_token[seg.start : seg.start + seg.length] += seg.nbytes() / max(seg.length, 1)
        per_token[length - layer.win_k.shape[2] :] += exact
    runs: list[tuple[int, int, float]] = []
    for i, value in enumerate(per_token.tolist()):
        age = length - 1 - i
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], age, value)
        else:
            runs.append((age, age, value))
    return runs


def fp16_bytes_per_token(model) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 2


def run(model, ids: torch.Tensor, method: MethodConfig, prompt: int, follow: int, chunk: int, budget: float = 0.0,
        max_bytes: int = 0) -> tuple[dict, object]:
    """One pass of the protocol; `budget` R: a MemoryBudget of 1/R of the run's fp16 bytes, or `max_bytes` exactly."""
    refits: dict[int, int] = {}
    measure = tiers.measure_tier

    def counting(layer, kind, k, v, start, fresh):
        errors = measure(layer, kind, k, v, start, fresh)
        if fresh:
            refits[layer.layer_idx] = refits.get(layer.layer_idx, 0) + 1
        return errors

    tiers.measure_tier = counting
    peak, hook = [0], None
    try:
        if budget:
            max_bytes = int(fp16_bytes_per_token(model) * (prompt + follow) / budget)
        limit = kvpack.MemoryBudget(max_bytes) if max_bytes else None
        cache = kvpack.KVCache(model, method, budget=limit)
        hook = model.register_forward_hook(  # the most the cache held after any forward (the budget's measure)
            lambda *_: peak.__setitem__(0, max(peak[0], sum(layer.nbytes() for layer in cache.compressed_layers()))))
        t0 = time.perf_counter()
        result = perplexity(model, ids, cache, prefix=prompt, chunk=chunk, n_score=follow, progress=False)
        seconds = time.perf_counter() - t0
    finally:
        tiers.measure_tier = measure
        if hook is not None:
            hook.remove()
    metrics = collect(cache)
    per_tier = {t.tier: {"tokens": t.tokens, "bytes": t.bytes, "state_bytes": t.state_bytes, "x_fp16": t.ratio_with_state}
                for t in metrics.tiers}
    row = {"method": method.name, "ppl": result.ppl, "total_bytes": metrics.total_bytes, "x_fp16": metrics.ratio,
           "peak_bytes": peak[0], "tiers": per_tier, "fits_per_layer": sorted(refits.values()) if refits else [], "seconds": seconds,
           "archive_keys": key_ranks(cache),
           "bytes_by_age": bytes_by_age(cache)}
    if limit is not None:
        events = cache.budget_events
        row["budget"] = {"fp16_fraction": limit.max_bytes / (fp16_bytes_per_token(model) * (prompt + follow)), "max_bytes": limit.max_bytes,
                         "demoted_tokens": sum(e.tokens for e in events if e.action == "demote"),
                         "evicted_tokens": sum(e.tokens for e in events if e.action == "evict")}
    return row, result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--follow", type=int, default=7168)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--methods", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="PNG: bytes per token against token age, one line per method (its first draw)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment("python experiments/archive_tier.py", argv)  # at the start: the tree the run's code came from
    model, tok = kvpack.load_model(args.model)
    ids = token_stream(tok, "news", args.prompt + args.follow + 1)
    kvpack.enable(model)
    seeds = [int(s) for s in args.seeds.split(",")]
    base = perplexity(model, ids, make_cache(model, "dynamic"), prefix=args.prompt, chunk=args.chunk,
                      n_score=args.follow, progress=False)
    rows, summary, firsts = [], [], []  # one row per (method, draw); the mean and range over draws per method
    done: dict[str, list[dict]] = {}  # each method's rows so far, by its name in --methods
    for name in [m for m in args.methods.split(",") if m]:
        draws = []
        method_name, _, budget = name.partition("|budget=")
        method_name, _, other = method_name.partition("|bytes-of=")
        method_name, _, fixed_bytes = method_name.partition("|max-bytes=")
        if other and other not in done:
            raise SystemExit(f"{name!r}: list {other!r} before it in --methods (its bytes set this run's budget)")
        for seed in seeds:
            max_bytes = next(r["peak_bytes"] for r in done.get(other, []) if r["seed"] == seed) if other else int(fixed_bytes or 0)
            row, result = run(model, ids, resolve(method_name, seed), args.prompt, args.follow, args.chunk, float(budget or 0), max_bytes)
            if budget or other or fixed_bytes:
                row["method"] += f"|budget={budget}" if budget else f"|bytes-of={other}" if other else f"|max-bytes={fixed_bytes}"
            row["seed"], row["ppl_delta_pct"] = seed, delta(result, base)[0]
            row["ppl_delta_ci"] = list(delta_ci(result, base))
            draws.append(row)
            save(args, base, env, [*rows, *draws], summary)  # after every pass: a stopped run keeps what it measured
            print(f"{row['method']}: {row['x_fp16']:.2f}x, {row['ppl_delta_pct']:+.2f}% "
                  f"[{row['ppl_delta_ci'][0]:+.1f}, {row['ppl_delta_ci'][1]:+.1f}], tiers "
                  + ", ".join(f"{k} {v['tokens']} tok {v['x_fp16']:.2f}x" for k, v in row["tiers"].items())
                  + f", fits/layer {row['fits_per_layer'][:1]}..{row['fits_per_layer'][-1:]}, key ranks {row['archive_keys']}, "
                  f"{row['seconds']:.0f} s", flush=True)
        deltas = [d["ppl_delta_pct"] for d in draws]
        rows += draws
        done[name] = draws
        firsts.append(draws[0])
        summary.append({"method": name, "draws": len(draws), "mean_delta_pct": statistics.fmean(deltas), "min_delta_pct": min(deltas),
                        "max_delta_pct": max(deltas), "sd_delta_pct": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
                        "mean_x_fp16": statistics.fmean(d["x_fp16"] for d in draws)})
        print(f"== {name}: mean {summary[-1]['mean_delta_pct']:+.2f}% ({min(deltas):+.2f} to {max(deltas):+.2f}), "
              f"{summary[-1]['mean_x_fp16']:.2f}x", flush=True)
    out = save(args, base, env, rows, summary)
    if args.plot:
        plot(firsts, args.plot, args.model)
    return out


def save(args: argparse.Namespace, base, env: dict, rows: list[dict], summary: list[dict]) -> dict:
    """The result so far, written to `--json` when given (the summary holds the methods whose draws all ran)."""
    out = {"config": vars(args) | {"json": str(args.json), "plot": str(args.plot)}, "baseline_ppl": base.ppl,
           "environment": env, "rows": rows, "summary": summary}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


def plot(rows: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        xs, ys = [], []
        for oldest, newest, value in row["bytes_by_age"]:
            xs += [oldest + 0.5, newest - 0.5]
            ys += [value, value]
        ax.plot(xs, ys, label=row["method"].replace(f"@seed={row['seed']}", ""))
    ax.set_xlabel("token age (tokens behind the newest)")
    ax.invert_xaxis()  # oldest on the left, as the tokens arrived
    ax.set_ylabel("bytes per token (all layers, K+V)")
    ax.set_yscale("log")
    ax.set_title(f"{model}: bytes per token by age at the end of the run")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
