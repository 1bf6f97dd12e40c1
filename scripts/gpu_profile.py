"""Where a GPU decode step's time goes: kernel time (CUDA) against wall time, for one attention call and one
model step, kvpack against the uncompressed baseline (docs/guide/gpu.md).

    python scripts/gpu_profile.py --config-dir .gpu/qwen2.5-0.5b --out bench/results/gpu/profile.json

1. Attention alone (`bench.attention.build_layer`, bf16): `fused_decode` over a compressed layer vs SDPA over
   bf16 K/V, under torch.profiler: the top kernels by CUDA time, their sum, and the wall time per call.
2. A model's decode step (random weights with the config's architecture, bf16, batch 1): DynamicCache vs a
   kvpack cache, wall time per step and CUDA kernel time per step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvpack.attention import fused_decode
from kvpack.bench.attention import SHAPES, _sdpa, build_layer
from kvpack.bench.decode import fill_kvpack, prefill_dynamic
from kvpack.bench.env import environment
from kvpack.eval.generate import forward

DEVICE = "cuda"  # --device cpu: a dry run of the script itself (no CUDA times)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def profiled(fn, reps: int) -> dict:
    """Wall ms per call and CUDA kernel ms per call of `fn`, plus its top kernels."""
    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if DEVICE == "cuda" else [ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync()
        wall = (time.perf_counter() - t) / reps
    kind = torch.autograd.DeviceType.CUDA if DEVICE == "cuda" else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind]
    total = sum(e.self_device_time_total for e in events) / 1e3 / reps
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
    launches = sum(e.count for e in events) / reps
    return {"wall_ms": wall * 1e3, "cuda_ms": total, "kernels_per_call": launches,
            "top": [{"name": e.key[:90], "ms": e.self_device_time_total / 1e3 / reps, "count": e.count // reps} for e in top]}


def attention_rows(methods: list[str], shape: str, batch: int, n: int, reps: int) -> list[dict]:
    kv, hq, d = SHAPES[shape]
    rows = []
    for method in methods:
        layer = build_layer(method, n, kv, d, batch=batch, device=DEVICE, dtype=torch.bfloat16)
        q = torch.randn(batch, hq, 1, d, device=DEVICE, dtype=torch.bfloat16)
        k, v = (t.to(torch.bfloat16) for t in layer.dequantized())
        base = _sdpa(q, k, v, d**-0.5)
        rows.append({"what": f"attention {method}", "shape": shape, "batch": batch, "context": n,
                     **profiled(lambda layer=layer, q=q: fused_decode(layer, q, d**-0.5), reps)})
        if method == methods[0]:
            for name, fn in base.items():
                rows.append({"what": f"attention sdpa-{name}", "shape": shape, "batch": batch, "context": n, **profiled(fn, reps)})
        layer = k = v = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def model_rows(config_dir: str, methods: list[str], n: int, reps: int) -> list[dict]:
    import kvpack
    from kvpack.models import random_weights_model

    model = random_weights_model(config_dir, torch.bfloat16, DEVICE)
    kvpack.enable(model)
    ids = torch.randint(model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    source, logits = prefill_dynamic(model, ids)
    rows = []
    for method in methods:
        cache = source if method == "dynamic" else fill_kvpack(model, method, source, ids)[0]
        token = logits[:, -1].argmax(-1, keepdim=True)
        rows.append({"what": f"decode step {method}", "context": n, "batch": 1, **profiled(lambda c=cache, t=token: forward(model, t, c), reps)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    rows = []
    for shape, batch in (("d64-gqa7", 1), ("d128-gqa4", 32)):
        rows += attention_rows(["turboquant:k3v2", "int8"], shape, batch, args.context, args.reps)
    rows += model_rows(args.config_dir, ["dynamic", "turboquant:k3v2", "int8"], min(8192, args.context), args.reps)
    for r in rows:
        print(f"{r['what']:32s} {r.get('shape', ''):10s} b{r['batch']:<3d} {r['context']:6d}  wall {r['wall_ms']:8.3f} ms  "
              f"cuda {r['cuda_ms']:8.3f} ms  {r['kernels_per_call']:6.0f} kernels  top: {r['top'][0]['name'][:50]} {r['top'][0]['ms']:.3f} ms")
    with open(args.out, "w") as f:
        json.dump({"environment": environment("python scripts/gpu_profile.py"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
