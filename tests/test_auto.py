"""Per-layer codecs in MethodConfig (what `auto:<target>` builds): validation, the layer's config, the data path."""

from __future__ import annotations

import json

import pytest
import torch

import kvpack
from kvpack.codecs.turboquant import TurboQuantCodec
from kvpack.models import tiny_random_model
from kvpack.registry import CodecSpec, LayerCodecs, MethodConfig, get_method
from kvpack.serve import blocks

TQ2 = CodecSpec("turboquant", {"bits": 2, "center": True})
INT8 = CodecSpec("int8")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_random_model(seed=0)
    return model, tokenizer


# -- per-layer codecs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layers, match", [((), "non-empty"), ([1], "non-empty tuple"), ((-1,), "non-negative"), ((True,), "non-negative"), ((1.0,), "non-negative")]
)
def test_layer_codecs_refuse_bad_layers(layers, match):
    with pytest.raises(ValueError, match=match):
        LayerCodecs(layers, TQ2, TQ2)


def test_layer_codecs_refuse_a_layer_listed_twice_and_non_specs():
    with pytest.raises(ValueError, match=r"layers \[1, 3\] more than once"):
        MethodConfig("m", INT8, INT8, layer_codecs=(LayerCodecs((0, 1, 3), TQ2, TQ2), LayerCodecs((3, 1), INT8, TQ2)))
    with pytest.raises(TypeError, match="LayerCodecs.value must be a CodecSpec"):
        LayerCodecs((0,), TQ2, "int8")
    with pytest.raises(TypeError, match="tuple of LayerCodecs"):
        MethodConfig("m", INT8, INT8, layer_codecs=[LayerCodecs((0,), TQ2, TQ2)])


def test_for_layer_replaces_key_and_value_of_listed_layers_only():
    method = MethodConfig("m", INT8, INT8, window=32, layer_codecs=(LayerCodecs((1, 4), TQ2, INT8),))
    assert method.for_layer(4) == MethodConfig("m", TQ2, INT8, window=32)
    assert method.for_layer(0) == MethodConfig("m", INT8, INT8, window=32)
    plain = get_method("int8")
    assert plain.for_layer(3) is plain


@torch.no_grad()
def test_cache_runs_each_layer_with_its_own_codecs(tiny):
    """Layer 1's keys read back exactly as an independent TurboQuant codec (layer 1's seed) encodes the same tokens."""
    model, _ = tiny
    method = MethodConfig("m", INT8, INT8, layer_codecs=(LayerCodecs((1,), TQ2, INT8),))
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = kvpack.KVCache(model, method)
    exact = kvpack.KVCache(model, "fp16")
    model(ids, past_key_values=cache)
    model(ids, past_key_values=exact)
    assert [type(layer._codecs["stream_key"]).__name__ for layer in cache.layers] == ["Int8Codec", "TurboQuantCodec"]
    seg = cache.layers[1].segments[0]
    middle = exact.layers[1].keys[:, :, seg.start : seg.start + seg.length]  # fp16 codec: the exact tokens
    codec = TurboQuantCodec(TQ2.config, 64, 2, layer_idx=1)
    assert torch.equal(cache.layers[1].keys[:, :, seg.start : seg.start + seg.length], codec.decode(codec.encode(middle)).to(middle.dtype))
    assert cache.layers[1].segments[0].key_run.nbytes() < cache.layers[0].segments[0].key_run.nbytes()  # 2-bit codes + norms < int8


def test_block_files_code_each_layer_with_its_own_codecs():
    k, v = torch.randn(2, 2, 100, 2, 64, generator=torch.Generator().manual_seed(0))  # (layers, tokens, kv_heads, head_dim)
    method = MethodConfig("m", INT8, INT8, layer_codecs=(LayerCodecs((1,), TQ2, INT8),))
    tensors, metadata = blocks.encode_kv(k, v, method)
    keys, _ = blocks.decode_kv(tensors, metadata, method)
    head, middle, _ = json.loads(metadata["split"])
    part = k[1, head : head + middle].permute(1, 0, 2).unsqueeze(0)  # (1, kv_heads, middle, head_dim)
    codec = TurboQuantCodec(TQ2.config, 64, 2, layer_idx=1)
    codec.fit(part)
    assert torch.equal(keys[1, head : head + middle], codec.decode(codec.encode(part))[0].permute(1, 0, 2))
    with pytest.raises(blocks.BlockMismatch):
        blocks.decode_kv(tensors, metadata, MethodConfig("m", INT8, INT8))
