"""End-to-end greedy decode speed, every contender side by side in one process.

    python -m kvpack.bench.decode --model smollm2-135m --contexts 2048,8192 --methods dynamic,turboquant:k3v2,int8,shard
    python -m kvpack.bench.decode --device cuda --dtype bfloat16 --model qwen2.5-0.5b --batch 32 --contexts 8192,32768

Protocol (the same for every contender, so machine noise hits them alike):
1. The prompt is prefilled once into a `DynamicCache` (in chunks, so long contexts fit); each kvpack
   cache is then filled with those same post-RoPE K/V through `cache.update`, exactly what the model
   would hand it during its own prefill, and compressed as it would be (prompt flush). A method whose
   prompt codecs fit on the prompt's queries (Shard) is filled by one real forward under kvpack
   attention instead, as a user's prefill fills it (`fill_kvpack`).
2. Untimed warm-up steps, then `steps` greedy decode steps interleaved round-robin: A B C A B C ...
   Each contender decodes its own greedy continuation. Blocks leave the window every 64 tokens, so
   the timed steps include the periodic block flushes.
3. Reported per contender: mean (amortized), p50 and p99 ms per token, and the speed ratio vs
   `DynamicCache` (its mean step time over the contender's), plus prefill-flush time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpack

from ..auto import auto_method, parse_auto
from ..cache.kvcache import KVCache
from ..cache.layer import KVPackLayer
from ..eval.generate import forward
from ..eval.memory import memory_report
from ..models import load_model, random_weights_model
from ..registry import get_method
from ..text import token_stream
from .env import environment

PROG = "python -m kvpack.bench.decode"


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


@torch.no_grad()
def prefill_dynamic(model, ids: torch.Tensor, chunk: int = 2048):
    """(DynamicCache holding `ids` ([T] or [B, T]), last logits): the prompt in chunks, exact attention."""
    cache = DynamicCache(config=model.config)
    logits = None
    for i in range(0, ids.shape[-1], chunk):
        logits = forward(model, ids[..., i : i + chunk], cache)
    return cache, logits


def needs_queries(method) -> bool:
    """Whether `method` reads the prompt's queries (a prompt codec's fit, e.g. Shard's PCA rank, or its anchors),
    runs the model over its prompt (`@fisher`), or compresses sliding-window layers (which need every prompt token,
    where a filled DynamicCache keeps only each window): what only a real forward under `kvpack.enable` gives it."""
    config = get_method(method)
    spec = config.prefill_key
    return (config.anchors > 0 or config.fisher_tail > 0 or config.sliding_method() is not None
            or (spec is not None and spec.codec_class.fits_on_queries))


@torch.no_grad()
def fill_kvpack(model, method, source, ids: torch.Tensor | None = None) -> tuple[object, float]:
    """A kvpack cache holding `source`'s K/V (a filled DynamicCache), compressed; and the seconds it took.

    With `ids` (the prompt) and a method that reads the prompt's queries (`needs_queries`), the cache is filled
    by one real forward of the model over `ids` under kvpack attention instead, so it sees the queries a user's
    prefill gives it (else Shard would fall back to its energy rank and anchors would not exist); the seconds
    then include that forward.
    """
    cache = KVCache(model, method)
    start = time.perf_counter()
    if ids is not None and needs_queries(method):
        forward(model, ids, cache)
        return cache, time.perf_counter() - start
    if any(isinstance(layer, KVPackLayer) and layer.sliding_window is not None for layer in cache.layers):
        raise ValueError(f"method {method!r} compresses sliding-window layers, which need the whole prompt (a DynamicCache keeps only "
                         "each window): pass the prompt's ids to fill the cache by a forward")
    for idx, (layer, src) in enumerate(zip(cache.layers, source.layers, strict=True)):
        k, v = src.keys, src.values
        if isinstance(layer, KVPackLayer):
            cache.update(k, v, idx)
            layer.flush()
        else:
            cache.update(k, v, idx)
    return cache, time.perf_counter() - start


def _new_cache(model, method, source, ids: torch.Tensor):
    if method == "dynamic":
        return copy.deepcopy(source), 0.0
    return fill_kvpack(model, method, source, ids)


@torch.no_grad()
def run_context(model, ids: torch.Tensor, methods: list[str], steps: int, warmup: int, log=print, configs: dict | None = None) -> list[dict]:
    """Rows for one context length: every method decoding `steps` interleaved greedy tokens. `configs`: name ->
    MethodConfig for names the registry cannot resolve alone (`auto:<target>`, read from the model's profile)."""
    configs = configs or {}
    start = time.perf_counter()
    source, logits = prefill_dynamic(model, ids)
    batch, context = (1, len(ids)) if ids.dim() == 1 else ids.shape
    log(f"  prefill {batch} x {context} tokens (DynamicCache, chunked) in {time.perf_counter() - start:.1f} s")
    caches, fills, last = {}, {}, {}
    for m in methods:
        caches[m], fills[m] = _new_cache(model, configs.get(m, m), source, ids)
        last[m] = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1): each row's greedy token
    del source
    times: dict[str, list[float]] = {m: [] for m in methods}
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)  # GPU steps are timed to completion
    for step in range(warmup + steps):
        for m in methods:
            sync()
            t0 = time.perf_counter()
            out = forward(model, last[m], caches[m])
            sync()
            dt = time.perf_counter() - t0
            last[m] = out[:, -1].argmax(-1, keepdim=True)
            if step >= warmup:
                times[m].append(dt)
    base = statistics.fmean(times[methods[0]])
    rows = []
    for m in methods:
        ts = times[m]
        mean = statistics.fmean(ts)
        rows.append({
            "method": m, "context": context, "batch": batch, "steps": steps, "mean_ms": 1e3 * mean, "p50_ms": 1e3 * _percentile(ts, 0.5),
            "p99_ms": 1e3 * _percentile(ts, 0.99), "tok_s": batch / mean, "speed_vs_first": base / mean, "kv_bytes": memory_report(caches[m], model.config)["total_bytes"],
            "fill_s": fills[m], "fill_includes_forward": m != "dynamic" and needs_queries(configs.get(m, m)), "step_ms": [round(1e3 * t, 3) for t in ts],
        })
        log(f"  {m:22s} mean {1e3 * mean:7.1f} ms  p50 {rows[-1]['p50_ms']:7.1f}  p99 {rows[-1]['p99_ms']:7.1f}  x{base / mean:.2f} vs {methods[0]}")
    return rows


