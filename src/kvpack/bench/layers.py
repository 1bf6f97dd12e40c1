"""Where a method loses, layer by layer and side by side: each layer's prompt K (or V) stored by the method's codec, the
other side exact, and the error of that layer's causal attention output on real queries.

    python -m kvpack.bench.layers --model gemma3-270m --prefix 8192 --methods turboquant:k3v2+ropemean turboquant:k4v4+ropemean \
        --json bench/results/layers-gemma3-270m-8k.json

One prefill records every layer's RoPE'd queries, keys and values (`prompt_qkv`); for each method and side the
layer's codec is fitted on the prompt as the cache fits it (positions, and the prompt's last queries for codecs that read
them), encodes and decodes it, and the prompt's second half of queries scores the relative squared error of the attention
output against exact K/V (sinks kept exact, as in the cache). This isolates each (layer, side): no error propagates from
earlier layers, so a layer's number is what its own codec costs it. Sliding-window layers, which kvpack leaves to
transformers, are skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvpack
from kvpack.bench.env import environment
from kvpack.cache.layer import FIT_QUERIES, KVPackLayer
from kvpack.models import load_model
from kvpack.text import token_stream

PROG = "python -m kvpack.bench.layers"


def prompt_qkv(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """Each layer's RoPE'd query, key and value `(1, heads, tokens, d)` float32 from one prefill, via SDPA."""
    seen = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (query.float(), key.float(), value.float())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvpack-record", record)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvpack-record")
    try:
        model(ids)
    finally:
        model.set_attn_implementation(previous)
    return seen


def causal_attention_error(q, k, v, k_hat, v_hat, first: int) -> float:
    """Mean relative squared error of causal attention outputs for queries from `first` on."""
    rep = q.shape[1] // k.shape[1]
    mask = torch.ones(q.shape[2] - first, k.shape[2], dtype=torch.bool).tril(first)
    ref, got = (
        torch.nn.functional.scaled_dot_product_attention(q[:, :, first:], kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1), attn_mask=mask)
        for kk, vv in ((k, v), (k_hat, v_hat))
    )
    return ((got - ref).square().sum(-1) / ref.square().sum(-1)).mean().item()


def stored(spec, x: torch.Tensor, layer, positions: torch.Tensor, queries: torch.Tensor, sinks: int):
    """`x (1, heads, tokens, d)` as `layer` (a `KVPackLayer`) would store it with `spec`'s codec: fitted on the prompt
    (positions and RoPE, the prompt's last queries for codecs that read them), encoded, decoded, the first `sinks` tokens
    exact. Returns (codec, packed, x_hat float32)."""
    codec = spec.build(x.shape[-1], x.shape[1], layer.layer_idx)
    if codec.uses_positions:
        codec.set_rope(*layer.rope)
    codec.fit(x, positions, **({"queries": queries[:, :, -FIT_QUERIES:]} if codec.fits_on_queries else {}))
    packed = codec.encode(x, positions)
    x_hat = codec.decode(packed, positions).float()
    x_hat[:, :, :sinks] = x[:, :, :sinks]
    return codec, packed, x_hat


@torch.no_grad()
def layer_errors(model, ids: torch.Tensor, methods: list[str]) -> list[dict]:
    """Rows `{layer, method, side, attn_error, bits_per_value}` for every compressed layer, method and side."""
    qkv = prompt_qkv(model, ids)
    layers = kvpack.KVCache(model, methods[0]).layers
    positions = torch.arange(ids.shape[1])[None]
    rows = []
    for method in methods:
        config = kvpack.get_method(method)
        for li, (q, k, v) in sorted(qkv.items()):
            if not isinstance(layers[li], KVPackLayer):
                continue
            for side, spec in (("key", config.key), ("value", config.value)):
                x = k if side == "key" else v
                _, packed, x_hat = stored(spec, x, layers[li], positions, q, config.sink_tokens)
                k_hat, v_hat = (x_hat, v) if side == "key" else (k, x_hat)
                rows.append({"layer": li, "method": method, "side": side, "bits_per_value": 8 * packed.nbytes() / x.numel(),
                             "attn_error": causal_attention_error(q, k, v, k_hat, v_hat, ids.shape[1] // 2)})
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    """Attention error per layer (log scale), one line per method and side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        for side, style in (("key", "o-"), ("value", "s--")):
            mine = [r for r in rows if r["method"] == method and r["side"] == side]
            ax.plot([r["layer"] for r in mine], [r["attn_error"] for r in mine], style, ms=3, label=f"{method} {side}")
    ax.set(xlabel="layer", ylabel="relative squared error of attention output", yscale="log", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix", type=int, default=8192, help="prompt tokens of the news text")
    ap.add_argument("--methods", nargs="+", required=True, help="methods whose key and value codecs are measured")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot", help="PNG: error per layer, per method and side")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids = token_stream(tok, "news", args.prefix)[None]
    rows = layer_errors(model, ids, args.methods)
    Path(args.json).write_text(json.dumps({"environment": environment(PROG, argv), "model": args.model, "prefix": args.prefix,
                                           "rows": rows}, indent=1))
    for method in args.methods:
        for side in ("key", "value"):
            errs = [r["attn_error"] for r in rows if r["method"] == method and r["side"] == side]
            worst = max((r for r in rows if r["method"] == method and r["side"] == side), key=lambda r: r["attn_error"])
            print(f"{method} {side:5s}: mean {sum(errs) / len(errs):.4f}, worst layer {worst['layer']} ({worst['attn_error']:.4f})", flush=True)
    print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, f"{args.model}: {args.prefix}-token news prompt, each layer and side alone")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
