"""Could a prompt rank its own layers' sensitivity at run time? The Fisher diagonal from the prompt's own tail.

    python experiments/runtime_fisher.py --model smollm2-135m --json bench/results/runtime-fisher-smollm2-135m.json

A calibrated profile (`kvpack calibrate`, `bench/results/profiles/<model>.json`) measures, per full-attention layer, the
next-token KL that compressing only that layer's K or V at 2/3/4 bits costs on a 2K pydoc prompt. A default that
gave a few layers' keys a fourth bit without calibration would need the same ranking from what a cache sees at
prefill. This measures one candidate signal: split the prompt into a prefix and its last `--tail` tokens, run the tail
with gradients w.r.t. the prefix's cached K/V (`kvpack.auto.fisher_diagonal`, `--draws` backward passes), and
predict each (layer, side, width) as the sum over the layer's stored elements of E[g^2] * delta^2 / 2, delta the
codec's real error on the prefix (the Fisher mode's raw prediction, `kvpack.auto`, with no probe to correct it).
It ranks the predictions against the calibrated profile's measured KL (Spearman's rho, per cell kind and over all),
for the profile's own pydoc prompt and for the news text the evaluations score (the prompt a user would bring), and
times the tail's forward and backward passes against the prompt's prefill.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from runtime_sensitivity import parse, profile_and_model, spearman  # noqa: E402

CELLS = ("k2", "k3", "v2", "v3")


def predictions(model, ids: torch.Tensor, tail: int, draws: int, layers: list[int]) -> tuple[dict, dict]:
    """({(layer, cell): predicted KL}, seconds {'prefill', 'tail'}) for the prompt `ids` split at its last `tail` tokens."""
    from kvpack import auto
    from kvpack.attention import disable
    from kvpack.cache import KVCache
    from kvpack.eval.generate import forward

    prefix, scored = ids[:-tail], ids[-tail:]
    specs = {(side, b): auto.codec_spec(side, b) for side in auto.SIDES for b in (2, 3)}
    disable(model)
    base = KVCache(model, auto._probe(None), allow_untested=True)
    start = time.perf_counter()
    forward(model, prefix, base)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    fisher = auto.fisher_diagonal(model, prefix, scored, draws)
    # fisher_diagonal prefills its own prefix cache first: the tail's passes are what it takes beyond one more prefill
    seconds = {"prefill": prefill, "tail": time.perf_counter() - start - prefill}
    heads = auto._head_raw(fisher, base, layers, specs, (2, 3), len(scored))
    return {(layer, f"{side[0]}{b}"): sum(heads[(layer, side, b)]) for layer in layers for side in auto.SIDES for b in (2, 3)}, seconds


def main(argv: list[str] | None = None) -> int:
    import json

    from kvpack.bench.env import environment
    from kvpack.text import token_stream

    args = parse(__doc__, argv, threads=2, tail={"type": int, "default": 128}, draws={"type": int, "default": 2},
                 texts={"default": "pydoc,news"})
    profile, model, tokenizer = profile_and_model(args.model, args.profile, args.threads)
    cal, layers = profile["calibration"], profile["layers"]
    kl = {(r["layer"], f"{r['side'][0]}{r['bits']}"): r["kl"] for r in profile["sensitivity"]}
    runs = {}
    for text in args.texts.split(","):
        ids = token_stream(tokenizer, text, cal["prefix"], offset=cal["offset"] if text == cal["text"] else 0)
        pred, seconds = predictions(model, ids, args.tail, args.draws, layers)
        rho = {c: spearman([pred[(lay, c)] for lay in layers], [kl[(lay, c)] for lay in layers]) for c in CELLS}
        rho["all"] = spearman([pred[(lay, c)] for lay in layers for c in CELLS], [kl[(lay, c)] for lay in layers for c in CELLS])
        top = {"fisher": sorted(layers, key=lambda lay: -pred[(lay, "k2")])[:5], "kl": sorted(layers, key=lambda lay: -kl[(lay, "k2")])[:5]}
        runs[text] = {"spearman": rho, "top_k2": top, "seconds": seconds, "predicted": {f"{lay}:{c}": pred[(lay, c)] for lay in layers for c in CELLS}}
        print(f"{args.model} {text} (tail {args.tail}, {args.draws} draws): Spearman rho vs calibrated KL: "
              + ", ".join(f"{c} {r:+.2f}" for c, r in rho.items())
              + f"; keys at 2 bits, top 5 by Fisher {top['fisher']}, by KL {top['kl']}; prefill {seconds['prefill']:.1f} s, tail passes {seconds['tail']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment("python experiments/runtime_fisher.py", argv), "config": vars(args),
                                               "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
