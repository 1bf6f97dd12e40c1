"""Shard measurements on real models: compression by context, perplexity delta, the quality
vs budget curve, needle recall and decode speed, each against an uncompressed `DynamicCache`.

    python -m kvpack.bench.shard                       # everything below, in priority order
    python -m kvpack.bench.shard context --model smollm2-135m --contexts 2048,4096,8192
    python -m kvpack.bench.shard ppl     --model smollm2-135m
    python -m kvpack.bench.shard curve   --model smollm2-135m
    python -m kvpack.bench.shard needle  --model smollm2-135m --lengths 1024
    python -m kvpack.bench.shard ablation --model smollm2-135m --prefix 8192   # which half loses quality
    python -m kvpack.bench.shard layers  --model qwen2.5-0.5b --prefix 2048    # attention error per layer, K and V apart
    python -m kvpack.bench.shard report                # tables + PNG from the JSON files only

Every experiment writes `bench/results/shard_<experiment>_<model>.json` (rows appended per run, so a
cut-off run keeps what it finished); `report` renders the markdown tables and
`bench/results/shard_curve.png`. Bytes are `KVCache.memory_report()`: every tensor the cache holds
(sinks, window, compressed middle, stream, PCA bases, VQ codebooks, scales). One CPU thread, fp32.
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
from kvpack import CodecSpec, get_method
from kvpack.bench.env import environment
from kvpack.bench.layers import causal_attention_error, prompt_qkv, stored
from kvpack.cache.layer import KVPackLayer
from kvpack.codecs.pca import PCAKeyCodec
from kvpack.eval import needle
from kvpack.eval.generate import forward
from kvpack.eval.perplexity import perplexity
from kvpack.registry import MethodConfig
from kvpack.text import token_stream

OUT = Path("bench/results")
# (label, PCA options, VQ options) for the quality-vs-budget curve, on top of the method's own options.
# The stored curve rows were measured before the current default (energy 0.90, per-token value RMS),
# when energy 0.95 was the default and VQ had no per-token RMS; labels are the stored rows' keys.
CURVE: list[tuple[str, dict, dict]] = [
    ("e0.95 b4 vq256 (default)", {"energy": 0.95}, {}),
    ("e0.90 b4 vq256", {"energy": 0.90, "bits": 4}, {}),
    ("e0.95 b2 vq256", {"energy": 0.95, "bits": 2}, {}),
    ("e0.95 b3 vq256", {"energy": 0.95, "bits": 3}, {}),
    ("e0.99 b3 vq256", {"energy": 0.99, "bits": 3}, {}),
    ("e0.99 b4 vq256", {"energy": 0.99, "bits": 4}, {}),
    ("e0.95 b4 vq16", {}, {"codebook_size": 16}),
    ("e0.90 b2 vq256", {"energy": 0.90, "bits": 2}, {}),
    ("e0.99 b2 vq256", {"energy": 0.99, "bits": 2}, {}),
    ("e0.90 b3 vq256", {"energy": 0.90, "bits": 3}, {}),
]
# Controls: kvpack's attention path with a lossless / int8 cache, and shard with an int8 prefill (no PCA/VQ),
# to separate the compression's effect from the attention implementation's.
CONTROLS: list[tuple[str, str, None]] = [("kvpack fp16 (control)", "fp16", None), ("kvpack int8 (control)", "int8", None)]


def _method(pca: dict | None = None, vq: dict | None = None, stream: str = ""):
    base = get_method("shard" + (f":{stream}" if stream else ""))
    if not pca and not vq:
        return base
    key = CodecSpec("pca", {**base.prefill_key.options, **(pca or {})})
    value = CodecSpec("vq", {**base.prefill_value.options, **(vq or {})})
    return base.with_options(prefill_key=key, prefill_value=value)


def ablation_methods() -> list[tuple[str, object]]:
    """Shard with one half made (nearly) lossless, to see which half costs perplexity."""
    base = get_method("shard")
    no_norm = CodecSpec("vq", {**base.prefill_value.options, "token_norm": False})
    tight = CodecSpec("pca", {**base.prefill_key.options, "score_error": 0.01})
    return [
        ("shard (default)", base),
        ("shard, VQ without per-token RMS (the blog's V path)", base.with_options(prefill_value=no_norm)),
        ("K lossy only (V int8)", base.with_options(prefill_value=CodecSpec("int8"))),
        ("V lossy only (K int8)", base.with_options(prefill_key=CodecSpec("int8"))),
        ("V lossy only, VQ without per-token RMS", base.with_options(prefill_key=CodecSpec("int8"), prefill_value=no_norm)),
        ("shard, key rank at 1% score error (3% default)", base.with_options(prefill_key=tight)),
    ]


def _cache(model, method):
    """`method` None: the uncompressed DynamicCache (kvpack attention disabled); else a KVCache (enabled)."""
    if method is None:
        kvpack.disable(model)
        return DynamicCache()
    kvpack.enable(model)
    return kvpack.KVCache(model, method)


def _dynamic_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _append(path: Path, row: dict) -> None:
    rows = json.loads(path.read_text()) if path.exists() else []
    rows.append(row)
    path.write_text(json.dumps(rows, indent=1))


def _load(name: str):
    torch.manual_seed(0)
    return kvpack.load_model(name)


def _decode_speed(model, cache, logits, steps: int) -> float:
    times = []
    for _ in range(steps):
        token = logits[0, -1].argmax().view(1)
        t = time.perf_counter()
        logits = forward(model, token, cache)
        times.append(time.perf_counter() - t)
    return 1.0 / statistics.median(times[1:] if len(times) > 2 else times)


@torch.no_grad()
def run_context(name: str, contexts: list[int], decode: int, out: Path, baseline: bool = True, config: int = 0) -> None:
    """Prefill `n` news tokens into shard and into a DynamicCache: real bytes, prefill time, decode tok/s."""
    model, tok = _load(name)
    for n in contexts:
        ids = token_stream(tok, "news", n)
        shard = ("shard" if config == 0 else f"shard {CURVE[config][0]}", _method(CURVE[config][1], CURVE[config][2]))
        for label, method in (("dynamic", None), shard)[0 if baseline else 1 :]:
            cache = _cache(model, method)
            t = time.perf_counter()
            logits = forward(model, ids, cache)
            prefill_s = time.perf_counter() - t
            if method is None:
                rep = {"tokens": n, "total_bytes": _dynamic_bytes(cache), "segments": {}}
                rep["fp16_bytes"] = rep["total_bytes"] // 2 if next(model.parameters()).dtype == torch.float32 else rep["total_bytes"]
            else:
                rep = cache.memory_report()
            row = {
                "model": name, "method": label, "context": n, "total_bytes": rep["total_bytes"], "fp16_bytes": rep["fp16_bytes"],
                "ratio_vs_fp16": rep["fp16_bytes"] / rep["total_bytes"], "bytes_per_token": rep["total_bytes"] / n,
                "segments": rep["segments"], "prefill_s": prefill_s,
                "decode_tok_s": _decode_speed(model, cache, logits, decode) if decode else None, "decode_steps": decode,
            }
            print(json.dumps({k: v for k, v in row.items() if k != "segments"}), flush=True)
            _append(out / f"shard_context_{name}.json", row)
            del cache


@torch.no_grad()
def run_ppl(name: str, configs: list[tuple[str, dict, dict]], out: Path, file: str, prefix: int = 2048, n_score: int = 512, chunk: int = 256) -> None:
    """Perplexity of `n_score` news tokens after a `prefix`-token prefill, per config, plus the DynamicCache baseline."""
    model, tok = _load(name)
    ids = token_stream(tok, "news", prefix + n_score + 1)
    path = out / f"shard_{file}_{name}.json"
    done = {r["label"] for r in json.loads(path.read_text())} if path.exists() else set()
    for label, pca, vq in [("dynamic", None, None), *configs]:
        if label in done:
            continue
        method = None if pca is None else get_method(pca) if isinstance(pca, str | MethodConfig) else _method(pca, vq)
        probe = {}

        def after(cache, method=method, probe=probe):
            probe.update(cache.memory_report() if method is not None else {"total_bytes": _dynamic_bytes(cache) // 2, "fp16_bytes": _dynamic_bytes(cache) // 2})
            probe.update(_key_stats(cache) if method is not None else {})

        t = time.perf_counter()
        res = perplexity(model, ids, _cache(model, method), prefix=prefix, chunk=chunk, n_score=n_score, after_prefill=after, progress=False)
        row = {
            **{k: v for k, v in probe.items() if k.startswith("k_")},
            "model": name, "label": label, "pca": pca if isinstance(pca, dict | str | None) else repr(pca), "vq": vq, "prefix": prefix, "n_score": n_score, "chunk": chunk,
            "ppl": res.ppl, "nll": res.nll, "total_bytes": probe["total_bytes"], "fp16_bytes": probe["fp16_bytes"],
            "ratio_vs_fp16": probe["fp16_bytes"] / probe["total_bytes"], "segments": probe.get("segments", {}), "seconds": time.perf_counter() - t,
        }
        print(json.dumps({k: v for k, v in row.items() if k != "segments"}), flush=True)
        _append(path, row)


@torch.no_grad()
def run_needle(name: str, lengths: list[int], depths: list[float], out: Path) -> None:
    model, tok = _load(name)
    for label, method in (("dynamic", None), ("shard", _method())):
        trials = needle.needle_grid(model, tok, lambda m=method: _cache(model, m), lengths, depths, "news", 0, 10, progress=False)
        for t in trials:
            row = {"model": name, "method": label, **t.as_dict()}
            print(json.dumps(row), flush=True)
            _append(out / f"shard_needle_{name}.json", row)


def _key_stats(cache) -> dict:
    """PCA rank kept (after the DP dropped groups) and key bits per element, averaged over layers."""
    codecs = [layer._codecs.get("prefill_key") for layer in cache.layers if hasattr(layer, "_codecs")]
    codecs = [c for c in codecs if isinstance(c, PCAKeyCodec)]  # ablations may hold the prompt's keys in int8
    if not codecs:
        return {}
    dims = codecs[0].kv_heads * codecs[0].head_dim
    return {
        "k_rank_mean": statistics.mean(c.rank for c in codecs),
        "k_rank_min": min(c.rank for c in codecs), "k_rank_max": max(c.rank for c in codecs),
        "k_bits_per_elem": statistics.mean(sum(n * b for n, b in c.segments) * c.groups for c in codecs) / dims,
    }


def _read(out: Path, pattern: str) -> list[dict]:
    rows = []
    for p in sorted(out.glob(pattern)):
        rows += json.loads(p.read_text())
    return rows


def report(out: Path) -> str:
    """Markdown tables from the JSON files, and the curve PNG."""
    lines = []
    ctx = _read(out, "shard_context_*.json")
    if ctx:
        lines += ["### Compression by context (real bytes, `memory_report()`)", "",
                  "| model | context | fp16 MB | shard MB | x fp16 | middle B/token/layer | window+sink MB | codec state MB | prefill s (shard / dyn) | decode tok/s (shard / dyn) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in [r for r in ctx if r["method"] != "dynamic"]:
            dyn = next((d for d in ctx if d["method"] == "dynamic" and d["model"] == r["model"] and d["context"] == r["context"]), {})
            seg = r["segments"]
            mid = seg.get("prefill:pca/vq", 0)
            layers = r.get("layers") or (30 if r["model"].startswith("smollm") else 24)
            mid_tokens = mid_tok(r)
            lines.append(
                f"| {r['model']}{'' if r['method'] == 'shard' else ' ' + r['method'][6:]} | {r['context']:,} | {r['fp16_bytes'] / 1e6:.2f} | {r['total_bytes'] / 1e6:.2f} | **{r['ratio_vs_fp16']:.2f}x** | "
                f"{mid / layers / mid_tokens:.1f} | {(seg.get('sink', 0) + seg.get('window', 0)) / 1e6:.2f} | {seg.get('codec_state', 0) / 1e6:.2f} | "
                f"{r['prefill_s']:.1f} / {_f(dyn.get('prefill_s'))} | "
                f"{_f(r.get('decode_tok_s'))} / {_f(dyn.get('decode_tok_s'))} |")
        lines.append("")
    for kind, title in (("ppl", "Perplexity at a 2,048-token prefix (512 scored news tokens, chunks of 256)"), ("curve", "Quality vs budget (SmolLM2-135M, 2K prefix)")):
        rows = _read(out, f"shard_{kind}_*.json")
        if kind == "ppl":  # a model's curve file holds its dynamic and default rows too
            have = {r["model"] for r in rows}
            rows += [r for r in _read(out, "shard_curve_*.json") if r["model"] not in have and r["label"] in ("dynamic", CURVE[0][0])]
        if not rows:
            continue
        rows = sorted(rows, key=lambda r: (r["model"], r["label"] != "dynamic", "control" not in r["label"], r["ratio_vs_fp16"]))
        lines += [f"### {title}", "",
                  "| model | config | K rank (mean, min-max) | K bits/elem | x fp16 at 2K | x fp16 at 8K (extrapolated) | ppl | ppl delta |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            base = next(b for b in rows if b["model"] == r["model"] and b["label"] == "dynamic")
            d = 100 * (r["ppl"] / base["ppl"] - 1)
            rank = f"{r['k_rank_mean']:.0f} ({r['k_rank_min']}-{r['k_rank_max']})" if "k_rank_mean" in r else "-"
            kb = f"{r['k_bits_per_elem']:.2f}" if "k_bits_per_elem" in r else "-"
            lines.append(f"| {r['model']} | {r['label']} | {rank} | {kb} | {r['ratio_vs_fp16']:.2f}x | {_at(r, 8192)} | {r['ppl']:.3f} | {d:+.2f}% |")
        lines.append("")
        if kind == "curve":
            _plot_curve(rows, out / "shard_curve.png")
    nd = _read(out, "shard_needle_*.json")
    if nd:
        lines += ["### Needle recall (passkey, greedy 10 tokens)", "", "| model | method | length | depth | found | answer |", "|---|---|---:|---:|---|---|"]
        for r in nd:
            lines.append(f"| {r['model']} | {r['method']} | {r['length']} | {r['depth']} | {'yes' if r['found'] else 'no'} | `{r['answer'].strip()[:30]}` (key {r['key']}) |")
        lines.append("")
    return "\n".join(lines)


def _at(r: dict, n: int) -> str:
    """Whole-cache ratio at n tokens from a 2K row: same sinks, window and codec state, middle bytes per
    token unchanged. The stored rows predate the exact-window prompt flush: their window held 124 tokens
    (2044 mod 64 = 60 extra), which is what this arithmetic assumes."""
    seg = r.get("segments") or {}
    if "prefill:pca/vq" not in seg:
        return "-"
    mid_2k = ((r["prefix"] - 4 - 64) // 64) * 64
    mid_n = ((n - 4 - 64) // 64) * 64
    per_tok = seg["prefill:pca/vq"] / mid_2k
    fixed = r["total_bytes"] - seg["prefill:pca/vq"] - seg.get("stream:int8/int8", 0)
    fp16 = r["fp16_bytes"] / r["prefix"] * n
    return f"{fp16 / (fixed + per_tok * mid_n):.2f}x"


def mid_tok(r: dict) -> int:
    """Middle tokens of a stored row: context - 4 sinks - a window of 64..127 (the block-granular prompt
    flush those rows were measured with; the cache now leaves exactly 64)."""
    rest = r["context"] - 4
    return max(1, ((rest - 64) // 64) * 64)


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _plot_curve(rows: list[dict], path: Path) -> None:
    """One point per config (controls left out), numbered; the legend names them. y is clipped at 6%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    top = 6.0
    for model in sorted({r["model"] for r in rows}):
        mr = [r for r in rows if r["model"] == model]
        base = next(b for b in mr if b["label"] == "dynamic")
        pts = sorted((r for r in mr if r["label"] != "dynamic" and "control" not in r["label"]), key=lambda r: r["ratio_vs_fp16"])
        for i, r in enumerate(pts, 1):
            d = 100 * (r["ppl"] / base["ppl"] - 1)
            y = min(d, top)
            marker = "^" if d > top else ("s" if r.get("vq", {}).get("codebook_size") else "o")
            ax.scatter(r["ratio_vs_fp16"], y, marker=marker, color="C3" if "default" in r["label"] else "C0", zorder=3,
                       label=f"{i}: {r['label']}  ({r['ratio_vs_fp16']:.2f}x, {d:+.2f}%)")
            ax.annotate(str(i), (r["ratio_vs_fp16"], y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.axhline(1.0, ls="--", c="gray", lw=0.8)
    ax.axhline(0.0, c="black", lw=0.5)
    ax.text(4.4, 1.05, "+1% target", va="bottom", fontsize=7, color="gray")
    ax.set_ylim(-1.5, top + 0.5)
    ax.set_xlabel("compression vs fp16, whole cache at 2K context (real bytes)")
    ax.set_ylabel("perplexity delta vs DynamicCache (%)")
    ax.set_title("Shard on SmolLM2-135M: quality vs budget (eN = PCA energy, bN = avg bits, vq = codebook)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", title="^ clipped, s = 16-entry VQ, red = default", title_fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@torch.no_grad()
def run_layers(name: str, prefix: int, out: Path) -> None:
    """Where Shard loses, layer by layer: the prompt encoded with only K (two rank rules) or only V lossy.

    The prompt's last 128 queries choose the query-measured rank, as the cache does under kvpack attention;
    queries from the prompt's second half score the attention error. Sinks stay exact, as in the cache.
    """
    model, tok = _load(name)
    ids = token_stream(tok, "news", prefix)[None]
    qkv = prompt_qkv(model, ids)
    layers = kvpack.KVCache(model, "shard").layers
    base = kvpack.get_method("shard")
    sides = {
        "K, rank by key energy": ("key", kvpack.CodecSpec("pca", {**base.prefill_key.options, "score_error": None})),
        "K, rank by prompt queries": ("key", base.prefill_key),
        "V": ("value", base.prefill_value),
    }
    positions = torch.arange(prefix)[None]
    rows = []
    for li, (q, k, v) in sorted(qkv.items()):
        if not isinstance(layers[li], KVPackLayer):
            continue  # a sliding-window layer (Gemma3's local layers): transformers keeps it, kvpack does not compress it
        row = {"layer": li}
        for label, (side, spec) in sides.items():
            x = k if side == "key" else v
            codec, packed, x_hat = stored(spec, x, layers[li], positions, q, base.sink_tokens)
            k_hat, v_hat = (x_hat, v) if side == "key" else (k, x_hat)
            row[label] = {"attn_error": causal_attention_error(q, k, v, k_hat, v_hat, prefix // 2), "bits_per_value": 8 * packed.nbytes() / x.numel()}
            row[label] |= {"rank": codec.rank} if side == "key" else {}
        rows.append(row)
    _append(out / f"shard_layers_{name}.json", {"env": environment("python -m kvpack.bench.shard"), "model": name, "prefix": prefix, "layers": rows})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="all", choices=["all", "context", "ppl", "curve", "controls", "needle", "ablation", "layers", "report"])
    p.add_argument("--prefix", type=int, default=2048, help="ablation, layers: tokens prefilled before scoring")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--decode", type=int, default=8, help="greedy decode steps timed after each prefill (median, first dropped)")
    p.add_argument("--lengths", default="1024")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--curve", type=int, default=len(CURVE), help="first N curve configs")
    p.add_argument("--config", type=int, default=0, help="context: index into CURVE of the shard config (0: default)")
    p.add_argument("--no-baseline", action="store_true", help="context: skip the DynamicCache run (bytes need no baseline)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    if a.what in ("context", "all"):
        run_context(a.model, ints(a.contexts), a.decode, out, baseline=not a.no_baseline, config=a.config)
    if a.what in ("ppl", "all"):
        run_ppl(a.model, CURVE[:1], out, "ppl")
    if a.what in ("curve", "all"):
        run_ppl(a.model, CURVE[: a.curve], out, "curve")
    if a.what in ("controls", "all"):
        run_ppl(a.model, CONTROLS, out, "curve")
    if a.what == "ablation":
        run_ppl(a.model, [(label, m, None) for label, m in ablation_methods()], out, f"ablation{a.prefix // 1024}k", prefix=a.prefix)
    if a.what == "layers":
        run_layers(a.model, a.prefix, out)
    if a.what in ("needle", "all"):
        run_needle(a.model, ints(a.lengths), [float(x) for x in a.depths.split(",")], out)
    print(report(out))


if __name__ == "__main__":
    main()
