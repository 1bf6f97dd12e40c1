"""The torch attention paths hold bounded temporaries, make no host syncs, and copy codec state to a device once.

Measured, not assumed. `Allocations` (a `TorchDispatchMode`) records every tensor an op allocates (an output
that shares no storage with the op's inputs: views are free) while `scores` / `weighted_sum` read a 40K-token
segment on the torch path (`KVPACK_KERNELS=torch`, what every codec runs off the CPU); the same instrument on
the codec's own whole-segment `decode` shows it catches a segment-sized temporary. On the `meta` device any
host sync raises (a meta tensor has no value to read), and `DeviceCopies` counts each call's CPU -> device copies.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvpack.codecs import base, concat_packed, kvquant, subspace
from kvpack.codecs.base import chunked_scores, chunked_sum
from kvpack.registry import CodecSpec

torch.set_num_threads(1)

# Every codec family of the torch path, with the variants whose temporaries differ (byte-table vs unpack
# centroids, the QJL residual, KIVI's two axes); kvquant-key's weighted_sum and kvquant-value's scores are
# `Codec`'s defaults.
CODECS = [
    ("turboquant", {"bits": 3}),
    ("turboquant", {"bits": 2, "qjl": True, "center": True, "channel_scale": 1.0}),
    ("polarquant-int4", {}),
    ("qjl", {}),
    ("kivi", {"bits": 2, "axis": "channel"}),
    ("kivi", {"bits": 4, "axis": "token"}),
    ("int8", {}),
    ("fp16", {}),
    ("kvquant-key", {}),
    ("kvquant-value", {}),
    ("subspace", {}),
    ("heads", {"heads": [1, 0], "codecs": [{"codec": "turboquant", "options": {"bits": 3, "center": True}}, {"codec": "int8", "options": {}}]}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in CODECS]
# Shard's codecs decode through the fused CPU kernel, but run this torch math on other devices. Their own tests
# hold them to decode; the small-cap equality test below does not apply (PCA's RoPE-identity contraction is a
# fixed rows x d x rank temporary, larger than that test's cap, not one that grows with the segment).
WITH_SHARD = [*CODECS, ("pca", {}), ("vq", {"n_iter": 2})]
WITH_SHARD_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in WITH_SHARD]
STATELESS = {"kivi", "int8", "fp16"}  # nothing fitted or seeded to move


class Allocations(TorchDispatchMode):
    """The largest tensor, in elements, that any op allocates while the mode is on (inputs and views excluded)."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.peak = max(self.peak, t.numel())
        return out


class DeviceCopies(TorchDispatchMode):
    """Ops that take a CPU tensor and return a tensor on another device (host-to-device copies on an accelerator)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        on_cpu = any(t.device.type == "cpu" for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        if on_cpu and any(t.device.type != "cpu" for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            self.ops.append(str(func))
        return out


def peak(fn) -> int:
    with Allocations() as mode:
        fn()
    return mode.peak


def copies(fn) -> list[str]:
    with DeviceCopies() as mode:
        fn()
    return mode.ops


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("KVPACK_KERNELS", "torch")


# -- the bound, on a long segment -----------------------------------------------------------------------
@pytest.mark.parametrize("name,options", WITH_SHARD, ids=WITH_SHARD_IDS)
def test_torch_paths_allocate_at_most_one_chunk_of_a_40k_segment(name, options, torch_path):
    b, kv, d, group, tokens = 1, 2, 128, 4, 40 * 1024
    codec = CodecSpec(name, options).build(d, kv)
    block = codec.encode(torch.randn(b, kv, 1024, d, generator=torch.Generator().manual_seed(0)))
    packed = concat_packed([block] * (tokens // 1024))  # 40K tokens for 1 block of encode time
    q = torch.randn(b, kv * group, 1, d)
    probs = torch.softmax(torch.randn(b, kv * group, 1, tokens), -1)
    # Control: the instrument sees the whole-segment float rebuild the torch paths used to make (2.5-5x the bound).
    assert peak(lambda: codec.decode(packed)) >= b * kv * tokens * d > 2 * base.CHUNK_ELEMENTS
    # The scores themselves, (b, q_heads, q_len, tokens) = 328K entries, are well inside the bound.
    assert peak(lambda: codec.scores(q, packed)) <= base.CHUNK_ELEMENTS
    assert peak(lambda: codec.weighted_sum(probs, packed)) <= base.CHUNK_ELEMENTS


# -- chunked results equal the unchunked math ---------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("name,options", CODECS, ids=IDS)
def test_chunked_scores_and_weighted_sums_equal_decode_then_matmul(name, options, backend, monkeypatch):
    """Awkward sizes (head_dim 80, batch 2, 3 query tokens, GQA 4, 224 tokens in 2-3 chunks, the last partial)
    against the codec's own `decode` and plain matmuls; with "auto" the CPU kernels run where they apply."""
    monkeypatch.setenv("KVPACK_KERNELS", backend)
    b, kv, d, group, q_len, tokens = 2, 2, 80, 4, 3, 224
    # 80 tokens per chunk for QJL (m = 2d signs per token), 145-160 for the others. Not smaller: a product with
    # per-head state broadcast over the batch (QJL's S q, b * kv * d * m = 51200) is a temporary of fixed size too.
    limit = b * kv * 2 * d * 80
    for module, attr in ((base, "CHUNK_ELEMENTS"), (kvquant, "_CHUNK_ELEMENTS"), (subspace, "_CHUNK_ELEMENTS")):
        monkeypatch.setattr(module, attr, limit)
    codec = CodecSpec(name, options).build(d, kv)
    gen = torch.Generator().manual_seed(1)
    packed = codec.encode(torch.randn(b, kv, tokens, d, generator=gen) * 2 + 0.5)
    q = torch.randn(b, kv * group, q_len, d, generator=gen)
    probs = torch.softmax(torch.randn(b, kv * group, q_len, tokens, generator=gen), -1)
    dense = codec.decode(packed).repeat_interleave(group, 1)  # transformers' repeat_kv
    ref_scores, ref_sum = q @ dense.mT, probs @ dense
    scores = codec.scores(q, packed)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-5 * ref_scores.abs().max().item())
    torch.testing.assert_close(codec.weighted_sum(probs, packed), ref_sum, rtol=1e-4, atol=1e-5 * ref_sum.abs().max().item())
    if backend == "torch":  # the chunks really were small: one chunk's temporaries, not the segment's
        assert peak(lambda: codec.scores(q, packed)) <= max(limit, scores.numel())
        assert peak(lambda: codec.weighted_sum(probs, packed)) <= limit < peak(lambda: codec.decode(packed))


