"""`KVCache`: a transformers `Cache` whose full-attention layers are compressed by a kvpack method."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..registry import DEFAULT_METHOD, MethodConfig, get_method
from .layer import KVPackLayer

# Architectures whose attention modules were verified to call `past_key_values.update` with
# post-RoPE keys and dispatch through AttentionInterface (transformers 5.x).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma2", "phi3", "olmo2", "smollm3", "granite")


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "get_text_config"):
        raise ValueError(f"KVCache needs a transformers model or PretrainedConfig, got {type(model_or_config).__name__}")
    return config, config.get_text_config(decoder=True)


def _rope_per_layer(model, text_config, n_layers: int) -> list[tuple[torch.Tensor, float] | None]:
    """(inv_freq, attention_scaling) of each layer, read from the model's rotary modules."""
    if model is None or not hasattr(model, "modules"):
        return [None] * n_layers
    emb = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]
    if not emb:
        # Gemma3-style rotary modules keep one buffer per layer type.
        emb = [m for m in model.modules() if any(n.endswith("inv_freq") for n, _ in m.named_buffers(recurse=False))]
    if not emb:
        return [None] * n_layers
    rotary = emb[0]
    types = getattr(text_config, "layer_types", None) or ["full_attention"] * n_layers
    out = []
    for layer_type in types:
        inv = getattr(rotary, f"{layer_type}_inv_freq", None)
        if inv is None:
            inv = getattr(rotary, "inv_freq", None)
        scaling = getattr(rotary, f"{layer_type}_attention_scaling", getattr(rotary, "attention_scaling", 1.0))
        out.append(None if inv is None else (inv.detach().float().clone(), float(scaling)))
    return out


class KVCache(Cache):
    """A compressed KV cache to pass as `model.generate(past_key_values=...)`.

    model_or_config: the model (preferred: its rotary parameters are read for RoPE-aware codecs)
    or its config. method: a registry name ("turboquant:k3v3", "kivi:2", "shard", ...) or a
    `MethodConfig`. Sliding-window layers (Gemma3's local layers) keep transformers' own bounded
    window; every full-attention layer is compressed.
    """

    def __init__(self, model_or_config, method: str | MethodConfig = DEFAULT_METHOD, allow_untested: bool = False):
        config, text = _text_config(model_or_config)
        model_type = getattr(text, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES and not allow_untested:
            raise ValueError(
                f"kvpack has not been verified on model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}. "
                "Pass allow_untested=True to try it (its attention must apply RoPE before calling cache.update)."
            )
        self.method = get_method(method)
        self.model_config = config
        n_layers = text.num_hidden_layers
        model = model_or_config if hasattr(model_or_config, "config") else None
        ropes = _rope_per_layer(model, text, n_layers)
        types = getattr(text, "layer_types", None) or ["full_attention"] * n_layers
        layers = []
        for idx, layer_type in enumerate(types):
            if layer_type == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=text.sliding_window))
            elif layer_type == "full_attention":
                layers.append(KVPackLayer(self.method, idx, config, ropes[idx]))
            else:
                raise ValueError(f"layer {idx} of {model_type!r} has type {layer_type!r}; kvpack handles full and sliding attention only")
        super().__init__(layers=layers)

    def memory_report(self) -> dict:
        """Bytes actually held by the cache's tensors, per segment kind, next to an fp16 DynamicCache.

        fp16_bytes counts what transformers' DynamicCache in fp16 would hold for the same tokens
        (sliding layers at their bounded size).
        """
        segments: dict[str, int] = {}
        total = fp16 = 0
        for layer in self.layers:
            if isinstance(layer, KVPackLayer):
                if not layer.is_initialized:
                    continue
                for name, nbytes in layer.memory().items():
                    segments[name] = segments.get(name, 0) + nbytes
                    total += nbytes
                fp16 += layer.batch * layer.kv_heads * layer.length * (layer.head_dim + layer.v_head_dim) * 2
            elif getattr(layer, "is_initialized", False):
                held = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                segments["sliding_window"] = segments.get("sliding_window", 0) + held
                total += held
                fp16 += (layer.keys.numel() + layer.values.numel()) * 2
        tokens = self.get_seq_length()
        return {
            "method": self.method.name,
            "tokens": tokens,
            "total_bytes": total,
            "fp16_bytes": fp16,
            "ratio": fp16 / total if total else float("nan"),
            "bytes_per_token": total / tokens if tokens else float("nan"),
            "segments": segments,
        }
