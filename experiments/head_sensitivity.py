"""Would widths per kv head buy bytes over `auto`'s widths per layer? Sensitivity per (layer, side, kv head, width).

    python experiments/head_sensitivity.py --model smollm2-135m --json bench/results/head-sensitivity-smollm2-135m.json

On the calibration prompt of a Fisher profile (`bench/results/profiles-fisher/<model>.json`: its text, prefix and
scored tokens), the Fisher diagonal of the scored tokens w.r.t. the cached K/V (`kvpack.auto.fisher_diagonal`) is
weighted by each codec's real squared error head by head: the raw second-order KL of every (layer, side, head, width).
The profile's sensitivity of each (layer, side, width) is split over the layer's heads in proportion to those raw
predictions, as the Fisher mode splits a measured total over layers. Then:

- **measured per head**: `--measure` (layer, side, width) cells, e.g. every layer's keys at 2 bits, are probed head by head:
  one head of one layer stored through the codec and decoded back (the compressed cache's scores are exact functions of
  the codes, so a decoded head reads as the codes do, to float16 rounding), every other value exact; the KL of the scored
  tokens from the reference. Spearman's rho of the per-head shares against the measured ones says whether the per-head
  split ranks heads as they are.
- **allocation**: the multiple-choice knapsack of `auto` (`kvpack.auto.allocate`) at each target, once with one width per
  (layer, side), once with one width per (layer, side, head), on the same sensitivities: the bytes per compressed token of
  each. Their ratio is what per-head widths would buy under the profile's own additive model.

`--write-profile PATH` also writes the profile with its key shares taken from the measured 2-bit key probes, to run
`auto:<target>/head` on measured rather than predicted splits (docs/notes/auto.md).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from runtime_sensitivity import parse, spearman

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (0.005, 0.01, 0.02, 0.04)


def probe_head(model, base, ref, scored, layer: int, side: str, head: int, spec) -> float:
    """KL of the scored tokens when only `head` of `layer`'s `side` is stored through `spec` (decoded back), all else exact."""
    from kvpack.auto import SIDES, _kl, _probe, _score, _stored, _uniform_cache  # noqa: F401

    cache = _uniform_cache(base, _probe(None), ())
    old = cache.layers[layer]
    s = SIDES.index(side)
    decoded = _stored(old, _probe(layer, side, spec), layer).dequantized()[s]
    k, v = old.keys.clone(), old.values.clone()
    (k if side == "key" else v)[:, head] = decoded[:, head].to(k.dtype)
    from kvpack.cache.layer import KVPackLayer

    new = KVPackLayer(_probe(None).for_layer(layer), layer, old.model_config, old.rope)
    new.update(k, v)
    cache.layers[layer] = new
    return _kl(_score(model, cache, scored), ref).mean().item()


