"""Where `kvpack compare`'s perplexity delta comes from: which scored tokens carry it, and which codes.

    python experiments/compare_delta_sources.py --model smollm2-135m --json bench/results/compare-delta-sources-smollm2-135m-2k.json

`kvpack compare`'s perplexity protocol (a 2,048-token news prompt, the next 512 tokens scored in chunks of 256, each
reading the compressed cache) for each variant at rotation draws 0, 1 and 2, against one `DynamicCache` run:
- `default`: the default method;
- `keys-exact` / `values-exact`: the default with one side's codes replaced by fp16 (prompt and stream), so each
  side's share of the delta is measured, not assumed;
- `anchors-5%-attention` / `anchors-5%-surprisal`: the default keeping 5% of the prompt exact (10x its anchors):
  chosen by the attention of the prompt's last queries (kvpack's own rule), or by each prompt token's surprisal
  (its NLL under an exact forward), the tokens a later copy would read;
- `shard` (`shard:k3v2@anchors=0.5%`): fitted PCA keys and VQ values for the prompt, the default's codes after it.
Per draw: the delta, the ratio to fp16 (every tensor held after the run), and the share of the delta carried by the 10
scored tokens whose NLL rose most (above 1: the other 502 tokens net to a gain).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvpack.bench.env import environment, write_json
from kvpack.cache import anchors as anchor_policies
from kvpack.cache.kvcache import KVCache, _resolve
from kvpack.eval.memory import memory_report
from kvpack.eval.methods import attention_for
from kvpack.eval.perplexity import perplexity
from kvpack.models import load_model
from kvpack.registry import DEFAULT_METHOD, CodecSpec
from kvpack.text import token_stream

TOP = 10  # scored tokens whose NLL rose most


@contextlib.contextmanager
def surprisal_anchors(surprisal: torch.Tensor):
    """The prompt's anchors chosen by `surprisal (prompt,)` instead of attention, as many as attention would choose."""
    original = anchor_policies.AttentionAnchors.keep_exact

    def keep_exact(self, layer, start: int, n: int, first: bool):
        chosen = original(self, layer, start, n, first)
        if not first or chosen is None:
            return chosen
        return torch.topk(surprisal[start : start + n], len(chosen)).indices.sort().values

    anchor_policies.AttentionAnchors.keep_exact = keep_exact
    try:
        yield
    finally:
        anchor_policies.AttentionAnchors.keep_exact = original


def variants(model, seed: int, surprisal: torch.Tensor) -> dict:
    """name -> (MethodConfig, context manager) for one rotation draw."""
    default = _resolve(f"{DEFAULT_METHOD}@seed={seed}", model.config)
    fp16 = CodecSpec("fp16")
    plain = contextlib.nullcontext
    anchored = _resolve(f"{DEFAULT_METHOD.replace('@anchors=0.5%', '@anchors=5%')}@seed={seed}", model.config)
    return {
        "default": (default, plain()),
        "keys-exact": (dataclasses.replace(default, key=fp16, prefill_key=None), plain()),
        "values-exact": (dataclasses.replace(default, value=fp16, prefill_value=None), plain()),
        "anchors-5%-attention": (anchored, plain()),
        "anchors-5%-surprisal": (anchored, surprisal_anchors(surprisal)),
        "shard": (_resolve(f"shard:k3v2@anchors=0.5%@seed={seed}", model.config), plain()),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ppl-tokens", type=int, default=512)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", default="", help="comma-separated variant names (all by default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment("python experiments/compare_delta_sources.py", argv)
    model, tokenizer = load_model(args.model)
    ids = token_stream(tokenizer, "news", args.context + args.ppl_tokens + 1)
    with torch.no_grad():
        logits = model(ids[: args.context][None]).logits[0].float()
    surprisal = torch.zeros(args.context)
    surprisal[1:] = F.cross_entropy(logits[:-1], ids[1 : args.context], reduction="none")
    base = perplexity(model, ids, DynamicCache(config=model.config), args.context, 256, args.ppl_tokens, progress=False)
    seeds = [int(s) for s in args.seeds.split(",")]
    only = [v for v in args.only.split(",") if v]
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        for name, (method, scope) in variants(model, seed, surprisal).items():
            if only and name not in only:
                continue
            cache = KVCache(model, method)
            with scope, attention_for(model, method.name):
                result = perplexity(model, ids, cache, args.context, 256, args.ppl_tokens, progress=False)
            rise = result.token_nll - base.token_nll
            top = torch.topk(rise, TOP)
            row = {"seed": seed, "ppl_delta_pct": 100 * (result.ppl / base.ppl - 1), "ratio": memory_report(cache, model.config)["ratio"],
                   "top_share": float(top.values.sum() / rise.sum()), "top_tokens": top.indices.tolist()}
            rows.setdefault(name, []).append(row)
            print(f"{name:22s} seed {seed}: {row['ppl_delta_pct']:+.2f}%  {row['ratio']:.2f}x  top-{TOP} share {row['top_share']:.2f}", flush=True)
    summary = {}
    for name, runs in rows.items():
        deltas = [r["ppl_delta_pct"] for r in runs]
        summary[name] = {"mean": statistics.fmean(deltas), "sd": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
                         "min": min(deltas), "max": max(deltas), "ratio": runs[0]["ratio"],
                         "top_share_mean": statistics.fmean(r["top_share"] for r in runs)}
        s = summary[name]
        print(f"{name:22s} mean {s['mean']:+.2f}% (sd {s['sd']:.2f}, {s['min']:+.2f} to {s['max']:+.2f}) at {s['ratio']:.2f}x")
    out = {"config": vars(args) | {"json": str(args.json), "default_method": DEFAULT_METHOD}, "environment": env,
           "baseline_ppl": base.ppl, "summary": summary, "runs": rows}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
