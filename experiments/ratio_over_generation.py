"""Bytes held as a cache grows past its prompt: `memory_report()` after the prompt and after each chunk that follows.

    python experiments/ratio_over_generation.py --model smollm2-135m --prompt 2048 --follow 2048 --chunk 256 \
        --methods 'shard:k3v2+e1@anchors=0.5%,shard:e1@anchors=0.5%,turboquant:k3v2@anchors=0.5%@window=32' \
        --json bench/results/ratio-over-generation-smollm2-135m.json

The tokens after the prompt are real news text fed in chunks under `kvpack.enable` (as generated tokens or a
chat's later turns would arrive), each chunk's last token as a one-token decode step (so the decode kernels'
derived state is held when the bytes are counted); each method's post-prompt codec holds them: Shard's prompt codecs fit once,
on the prompt, and what follows goes to its stream codec. Ratios are against an fp16 `DynamicCache` of the same tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvpack
from kvpack.bench.env import environment
from kvpack.text import token_stream


def ratios(model, ids: torch.Tensor, method: str, prompt: int, chunk: int) -> list[dict]:
    """[{tokens, total_bytes, ratio}] after the prompt and after each following chunk of `ids (1, T)`."""
    cache = kvpack.KVCache(model, method)
    points = []
    with torch.no_grad():
        for start, end in [(0, prompt), *((s, min(s + chunk, ids.shape[1])) for s in range(prompt, ids.shape[1], chunk))]:
            # The last token as a decode step of its own: the CPU kernels' derived state (built on a step's first
            # call) is then held, and counted, as in a real generation.
            if end - start > 1:
                model(ids[:, start : end - 1], past_key_values=cache, use_cache=True)
            model(ids[:, end - 1 : end], past_key_values=cache, use_cache=True)
            report = cache.memory_report()
            points.append({"tokens": report["tokens"], "total_bytes": report["total_bytes"], "ratio": report["ratio"]})
    return points


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--follow", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--methods", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if min(args.prompt, args.chunk) < 1 or args.follow < 0:
        p.error("--prompt and --chunk must be >= 1, --follow >= 0")
    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    ids = token_stream(tok, "news", args.prompt + args.follow)[None]
    kvpack.enable(model)
    try:
        rows = {m: ratios(model, ids, m, args.prompt, args.chunk) for m in args.methods.split(",") if m}
    finally:
        kvpack.disable(model)
    for m, points in rows.items():
        print(f"{m:44s} " + "  ".join(f"{q['tokens']}: {q['ratio']:.2f}x" for q in points[:: max(1, len(points) // 4)]))
    result = {"environment": environment("python experiments/ratio_over_generation.py", argv), "model": args.model,
              "prompt": args.prompt, "follow": args.follow, "chunk": args.chunk, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
