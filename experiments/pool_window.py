"""What does a recent window buy vLLM's kvpack pool, and what does each way of storing it cost? Reproduced in transformers.

    python experiments/pool_window.py --calibration ~/.cache/kvpack/smollm2-135m-pool-calibration.safetensors \
        --json bench/results/pool-window-smollm2-135m.json

The vLLM pool benchmark (`python -m kvpack.bench.vllm`) scores the second half of 256-token news windows with every
position reading only compressed keys and values (`exact_chunk: false`). This script computes the same numbers in
transformers, without vLLM: each layer's K and V go through the pool's own codecs (`paged_pool.PoolFormat`, the
calibration file's static centering and scales), its first `--sinks` tokens stay exact, and a query at position p reads
positions `p - W + 1 .. p` exactly (or through int8 rows, as the pool's window store holds them). Its baseline and the
pool rows reproduce the vLLM engine's float32 figures (29.28 perplexity; k3v2 70.4%, int8 98.3% agreement), so the
window sizes and storage choices can be compared here in a minute each instead of an engine start per setting.

A setting is `METHOD[/wN][/int8][/tcq]`: the pool method (`int8`, `turboquant:kXvY`), a window of N tokens, the window
read through int8 rows instead of exactly, TurboQuant's codes trellis-coded (`+tcq`, same bytes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

MODEL = Path("~/.cache/kvpack/hf/smollm2-135m").expanduser()
SETTINGS = ["turboquant:k3v2", "turboquant:k3v2/w8", "turboquant:k3v2/w16", "turboquant:k3v2/w32", "turboquant:k3v2/w32/int8",
            "turboquant:k3v2/w64/int8", "turboquant:k3v2/w32/int8/tcq", "turboquant:k4v2/w32/int8", "turboquant:k3v3/w32/int8",
            "turboquant:k4v3/w32/int8", "turboquant:k4v4/w32/int8", "int8"]


def parse(setting: str) -> dict:
    method, *flags = setting.split("/")
    width = next((int(f[1:]) for f in flags if f.startswith("w")), 0)
    unknown = [f for f in flags if f not in ("int8", "tcq") and not (f.startswith("w") and f[1:].isdigit())]
    if unknown:
        raise SystemExit(f"{setting!r}: a setting is METHOD[/wN][/int8][/tcq], got {unknown}")
    return {"method": method, "window": width, "int8_window": "int8" in flags, "tcq": "tcq" in flags}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(MODEL), help="a converted model directory (kvpack's loader writes SmolLM2's here)")
    parser.add_argument("--calibration", required=True, help="the pool calibration file (python -m kvpack.serve.pool_calibration)")
    parser.add_argument("--windows", type=int, default=16, help="256-token news windows scored (second half)")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", nargs="+", default=SETTINGS)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvpack.bench.env import environment
    from kvpack.codecs.turboquant import TurboQuantCodec, TurboQuantConfig
    from kvpack.serve import pool_calibration
    from kvpack.serve.paged_pool import KEY_CHANNEL_SCALE, PoolFormat

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    gensim = importlib.util.find_spec("gensim")
    if gensim is None:
        raise SystemExit("the news corpus comes from gensim's test data: pip install --no-deps gensim==4.4.0")
    text = (Path(gensim.submodule_search_locations[0]) / "test/test_data/lee_background.cor").read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    length = 256
    windows = [ids[i * length : (i + 1) * length] for i in range(args.windows)]  # the vLLM benchmark's windows
    cfg = model.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    state = pool_calibration.load(args.calibration, pool_calibration.model_fingerprint(args.model), cfg.num_hidden_layers, kv_heads, head_dim)
    active: dict = {}

    def codecs(setting: dict, layer: int):
        fmt = PoolFormat(setting["method"], head_dim, 0, setting["method"] != "int8")
        pair = fmt.codecs(kv_heads, layer, None if fmt.bits is None else state[layer])
        if not setting["tcq"]:
            return pair
        kb, vb = fmt.bits  # trellis of L = the first multiple of the width >= 8, as the '+tcq' methods
        key = TurboQuantCodec(TurboQuantConfig(bits=kb, center=True, channel_scale=KEY_CHANNEL_SCALE, trellis=-(-8 // kb) * kb), head_dim, kv_heads, layer)
        value = TurboQuantCodec(TurboQuantConfig(bits=vb, center=True, trellis=-(-8 // vb) * vb), head_dim, kv_heads, layer)
        key.load_state_dict(pair[0].state_dict())
        value.load_state_dict(pair[1].state_dict())
        return key, value

    def roundtrip(pair, k, v):
        return (pair[0].decode(pair[0].encode(k.float())).to(k.dtype), pair[1].decode(pair[1].encode(v.float())).to(v.dtype))

    def attention(module, q, k, v, mask, **kw):
        """k, v `(b, kv_heads, T, d)`: every token through the pool's codecs, sinks exact, the window exact or int8."""
        setting = active.get("setting")
        if setting is None:
            return sdpa_attention_forward(module, q, k, v, mask, **kw)
        kh, vh = roundtrip(codecs(setting, module.layer_idx), k, v)
        kh[:, :, : args.sinks], vh[:, :, : args.sinks] = k[:, :, : args.sinks], v[:, :, : args.sinks]
        width = setting["window"]
        if not width:
            return sdpa_attention_forward(module, q, kh, vh, mask, **kw)
        if setting["int8_window"]:
            k, v = roundtrip(PoolFormat("int8", head_dim).codecs(kv_heads, 0), k, v)
        group = q.shape[1] // k.shape[1]
        t = torch.arange(k.shape[2])
        near = (t[None, :] > t[:, None] - width) & (t[None, :] <= t[:, None])  # (query, key): read from the window
        near |= (t < args.sinks)[None, :]
        exact_k, exact_v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()  # (b, heads, T, d)
        coded_k, coded_v = kh.repeat_interleave(group, 1).float(), vh.repeat_interleave(group, 1).float()
        scores = torch.where(near, q.float() @ exact_k.mT, q.float() @ coded_k.mT) * module.scaling  # (b, heads, T, T)
        p = scores.masked_fill(t[None, :] > t[:, None], float("-inf")).softmax(-1)
        out = torch.where(near, p, 0) @ exact_v + torch.where(near, 0, p) @ coded_v  # (b, heads, T, d)
        return out.transpose(1, 2).to(q.dtype), None

    AttentionInterface.register("kvpack_pool_sim", attention)
    model.config._attn_implementation = "kvpack_pool_sim"

    def score(setting: dict | None) -> tuple[float, list[torch.Tensor]]:
        active["setting"] = setting
        nll, count, top1 = 0.0, 0, []
        for w in windows:
            x = torch.tensor([w])
            with torch.no_grad():
                logits = model(x).logits[0, length // 2 - 1 : length - 1].float()
            target = x[0, length // 2 :]
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            count += target.numel()
            top1.append(logits.argmax(-1))
        return math.exp(nll / count), top1

    base_ppl, base_top1 = score(None)
    rows = [{"setting": "uncompressed", "perplexity": round(base_ppl, 3), "ppl_delta_pct": 0.0, "agreement": 1.0}]
    print(f"{'uncompressed':32s} ppl {base_ppl:.3f}", flush=True)
    for text_setting in args.settings:
        setting = parse(text_setting)
        ppl, top1 = score(setting)
        agree = sum(int((a == b).sum()) for a, b in zip(top1, base_top1, strict=True)) / sum(a.numel() for a in base_top1)
        rows.append({"setting": text_setting, **setting, "perplexity": round(ppl, 3), "ppl_delta_pct": round((ppl / base_ppl - 1) * 100, 2),
                     "agreement": round(agree, 4)})
        print(f"{text_setting:32s} ppl {ppl:.3f} ({(ppl / base_ppl - 1) * 100:+.1f}%) agreement {agree * 100:.1f}%", flush=True)
    if args.json:
        env = environment("python experiments/pool_window.py", sys.argv[1:] if argv is None else argv)
        setup = {"model": args.model, "windows": args.windows, "window_tokens": length, "scored_per_window": length // 2,
                 "sinks": args.sinks, "dtype": "float32", "text": "news (gensim lee_background.cor)"}
        Path(args.json).write_text(json.dumps({"environment": env, "setup": setup, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
