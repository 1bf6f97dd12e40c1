"""A layer's decode step as the model calls it (`attention.fused_decode`) traces whole under
`torch.compile(fullgraph=True)`: no `.item()`, `.tolist()`, host sync or Python branch on a tensor's values between the
query and the attention output, which is what capturing the step in a CUDA graph needs (docs/guide/gpu.md).

The step is traced on the path CUDA takes: every part through its `torch.library` op (which has a fake implementation),
the CPU's C++ dispatch switched off (`KVPACK_KERNELS=torch`; choosing a C++ kernel is host-side Python by design)."""

from __future__ import annotations

import pytest
import torch

from kvpack.attention import fused_decode
from kvpack.bench.attention import build_layer
from kvpack.kernels import ops, table
from kvpack.registry import DEFAULT_METHOD


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setenv("KVPACK_KERNELS", "torch")
    ops.set_backend("torch")
    torch._dynamo.reset()
    yield
    ops.set_backend(None)
    torch._dynamo.reset()


def _traced_step(method: str, n: int = 700):
    layer = build_layer(method, n, kv_heads=2, head_dim=64, batch=2, key_bias=1.0)
    q = torch.randn(2, 14, 1, 64, generator=torch.Generator().manual_seed(0))
    return layer, q, torch.compile(lambda q: fused_decode(layer, q, 0.125), fullgraph=True, backend="eager")


@pytest.mark.parametrize("method", [DEFAULT_METHOD, "turboquant:k3v2", "int8", "shard"])
def test_decode_step_traces_whole(method, device_path):
    layer, q, step = _traced_step(method)
    want = fused_decode(layer, q, 0.125)
    assert want is not None, "the step must take the fused path"
    torch.testing.assert_close(step(q), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sync", ["branch on item", "tolist"])
def test_a_host_sync_in_the_step_is_caught(sync, device_path, monkeypatch):
    """The check itself: a step that reads a value to the host (here in the merge) fails to trace whole."""
    merge = table.merge_with_exact

    def syncing(q, k, v, scale, parts):
        if sync == "tolist":
            parts = [(m + len(m.flatten().tolist()) * 0, denom, o) for m, denom, o in parts]
        elif parts[0][0].max().item() > 1e30:  # a Python branch on a tensor's value
            raise AssertionError("unreachable")
        return merge(q, k, v, scale, parts)

    monkeypatch.setattr(table, "merge_with_exact", syncing)
    _, q, step = _traced_step("int8")
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        step(q)
