"""How cheap can the prompt's Fisher signal be before its key-width pairs get worse? Backward passes and tail length.

    python experiments/fisher_signal_cost.py --model smollm2-135m --json bench/results/fisher-signal-cost-smollm2-135m-2k.json

`@fisher=N` (kvpack/cache/prompt_widths.py) runs the prompt's last N tokens again with gradients w.r.t. the earlier
tokens' cached K/V and pairs layers by the predicted KL of their keys at 2, 3 and 4 bits. Its cost is the tail's
forward and one backward pass per draw, each through every layer; its noise moves the marginal pairs. This prefills
one `--context`-token news prompt into a held `@fisher` cache, then, before the widths are placed, runs the placement
for every (draws, tail) of `--grid` at each of `--seeds` sampling seeds, and a reference with `--ref-draws` backward
passes at the longest tail. Each variant's pairs are scored by the reference's predictions: the predicted KL change
of its moves, sum over promoted layers of (KL at 4 bits - at 3) plus over demoted layers of (KL at 2 - at 3), as a
share of the change the reference's own pairs predict. A variant that captures (almost) all of it places bits as
well as the reference would; the perplexity of the variant chosen is then measured over rotation draws with
`python -m kvpack.bench.auto` (docs/notes/auto.md). Reported per variant: the pairs, that share, and the placement's
seconds (the tail's forward and backward passes plus the width predictions) beside the prompt's prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import kvpack  # noqa: E402
from kvpack import DEFAULT_METHOD  # noqa: E402
from kvpack.bench.env import environment  # noqa: E402
from kvpack.cache import KVCache, prompt_widths  # noqa: E402
from kvpack.text import token_stream  # noqa: E402


def moved_kl(pred: dict[int, dict[int, float]], up: list[int], down: list[int]) -> float:
    """The KL change `pred` predicts for keys at 4 bits on `up` and 2 bits on `down` (negative: better)."""
    return sum(pred[lay][4] - pred[lay][3] for lay in up) + sum(pred[lay][2] - pred[lay][3] for lay in down)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default=DEFAULT_METHOD)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--grid", default="2x128,1x128,1x64,1x32", help="draws x tail, comma-separated")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--ref-draws", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    grid = [tuple(int(x) for x in g.split("x")) for g in args.grid.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    longest = max(t for _, t in grid)
    model, tokenizer = kvpack.load_model(args.model)
    ids = token_stream(tokenizer, "news", args.context)[None]
    out: dict = {"environment": environment("python experiments/fisher_signal_cost.py", argv), "config": vars(args), "variants": []}

    class Measured(KVCache):
        def place_prompt(self, model) -> None:  # the grid runs on the held prompt before the cache places its own widths
            ref = prompt_widths.place(self, model, self._prompt_ids, tail=longest, draws=args.ref_draws, seed=1000)
            best = moved_kl(ref["predicted"], ref["promoted"], ref["demoted"])
            out["reference"] = {"draws": args.ref_draws, "tail": longest, "promoted": ref["promoted"], "demoted": ref["demoted"],
                                "predicted_change": best, "seconds": ref["seconds"]}
            print(f"reference: {len(ref['promoted'])} pairs, predicted change {best:.5f}, {ref['seconds']:.2f} s", flush=True)
            for draws, tail in grid:
                for seed in seeds:
                    r = prompt_widths.place(self, model, self._prompt_ids, tail=tail, draws=draws, seed=seed)
                    share = moved_kl(ref["predicted"], r["promoted"], r["demoted"]) / best if best else 1.0
                    out["variants"].append({"draws": draws, "tail": tail, "seed": seed, "promoted": r["promoted"], "demoted": r["demoted"],
                                            "share_of_reference_gain": share, "seconds": r["seconds"]})
                    print(f"draws {draws} tail {tail:4d} seed {seed}: {len(r['promoted']):2d} pairs, share {share:.3f}, {r['seconds']:.2f} s", flush=True)
            super().place_prompt(model)

    kvpack.enable(model)
    cache = Measured(model, f"{args.method}@fisher={longest}")
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    out["prefill_and_grid_seconds"] = time.perf_counter() - start
    kvpack.disable(model)
    # the prompt's prefill alone, for scale (DynamicCache, the model's own attention)
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=True)
    out["dynamic_prefill_seconds"] = time.perf_counter() - start
    out["summary"] = []
    for draws, tail in grid:
        rows = [v for v in out["variants"] if (v["draws"], v["tail"]) == (draws, tail)]
        shares, secs = [v["share_of_reference_gain"] for v in rows], [v["seconds"] for v in rows]
        out["summary"].append({"draws": draws, "tail": tail, "share_mean": statistics.mean(shares), "share_min": min(shares),
                               "seconds_median": statistics.median(secs), "x_prefill": statistics.median(secs) / out["dynamic_prefill_seconds"]})
    for s in out["summary"]:
        print(f"draws {s['draws']} tail {s['tail']:4d}: share mean {s['share_mean']:.3f} (min {s['share_min']:.3f}), "
              f"{s['seconds_median']:.2f} s = {s['x_prefill']:.2f} of a prefill ({out['dynamic_prefill_seconds']:.2f} s)")
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
