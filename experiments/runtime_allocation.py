"""The default's bytes placed by the prompt's own Fisher signal: a fourth bit for the keys of the layers it ranks most
sensitive, paid for by a second bit less on the keys it ranks least, over rotation draws.

    python experiments/runtime_allocation.py --model smollm2-135m --seeds 0,1,2 --json bench/results/runtime-allocation-smollm2-135m-2k.json

Protocol: the perplexity protocol of `kvpack compare` (a `--context`-token news prompt prefilled into the cache,
`--ppl-tokens` scored in chunks of 256 that read the compressed cache), the default method at each `@seed`, beside
the same method with per-layer key widths from the prompt alone: its last `--tail` tokens are run with gradients
w.r.t. the rest's cached K/V (`kvpack.auto.fisher_diagonal`, `--draws` backward passes), and each layer's keys at
2, 3 and 4 bits are predicted as the Fisher mode's raw second-order KL (`experiments/runtime_fisher.py` measures how
well that ranks layers: Spearman 0.79-0.94 against calibrated profiles). Layers are then paired greedily: the largest
predicted gain of a fourth bit against the smallest predicted cost of a second bit less, while the gain exceeds the
cost, so the bytes per token stay the default's exactly (one key bit more on one layer, one less on another). No
constant is fitted: the pairs follow from the predictions. Each row reports the paired perplexity delta against the
uncompressed cache per draw, the next-token KL, and the bytes held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvpack import DEFAULT_METHOD, KVCache, auto  # noqa: E402
from kvpack.attention import disable  # noqa: E402
from kvpack.bench.env import environment  # noqa: E402
from kvpack.cache import KVCache as ProbeCache  # noqa: E402
from kvpack.cache import prompt_widths  # noqa: E402
from kvpack.eval.generate import forward  # noqa: E402
from kvpack.eval.memory import memory_report  # noqa: E402
from kvpack.eval.methods import BASELINE, attention_for, make_cache  # noqa: E402
from kvpack.eval.perplexity import delta, delta_ci, perplexity  # noqa: E402
from kvpack.models import load_model  # noqa: E402
from kvpack.registry import CodecSpec, LayerCodecs, get_method  # noqa: E402
from kvpack.support import layer_kinds, text_config  # noqa: E402
from kvpack.text import token_stream  # noqa: E402

KEY_BITS = (2, 3, 4)


def key_predictions(model, prompt: torch.Tensor, tail: int, draws: int, layers: list[int]) -> dict[tuple[int, int], float]:
    """{(layer, bits): the Fisher's predicted KL of that layer's keys at `bits`}, from the prompt alone."""
    disable(model)
    base = ProbeCache(model, auto._probe(None), allow_untested=True)
    forward(model, prompt[:-tail], base)
    fisher = auto.fisher_diagonal(model, prompt[:-tail], prompt[-tail:], draws)
    specs = {(side, b): auto.codec_spec(side, b) for side in auto.SIDES for b in KEY_BITS}  # _head_raw predicts both sides
    heads = auto._head_raw(fisher, base, layers, specs, KEY_BITS, tail)
    return {(layer, b): sum(heads[(layer, "key", b)]) for layer in layers for b in KEY_BITS}


def pairs(pred: dict[tuple[int, int], float], layers: list[int]) -> tuple[list[int], list[int]]:
    """(promoted, demoted) layers: the cache's own pairing rule (`prompt_widths.pairs`) on these predictions."""
    return prompt_widths.pairs({lay: {b: pred[(lay, b)] for b in KEY_BITS} for lay in layers})


def allocated(method: str, up: list[int], down: list[int]):
    """`method`'s config with keys at 4 bits on `up` and 2 bits on `down` (values and everything else unchanged)."""
    cfg = get_method(method)

    def width(bits: int) -> CodecSpec:
        return CodecSpec(cfg.key.codec, {**cfg.key.options, "bits": bits})

    entries = tuple(LayerCodecs(tuple(ls), width(b), cfg.value) for ls, b in ((up, 4), (down, 2)) if ls)
    return replace(cfg, name=f"{cfg.name} keys 4 bits on {up}, 2 on {down}", layer_codecs=entries)


def run(model, ids, method, args, reference: list[torch.Tensor] | None):
    """(PerplexityResult, bytes report, KL or None, chunks' log-probabilities when `reference` is None)."""
    chunks, kl, mem = [], [], {}

    def on_logits(logits: torch.Tensor) -> None:
        logp = F.log_softmax(logits.double(), dim=-1)
        if reference is None:
            chunks.append(logp.float())
        else:
            kl.append(F.kl_div(logp, reference[len(kl)].double(), log_target=True, reduction="none").sum(-1).clamp_min(0))

    cache = make_cache(model, BASELINE) if method == BASELINE else KVCache(model, method)
    with attention_for(model, BASELINE if method == BASELINE else "kvpack"):
        result = perplexity(model, ids, cache, args.context, 256, args.ppl_tokens, after_prefill=lambda c: mem.update(memory_report(c, model.config)),
                            progress=False, on_logits=on_logits)
    return result, mem, (torch.cat(kl).mean().item() if kl else None), chunks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default=DEFAULT_METHOD)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tail", type=int, default=128)
    p.add_argument("--draws", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    layers = [i for i, (kind, _) in enumerate(layer_kinds(text_config(model)[1])) if kind == "full_attention"]
    ids = token_stream(tokenizer, "news", args.context + args.ppl_tokens + 1)
    start = time.perf_counter()
    pred = key_predictions(model, ids[: args.context], args.tail, args.draws, layers)
    up, down = pairs(pred, layers)
    out = {"environment": environment("python experiments/runtime_allocation.py", argv), "config": vars(args), "promoted": up, "demoted": down,
           "signal_seconds": time.perf_counter() - start, "predicted": {f"{lay}:k{b}": pred[(lay, b)] for lay in layers for b in KEY_BITS}, "rows": []}
    print(f"keys at 4 bits on {up}, at 2 bits on {down} ({out['signal_seconds']:.0f} s)", flush=True)
    base, base_mem, _, reference = run(model, ids, BASELINE, args, None)
    out["baseline"] = {"ppl": base.ppl, "bytes": base_mem["total_bytes"]}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for label, method in (("default", get_method(f"{args.method}@seed={seed}")), ("allocated", allocated(f"{args.method}@seed={seed}", up, down))):
            result, mem, kl, _ = run(model, ids, method, args, reference)
            pct, _ = delta(result, base)
            row = {"method": label, "seed": seed, "ppl_delta_pct": pct, "ppl_delta_ci": list(delta_ci(result, base)), "kl": kl,
                   "ratio_vs_fp16": mem["fp16_bytes"] / mem["total_bytes"], "total_bytes": mem["total_bytes"]}
            out["rows"].append(row)
            Path(args.json).write_text(json.dumps(out, indent=1))
            print(f"{label} @seed={seed}: {row['ratio_vs_fp16']:.3f}x, ppl {pct:+.2f}%, KL {kl:.5f}", flush=True)
    for label in ("default", "allocated"):
        rows = [r for r in out["rows"] if r["method"] == label]
        d = [r["ppl_delta_pct"] for r in rows]
        out[label] = {"mean_pct": statistics.mean(d), "sd": statistics.stdev(d) if len(d) > 1 else 0.0, "kl": statistics.mean(r["kl"] for r in rows)}
        print(f"== {label}: mean {out[label]['mean_pct']:+.2f}% (sd {out[label]['sd']:.2f}), KL {out[label]['kl']:.5f}")
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
