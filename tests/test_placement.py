"""The placement policy: one object a layer consults for where blocks go, what stays exact and what moves after a flush.

The default policies (anchors, age tiers, byte budget) are covered by their own tests (test_anchors, test_tiers,
test_budget); here: that a policy written outside kvpack plugs in through `KVCache(..., placement=...)` and changes
exactly what it decides, that the composite consults its policies in order, and that bad policies are refused."""

from __future__ import annotations

import pytest
import torch

import kvpack
from kvpack.cache import KVPackLayer
from kvpack.cache.placement import Placement, PlacementPolicy
from kvpack.cache.policies import DEFAULT_POLICIES, POLICIES, build_placement
from kvpack.codecs.kivi import KiviCodec, KiviConfig
from kvpack.models import tiny_random_model
from kvpack.registry import get_method
from kvpack.support import cache_kwargs


class _Cfg:
    _attn_implementation = "sdpa"


class StraightToArchive(PlacementPolicy):
    """Every block leaving the window goes to the method's oldest tier at once (no warm stay)."""

    def route(self, layer, kind, start, n):
        return None if kind == "prefill" else [(f"tier{len(layer.method.tiers)}", n)]


class KeepFirstOfEachBlock(PlacementPolicy):
    """The first token of every flushed run stays exact."""

    def __init__(self):
        self.flushes = []

    def keep_exact(self, layer, start, n, first):
        self.flushes.append(start)
        return torch.zeros(1, dtype=torch.long)


def _fill(layer: KVPackLayer, prompt: int, steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ks, vs = [torch.randn(1, 2, prompt, 64, generator=g)], [torch.randn(1, 2, prompt, 64, generator=g)]
    layer.update(ks[0], vs[0])
    layer.flush()
    for _ in range(steps):
        ks.append(torch.randn(1, 2, 1, 64, generator=g))
        vs.append(torch.randn(1, 2, 1, 64, generator=g))
        layer.update(ks[-1], vs[-1])
        layer.flush()
    return torch.cat(ks, 2), torch.cat(vs, 2)


def test_a_routing_policy_decides_where_every_block_goes():
    default = KVPackLayer(get_method("tiered:512"), 0, _Cfg())
    _fill(default, 300, 200)
    assert {seg.kind for seg in default.segments} == {"stream"}  # 500 tokens: none is past the 512-token boundary yet

    custom = KVPackLayer(get_method("tiered:512"), 0, _Cfg())
    custom.placement = build_placement([StraightToArchive(), "tiers", "budget"])
    k, v = _fill(custom, 300, 200)
    assert [seg.kind for seg in custom.segments] == ["tier1"]
    assert custom.segments[0].key_codec.config.bits == 2  # the archive's codec, not the warm tier's 4 bits
    # Read back, those tokens carry the archive's 2-bit error, not the warm tier's 4-bit one.
    seg = custom.segments[0]
    span = slice(seg.start, seg.start + seg.length)
    got_k, _ = custom.dequantized()
    err = (got_k[:, :, span].float() - k[:, :, span]).norm() / k[:, :, span].norm()
    two, four = (KiviCodec(KiviConfig(bits=bits, axis="channel"), 64, 2) for bits in (2, 4))
    err2, err4 = ((c.decode(c.encode(k[:, :, span])) - k[:, :, span]).norm() / k[:, :, span].norm() for c in (two, four))
    assert 0.8 * err2 < err < 1.2 * err2 and err > 3 * err4, (err, err2, err4)


def test_an_exact_token_policy_replaces_the_anchor_choice():
    method = get_method("turboquant:k3v2")  # no anchors of its own
    layer = KVPackLayer(method, 0, _Cfg())
    policy = KeepFirstOfEachBlock()
    layer.placement = build_placement([policy, "tiers", "budget"])
    k, v = _fill(layer, 300, 128)
    starts = [int(i) for part in layer.anchors.parts for i in part.index]
    # By hand: 4 sinks and a 64-token window; the prompt's flush compresses tokens 4..235, and the 128 decode steps
    # push out one 64-token block, from 300 (the window flushes when it holds a block beyond its 64 tokens).
    assert policy.flushes == [4, 236, 300] and starts == policy.flushes
    got_k, _ = layer.dequantized()
    # Held exact (in the layer's fp16 exact dtype), where their neighbours carry 3-bit codes' error.
    assert torch.equal(got_k[:, :, starts].float(), k[:, :, starts].half().float())
    neighbours = [i + 1 for i in starts]
    assert (got_k[:, :, neighbours].float() - k[:, :, neighbours]).abs().max() > 0.05


def test_without_the_anchor_policy_a_method_with_anchors_keeps_none():
    model, _ = tiny_random_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 400), generator=torch.Generator().manual_seed(0))
    kvpack.enable(model)
    try:
        caches = {}
        for name, placement in (("default", None), ("no anchors", ["tiers", "budget"])):
            caches[name] = kvpack.KVCache(model, "turboquant:k3v2@anchors=2%", placement=placement)
            model(ids, use_cache=True, **cache_kwargs(model, caches[name]))
    finally:
        kvpack.disable(model)
    with_anchors = [layer.anchors for layer in caches["default"].compressed_layers()]
    assert all(a is not None and a.count > 0 for a in with_anchors)
    assert all(layer.anchors is None for layer in caches["no anchors"].compressed_layers())


def test_the_composite_takes_the_first_answer_and_runs_every_after_flush_hook():
    calls = []

    class Recorder(PlacementPolicy):
        def __init__(self, name, runs=None):
            self.name, self.runs = name, runs

        def route(self, layer, kind, start, n):
            calls.append(("route", self.name))
            return self.runs

        def after_flush(self, layer, flushed):
            calls.append(("after", self.name))

    placement = Placement([Recorder("a"), Recorder("b", [("stream", 64)]), Recorder("c", [("tier1", 64)])])
    assert placement.route(None, "stream", 0, 64) == [("stream", 64)]
    placement.after_flush(None, True)
    assert calls == [("route", "a"), ("route", "b"), ("after", "a"), ("after", "b"), ("after", "c")]
    assert Placement([]).route(None, "stream", 0, 64) == [("stream", 64)]  # nobody decides: the kind asked for


def test_a_route_that_loses_tokens_is_refused():
    class Lossy(PlacementPolicy):
        def route(self, layer, kind, start, n):
            return [(kind, n - 1)]

    with pytest.raises(ValueError, match="must cover the 64 tokens"):
        Placement([Lossy()]).route(None, "stream", 0, 64)


def test_bad_placements_are_refused_with_the_registered_names():
    with pytest.raises(ValueError, match="unknown placement policy 'by-age'; registered: anchors, tiers, budget"):
        build_placement(["by-age"])
    with pytest.raises(TypeError, match="PlacementPolicy objects"):
        Placement([object()])
    with pytest.raises(TypeError, match="sequence of policy names"):
        build_placement("tiers")
    model, _ = tiny_random_model()
    with pytest.raises(ValueError, match="unknown placement policy"):
        kvpack.KVCache(model, "turboquant:k3v2", placement=["nope"])


def test_every_registered_policy_is_in_the_default_order():
    assert set(DEFAULT_POLICIES) == set(POLICIES)
    assert all(issubclass(cls, PlacementPolicy) for cls in POLICIES.values())
