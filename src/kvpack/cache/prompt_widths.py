"""Key widths per layer placed by the prompt itself (`MethodConfig.fisher_tail`, method suffix `@fisher=N`).

A few layers' keys carry most of what 3-bit keys lose (docs/notes/auto.md, "Where each model loses"); a calibrated
profile finds them per model. This finds them per prompt, with no calibration: after the prefill, the prompt's last
N tokens are run once more with gradients w.r.t. the earlier tokens' cached K/V (one backward pass), and each
layer's keys at 2, 3 and 4 bits are predicted as the second-order KL sum_i E[g_i^2] * delta_i^2 / 2 per scored token
(`fisher_diagonal`; delta the codec's error on the keys the layer will compress). That ranks layers as the
calibrated profiles' measured KL does (Spearman 0.79-0.94 on SmolLM2-135M and Qwen2.5-0.5B,
`experiments/runtime_fisher.py`). Layers are then paired greedily, the largest predicted gain of a fourth bit against
the smallest predicted cost of a second bit less, while the gain exceeds the cost: one key bit more on one layer, one
less on another, so the bytes are the method's own. On hybrid models the sliding-window layers record the held
prompt too, so the pass reads every layer's prefix K/V from the cache rather than prefilling it again.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..allocator import codec_spec
from ..registry import CodecSpec, LayerCodecs, MethodConfig
from ..support import cache_kwargs

KEY_BITS = (2, 3, 4)  # the widths a 3-bit key layer can take: one bit less, its own, one more
# Backward passes. Each is the tail's cost again, and the pairs it misses are the marginal ones: scored by an 8-pass
# estimate, one pass over a 32-token tail keeps 89% (SmolLM2) and 99% (Qwen2.5) of the predicted gain that two over 128
# keep 96% and 99.6% of, at a third of the time (experiments/fisher_signal_cost.py).
DRAWS = 1


def fisher_diagonal(model, prompt: torch.Tensor, scored: torch.Tensor, draws: int, seed: int = 0,
                    cache: DynamicCache | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, E[g^2] for the prompt's cached keys and values `(rows, kv_heads, len(prompt), head_dim)`: an
    unbiased estimate of the diagonal of sum_t F_t, the Fisher information of the scored tokens' predictions w.r.t.
    the cache. prompt `(P,)` or `(rows, P)`, scored `(T,)` or `(rows, T)`: unpadded rows, each its own sequence.

    Each draw samples y_t from the model's own prediction and a random sign s_t per scored token and takes the gradient
    g of sum_t s_t * log p_t(y_t) w.r.t. the cached K/V: E_y[grad grad^T] is F_t, and the signs cancel the cross terms
    between tokens, so E[g^2] = sum_t diag(F_t). One forward of the scored tokens, `draws` backward passes.
    cache: a DynamicCache already holding `prompt`'s K/V (its tensors are replaced by leaves); None prefills one.
    """
    prompt, scored = prompt.view(-1, prompt.shape[-1]), scored.view(-1, scored.shape[-1])
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)  # gradients w.r.t. the cache only: no weight gradients held
    try:
        if cache is None:
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model(input_ids=prompt.to(model.device), use_cache=True, **cache_kwargs(model, cache))
        leaves = []
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.detach().requires_grad_(True), layer.values.detach().requires_grad_(True)
            leaves += [layer.keys, layer.values]
        with torch.enable_grad():
            logits = model(input_ids=scored.to(model.device), use_cache=True, **cache_kwargs(model, cache)).logits
            logp = F.log_softmax(logits.float(), dim=-1).flatten(0, 1)  # (rows * T, vocab): every scored token alike
            gen = torch.Generator().manual_seed(seed)
            acc = [torch.zeros_like(x, dtype=torch.float32) for x in leaves]
            rows = torch.arange(scored.numel(), device=logp.device)
            for i in range(draws):
                y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=gen)[:, 0].to(logp.device)
                signs = (torch.randint(0, 2, (scored.numel(),), generator=gen) * 2 - 1).to(logp)
                grads = torch.autograd.grad((signs * logp[rows, y]).sum(), leaves, retain_graph=i < draws - 1, allow_unused=True)
                for a, g in zip(acc, grads, strict=True):
                    if g is not None:  # a sliding-window layer's evicted positions get no gradient
                        a += g.float().square() / draws
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    return [(acc[2 * i], acc[2 * i + 1]) for i in range(len(cache.layers))]


