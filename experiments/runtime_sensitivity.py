"""Could the default find its sensitive layers at run time, without calibration? A test of the cheapest signal.

    python experiments/runtime_sensitivity.py --model smollm2-135m --json bench/results/runtime-sensitivity-smollm2-135m.json

At prefill a cache sees every layer's keys, values and (through the attention function) the prompt's queries. Per
full-attention layer this measures what compressing only that layer's K or V at 2/3/4 bits (TurboQuant, sinks and
window exact, as the methods store them) does to the layer's own output for the prompt's last `--queries` queries:

    local(l, side, b) = mean_t ||W_o (o_hat_t - o_t)||^2 / ||h_t||^2

(the attention output's change after the output projection, relative to the residual stream entering the layer), and
ranks it against the calibrated profile's downstream KL for the same (layer, side, bits) with Spearman's rho. A
run-time allocation would need rho near 1; docs/notes/auto.md records what it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SINKS, WINDOW = 4, 128


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho (no ties expected among these continuous errors): Pearson correlation of the ranks."""
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def parse(doc: str, argv: list[str] | None, threads: int, **options: dict) -> argparse.Namespace:
    """--model, --profile, --threads, --json and each `options` entry (flag name -> add_argument keywords)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", help="calibrated profile (default: bench/results/profiles/<model>.json)")
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--json")
    for flag, kwargs in options.items():
        p.add_argument(f"--{flag}", **kwargs)
    return p.parse_args(argv)


def profile_and_model(name: str, profile: str | None, threads: int):
    """The probe profile (`profile`, else bench/results/profiles/<name>.json) and the model in the dtype it was made in."""
    sys.path.insert(0, str(ROOT / "src"))
    from kvpack.models import load_model

    torch.set_num_threads(threads)
    data = json.loads(Path(profile or ROOT / "bench" / "results" / "profiles" / f"{name}.json").read_text())
    return (data, *load_model(name, dtype=getattr(torch, data["calibration"]["dtype"])))


def capture(model, ids: torch.Tensor) -> tuple[dict, dict]:
    """One prefill: each layer's RoPE'd (q, k, v) (kvpack.bench.layers.prompt_qkv) and the hidden state entering it."""
    from kvpack.bench.layers import prompt_qkv

    hidden = {}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, kwargs, i=i: hidden.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).detach()),
                                             with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            qkv = prompt_qkv(model, ids[None])
    finally:
        for h in hooks:
            h.remove()
    return qkv, hidden


def local_errors(model, qkv, hidden, layer: int, queries: int) -> dict[str, float]:
    """{'k2': ..., 'v4': ...}: local(l, side, b) of one layer (module docstring)."""
    from kvpack import auto

    q, k, v = qkv[layer]
    attn = model.model.layers[layer].self_attn
    heads, kv_heads, length, head_dim = q.shape[1], k.shape[1], k.shape[2], k.shape[3]
    qq = q[:, :, -queries:]
    causal = torch.arange(length)[None, :] > torch.arange(length - queries, length)[:, None]

    def attend(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        kk, vv = kk.repeat_interleave(heads // kv_heads, 1), vv.repeat_interleave(heads // kv_heads, 1)
        scores = (qq @ kk.transpose(-1, -2) * attn.scaling).masked_fill(causal, float("-inf"))
        return torch.softmax(scores, -1) @ vv

    exact = attend(k, v)
    h = hidden[layer][:, -queries:]
    out = {}
    for side, x in (("key", k), ("value", v)):
        for bits in (2, 3, 4):
            codec = auto.codec_spec(side, bits).build(head_dim, kv_heads)
            mid = codec.decode(codec.encode(x[:, :, SINKS : length - WINDOW].contiguous())).to(x.dtype)
            xq = torch.cat([x[:, :, :SINKS], mid, x[:, :, length - WINDOW :]], 2)
            approx = attend(xq, v) if side == "key" else attend(k, xq)
            delta = (approx - exact).transpose(1, 2).reshape(1, queries, -1) @ attn.o_proj.weight.T
            out[f"{side[0]}{bits}"] = (delta.pow(2).sum(-1) / h.pow(2).sum(-1)).mean().item()
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from kvpack.bench.env import environment
    from kvpack.text import token_stream

    args = parse(__doc__, argv, threads=1, queries={"type": int, "default": 256})
    profile, model, tokenizer = profile_and_model(args.model, args.profile, args.threads)
    cal = profile["calibration"]
    ids = token_stream(tokenizer, cal["text"], cal["prefix"], offset=cal["offset"])  # the calibration's own prompt
    qkv, hidden = capture(model, ids)
    local = {layer: local_errors(model, qkv, hidden, layer, args.queries) for layer in profile["layers"]}
    kl = {(r["layer"], f"{r['side'][0]}{r['bits']}"): r["kl"] for r in profile["sensitivity"]}
    cells = ["k2", "k3", "v2", "v3"]
    rho = {c: spearman([local[lay][c] for lay in profile["layers"]], [kl[(lay, c)] for lay in profile["layers"]]) for c in cells}
    rho["all"] = spearman([local[lay][c] for lay in profile["layers"] for c in cells], [kl[(lay, c)] for lay in profile["layers"] for c in cells])
    top = {"local": sorted(profile["layers"], key=lambda lay: -local[lay]["k2"])[:5], "kl": sorted(profile["layers"], key=lambda lay: -kl[(lay, "k2")])[:5]}
    print(f"{args.model}: Spearman rho of local error vs calibrated KL: " + ", ".join(f"{c} {r:+.2f}" for c, r in rho.items()))
    print(f"  most sensitive keys at 2 bits, by local error {top['local']}, by KL {top['kl']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment("python experiments/runtime_sensitivity.py", argv), "config": vars(args),
                                               "spearman": rho, "top_k2": top, "local": {str(k): v for k, v in local.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
