"""Real bytes held by a cache, next to what an fp16 `DynamicCache` would hold for the same tokens.

kvpack caches report themselves (`memory_report()`). For transformers caches the tensors each layer
holds are walked: plain tensors by their storage (shared storages counted once), quantized tensor
subclasses (optimum-quanto) through `__tensor_flatten__` down to their packed data, scales and
shifts, and hqq's `(packed, meta)` pairs through the meta dict.
"""

from __future__ import annotations

import torch

_SKIP = {"device", "dtype"}


def _walk(obj, seen: set[int], depth: int = 0) -> int:
    if depth > 8:
        return 0
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(_walk(getattr(obj, n), seen, depth + 1) for n in names)
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(_walk(v, seen, depth + 1) for k, v in obj.items() if k not in _SKIP)
    if isinstance(obj, list | tuple):
        return sum(_walk(v, seen, depth + 1) for v in obj)
    return 0


def tensor_bytes(obj) -> int:
    """Bytes of every tensor storage reachable from obj (tensor, container, or a cache layer's attributes)."""
    seen: set[int] = set()
    if isinstance(obj, torch.Tensor | dict | list | tuple):
        return _walk(obj, seen)
    return sum(_walk(v, seen) for v in vars(obj).values())


def _kv_shape(config) -> tuple[int, int, int]:
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim


def memory_report(cache, config=None) -> dict:
    """{"total_bytes", "fp16_bytes", "ratio" (fp16 / total), "tokens", "bytes_per_token"} for any cache."""
    if hasattr(cache, "memory_report"):
        report = dict(cache.memory_report())
    else:
        layers = getattr(cache, "layers", [])
        total = sum(tensor_bytes(layer) for layer in layers)
        tokens = cache.get_seq_length()
        _, kv_heads, head_dim = _kv_shape(config)
        batch = next((layer.keys.shape[0] for layer in layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4), 1)
        # fp16 reference: what each layer would hold as fp16 K and V (sliding layers at their bounded size).
        fp16 = sum(2 * 2 * batch * kv_heads * head_dim * _layer_tokens(layer) for layer in layers)
        report = {"tokens": tokens, "total_bytes": total, "fp16_bytes": fp16, "ratio": fp16 / total if total else float("nan")}
    report["bytes_per_token"] = report["total_bytes"] / report["tokens"] if report["tokens"] else float("nan")
    return report


def _layer_tokens(layer) -> int:
    if not getattr(layer, "is_initialized", False):
        return 0
    if getattr(layer, "is_sliding", False):
        return layer.keys.shape[-2]
    return layer.get_seq_length()
