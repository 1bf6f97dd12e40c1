"""`kvpack.bench.layers`: per-layer, per-side attention error of a method's codecs on a model's own prompt."""

from __future__ import annotations

import torch

from kvpack.models import tiny_random_model


def test_each_layer_and_side_loses_less_with_more_bits():
    """On every compressed layer and side, 4-bit TurboQuant errs less than 2-bit on the same prompt (the rows isolate
    each (layer, side): the other side and every other layer stay exact), and a lossless codec errs by float rounding."""
    from kvpack.bench.layers import layer_errors

    model, _ = tiny_random_model(seed=0)
    ids = torch.randint(1, 200, (1, 96), generator=torch.Generator().manual_seed(0))
    rows = layer_errors(model, ids, ["turboquant:k2v2", "turboquant:k4v4", "fp16"])
    by = {(r["method"], r["layer"], r["side"]): r for r in rows}
    layers = sorted({r["layer"] for r in rows})
    assert layers and len(rows) == 3 * 2 * len(layers)
    for li in layers:
        for side in ("key", "value"):
            narrow, wide = by["turboquant:k2v2", li, side], by["turboquant:k4v4", li, side]
            assert wide["attn_error"] < narrow["attn_error"] and wide["bits_per_value"] > narrow["bits_per_value"]
            assert by["fp16", li, side]["attn_error"] < 1e-6
