"""Decode-step attention speed: each method's compressed-domain attention vs fp32 SDPA.

One query token attends to a cache of N tokens. Method and baseline are timed alternately in
the same loop (this machine is noisy), and the ratio of medians is reported.

    python -m kvpack.bench.attention --contexts 2048 8192 32768 --out bench/results/attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..attention import segmented_attention
from ..cache.layer import KVPackLayer
from ..registry import get_method, list_methods

SHAPES = {"d64-gqa3": (3, 9, 64), "d128-gqa7": (2, 14, 128)}  # (kv_heads, q_heads, head_dim)


class _Enabled:
    _attn_implementation = "kvpack"


def build_layer(method: str, n: int, kv_heads: int, head_dim: int, seed: int = 0) -> KVPackLayer:
    """A layer holding `n` random tokens, prefilled in one update then one decode token."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    layer = KVPackLayer(get_method(method), 0, _Enabled(), (inv_freq, 1.0))
    k = torch.randn(1, kv_heads, n - 1, head_dim, generator=gen)
    layer.update(k, torch.randn(1, kv_heads, n - 1, head_dim, generator=gen))
    layer.flush()
    layer.update(torch.randn(1, kv_heads, 1, head_dim, generator=gen), torch.randn(1, kv_heads, 1, head_dim, generator=gen))
    return layer


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_one(method: str, n: int, shape: str, reps: int = 30) -> dict:
    kv_heads, q_heads, d = SHAPES[shape]
    layer = build_layer(method, n, kv_heads, d)
    k, v = layer.dequantized()
    q = torch.randn(1, q_heads, 1, d)
    scale = d**-0.5

    def ours():
        return segmented_attention(layer, q, None, scale)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    ours(), sdpa()  # warm-up
    t_ours, t_sdpa = [], []
    for _ in range(reps):  # alternate so drift hits both alike
        t_ours += _time(ours, 1)
        t_sdpa += _time(sdpa, 1)
    mo, ms = statistics.median(t_ours), statistics.median(t_sdpa)
    mem = layer.memory()
    return {
        "method": method, "context": n, "shape": shape, "ours_ms": mo * 1e3, "sdpa_fp32_ms": ms * 1e3,
        "slowdown_vs_sdpa": mo / ms, "cache_bytes": sum(mem.values()), "fp16_bytes": 2 * kv_heads * n * d * 2,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = [(r["context"], r["slowdown_vs_sdpa"]) for r in rows if r["shape"] == shape and r["method"] == method]
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="time / fp32 SDPA", title=f"decode attention, {shape}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--methods", nargs="+", default=list_methods())
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/attention.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for shape in args.shapes:
        for n in args.contexts:
            for method in args.methods:
                row = bench_one(method, n, shape, args.reps)
                rows.append(row)
                print(f"{shape:10s} {n:6d} {method:22s} ours {row['ours_ms']:8.3f} ms  sdpa {row['sdpa_fp32_ms']:7.3f} ms  x{row['slowdown_vs_sdpa']:.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
