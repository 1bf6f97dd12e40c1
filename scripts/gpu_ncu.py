"""One decode-attention kernel call per configuration, for Nsight Compute (`ncu`) to profile: where a kernel's time goes
(issue slots, stall reasons, occupancy, memory throughput) when timing alone cannot say (docs/guide/gpu.md).

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:attention_kernel --launch-skip 1 \\
        --launch-count 1 python3 scripts/gpu_ncu.py --kernel tq-turn --variant base --shape b32-kv8-g4-d128

Each call runs twice (the first compiles); `--launch-skip 1 --launch-count 1` profiles the second. Inputs and
variants are `scripts/gpu_sweep.py`'s.
"""

from __future__ import annotations

import argparse

import gpu_sweep
import torch

from kvpack.kernels import triton_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="tq-turn", choices=gpu_sweep.KERNELS)
    ap.add_argument("--variant", default="base", choices=list(gpu_sweep.VARIANTS))
    ap.add_argument("--shape", default="b32-kv8-g4-d128", choices=list(gpu_sweep.SHAPES))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run under Triton's interpreter")
    args = ap.parse_args()
    data = gpu_sweep.inputs(args.shape, args.context, args.device)[args.kernel]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    fn = triton_attention.int8_attention if args.kernel == "int8" else triton_attention.tq_attention
    original, init = gpu_sweep._patched_plan(gpu_sweep.VARIANTS[args.variant])
    triton_attention._Plan.__init__ = init
    try:
        for _ in range(2):
            fn(**data)
            sync()
    finally:
        triton_attention._Plan.__init__ = original
    plan = gpu_sweep.PLANS[-1]
    print(f"{args.kernel} {args.variant} {args.shape}: t{plan.block_t_run} s{plan.stages_run} w{plan.num_warps} splits {plan.splits} "
          f"regs {getattr(plan.compiled, 'n_regs', None)} spills {getattr(plan.compiled, 'n_spills', None)}", flush=True)


if __name__ == "__main__":
    main()