def test_chunks_tile_the_segment_and_one_chunk_is_passed_whole():
    """The helpers' contract: chunks cover [0, tokens) in order at multiples of `multiple`; a block that fits is
    handed over as the same object, unsliced (what every 64-token decode-time block gets)."""
    codec = CodecSpec("kivi", {"bits": 2, "axis": "channel", "group_size": 32}).build(64, 2)
    packed = codec.encode(torch.randn(1, 2, 320, 64))
    like = torch.zeros(1, 2, 4, 64)
    seen = []

    def part(block, start, stop):
        seen.append((block is packed, start, stop, block.num_tokens))
        return like.new_full((1, 2, 4, stop - start), float(start))

    out = chunked_scores(part, packed, like, width=64)
    assert seen == [(True, 0, 320, 320)] and torch.equal(out, torch.zeros(1, 2, 4, 320))
    seen.clear()
    out = chunked_scores(part, packed, like, width=64, multiple=32, limit=2 * 64 * 100)  # 100 tokens -> 96
    assert seen == [(False, 0, 96, 96), (False, 96, 192, 96), (False, 192, 288, 96), (False, 288, 320, 32)]
    assert torch.equal(out[0, 0, 0], torch.tensor([0.0] * 96 + [96.0] * 96 + [192.0] * 96 + [288.0] * 32))
    probs = torch.rand(1, 2, 4, 320)
    total = chunked_sum(lambda pc, block: pc.sum(-1, keepdim=True), probs, packed, width=64, multiple=32, limit=2 * 64 * 100)
    torch.testing.assert_close(total, probs.sum(-1, keepdim=True))


# -- no host syncs, state copied to the device once ---------------------------------------------------
@pytest.mark.parametrize("name,options", WITH_SHARD, ids=WITH_SHARD_IDS)
def test_torch_paths_run_on_another_device_with_state_copied_once(name, options, torch_path):
    """Fitted on the CPU, read on `meta`: no host sync anywhere (it would raise), the codec's state copied on the
    first call only."""
    meta = torch.device("meta")
    codec = CodecSpec(name, options).build(64, 2)
    packed = codec.encode(torch.randn(1, 2, 64, 64)).map_tensors(lambda t: t.to(meta))
    q, probs = torch.randn(1, 8, 1, 64, device=meta), torch.rand(1, 8, 1, 64, device=meta)

    def step():
        assert codec.scores(q, packed).shape == (1, 8, 1, 64) and codec.weighted_sum(probs, packed).shape == (1, 8, 1, 64)

    first = copies(step)
    assert (len(first) == 0) == (name in STATELESS), first
    assert copies(step) == []


def test_device_copy_is_refreshed_when_the_state_changes(torch_path):
    meta = torch.device("meta")
    codec = CodecSpec("turboquant", {"bits": 3, "center": True}).build(64, 2)
    packed = codec.encode(torch.randn(1, 2, 64, 64)).map_tensors(lambda t: t.to(meta))
    q = torch.randn(1, 8, 1, 64, device=meta)
    codec.scores(q, packed)
    held = codec._on("mean", codec.mean, meta)
    assert codec._on("mean", codec.mean, meta) is held and copies(lambda: codec.scores(q, packed)) == []
    codec.load_state_dict({"mean": torch.ones(2, 64)})
    assert copies(lambda: codec.scores(q, packed)) == ["aten._to_copy.default"]  # the new mean, nothing else
    assert codec._on("mean", codec.mean, meta) is not held
