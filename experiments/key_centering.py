"""Where TurboQuant's 3-bit keys lose, per layer, under three ways of centering them before coding.

    python experiments/key_centering.py --model smollm2-135m --json bench/results/key-centering-smollm2-135m.json

A model's keys reach the cache with RoPE applied. A component that is constant before RoPE (a QKV bias, a massive
channel) turns with position after it, at each RoPE pair's own frequency, so the post-RoPE mean the default
subtracts removes it only from pairs that barely turn over the context. For each full-attention layer this codes
the first half of a `--context`-token news prompt's keys at `--bits` bits three ways and measures the attention
KL of the second half's queries (values exact, the 4 sinks exact, and 0.5% anchors exact: the tokens the last 128
first-half queries attend to most, as `@anchors=0.5%` keeps them):

    post     the default: subtract the post-RoPE mean (`TurboQuantConfig.center`)
    unroped  subtract the un-RoPEd mean turned to each token's position, on every RoPE pair
    ropemean what `+ropemean` does (`turning_means`): the un-RoPEd mean on the pairs where it gains more than an
             average pair's residual, the post-RoPE mean on the rest

plus the residual energy left by each, and how many pairs turn. One rotation draw (`--seed`); the same draw for all
three, so the comparison is paired.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvpack
from kvpack.bench.env import environment
from kvpack.codecs.turboquant import TurboQuantCodec, TurboQuantConfig, turning_means
from kvpack.primitives.rope import apply_rope, rope_cos_sin, undo_rope
from kvpack.support import rope_per_layer
from kvpack.text import token_stream

SINKS, FIT_QUERIES = 4, 128


def capture(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's RoPE'd keys `(1, kv, T, d)` and un-RoPEd queries `(1, heads, T, d)` of one forward over `ids`."""
    from transformers import DynamicCache

    cfg, tokens = model.config, ids.shape[1]
    heads = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    queries: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        module = getattr(attn, "q_norm", None) or attn.q_proj  # Gemma normalizes q before RoPE

        def hook(_m, _inp, out, i=i):
            queries[i] = out.detach().float().reshape(1, tokens, heads, d).transpose(1, 2)

        hooks.append(module.register_forward_hook(hook))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    for h in hooks:
        h.remove()
    return [layer.keys.float() for layer in cache.layers], [queries[i] for i in range(len(cache.layers))]


def layer_row(keys, queries, rope, scaling: float, bits: int, seed: int, layer_idx: int) -> dict:
    """KL and residual energy of the three centerings for one layer (see the module docstring)."""
    tokens = keys.shape[2]
    half, d, kv = tokens // 2, keys.shape[-1], keys.shape[1]
    group = queries.shape[1] // kv
    cos, sin = rope_cos_sin(torch.arange(tokens)[None], *rope)
    q = apply_rope(queries, cos, sin)
    k = keys[:, :, :half]

    def log_attention(rows: torch.Tensor, k_: torch.Tensor, causal_from: int | None = None) -> torch.Tensor:
        s = (rows @ k_.repeat_interleave(group, 1).mT) * scaling
        if causal_from is not None:  # rows at positions causal_from.. see keys up to their own position
            pos = torch.arange(causal_from, causal_from + rows.shape[2])[:, None]
            s = s.masked_fill(torch.arange(k_.shape[2])[None, :] > pos, float("-inf"))
        return s.log_softmax(-1)

    mass = log_attention(q[:, :, half - FIT_QUERIES : half], k, half - FIT_QUERIES).exp().sum((0, 1, 2))
    mass[:SINKS] = -1
    anchors = mass.topk(max(1, round(0.005 * (half - SINKS)))).indices
    coded = torch.ones(half, dtype=torch.bool)
    coded[:SINKS] = False
    coded[anchors] = False
    ref = log_attention(q[:, :, half:], k)
    c, s_ = cos[:, :half][:, coded], sin[:, :half][:, coded]
    x = k[:, :, coded]
    constant = x.mean(dim=(0, 2))
    unroped = undo_rope(x, c, s_).mean(dim=(0, 2))
    mean, rope_mean = turning_means(x, c, s_)

    def turned(m: torch.Tensor) -> torch.Tensor:
        return apply_rope(m[None, :, None, :].expand_as(x), c, s_)

    centers = {"post": constant[None, :, None, :].expand_as(x), "unroped": turned(unroped), "ropemean": mean[None, :, None, :] + turned(rope_mean)}
    row: dict = {"layer": layer_idx, "turning_pairs_mean": float((rope_mean[:, : d // 2] != 0).float().sum(-1).mean())}
    for name, center in centers.items():
        codec = TurboQuantCodec(TurboQuantConfig(bits, channel_scale=0.5, seed=seed), d, kv, layer_idx)
        residual = x - center
        codec.fit(residual)
        k_hat = k.clone()
        k_hat[:, :, coded] = codec.decode(codec.encode(residual)) + center
        lp = log_attention(q[:, :, half:], k_hat)
        row[f"kl_{name}"] = float((ref.exp() * (ref - lp)).sum(-1).mean())
        row[f"energy_{name}"] = float(residual.pow(2).sum(-1).mean() / x.pow(2).sum(-1).mean())
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    cfg = model.config
    ids = token_stream(tok, "news", args.context)[None]
    keys, queries = capture(model, ids)
    kinds = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    ropes = rope_per_layer(model, [(kind, None) for kind in kinds])
    scaling = model.model.layers[0].self_attn.scaling
    rows = []
    for i, kind in enumerate(kinds):
        if kind != "full_attention" or ropes[i] is None:
            continue
        rows.append(layer_row(keys[i], queries[i], ropes[i], scaling, args.bits, args.seed, i))
        r = rows[-1]
        print(f"layer {i:2d}: KL post {r['kl_post']:.4f}  unroped {r['kl_unroped']:.4f}  ropemean {r['kl_ropemean']:.4f}"
              f"  (turning pairs {r['turning_pairs_mean']:.1f})", flush=True)
    summary = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k != "layer"}
    print("mean over layers: " + ", ".join(f"{k} {v:.4f}" for k, v in summary.items()))
    if args.json:
        out = {"config": vars(args), "environment": environment("python experiments/key_centering.py", argv),
               "layers": rows, "mean": summary}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
