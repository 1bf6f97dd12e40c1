"""Attention over a kvpack layer's segments, each read in its own compressed domain.

Every segment yields a partial softmax: its row max m, sum of exponentials l and unnormalized
weighted values o, computed by the segment's codecs (`scores`, `weighted_sum`). Partials merge
exactly by log-sum-exp, so no step rebuilds the whole K or V in floating point.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import kernels
from .cache import anchors
from .cache.layer import PENDING, KVPackLayer
from .codecs.base import group_query, ungroup
from .kernels import table

NAME = "kvpack"


class Partial:
    """Running (max, sum, weighted values) of an online softmax, all float32.

    m, l: (batch, q_heads, q_len, 1); o: (batch, q_heads, q_len, head_dim).
    """

    def __init__(self):
        self.m = self.l = self.o = None

    def add(self, scores: torch.Tensor, weighted_sum) -> None:
        """Fold in one segment's scaled, masked `scores (b, hq, lq, t)`; `weighted_sum(p)` gives p @ V."""
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows contribute nothing
        p = torch.exp(scores - m)
        total, o = p.sum(-1, keepdim=True), weighted_sum(p)
        if self.m is None:
            self.m, self.l, self.o = m, total, o
            return
        new_m = torch.maximum(self.m, m)
        a, b = torch.exp(self.m - new_m), torch.exp(m - new_m)
        self.m, self.l, self.o = new_m, self.l * a + total * b, self.o * a + o * b

    def result(self) -> torch.Tensor:
        return self.o / self.l.clamp_min(1e-30)


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor | None, cols: slice, causal_from: int | None, softcap: float | None) -> torch.Tensor:
    """Softcap, then mask columns `cols` (a slice, or a `(t,)` long tensor of key indices) of the layer's key range.

    `mask`: transformers' bool mask (b, 1|h, lq, kv_len), True = attend; None means no padding,
    and then `causal_from` (the key index of the first query) gives the causal limit.
    """
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        m = mask[..., cols]
        if m.dtype == torch.bool:
            return scores.masked_fill(~m, float("-inf"))
        return scores + m.float()
    if causal_from is not None:
        lq, t = scores.shape[-2], scores.shape[-1]
        q_idx = causal_from + torch.arange(lq, device=scores.device).unsqueeze(1)
        k_idx = (cols.start + torch.arange(t, device=scores.device) if isinstance(cols, slice) else cols.to(scores.device)).unsqueeze(0)
        return scores.masked_fill(k_idx > q_idx, float("-inf"))
    return scores


