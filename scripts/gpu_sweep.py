"""Kernel-only times of the Triton decode-attention kernels under other tile sizes, warps and dot precisions,
against SDPA over bf16 K/V at the same shape (docs/guide/gpu.md): which knob a GPU's time follows. The "old" variant is
the kernels as first measured (float32 dots at tf32x3, codes unpacked one by one), timed in the same process.

    python scripts/gpu_sweep.py --out bench/results/gpu/sweep.json

Times are `triton.testing.do_bench` medians (CUDA events, many calls) of one kernel call on random codes.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from kvpack.bench.env import environment
from kvpack.kernels import triton_attention
from kvpack.primitives.lloyd_max import lloyd_max_codebook

VARIANTS = {  # name: _Plan attributes replaced ("split_factor" scales the split count); "@64" values apply at 33-64 dims
    "base": {},
    # TurboQuant before centroid pairs: 128-token tiles in 3 stages (at 65-128 dims more shared memory than an H200 has,
    # so the launch falls back to 64 tokens in 1 stage), and at 33-64 dims the select chain
    "before": {"pairs": False, "words": False, "num_stages": None, "block_t": 128, "select@64": True},
    "before-t64-s1": {"pairs": False, "words": False, "num_stages": 1, "block_t": 64, "select@64": True},
    "select-s1": {"pairs": False, "words": False, "select": True, "block_t": 128, "num_stages": 1},  # the select chain unpipelined
    "bytes": {"words": False},  # pairs with codes assembled from bytes, not read as words
    "s2": {"num_stages": 2},
    "t64-w8": {"block_t": 64, "num_warps": 8},
    "t32-w2": {"block_t": 32, "num_warps": 2},
    "old": {"f16": False, "grouped": False, "block_t": 64, "select": False, "pairs": False, "num_stages": None},  # as first measured
    "f32dots": {"f16": False},
    "per-code": {"grouped": False},
    "t32": {"block_t": 32},
    "t128": {"block_t": 128},
    "w8": {"num_warps": 8},
    "t128-w8": {"block_t": 128, "num_warps": 8},
    "splits/2": {"split_factor": 0.5},
    "splits/4": {"split_factor": 0.25},
    "select": {"select": True, "block_t": 128},
    "gather": {"select": False},
    "gather-t64": {"select": False, "block_t": 64},
    "t64": {"block_t": 64},
}
SHAPES = {  # batch, kv heads, query rows per kv head, head_dim
    "b32-kv8-g4-d128": (32, 8, 4, 128), "b1-kv2-g7-d64": (1, 2, 7, 64), "b32-kv2-g7-d64": (32, 2, 7, 64), "b1-kv8-g4-d128": (1, 8, 4, 128),
}


KERNELS = ("tq", "tq-turn", "tq-tcq", "tq-turn-tcq", "int8")
PLANS: list = []  # the plans of the calls made under a patched `_Plan`: what actually launched (tile, stages, registers)


def bytes_read(kernel: str, shape: str, t: int) -> int:
    """Bytes one call reads from HBM at least: every code, norm or scale of the segment once (the queries and partials
    are < 0.1% of it)."""
    b, kv, _, d = SHAPES[shape]
    per_token = {"int8": 2 * d + 4, "sdpa-bf16": 4 * d}.get(kernel, d * 3 // 8 + d * 2 // 8 + 4)
    return b * kv * t * per_token


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted), the machine's practical HBM ceiling."""
    if device != "cuda":
        return float("nan")
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() / (ms * 1e-3)
SDPA = torch.nn.functional.scaled_dot_product_attention


def _patched_plan(overrides: dict):
    """A `_Plan.__init__` that applies `overrides`, re-deriving the split length for another token tile or split count."""
    original = triton_attention._Plan.__init__

    def init(self, q, t, d, dv, num_splits, **kwargs):
        original(self, q, t, d, dv, num_splits, **kwargs)
        overrides_ = dict(overrides)
        factor = overrides_.pop("split_factor", 1.0)
        narrow = max(self.block_d, self.block_dv) <= 64
        for name, value in overrides_.items():
            if name.endswith("@64"):
                if narrow:
                    setattr(self, name[:-3], value)
            else:
                setattr(self, name, value)
        PLANS.append(self)
        if "block_t" in overrides_ or factor != 1.0:
            tiles = triton.cdiv(t, self.block_t)
            splits = max(1, round(self.splits * factor))
            split_tiles = triton.cdiv(tiles, max(1, min(splits, tiles)))
            self.split_len = split_tiles * self.block_t
            self.splits = triton.cdiv(t, self.split_len)

    return original, init