def allocation_bytes(profile: dict, head_kl: dict, target: float) -> dict:
    """Bytes per compressed token (all layers, K and V) of the knapsack per layer and per head, at one target."""
    from kvpack.auto import SIDES, allocate, sensitivities

    bits = [str(b) for b in profile["bits"]]
    heads = profile["kv_heads"]
    budget = math.log1p(target)
    sens = sensitivities(profile)
    layer_items = [(layer, side) for layer in profile["layers"] for side in SIDES]
    cost = {side: [int(profile["block_bytes"][side][b]) for b in bits] for side in SIDES}
    per_layer = allocate([cost[side] for _, side in layer_items], [sens[i] for i in layer_items], budget)
    head_items = [(layer, side, h) for layer, side in layer_items for h in range(heads)]
    head_cost = {side: [c // heads for c in cost[side]] for side in SIDES}  # a block's bytes are the same per head
    per_head = allocate([head_cost[side] for _, side, _ in head_items], [head_kl[i] for i in head_items], budget)
    if per_layer is None or per_head is None:
        return {"target": target, "reachable": False}
    layer_bytes = sum(cost[side][j] for (_, side), j in zip(layer_items, per_layer, strict=True)) / profile["block_tokens"]
    head_bytes = sum(head_cost[side][j] for (_, side, _), j in zip(head_items, per_head, strict=True)) / profile["block_tokens"]
    mixed = sum(len({per_head[i * heads + h] for h in range(heads)}) > 1 for i in range(len(layer_items)))
    return {"target": target, "reachable": True, "per_layer_bytes_per_token": layer_bytes, "per_head_bytes_per_token": head_bytes,
            "bytes_saved": 1 - head_bytes / layer_bytes, "items_with_mixed_head_widths": mixed, "items": len(layer_items)}


def write_measured_shares(profile: dict, measured: list[dict], path: str) -> None:
    """`profile` with each layer's key `head_shares` (at every width) set to its measured 2-bit key probes' shares."""
    shares = {m["layer"]: m["kl"] for m in measured if (m["side"], m["bits"]) == ("key", 2)}
    if set(shares) != set(profile["layers"]):
        raise SystemExit("--write-profile needs the 2-bit key probes of every layer (--measure key:2)")
    out = json.loads(json.dumps(profile))
    for r in out["sensitivity"]:
        if r["side"] == "key":
            total = sum(shares[r["layer"]])
            r["head_shares"] = [x / total for x in shares[r["layer"]]] if total > 0 else [1 / len(shares[r["layer"]])] * len(shares[r["layer"]])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse(__doc__, argv, threads=2, measure={"default": "key:2", "help": "side:bits cells probed head by head, comma-separated ('' none)"},
                 **{"write-profile": {"help": "write a copy of the profile whose key head_shares (every width) are the measured 2-bit key probes' shares"}})
    sys.path.insert(0, str(ROOT / "src"))
    from kvpack.attention import disable
    from kvpack.auto import SIDES, _head_raw, _probe, _score, codec_spec, fisher_diagonal, sensitivities
    from kvpack.bench.env import environment
    from kvpack.cache.kvcache import KVCache
    from kvpack.eval.generate import forward
    from kvpack.models import load_model
    from kvpack.text import token_stream

    torch.set_num_threads(args.threads)
    profile = json.loads(Path(args.profile or ROOT / "bench" / "results" / "profiles-fisher" / f"{args.model}.json").read_text())
    cal = profile["calibration"]
    model, tok = load_model(args.model, dtype=getattr(torch, cal["dtype"]))
    disable(model)
    ids = token_stream(tok, cal["text"], cal["prefix"] + cal["tokens"] + 1, offset=cal["offset"])
    prompt, scored = ids[: cal["prefix"]], ids[cal["prefix"] : -1]
    base = KVCache(model, _probe(None), allow_untested=True)
    forward(model, prompt, base)
    import copy

    ref = _score(model, copy.deepcopy(base), scored)
    layers, bits, heads = profile["layers"], profile["bits"], profile["kv_heads"]
    specs = {(side, b): codec_spec(side, b) for side in SIDES for b in bits}
    fisher = fisher_diagonal(model, prompt, scored, cal["draws"])
    raw = _head_raw(fisher, base, layers, specs, bits, len(scored))
    sens = sensitivities(profile)
    head_kl = {}
    for layer in layers:
        for side in SIDES:
            for h in range(heads):
                shares = [raw[(layer, side, b)][h] / max(sum(raw[(layer, side, b)]), 1e-30) for b in bits]
                head_kl[(layer, side, h)] = [s * kl for s, kl in zip(shares, sens[(layer, side)], strict=True)]
    measured = []
    for cell in filter(None, args.measure.split(",")):
        side, b = cell.split(":")
        b = int(b)
        for layer in layers:
            kls = [probe_head(model, base, ref, scored, layer, side, h, specs[(side, b)]) for h in range(heads)]
            measured.append({"layer": layer, "side": side, "bits": b, "kl": kls, "raw": raw[(layer, side, b)]})
            print(f"layer {layer:2d} {side} {b} bits: measured {[f'{x:.5f}' for x in kls]}  raw {[f'{x:.5f}' for x in raw[(layer, side, b)]]}", flush=True)
    rho = {}
    if measured and heads > 1:
        share = lambda row: [x / max(sum(row), 1e-30) for x in row]  # noqa: E731
        rho["within_layer_share"] = spearman([s for m in measured for s in share(m["raw"])], [s for m in measured for s in share(m["kl"])])
        rho["all_cells"] = spearman([x for m in measured for x in m["raw"]], [x for m in measured for x in m["kl"]])
        spread = [max(m["kl"]) / max(min(m["kl"]), 1e-9) for m in measured]
        rho["max_over_min_head_median"] = sorted(spread)[len(spread) // 2]
        print(f"rho: {rho}")
    if args.write_profile:
        write_measured_shares(profile, measured, args.write_profile)
    alloc = [allocation_bytes(profile, head_kl, t) for t in TARGETS]
    for a in alloc:
        print(a)
    if args.json:
        out = {"environment": environment("python experiments/head_sensitivity.py", argv), "config": vars(args), "kv_heads": heads,
               "raw": [{"layer": k[0], "side": k[1], "bits": k[2], "raw": v} for k, v in raw.items()], "measured": measured, "rho": rho,
               "allocation": alloc}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
