"""Decode-step attention speed: each method's compressed-domain attention vs SDPA over uncompressed K/V.

One query token per batch row attends to a cache of N tokens, through the function a model's decode step
calls (`fused_decode`: one fused kernel per part, Triton on a GPU; `segmented_attention` where a step does
not qualify). Method and baseline are timed alternately
in the same loop (machines are noisy), each call to completion (`torch.cuda.synchronize` on a GPU), and
the ratio of medians is reported, with the error of the method's output against SDPA over its own
dequantized cache (the check that the compressed-domain path computes the attention it stands for).

    python -m kvpack.bench.attention --contexts 2048 8192 32768 --out bench/results/attention.json
    python -m kvpack.bench.attention --device cuda --dtype bfloat16 --batch 1 32 --contexts 8192 32768 \
        --shapes d64-gqa7 d128-gqa4 --out bench/results/attention-cuda.json

On a GPU the baseline is the faster of two SDPA calls over bf16 K/V: `enable_gqa=True`, and the query
group folded into the query-length axis (exact for one decode token, and served by the flash kernel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..attention import fused_decode, segmented_attention
from ..cache.layer import PENDING, KVPackLayer
from ..cache.serialize import method_from_json
from ..primitives.rope import apply_rope, rope_cos_sin
from ..registry import MethodConfig, get_method, list_methods
from .env import environment

SHAPES = {  # (kv_heads, q_heads, head_dim)
    "d64-gqa3": (3, 9, 64),  # SmolLM2-135M
    "d64-gqa7": (2, 14, 64),  # Qwen2.5-0.5B
    "d128-gqa7": (2, 14, 128),
    "d128-gqa4": (8, 32, 128),  # Llama-3-8B
}


class _Enabled:
    _attn_implementation = "kvpack"


def build_layer(method: str | MethodConfig, n: int, kv_heads: int, head_dim: int, seed: int = 0, batch: int = 1,
                device: str = "cpu", dtype: torch.dtype = torch.float32, key_bias: float = 0.0) -> KVPackLayer:
    """A layer holding `n` random tokens `(batch, kv_heads, n, head_dim)` on `device`, prefilled in one
    update then one decode token.

    Values are Gaussian. Keys are RoPE'd at their positions from un-RoPEd keys whose spectrum decays over
    two decades (as real keys' does: Shard's PCA finds a rank below full, so its kernel does the work it
    does on a model; the other codecs cost the same on any data). `key_bias` adds to every un-RoPEd key one
    constant vector per kv head, of `key_bias` times a key's RMS norm (a QKV bias, as Qwen2.5's): after RoPE it
    turns with position, which is what `+ropemean` methods store apart (so their kernels do that work too)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    layer = KVPackLayer(get_method(method), 0, _Enabled(), (inv_freq, 1.0))
    dim = kv_heads * head_dim
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, device=device))
    spectrum = torch.logspace(0.5, -1.5, dim, device=device)
    mean = torch.randn(kv_heads, head_dim, generator=gen, device=device)
    mean = mean / mean.norm(dim=-1, keepdim=True) * key_bias * (spectrum.square().sum() / kv_heads).sqrt()

    def keys(t0: int, t: int) -> torch.Tensor:
        k0 = (torch.randn(batch, t, dim, generator=gen, device=device) * spectrum) @ basis.T
        k0 = k0.view(batch, t, kv_heads, head_dim).transpose(1, 2) + mean[:, None]
        cos, sin = rope_cos_sin(torch.arange(t0, t0 + t, device=device).expand(batch, t), inv_freq)
        return apply_rope(k0, cos, sin).to(dtype)

    def values(t: int) -> torch.Tensor:
        return torch.randn(batch, kv_heads, t, head_dim, generator=gen, device=device).to(dtype)

    layer.update(keys(0, n - 1), values(n - 1))
    layer.flush()
    layer.update(keys(n - 1, 1), values(1))
    PENDING.layer = None  # no model attention follows this update: a model run later must not see it as pending
    return layer


