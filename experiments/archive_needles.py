"""Does a fitted archive still find a needle anywhere in a long prompt, on every rotation draw?

    python experiments/archive_needles.py --model qwen2.5-0.5b --lengths 8192 --depths 0,0.25,0.5,0.75,1 --seeds 0,1,2 \
        --methods tiered:1024:shard --json bench/results/archive-needles-qwen2.5-0.5b-8k.json

A passkey (a 5-digit number) is hidden in news text at each depth (0: the first tokens, 1: the last) of a prompt of
each length; the model is asked for it and answers greedily (`kvpack.eval.needle`, the grid `kvpack compare` runs).
Each prompt is one forward under kvpack attention, so at a length past the archive boundary the needle's tokens sit
in the archive (depth 0 to about 1 - boundary / length), in the warm tier or in the exact window (depth 1). Every
method runs once per draw (`@seed=N`), with the same needles in the same places; the uncompressed `DynamicCache` runs
the grid once, as the reference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import kvpack
from kvpack.bench.env import environment, write_json
from kvpack.eval.methods import make_cache
from kvpack.eval.needle import needle_grid
from kvpack.registry import get_method


def grid(model, tok, new_cache, lengths: list[int], depths: list[float]) -> list[dict]:
    """One trial per (length, depth) cell, the needles seeded alike for every method (`needle_grid`'s seed 0)."""
    trials = needle_grid(model, tok, new_cache, lengths, depths, "news", seed=0, progress=True)
    return [t.as_dict() for t in trials]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--lengths", default="8192", help="comma-separated prompt lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--methods", default="tiered:1024:shard")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    if not lengths or any(n < 1 for n in lengths) or any(not 0 <= d <= 1 for d in depths):
        raise SystemExit(f"--lengths takes positive token counts and --depths values in [0, 1], got {args.lengths!r} and {args.depths!r}")
    torch.set_num_threads(args.threads)
    env = environment("python experiments/archive_needles.py", argv)  # at the start: the tree the run's code came from
    model, tok = kvpack.load_model(args.model)
    kvpack.enable(model)
    rows = [{"method": "dynamic", "seed": None, "trials": grid(model, tok, lambda: make_cache(model, "dynamic"), lengths, depths)}]
    for name in [m for m in args.methods.split(",") if m]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            method = get_method(name).with_seed(seed)
            rows.append({"method": name, "seed": seed, "trials": grid(model, tok, lambda m=method: kvpack.KVCache(model, m), lengths, depths)})
    for row in rows:
        found, total = sum(t["found"] for t in row["trials"]), len(row["trials"])
        row["found"], row["total"] = found, total
        missed = [(t["target_length"], t["depth"], t["answer"]) for t in row["trials"] if not t["found"]]
        print(f"{row['method']} seed {row['seed']}: {found}/{total} found" + (f", missed {missed}" if missed else ""), flush=True)
    out = {"config": vars(args) | {"json": str(args.json)}, "environment": env, "rows": rows}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