def _exact(partial: Partial, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling, mask, cols, causal_from, softcap) -> None:
    """Fold an uncompressed part (sinks, window) into the partial softmax."""
    if k.shape[2] == 0:
        return
    b, hq, lq, d = query.shape
    hk = k.shape[1]
    qg = query.float().reshape(b, hk, (hq // hk) * lq, d)
    s = (qg @ k.float().transpose(-1, -2)).reshape(b, hq, lq, -1) * scaling
    s = _apply_mask(s, mask, cols, causal_from, softcap)
    vf = v.float()
    partial.add(s, lambda p: (p.reshape(b, hk, -1, p.shape[-1]) @ vf).reshape(b, hq, lq, -1))


QUERY_CHUNK = 512  # bounds the (q_len, tokens) score block of long prefills


def segmented_attention(layer: KVPackLayer, query: torch.Tensor, mask: torch.Tensor | None, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of `query (b, q_heads, q_len, d)` over all of `layer`'s tokens -> (b, q_heads, q_len, d_v)."""
    lq = query.shape[2]
    if mask is not None and mask.shape[-1] != layer.length:
        raise ValueError(f"attention mask covers {mask.shape[-1]} keys but layer {layer.layer_idx} holds {layer.length}")
    if not layer.segments and not layer.evicted and not layer.dropped and softcap is None:  # sinks and window: every token
        return _exact_sdpa(layer, query, mask, scaling)
    outs = []
    for q0 in range(0, lq, QUERY_CHUNK):
        q1 = min(lq, q0 + QUERY_CHUNK)
        m = None if mask is None else mask[..., q0:q1, :]
        outs.append(_segmented(layer, query[:, :, q0:q1], m, scaling, softcap, layer.length - lq + q0, lq > 1))
    return torch.cat(outs, dim=2)


def _exact_sdpa(layer: KVPackLayer, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Nothing compressed yet (a prompt shorter than sinks + window + block, or the prefill itself)."""
    k = torch.cat([layer.sink_k, layer.win_k], dim=2)
    v = torch.cat([layer.sink_v, layer.win_v], dim=2)
    causal = mask is None and query.shape[2] > 1
    if causal and query.shape[2] != k.shape[2]:
        mask = torch.ones(query.shape[2], k.shape[2], dtype=torch.bool, device=k.device).tril(k.shape[2] - query.shape[2])
        causal = False
    out = torch.nn.functional.scaled_dot_product_attention(query, k.to(query.dtype), v.to(query.dtype), attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True)
    return out.float()


def _segmented(layer: KVPackLayer, query: torch.Tensor, mask, scaling: float, softcap, first_query: int, causal: bool) -> torch.Tensor:
    lq = query.shape[2]
    causal_from = first_query if (mask is None and causal) else None
    partial = Partial()
    n_sink = layer.sink_k.shape[2]
    _exact(partial, query, layer.sink_k, layer.sink_v, scaling, mask, slice(0, n_sink), causal_from, softcap)
    q_pos = layer.positions(first_query, lq)
    for seg in layer.segments:
        cols = slice(seg.start, seg.start + seg.length)
        s = seg.key_codec.scores(query, seg.keys, q_pos, layer.positions(seg.start, seg.length)) * scaling
        s = _skip_anchors(layer, seg, _apply_mask(s, mask, cols, causal_from, softcap))
        partial.add(s, lambda p, seg=seg: seg.value_codec.weighted_sum(p, seg.values))
    a = layer.anchors
    if a is not None:  # their exact rows, in place of the codes their segment left out
        _exact(partial, query, a.k, a.v, scaling, mask, a.index, causal_from, softcap)
    w = layer.win_k.shape[2]
    _exact(partial, query, layer.win_k, layer.win_v, scaling, mask, slice(layer.length - w, layer.length), causal_from, softcap)
    return partial.result()


def fused_decode(layer: KVPackLayer, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """A one-token decode step with no mask: one kernel call per part, through the kernel table (`kernels.table`).

    The parts are the exact rows (sinks, window, anchors) and each segment; a segment's entry calls its op, whose
    kernel for the query's device runs (C++ on CPU, Triton on CUDA, the torch reference otherwise); a segment whose
    codecs have no entry takes its codecs' `scores` / `weighted_sum`. Returns `(b, q_heads, 1, d_v)` float32, or None when
    the step does not qualify (longer queries need causal masking inside the window; padded batches carry a mask).
    """
    b, hq, lq, _ = query.shape
    if lq != 1 or hq // layer.kv_heads > kernels.MAX_FUSED_ROWS:
        return None
    q = group_query(query.float(), layer.kv_heads)  # (b, kv, group, d)
    a = layer.anchors
    exact = [(kind, k, v) for kind, k, v in (("sink", layer.sink_k, layer.sink_v), ("window", layer.win_k, layer.win_v)) if k.shape[2]]
    if a is not None:  # their exact rows, in place of the codes their segment leaves out (`skip`)
        exact.append((anchors.KIND, a.k, a.v))
    if layer.tracker is None and len(exact) > 1:
        # One partial over all exact rows (a few hundred at most): on a GPU each partial is ~9 kernel launches and a
        # batch-1 decode step is bound by launches (docs/guide/gpu.md); on CPU a partial's call costs ~12 us, two small
        # copies ~6 us. The adaptive boundary (`tracker`) reads each part's mass, so it keeps them apart.
        exact = [("exact", torch.cat([k for _, k, _ in exact], 2), torch.cat([v for _, _, v in exact], 2))]
    segments = []
    hidden = layer.hidden_front()  # a sliding layer's oldest held tokens, past the query's window: left out like anchors
    for i, seg in enumerate(layer.segments):
        skip = None if a is None else a.skip_in(seg)
        if i == 0 and hidden:  # a compressed sliding layer holds no anchors (`MethodConfig.sliding_method`)
            skip = _front(hidden, q.device)
        part = table.segment_partial(q, seg, scaling, _first_position(layer, seg), skip)
        segments.append(part if part is not None else _codec_partial(layer, seg, query, scaling, skip))
    if layer.tracker is None and len(exact) == 1:  # the exact rows' partial and the merge in one call (one launch on CUDA)
        return ungroup(table.merge_with_exact(q, exact[0][1], exact[0][2], scaling, segments), hq)
    parts = [table.exact_partial(q, k, v, scaling) for _, k, v in exact] + segments
    if layer.tracker is not None:  # attention mass per part, from the partials: the adaptive boundary's live signal
        layer.tracker.on_decode(layer, [kind for kind, _, _ in exact] + [seg.kind for seg in layer.segments], parts)
    return ungroup(table.merge(parts), hq)


_FRONT: dict[torch.device, torch.Tensor] = {}


def _front(n: int, device: torch.device) -> torch.Tensor:
    """Offsets `0 .. n-1` `(n,)` int64 on `device`: a view of one tensor kept per device (a step asks every sliding layer)."""
    held = _FRONT.get(device)
    if held is None or held.numel() < n:
        held = _FRONT[device] = torch.arange(max(n, 1024), device=device)
    return held[:n]


def _skip_anchors(layer: KVPackLayer, seg, s: torch.Tensor) -> torch.Tensor:
    """Scores `s (..., seg.length)` with the columns of the anchors `seg` holds at -inf (their exact copies are another part)."""
    skip = None if layer.anchors is None else layer.anchors.skip_in(seg)
    return s if skip is None else s.index_fill(-1, skip.to(s.device), float("-inf"))


def _first_position(layer: KVPackLayer, seg):
    """`() -> (b,)` RoPE position of `seg`'s first token, for the kernels of codecs that store keys without RoPE."""
    return lambda: layer.first_position(seg.start)


def _codec_partial(layer: KVPackLayer, seg, query: torch.Tensor, scaling: float, skip: torch.Tensor | None) -> table.Partial:
    """A segment without a table entry: its codecs' `scores` / `weighted_sum`, as a grouped partial, the tokens at
    offsets `skip (S,)` (anchors, a sliding layer's tokens past the window) left out."""
    q_pos = layer.positions(layer.length - query.shape[2], query.shape[2])
    s = seg.key_codec.scores(query, seg.keys, q_pos, layer.positions(seg.start, seg.length)) * scaling
    if skip is not None:
        s = s.index_fill(-1, skip.to(s.device), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    o = seg.value_codec.weighted_sum(p, seg.values)
    kv = layer.kv_heads
    return group_query(m, kv), group_query(p.sum(-1, keepdim=True), kv), group_query(o, kv)


def kvpack_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The function registered as attention implementation "kvpack".

    Keys returned by a kvpack layer's `update` carry a reference to that layer; anything else
    (sliding-window layers, other caches) goes to transformers' SDPA unchanged.
    """
    layer = getattr(key, "_kvpack_layer", None)
    if layer is None:
        _check_untagged(module)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    PENDING.layer = None
    if _attentions_requested():
        raise ValueError(
            "output_attentions=True: kvpack's attention runs on the compressed cache and never builds the attention "
            "weights; call kvpack.disable(model) to get them (attention then runs over the dequantized cache)"
        )
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer.set_positions(kwargs.get("position_ids"), query.shape[2])
    out = None
    fused_mask = attention_mask
    if attention_mask is not None and layer.sliding_window is not None and query.shape[2] == 1 and attention_mask.shape[-1] == layer.length:
        # A sliding layer's decode step: the window's mask is all True from the query's window on, and the layer holds
        # nothing older but the few tokens it has yet to drop, which the fused step leaves out (`hidden_front`); so the
        # step is the unmasked one and takes the fused kernels. Only they leave those tokens out: a step the fused
        # kernels do not take keeps the mask.
        hidden = layer.hidden_front()
        visible = layer.segments[0].start + hidden if hidden else layer.dropped
        if bool(attention_mask[..., visible:].all()):
            fused_mask = None
    if fused_mask is None and kwargs.get("softcap") is None:
        out = fused_decode(layer, query, scaling)
    if out is None:
        out = segmented_attention(layer, query, attention_mask, scaling, kwargs.get("softcap"))
    layer.observe_queries(query, scaling)
    layer.flush()
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _check_untagged(module) -> None:
    """Refuse to run SDPA over the new tokens only when a kvpack layer's update is waiting for this attention."""
    pending = getattr(PENDING, "layer", None)
    if pending is not None and pending.pending_attention and pending.layer_idx == getattr(module, "layer_idx", None):
        PENDING.layer = None
        raise RuntimeError(
            f"layer {pending.layer_idx}: the keys reaching attention lost kvpack's tag (the model's code rebuilt the tensor "
            "returned by cache.update, e.g. a cast or copy), so attention would silently see the new tokens only. "
            "Run this model without kvpack.enable (the cache then returns dequantized K/V), or report the architecture."
        )


def _attentions_requested() -> bool:
    """Whether the running forward collects attention weights (transformers' output_attentions=True)."""
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, LookupError):
        return False
    return bool(collected) and "attentions" in collected


def register() -> None:
    AttentionInterface.register(NAME, kvpack_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def enable(model) -> None:
    """Compute attention on the compressed cache for `model` (switches its attention to "kvpack").

    Layers that a kvpack cache does not manage keep exact SDPA semantics. `disable` restores the
    implementation this replaced.
    """
    register()
    current = model.config._attn_implementation
    if current != NAME:
        model._kvpack_previous_attn = current or "sdpa"
    model.set_attn_implementation(NAME)


def disable(model, implementation: str | None = None) -> None:
    """Restore the attention implementation `enable` replaced (or `implementation`, e.g. "eager").

    A model kvpack never enabled keeps its implementation.
    """
    previous = model.__dict__.pop("_kvpack_previous_attn", None)
    target = implementation or previous
    if target is None and model.config._attn_implementation == NAME:
        target = "sdpa"
    if target is not None and target != model.config._attn_implementation:
        model.set_attn_implementation(target)