def load_method(method: str) -> MethodConfig:
    """A method name, or the path of a method JSON file (`kvpack.cache.serialize.method_to_json`'s form, e.g. a
    `heads` method whose widths differ per kv head: it must be written for the shape's kv head count)."""
    if method.endswith(".json"):
        return method_from_json(json.loads(Path(method).read_text()))
    return get_method(method)


def _timer(device: str):
    """`fn -> seconds` of one call, to completion on a GPU."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def time_one(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    return time_one


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """`() -> out` calls of SDPA over uncompressed `k, v (b, kv, n, d)` for one decode token `q (b, q_heads, 1, d)`:
    with `enable_gqa`, and with each kv head's query group as query rows (the same attention for one token)."""
    b, hq, _, d = q.shape
    hk = k.shape[1]
    folded = q.reshape(b, hk, hq // hk, d)
    return {
        "gqa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
        "folded": lambda: torch.nn.functional.scaled_dot_product_attention(folded, k, v, scale=scale),
    }


_COPY: dict[str, float] = {}


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a 1 GiB device-to-device copy, read and write counted (median of 20): the practical ceiling a
    memory-bound step is held to (`peak_share`). Measured once per process; NaN on CPU."""
    if not device.startswith("cuda"):
        return float("nan")
    if device not in _COPY:
        x = torch.empty(2**30, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        time_one = _timer(device)
        y.copy_(x)
        _COPY[device] = 2 * x.numel() / statistics.median(time_one(lambda: y.copy_(x)) for _ in range(20))
    return _COPY[device]


def graphed(fn, device: str):
    """`fn` captured into a CUDA graph after a warm-up on a side stream: `(replay, None)`, or `(None, reason)` when the
    step does not capture (a host sync, a copy from host memory, a shape decided on the host...)."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        return graph.replay, None
    except Exception as e:  # recorded in the row: which step does not capture, and why
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def bench_one(method: str, n: int, shape: str, reps: int = 30, batch: int = 1, device: str = "cpu",
              dtype: torch.dtype = torch.float32, key_bias: float = 0.0, graph: bool = False) -> dict:
    """One cell: `method` is a method name or a method JSON file (`load_method`). Besides the times, the bytes each
    side's step reads (the cache's bytes: every code, norm, scale and exact row once; the bf16 K/V for SDPA), the
    rate that makes, and its share of the device's copy bandwidth. `graph`: the same two steps also replayed from CUDA
    graphs (no Python or launch cost per kernel), alternated, when the step captures."""
    kv_heads, q_heads, d = SHAPES[shape]
    layer = build_layer(load_method(method), n, kv_heads, d, batch=batch, device=device, dtype=dtype, key_bias=key_bias)
    k, v = (t.to(dtype) for t in layer.dequantized())
    q = torch.randn(batch, q_heads, 1, d, device=device, dtype=dtype)
    scale = d**-0.5
    baselines = _sdpa(q, k, v, scale)

    def ours():  # the model's decode step: one fused kernel per part where the step qualifies (kvpack_attention_forward)
        out = fused_decode(layer, q, scale)
        return segmented_attention(layer, q, None, scale) if out is None else out

    err = (ours().float() - baselines["gqa"]().float()).abs().max().item()  # also the warm-up
    for fn in baselines.values():
        fn()
    time_one = _timer(device)
    times: dict[str, list[float]] = {"ours": [], **{name: [] for name in baselines}}
    for _ in range(reps):  # alternate so drift hits all alike
        times["ours"].append(time_one(ours))
        for name, fn in baselines.items():
            times[name].append(time_one(fn))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base_name = min(baselines, key=med.get)
    mem = layer.memory()
    cache_bytes, bf16_bytes = sum(mem.values()), 2 * batch * kv_heads * n * d * 2
    peak = copy_bandwidth(device)
    roof = {"copy_bytes_per_s": peak, "ours_gb_per_s": cache_bytes / med["ours"] / 1e9, "sdpa_gb_per_s": bf16_bytes / med[base_name] / 1e9,
            "ours_peak_share": cache_bytes / med["ours"] / peak, "sdpa_peak_share": bf16_bytes / med[base_name] / peak}
    if graph and device.startswith("cuda"):
        replay, why = graphed(ours, device)
        base_replay, base_why = graphed(baselines[base_name], device)
        if replay is None or base_replay is None:
            roof["graph_error"] = why or base_why
        else:
            g_times = {"ours": [], "sdpa": []}
            for _ in range(reps):
                g_times["ours"].append(time_one(replay))
                g_times["sdpa"].append(time_one(base_replay))
            g_med = {name: statistics.median(ts) for name, ts in g_times.items()}
            roof |= {"graph_ours_ms": g_med["ours"] * 1e3, "graph_sdpa_ms": g_med["sdpa"] * 1e3, "graph_speedup_vs_sdpa": g_med["sdpa"] / g_med["ours"],
                     "graph_ours_peak_share": cache_bytes / g_med["ours"] / peak}
    return {
        "method": method, "context": n, "shape": shape, "batch": batch, "device": device, "dtype": str(dtype).removeprefix("torch."),
        "key_bias": key_bias, "path": "segmented" if fused_decode(layer, q, scale) is None else "fused",
        "ours_ms": med["ours"] * 1e3, "sdpa_ms": med[base_name] * 1e3, "sdpa_kind": base_name,
        **{f"sdpa_{name}_ms": med[name] * 1e3 for name in baselines},
        "slowdown_vs_sdpa": med["ours"] / med[base_name], "speedup_vs_sdpa": med[base_name] / med["ours"],
        "max_abs_err_vs_dequantized": err, "cache_bytes": cache_bytes, "bf16_bytes": bf16_bytes, **roof,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = [(r["context"], r["slowdown_vs_sdpa"]) for r in rows if r["shape"] == shape and r["method"] == method and r["batch"] == min(r2["batch"] for r2 in rows)]
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="time / SDPA (uncompressed)", title=f"decode attention, {shape}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--methods", nargs="+", default=list_methods())
    ap.add_argument("--shapes", nargs="+", default=["d64-gqa3", "d128-gqa7"], choices=list(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--key-bias", type=float, default=0.0,
                    help="a constant un-RoPEd key per kv head, in units of a key's RMS norm (as a QKV bias; 0: none)")
    ap.add_argument("--graph", action="store_true", help="on CUDA, also time both steps replayed from CUDA graphs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/attention.json"))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA build of torch and a GPU")
    for method in args.methods:
        load_method(method)  # unknown names and unreadable files fail here, before any work
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        for batch in args.batch:
            for n in args.contexts:
                for method in args.methods:
                    try:
                        row = bench_one(method, n, shape, args.reps, batch, args.device, dtype, args.key_bias, args.graph)
                    except Exception as e:  # one failing cell is recorded, the sweep goes on
                        row = {"method": method, "context": n, "shape": shape, "batch": batch, "error": f"{type(e).__name__}: {e}"}
                        print(f"{shape:10s} b{batch:<3d} {n:6d} {method:22s} FAILED {row['error'][:300]}", flush=True)
                    else:
                        print(f"{shape:10s} b{batch:<3d} {n:6d} {method:22s} ours {row['ours_ms']:8.3f} ms  sdpa {row['sdpa_ms']:7.3f} ms "
                              f"({row['sdpa_kind']})  x{row['speedup_vs_sdpa']:.2f}  err {row['max_abs_err_vs_dequantized']:.1e}  "
                              f"{row['bf16_bytes'] / row['cache_bytes']:.2f}x smaller than bf16"
                              + (f"  {row['ours_peak_share']:.0%} / {row['sdpa_peak_share']:.0%} of copy bw" if args.device == "cuda" else "")
                              + (f"  graphs: ours {row['graph_ours_ms']:.3f} ms sdpa {row['graph_sdpa_ms']:.3f} ms x{row['graph_speedup_vs_sdpa']:.2f}"
                                 if "graph_ours_ms" in row else f"  graph: {row['graph_error'][:200]}" if "graph_error" in row else ""), flush=True)
                    rows.append(row)
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                    args.out.write_text(json.dumps({"environment": environment("python -m kvpack.bench.attention"), "rows": rows}, indent=1))
    plot([r for r in rows if "error" not in r], args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