def inputs(shape: str, t: int, device: str) -> dict:
    b, kv, rows, d = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    u8 = lambda last: torch.randint(0, 256, (b, kv, t, last), generator=g, device=device, dtype=torch.uint8)  # noqa: E731
    f16 = lambda: (torch.rand(b, kv, t, 1, generator=g, device=device) + 0.5).half()  # noqa: E731
    tq = dict(q_rot=torch.randn(b, kv, rows, d, generator=g, device=device), k_codes=u8(d * 3 // 8), k_norm=f16(),
              k_centroids=lloyd_max_codebook(d, 3, "gaussian").centroids.to(device), k_bits=3, v_codes=u8(d * 2 // 8), v_norm=f16(),
              v_centroids=lloyd_max_codebook(d, 2, "gaussian").centroids.to(device), v_bits=2, d=d, scale=d**-0.5)
    # `+ropemean` keys (the default): ~9 of 32 RoPE pairs turn per head at d = 64 as on real models, 21 of 64 at d = 128
    # as with `bench.attention --key-bias 1.0`; `+tcq`: trellis tables (L = 9 keys, 8 values) in place of the centroids.
    pairs = 9 if d == 64 else 21
    turn = dict(turn_q=torch.randn(b, kv, rows, d, generator=g, device=device),
                turn_pair=torch.stack([torch.randperm(d // 2, generator=g, device=device)[:pairs] for _ in range(kv)]),
                turn_mu=torch.randn(kv, pairs, 2, generator=g, device=device),
                turn_freq=1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)),
                turn_pos0=torch.randint(0, 30000, (b,), generator=g, device=device))
    tcq = dict(k_centroids=torch.randn(512, generator=g, device=device) * d**-0.5, v_centroids=torch.randn(256, generator=g, device=device) * d**-0.5)
    i8 = dict(q=tq["q_rot"], k_codes=u8(d).view(torch.int8), k_scale=f16(), v_codes=u8(d).view(torch.int8), v_scale=f16(), scale=d**-0.5)
    q = torch.randn(b, kv * rows, 1, d, generator=g, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, kv, t, d, generator=g, device=device, dtype=torch.bfloat16)
    return {"tq": tq, "tq-turn": tq | turn, "tq-tcq": tq | tcq, "tq-turn-tcq": tq | turn | tcq, "int8": i8, "sdpa": (q, k, k.clone())}


def bench(fn, device: str) -> float:
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=60)
    fn()
    return float("nan")  # --device cpu: a dry run under the interpreter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--kernels", nargs="+", default=["tq", "int8"], choices=KERNELS,
                    help="tq-turn: keys centered on a turning mean (+ropemean); tq-tcq: trellis tables (+tcq)")
    args = ap.parse_args()
    rows = []
    peak = copy_bandwidth(args.device)
    print(f"device-to-device copy: {peak / 1e12:.2f} TB/s", flush=True)
    for shape in args.shapes:
        data = inputs(shape, args.context, args.device)
        q, k, v = data["sdpa"]
        hk = k.shape[1]
        folded = q.reshape(q.shape[0], hk, -1, q.shape[-1])
        timed = {"folded": bench(lambda q=folded, k=k, v=v: SDPA(q, k, v), args.device),
                 "enable_gqa": bench(lambda q=q, k=k, v=v: SDPA(q, k, v, enable_gqa=True), args.device)}
        for variant, ms in timed.items():
            gbps = bytes_read("sdpa-bf16", shape, args.context) / (ms * 1e-3) / 1e9
            rows.append({"shape": shape, "kernel": "sdpa-bf16", "variant": variant, "ms": ms, "gb_per_s": gbps, "peak_share": gbps * 1e9 / peak})
            print(f"{shape:18s} sdpa-bf16 {variant:10s} {ms:8.4f} ms", flush=True)
        sdpa = min(timed.values())  # the faster SDPA form is the baseline
        for kernel in args.kernels:
            fn = triton_attention.int8_attention if kernel == "int8" else triton_attention.tq_attention
            _, denom, o = fn(**data[kernel])
            base = o / denom  # each variant's output against the shipped configuration's
            for variant in args.variants:
                overrides = VARIANTS[variant]
                original, init = _patched_plan(overrides)
                triton_attention._Plan.__init__ = init
                try:
                    PLANS.clear()
                    _, denom, o = fn(**data[kernel])
                    err = (o / denom - base).abs().max().item()
                    ms = bench(lambda fn=fn, kw=data[kernel]: fn(**kw), args.device)
                    plan = PLANS[0]
                    gbps = bytes_read(kernel, shape, args.context) / (ms * 1e-3) / 1e9
                    row = {"shape": shape, "kernel": kernel, "variant": variant, "ms": ms, "vs_sdpa": sdpa / ms, "max_diff_vs_base": err,
                           "gb_per_s": gbps, "peak_share": gbps * 1e9 / peak, "block_t": getattr(plan, "block_t_run", None),
                           "num_stages": getattr(plan, "stages_run", None), "num_warps": plan.num_warps, "splits": plan.splits,
                           "pairs": getattr(plan, "pairs", None), "words": getattr(plan, "words", None),
                           "registers": getattr(getattr(plan, "compiled", None), "n_regs", None),
                           "spills": getattr(getattr(plan, "compiled", None), "n_spills", None)}
                except Exception as e:  # a variant that does not fit (shared memory, registers) is recorded
                    row = {"shape": shape, "kernel": kernel, "variant": variant, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                finally:
                    triton_attention._Plan.__init__ = original
                rows.append(row)
                print(f"{shape:18s} {kernel:5s} {variant:14s} " + (
                    f"{row['ms']:8.4f} ms  x{row['vs_sdpa']:.2f} vs sdpa  {row['peak_share']:.0%} of copy bw  diff {row['max_diff_vs_base']:.1e}  "
                    f"t{row['block_t']} s{row['num_stages']} w{row['num_warps']} regs {row['registers']} spills {row['spills']}" if "ms" in row else row["error"]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"environment": environment("python scripts/gpu_sweep.py"), "context": args.context, "copy_bytes_per_s": peak, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
