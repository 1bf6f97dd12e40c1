"""Shard's key rank chosen by the prompt's attention error in nats, against its relative score-error rule.

    python experiments/shard_rank_rule.py --model smollm2-135m --rules e3,kl0.3,kl0.1,kl0.01 \
        --json bench/results/shard-rank-rule-smollm2-135m-2k.json

Shard's PCA keys keep the smallest rank whose truncation keeps the relative score error of the prompt's last queries
within N% (`eN`, `PCAConfig.score_error`). A relative error ignores how sharp the attention it feeds is. The `klT`
rule instead keeps the smallest rank whose truncation moves the attention of the prompt's last 32 queries by at most T
nats, by the second-order estimate KL(p || p') ~ 1/2 Var_p(eps) (p the exact attention over every key being fitted,
eps the truncation's logit error at scale head_dim^-0.5, causality ignored). Both act on the prompt of
`shard:k3v2@anchors=0.5%` (tokens after it: the default's 3/2-bit TurboQuant codes), measured with `kvpack compare`'s
perplexity protocol (a 2,048-token news prompt, the next 512 tokens scored in chunks of 256) at draws 0, 1 and 2,
against one `DynamicCache` run. `klT` replaces `PCAKeyCodec._rank_for_scores` for the run (an experiment, not an
option of the codec). Recorded per rule: each draw's delta, the bytes (every tensor held after the run) and each
layer's kept rank (summed over the kv heads' groups).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

import torch
from transformers import DynamicCache

from kvpack.bench.env import environment, write_json
from kvpack.codecs import pca
from kvpack.codecs.base import group_query
from kvpack.eval.memory import memory_report
from kvpack.eval.methods import attention_for, make_cache
from kvpack.eval.perplexity import perplexity
from kvpack.models import load_model
from kvpack.primitives.rope import apply_rope
from kvpack.text import token_stream

METHOD = "shard:k3v2@anchors=0.5%"
QUERY_ROWS = 32  # the prompt's last queries the klT rule reads


def rank_by_attention_kl(tau: float):
    """A `_rank_for_scores` replacement: the smallest rank (a multiple of the group size) whose truncation's estimated
    attention KL, averaged over the prompt's last `QUERY_ROWS` queries, is at most `tau` nats."""

    def rank(self, x0: torch.Tensor, positions: torch.Tensor, result, queries: torch.Tensor) -> int:
        x0 = x0.double()  # (b, groups, t, group_dim), un-RoPEd
        cos, sin = self._cos_sin(positions, x0.shape[0], x0.shape[2], x0.device)
        cos, sin = cos.double(), sin.double()
        q = group_query(queries[:, :, -QUERY_ROWS:].double(), self.kv_heads)  # (b, kv, rows, d)
        scale = q.shape[-1] ** -0.5

        def logits(y: torch.Tensor) -> torch.Tensor:  # (b, kv, rows, t)
            return scale * (q @ apply_rope(self._from_groups(y), cos, sin).mT)

        p = torch.softmax(logits(x0), -1)
        residual = x0 - result.mean.double()[None, :, None]
        basis = result.basis.double()
        coefs = residual @ basis
        step = self.config.group_size
        for r in range(step, basis.shape[-1], step):
            residual = residual - coefs[..., r - step : r] @ basis[:, :, r - step : r].mT[None]
            eps = logits(residual)
            centered = eps - (p * eps).sum(-1, keepdim=True)
            if 0.5 * (p * centered.square()).sum(-1).mean() <= tau:
                return r
        return basis.shape[-1]

    return rank


@contextlib.contextmanager
def rule(name: str):
    """(method name, context) for rule `eN` (Shard's own, at N% score error) or `klT` (the attention-KL rank)."""
    if name.startswith("e"):
        yield METHOD if name == "e3" else METHOD.replace("shard:k3v2", f"shard:k3v2+{name}")
        return
    if not name.startswith("kl"):
        raise ValueError(f"a rule is eN (N in 0.5, 1, 2, 3, 5) or klT (T in nats, e.g. kl0.1), got {name!r}")
    original = pca.PCAKeyCodec._rank_for_scores
    pca.PCAKeyCodec._rank_for_scores = rank_by_attention_kl(float(name[2:]))
    try:
        yield METHOD
    finally:
        pca.PCAKeyCodec._rank_for_scores = original


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rules", default="e3,kl0.3,kl0.1,kl0.01")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ppl-tokens", type=int, default=512)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment("python experiments/shard_rank_rule.py", argv)
    model, tokenizer = load_model(args.model)
    ids = token_stream(tokenizer, "news", args.context + args.ppl_tokens + 1)
    base = perplexity(model, ids, DynamicCache(config=model.config), args.context, 256, args.ppl_tokens, progress=False)
    summary, runs = {}, {}
    for name in args.rules.split(","):
        rows = []
        for seed in (int(s) for s in args.seeds.split(",")):
            with rule(name) as method:
                method = f"{method}@seed={seed}"
                with attention_for(model, method):
                    cache = make_cache(model, method)
                    result = perplexity(model, ids, cache, args.context, 256, args.ppl_tokens, progress=False)
            ranks = [layer._codecs["prefill_key"].rank for layer in cache.layers if "prefill_key" in getattr(layer, "_codecs", {})]
            rows.append({"seed": seed, "method": method, "ppl_delta_pct": 100 * (result.ppl / base.ppl - 1),
                         "ratio": memory_report(cache, model.config)["ratio"], "ranks": ranks})
        deltas = [r["ppl_delta_pct"] for r in rows]
        summary[name] = {"mean": statistics.fmean(deltas), "sd": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
                         "min": min(deltas), "max": max(deltas), "ratio": rows[0]["ratio"]}
        runs[name] = rows
        s = summary[name]
        print(f"{name:8s} {s['ratio']:.2f}x  " + " / ".join(f"{d:+.2f}" for d in deltas) + f"%  mean {s['mean']:+.2f}% (sd {s['sd']:.2f})"
              f"  ranks {rows[0]['ranks']}", flush=True)
    out = {"config": vars(args) | {"json": str(args.json), "method": METHOD}, "environment": env, "baseline_ppl": base.ppl,
           "summary": summary, "runs": runs}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
