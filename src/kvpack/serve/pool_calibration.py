"""Static TurboQuant state for a paged KV pool: per-layer key mean and channel scale, value mean, fitted once.

kvpack's TurboQuant methods center keys and values and scale key channels by RMS^0.5 before rotating (see
`TurboQuantConfig`): SmolLM2's and Qwen2's keys share a large component that quantization error otherwise scales
with. A cache fits these on each prompt; a serving pool whose rows are written once, by any request, cannot. So they
are fitted once per model on calibration text (Python's reference docs by default: disjoint from the news text the
benchmarks score) and stored in a safetensors file that names the model it was fitted on:

    python -m kvpack.serve.pool_calibration --model ~/.cache/kvpack/hf/smollm2-135m --out smollm2-pool.safetensors

The file is refused for another model (its fingerprint: the sha256 of the model directory's config.json and the byte
sizes of its weight files) or another head layout. Keys are taken after RoPE, as the pool stores them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..codecs.turboquant import TurboQuantCodec, TurboQuantConfig
from .paged_pool import KEY_CHANNEL_SCALE

FORMAT = "kvpack-pool-calibration/1"


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 of the directory's config.json and the names and byte sizes of its weight files."""
    root = Path(model_dir).expanduser()
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for weights in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()


def fit_layer(keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """`keys, values (kv_heads, tokens, d)` of one layer -> key_mean, key_scale, value_mean `(kv_heads, d)` float32, as
    a TurboQuant codec with kvpack's centering and channel scale fits them (`TurboQuantCodec.fit`)."""
    kv_heads, _, d = keys.shape
    key = TurboQuantCodec(TurboQuantConfig(center=True, channel_scale=KEY_CHANNEL_SCALE), d, kv_heads)
    key.fit(keys[None])
    value = TurboQuantCodec(TurboQuantConfig(center=True), d, kv_heads)
    value.fit(values[None])
    return {"key_mean": key.mean, "key_scale": key.scale, "value_mean": value.mean}


def save(path: str | Path, layers: list[dict[str, torch.Tensor]], fingerprint: str, model: str, text: str, tokens: int) -> None:
    tensors = {f"layer.{i}.{name}": t.float().clone() for i, state in enumerate(layers) for name, t in state.items()}
    meta = {"format": FORMAT, "fingerprint": fingerprint, "model": model, "text": text, "tokens": str(tokens), "layers": str(len(layers))}
    save_file(tensors, str(path), metadata=meta)


def load(path: str | Path, fingerprint: str, layers: int, kv_heads: int, head_dim: int) -> list[dict[str, torch.Tensor]]:
    """Per-layer state of a calibration file, refused (ValueError naming the fix) unless it was fitted on this model."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a kvpack pool calibration file (format {meta.get('format')!r}, expected {FORMAT!r})")
    if meta.get("fingerprint") != fingerprint:
        raise ValueError(f"{path} was fitted on another model ({meta.get('model')}); fit one for this model with "
                         "`python -m kvpack.serve.pool_calibration --model MODEL_DIR --out FILE`")
    if meta.get("layers") != str(layers):
        raise ValueError(f"{path} holds {meta.get('layers')} layers, the model has {layers}: refit it for this model")
    tensors = load_file(str(path))
    out = []
    for i in range(layers):
        state = {name: tensors.get(f"layer.{i}.{name}") for name in ("key_mean", "key_scale", "value_mean")}
        if any(t is None or tuple(t.shape) != (kv_heads, head_dim) for t in state.values()):
            raise ValueError(f"{path}: layer {i} has no ({kv_heads}, {head_dim}) key_mean/key_scale/value_mean; "
                             "refit it for this model")
        out.append(state)
    return out


def calibrate(model_dir: str | Path, out: str | Path, text: str = "pydoc", tokens: int = 2048) -> None:
    """Run the model (transformers, CPU, float32) over `tokens` tokens of `text` and store every layer's fitted state."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from ..text import token_stream

    model_dir = Path(model_dir).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = token_stream(tokenizer, text, tokens).view(1, -1)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    layers = [fit_layer(layer.keys[0].float(), layer.values[0].float()) for layer in cache.layers]
    save(out, layers, model_fingerprint(model_dir), str(model_dir), text, ids.shape[1])
    print(json.dumps({"out": str(out), "layers": len(layers), "tokens": ids.shape[1], "text": text}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpack.serve.pool_calibration", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model directory vLLM serves")
    parser.add_argument("--out", required=True, help="calibration file to write (safetensors)")
    parser.add_argument("--text", default="pydoc", choices=["pydoc", "shakespeare"], help="calibration text (not the news text benchmarks score)")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    calibrate(args.model, args.out, args.text, args.tokens)


if __name__ == "__main__":
    main()