def _prompt_ids(tok, text: str, context: int, batch: int, vocab: int) -> torch.Tensor:
    """`[context]` prompt tokens, or `[batch, context]`: the text's tokens, each row rotated by its own offset
    (rows differ, one text suffices); random ids without a tokenizer (random weights)."""
    if tok is None:
        ids = torch.randint(vocab, (batch, context), generator=torch.Generator().manual_seed(context))
        return ids[0] if batch == 1 else ids
    ids = token_stream(tok, text, context)
    return ids if batch == 1 else torch.stack([ids.roll(-(row * context) // batch) for row in range(batch)])


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["context"], r["mean_ms"]) for r in rows if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decoded token (mean, lower is better)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--random-weights", action="store_true",
                   help="the --model directory's architecture (its config.json) with random weights and random token ids: "
                        "speed only, where the weights are not at hand; fixed-width codecs cost the same on any weights")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (each row its own greedy tokens)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--methods", default="dynamic,turboquant:k3v2,int8,shard", help="the first is the reference (dynamic)")
    p.add_argument("--steps", type=int, default=160, help="timed decode steps per method (>= 128 so block flushes fall inside)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the model and every cache on it; CUDA steps run kvpack's Triton ops)")
    p.add_argument("--text", default="news")
    p.add_argument("--json", default="bench/results/decode.json")
    p.add_argument("--plot", default=None, help="PNG: ms per token vs context per method")
    p.add_argument("--conditions", default="quiet", help="what else ran on the machine, stored in the JSON (e.g. 'two busy loops')")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    contexts = [int(c) for c in args.contexts.split(",")]
    if not methods or methods[0] != "dynamic":
        p.error("--methods must start with 'dynamic' (the reference)")
    for m in methods[1:]:
        if m.startswith("auto:"):  # its profile is read once the model is loaded

            parse_auto(m.removeprefix("auto:"))
        else:
            get_method(m)  # unknown names fail here, before any model loads
    if args.threads < 1 or args.steps < 1 or args.batch < 1 or any(c < 128 for c in contexts):
        p.error("--threads, --steps and --batch must be >= 1 and every context >= 128")
    torch.set_num_threads(args.threads)
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device must be cpu or cuda (with a CUDA build of torch and a GPU), got {args.device!r}")
    if args.random_weights:
        model, tok = random_weights_model(args.model, getattr(torch, args.dtype), args.device), None
    else:
        model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
        model.to(args.device)

    kvpack.enable(model)

    configs = {m: auto_method(model, m) for m in methods if m.startswith("auto:")}  # a missing profile fails now, naming the command
    rows: list[dict] = []
    for ctx in contexts:
        print(f"{args.model}: context {ctx}", flush=True)
        ids = _prompt_ids(tok, args.text, ctx, args.batch, model.config.get_text_config(decoder=True).vocab_size)
        rows += run_context(model, ids, methods, args.steps, args.warmup, configs=configs)
        out = {"environment": environment(PROG), "model": args.model, "random_weights": args.random_weights, "dtype": args.dtype,
               "device": args.device, "batch": args.batch, "conditions": args.conditions, "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))  # saved after every context
    if args.plot:
        plot(rows, args.plot)
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
