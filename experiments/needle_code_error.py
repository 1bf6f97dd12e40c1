"""How badly does a fitted archive code a needle's tokens, against every other token it holds?

    python experiments/needle_code_error.py --model qwen2.5-0.5b --length 32768 --depth 0.5 --seed 0 \
        --json bench/results/needle-code-error-qwen2.5-0.5b-32k.json

The passkey prompt of `kvpack.eval.needle` (the first needle of `needle_grid`'s seed 0 at one length and depth) is
prefilled twice: into a `DynamicCache` (the exact K/V) and into a cache of `--method` at rotation draw `--seed`. For
every layer, each token the archive (`tier1`) holds gets its relative squared error, keys and values apart (decoded
from its codes against the exact rows, mean over kv heads); the needle sentence's tokens are placed by percentile
among all of the archive's tokens, and the anchors (tokens kept exact) among them are listed. A needle whose tokens
sit in the worst-coded 0.5% could be kept exact at that cost; tokens at the 90th percentile cannot, at any cost a
10x archive affords.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpack
from kvpack.bench.env import environment, write_json
from kvpack.eval.generate import forward
from kvpack.eval.needle import build_prompt, make_needles
from kvpack.registry import get_method
from kvpack.text import token_stream


def percentiles(errors: torch.Tensor, index: torch.Tensor) -> list[float]:
    """Share of `errors (n,)` strictly below each of `errors[index]`."""
    return [float((errors < errors[i]).float().mean()) for i in index.tolist()]


def relative_errors(exact: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """`(b, kv, n, d)` pairs -> `(n,)` relative squared error per token, mean over batch and kv heads."""
    exact, decoded = exact.float(), decoded.float()
    return ((decoded - exact).square().sum(-1) / exact.square().sum(-1).clamp_min(1e-12)).mean((0, 1))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--method", default="tiered:1024:shard")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0, help="the method's rotation draw")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment("python experiments/needle_code_error.py", argv)
    model, tok = kvpack.load_model(args.model)
    kvpack.enable(model)
    filler = token_stream(tok, "news", args.length)
    needle = make_needles("passkey", 1, 0, tok.decode(filler))[0]
    document, _ = build_prompt(tok, filler, args.length, args.depth, needle)
    sentence = tok(" " + needle.sentence, add_special_tokens=False).input_ids
    ids = document.tolist()
    at = next((i for i in range(len(ids)) if ids[i : i + len(sentence)] == sentence), None)
    if at is None:  # at depth 0 the needle opens the document without its leading space
        sentence = tok(needle.sentence, add_special_tokens=False).input_ids
        at = next(i for i in range(len(ids)) if ids[i : i + len(sentence)] == sentence)
    exact = DynamicCache(config=model.config)
    forward(model, document, exact)
    rows = [(layer.keys, layer.values) for layer in exact.layers]
    del exact
    cache = kvpack.KVCache(model, get_method(args.method).with_seed(args.seed))
    forward(model, document, cache)
    layers = []
    for i, layer in enumerate(cache.layers):
        seg = next((s for s in getattr(layer, "segments", []) if s.kind == "tier1"), None)
        if seg is None or not seg.start <= at < seg.start + seg.length - len(sentence):
            continue
        dk, dv = layer.decode_front(seg, seg.length)
        k, v = (x[:, :, seg.start : seg.start + seg.length] for x in rows[i])
        ek, ev = relative_errors(k, dk), relative_errors(v, dv)
        index = torch.arange(at, at + len(sentence)) - seg.start
        anchors = set(layer.anchors.index.tolist()) if layer.anchors is not None else set()
        layers.append({
            "layer": i, "archive_tokens": seg.length, "key_percentile": percentiles(ek, index), "value_percentile": percentiles(ev, index),
            "key_error_median": float(ek.median()), "value_error_median": float(ev.median()),
            "needle_anchors": [t for t in range(at, at + len(sentence)) if t in anchors],
        })
    pieces = [tok.decode([t]) for t in sentence]
    digits = [j for j, piece in enumerate(pieces) if piece.strip().isdigit()]
    key_digits = [row["key_percentile"][j] for row in layers for j in digits]
    summary = {
        "needle_tokens": pieces, "needle_start": at, "layers_measured": len(layers),
        "digit_key_percentile_median": statistics.median(key_digits) if key_digits else None,
        "digit_layer_pairs_in_worst_key_share": {f"{share:g}": sum(x >= 1 - share for x in key_digits) for share in (0.005, 0.01, 0.02, 0.05, 0.1)},
        "digit_layer_pairs": len(key_digits),
        "needle_tokens_anchored": sum(len(row["needle_anchors"]) for row in layers),
    }
    print(json.dumps(summary, indent=1), flush=True)
    out = {"config": vars(args) | {"json": str(args.json)}, "environment": env, "summary": summary, "layers": layers}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