def predicted_key_kl(g2: torch.Tensor, keys: torch.Tensor, layer_idx: int, tokens: int) -> dict[int, float]:
    """{bits: the second-order KL of storing `keys (rows, kv, n, d)` at bits}, `g2` their Fisher diagonal (same
    shape), per scored token of `tokens` (all rows'); the codecs are `kvpack.auto`'s key codecs (`allocator.codec_spec`)."""
    out = {}
    kv, d = keys.shape[1], keys.shape[3]
    for bits in KEY_BITS:
        codec = codec_spec("key", bits).build(d, kv, layer_idx)
        delta = codec.decode(codec.encode(keys)).float() - keys.float()
        out[bits] = float((g2 * delta.square()).sum()) / (2 * tokens)
    return out


def pairs(pred: dict[int, dict[int, float]]) -> tuple[list[int], list[int]]:
    """(promoted, demoted) layers from `pred` {layer: {bits: predicted KL}}: greedy pairs of the largest predicted gain
    of 3 -> 4 bits against the smallest predicted cost of 3 -> 2 bits, while the gain exceeds the cost; a layer is
    promoted or demoted, never both."""
    gain = {layer: p[3] - p[4] for layer, p in pred.items()}
    cost = {layer: p[2] - p[3] for layer, p in pred.items()}
    up, down = [], []
    for g, c in zip(sorted(pred, key=lambda lay: -gain[lay]), sorted(pred, key=lambda lay: cost[lay]), strict=True):
        if g in down or c in up or g == c or gain[g] <= cost[c]:
            break
        up.append(g)
        down.append(c)
    return up, down


def place(cache, model, ids: torch.Tensor, *, tail: int | None = None, draws: int = DRAWS, seed: int = 0) -> dict:
    """The layers whose keys get a fourth bit and those that give one up, from the prompt `ids (rows, P)` that `cache`
    holds uncompressed (`KVPackLayer.hold_prompt`; unpadded rows get one set of widths, from their summed signal);
    reads the cache, changes nothing. tail: the scored tokens per row (None: the method's `fisher_tail`); draws,
    seed: the Fisher estimate's backward passes and sampling seed.
    Returns {"promoted", "demoted", "seconds", "predicted": {layer: {bits: predicted KL}}}."""
    start = time.perf_counter()
    layers = cache.compressed_layers()
    method = layers[0].method
    tail = method.fisher_tail if tail is None else tail
    prefix = ids.shape[1] - tail
    held = {layer.layer_idx: (torch.cat([layer.sink_k, layer.win_k], 2), torch.cat([layer.sink_v, layer.win_v], 2)) for layer in layers}
    for idx, layer in enumerate(cache.layers):  # other layers: sliding-window ones record the whole prompt while it is held
        if idx not in held and getattr(layer, "keys", None) is not None and layer.keys.shape[-2] == ids.shape[1]:
            held[idx] = (layer.keys, layer.values)
    dynamic = None
    if len(held) == len(cache.layers):  # every layer's K/V of the prefix at hand: the prefill need not run again
        dynamic = DynamicCache(config=model.config)  # sliding-window layers keep the prefix's last window, as a prefill leaves them
        for idx in range(len(cache.layers)):
            k, v = held[idx]
            dynamic.update(k[:, :, :prefix].to(model.dtype), v[:, :, :prefix].to(model.dtype), idx)
    # else (a layer that kept only part of the prompt): fisher_diagonal prefills the prefix itself
    fisher = fisher_diagonal(model, ids[:, :prefix], ids[:, prefix:], draws, seed=seed, cache=dynamic)
    # The tail's queries read their nearest tokens exactly where a later query would find them in the window, which
    # holds `window` to `window + block_size` recent tokens as blocks leave it: those prefix tokens, the last
    # window + block_size / 2, are left out of the prediction (their gradients are the tail's, not a later token's).
    lo, hi = min(method.sink_tokens, prefix), max(prefix - method.window - method.block_size // 2, 0)
    pred = {}
    for layer in layers:
        keys = held[layer.layer_idx][0][:, :, lo:hi]
        pred[layer.layer_idx] = predicted_key_kl(fisher[layer.layer_idx][0][:, :, lo:hi], keys, layer.layer_idx, tail * ids.shape[0])
    up, down = pairs(pred)
    return {"promoted": up, "demoted": down, "seconds": time.perf_counter() - start, "predicted": pred}


def placed_method(method: MethodConfig, up: list[int], down: list[int]) -> MethodConfig:
    """`method` with its keys at 4 bits on layers `up` and 2 bits on `down` (`layer_codecs`, which a saved cache keeps),
    its widths placed: `fisher_tail` 0, the name unchanged."""
    def width(bits: int) -> CodecSpec:
        return CodecSpec(method.key.codec, {**method.key.options, "bits": bits})

    entries = tuple(LayerCodecs(tuple(layers), width(bits), method.value) for layers, bits in ((up, 4), (down, 2)) if layers)
    return replace(method, layer_codecs=entries, fisher_tail=0)
