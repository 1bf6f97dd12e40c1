"""`auto:<target>`: bit widths per layer and per K/V (TurboQuant 2-4 bits, int8), allocated from a measured profile to a quality target.

Calibration (once per model: `kvpack calibrate --model NAME`, `calibrate()` here). A prompt of a calibration text
(pydoc by default: always installed, and not the evaluation's news) is prefilled once; its K/V are then stored by
one probe cache per (full-attention layer l, K or V, bits b in BITS): TurboQuant at b bits (int8 for b = 8) on that
one side of that one layer, the lossless `fp16` codec everywhere else (sinks, window and block size as the fixed TurboQuant
methods). The following tokens are scored in one forward through each cache, and the probe's sensitivity is
the mean KL divergence of the next-token distribution from the reference cache's (`fp16` on every layer):

    s(l, side, b) = mean_t KL(p_ref(. | t) || p_probe(. | t))          (nats per token)

KL is non-negative and has far less variance than a perplexity delta on the same tokens (it reads every
token's whole distribution, not the one log-probability of the token that came).

The fisher mode (`CalibrationConfig(mode="fisher")`, `_fisher_sensitivity`) replaces the 8 forwards per layer by
`draws` backward passes that estimate the Fisher diagonal of the scored tokens w.r.t. the cached K/V
(`fisher_diagonal`), which predicts every probe to second order, one key probe per layer at the narrowest width
that corrects each layer's predictions, and one measured forward per (side, width) that fixes their total: about
8x faster (docs/notes/auto.md).

The allocation that reads the profiles is `kvpack.allocator` (the cache uses it for `auto:<target>` names; its
names are also importable from here).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ._optional import require
from .allocator import (
    BITS,
    BLOCK,
    INT8,
    MODES,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    SAMPLE,
    SIDES,
    ProfileError,
    allocate,
    auto_method,
    block_bytes,
    calibrate_command,
    codec_spec,
    fingerprint,
    has_head_shares,
    head_bits,
    head_sensitivities,
    load_profile,
    method_from_profile,
    model_name,
    profile_dir,
    profile_path,
    save_profile,
    sensitivities,
    spec_bits,
    summary,
    weights_digest,
)
from .attention import NAME, disable, enable
from .cache import KVCache, KVPackLayer
from .cache.prompt_widths import fisher_diagonal
from .eval.generate import forward
from .registry import DEFAULT_GRAIN, GRAINS, CodecSpec, LayerCodecs, MethodConfig, parse_auto, parse_target, target_name
from .support import VERSION, cache_kwargs, layer_kinds, text_config
from .text import TEXTS, token_stream

# The allocation's names, importable from here as before the allocator had its own module.
__all__ = [
    "BITS", "BLOCK", "DEFAULT_GRAIN", "GRAINS", "INT8", "MODES", "PROFILE_FORMAT", "PROFILE_VERSION", "SAMPLE", "SIDES", "CalibrationConfig",
    "ProfileError", "allocate", "auto_method", "block_bytes", "calibrate", "calibrate_command", "codec_spec", "fingerprint", "fisher_diagonal",
    "has_head_shares", "head_bits", "head_sensitivities", "load_profile", "method_from_profile", "model_name", "parse_auto", "parse_target",
    "profile_dir", "profile_path", "save_profile", "sensitivities", "spec_bits", "summary", "target_name", "weights_digest",
]


# -- calibration --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationConfig:
    """text: corpus from kvpack.text; pydoc by default (in the standard library, and not the evaluation's news).
    prefix: prompt tokens in each probe cache (all but sinks and window compressed). Sensitivity grows with the
        context: the KL of SmolLM2's auto:1% (profiled at 1024) on news was 0.0094 / 0.0142 / 0.0199 nats at 1K / 2K / 4K,
        so the default is the 2K context kvpack's comparisons use; profile at your context with `--prefix`.
    tokens: tokens scored after the prompt in one forward, each reading the probe cache.
    offset: first token of the text used. bits: widths measured (TurboQuant 2/3/4, int8 as 8).

    mode: "fisher" (default: its profiles met 10 of 12 targets on three models, the probes' 9, in a tenth of the
        time) predicts them from `draws` backward passes and measures one key probe per layer and one forward
        per (side, width) (a minute; `_fisher_sensitivity`); "probe" measures every (layer, side, width) with its own
        forward (8 forwards per layer).
    draws: backward passes of the fisher mode (its estimate's noise falls as 1/sqrt(draws)).
    """

    text: str = "pydoc"
    prefix: int = 2048
    tokens: int = 256
    offset: int = 0
    bits: tuple[int, ...] = BITS
    mode: str = "fisher"
    draws: int = 4

    def __post_init__(self):
        if self.text not in TEXTS:
            raise ValueError(f"text must be one of {sorted(TEXTS)}, got {self.text!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.draws, bool) or not isinstance(self.draws, int) or self.draws < 1:
            raise ValueError(f"draws must be a positive integer, got {self.draws!r}")
        if self.prefix < 2 * BLOCK or self.tokens < 1 or self.offset < 0:
            raise ValueError(f"need prefix >= {2 * BLOCK}, tokens >= 1, offset >= 0; got {self.prefix}, {self.tokens}, {self.offset}")
        if not self.bits or any(b not in BITS for b in self.bits) or tuple(sorted(set(self.bits))) != tuple(self.bits):
            raise ValueError(f"bits must be distinct widths from {BITS} (8: int8) in increasing order, got {self.bits!r}")


def _probe(layer: int | None, side: str = "key", spec: CodecSpec | None = None) -> MethodConfig:
    """The reference (`fp16` everywhere, layer None) or `spec` on one side of one layer; defaults as the fixed methods."""
    fp16 = CodecSpec("fp16")
    if layer is None:
        return MethodConfig("auto-reference", fp16, fp16)
    pair = (spec, fp16) if side == "key" else (fp16, spec)
    return MethodConfig(f"auto-probe:{layer}:{side}", fp16, fp16, layer_codecs=(LayerCodecs((layer,), *pair),))


def _probe_cache(base, method: MethodConfig, layer: int):
    """A copy of the prefilled reference cache `base` whose `layer` holds the same prompt through `method`'s codecs.

    Exactly what a prefill through a cache of `method` holds: a prefill's attention reads the prompt as the exact
    (float16) tokens whatever the codecs, so every layer's prompt K/V are the reference's; only `layer` stores them otherwise.
    """
    return _uniform_cache(base, method, (layer,))


@torch.no_grad()
def _score(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Float64 log-probabilities `(tokens, vocab)` of `ids` read through `cache` (which the forward extends)."""
    logits = model(input_ids=ids.view(1, -1).to(model.device), use_cache=True, **cache_kwargs(model, cache)).logits[0]
    return F.log_softmax(logits.double(), dim=-1)  # float64: a KL of 1e-6 nats is a difference of nearly equal sums


def calibrate(model, tokenizer, config: CalibrationConfig | None = None, progress: bool = True) -> dict:
    """Measure every (full-attention layer, side, bits) probe of `model` (see the module docstring); returns the profile."""

    tqdm = require("tqdm.auto", "kvpack calibration (its progress bar)").tqdm
    config = config or CalibrationConfig()
    start = time.perf_counter()
    _, text = text_config(model)
    layers = [i for i, (kind, _) in enumerate(layer_kinds(text)) if kind == "full_attention"]
    if not layers:
        raise ValueError("this model has no full-attention layer: kvpack compresses none, so there is nothing to calibrate")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    ids = token_stream(tokenizer, config.text, config.prefix + config.tokens + 1, offset=config.offset)
    prompt, scored, targets = ids[: config.prefix], ids[config.prefix : -1], ids[config.prefix + 1 :]
    specs = {(side, b): codec_spec(side, b) for side in SIDES for b in config.bits}

    enabled = model.config._attn_implementation == NAME
    disable(model)  # probe layers are filled by update() outside a forward, which kvpack attention would wait on
    try:
        base = KVCache(model, _probe(None), allow_untested=True)
        forward(model, prompt, base)
        ref = _score(model, copy.deepcopy(base), scored)
        ref_nll = -ref[torch.arange(len(targets)), targets]
        measure = _probe_sensitivity if config.mode == "probe" else _fisher_sensitivity
        records = measure(model, base, ref, (prompt, scored, targets), layers, specs, config, tqdm, progress)
    finally:
        if enabled:
            enable(model)
    return {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "kvpack_version": VERSION, "model": model_name(model),
        "fingerprint": fingerprint(model), "calibration": {**asdict(config), "dtype": str(model.dtype).removeprefix("torch."),
        "reference_nll": ref_nll.mean().item(), "seconds": round(time.perf_counter() - start, 1), "torch_threads": torch.get_num_threads()},
        "layers": layers, "bits": list(config.bits), "head_dim": head_dim, "kv_heads": kv_heads,
        "codecs": {side: {str(b): {"codec": specs[(side, b)].codec, "options": specs[(side, b)].options} for b in config.bits} for side in SIDES},
        "block_bytes": {side: {str(b): block_bytes(specs[(side, b)], head_dim, kv_heads) for b in config.bits} for side in SIDES},
        "block_tokens": BLOCK, "sensitivity": records,
    }


def _kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """(tokens,) KL(p_ref || p) of float64 log-probabilities; what rounding leaves below 0 of a KL that is >= 0 is 0."""
    return F.kl_div(logp, ref, log_target=True, reduction="none").sum(-1).clamp_min(0)


def _probe_sensitivity(model, base, ref, text, layers, specs, config, tqdm, progress) -> list[dict]:
    """Every (layer, side, width) measured by its own probe cache: one forward of the scored tokens each; its split over
    the kv heads from the Fisher diagonal (`_head_raw`: `draws` backward passes more)."""
    prompt, scored, targets = text
    ref_nll = -ref[torch.arange(len(targets)), targets]
    heads = _head_raw(fisher_diagonal(model, prompt, scored, config.draws), base, layers, specs, config.bits, len(scored))
    records = []
    probes = [(layer, side, b) for layer in layers for side in SIDES for b in config.bits]
    for layer, side, b in tqdm(probes, desc="calibrating", unit="probe", disable=not progress):
        logp = _score(model, _probe_cache(base, _probe(layer, side, specs[(side, b)]), layer), scored)
        kl = _kl(logp, ref)
        nll = -logp[torch.arange(len(targets)), targets]
        records.append({
            "layer": layer, "side": side, "bits": b, "kl": kl.mean().item(), "kl_se": (kl.std() / len(kl) ** 0.5).item(),
            "nll_delta": (nll - ref_nll).mean().item(), "head_shares": _shares(heads[(layer, side, b)]),
        })
    return records


def _fisher_sensitivity(model, base, ref, text, layers, specs, config, tqdm, progress) -> list[dict]:
    """Every (layer, side, width) from the Fisher diagonal, corrected per layer by one key probe, its total per
    (side, width) from one measured forward.

    The second-order prediction of probe (l, side, b) is sum over the layer's stored elements of E[g^2] * delta^2 / 2
    per scored token, delta the codec's real error on the prompt (sinks and window included, as the layer stores them).
    It ranks the probes as their measured KL does (Spearman 0.96-0.98 on SmolLM2, Qwen2.5 and Gemma-3), with two
    faults. Its scale leaves out how a code's errors correlate within a vector and across tokens; so one forward per
    (side, width) compresses that side of every layer, and its measured KL, split over the layers in proportion to
    their predictions, is each probe's sensitivity. And a layer whose attention is saturated has almost no gradient
    yet loses much once an error moves its argmax (Qwen2.5's layer-0 keys in an 8K pydoc prompt: 0.0109 nats at 2 bits,
    predicted 0.0002); so each layer's keys are probed once at the narrowest width, and the ratio of that probe to its
    prediction scales the layer's key predictions at every width.
    """
    prompt, scored, _ = text
    steps = tqdm(total=config.draws + 1 + len(layers) + len(SIDES) * len(config.bits), desc="calibrating (fisher)", unit="pass", disable=not progress)
    fisher = fisher_diagonal(model, prompt, scored, config.draws)
    steps.update(config.draws + 1)
    heads = _head_raw(fisher, base, layers, specs, config.bits, len(scored))
    raw, predicted, probed = _corrected_predictions(model, base, ref, scored, heads, layers, config.bits, specs, steps)
    records = []
    for side in SIDES:
        for b in config.bits:
            fp16 = CodecSpec("fp16")
            pair = (specs[(side, b)], fp16) if side == "key" else (fp16, specs[(side, b)])
            method = MethodConfig(f"auto-probe:all:{side}", fp16, fp16, layer_codecs=(LayerCodecs(tuple(layers), *pair),))
            measured = _kl(_score(model, _uniform_cache(base, method, layers), scored), ref).mean().item()
            steps.update(1)
            total = sum(predicted[(layer, side, b)] for layer in layers)
            for layer in layers:
                share = predicted[(layer, side, b)] / total if total > 0 else 1 / len(layers)
                record = {"layer": layer, "side": side, "bits": b, "kl": measured * share, "fisher": raw[(layer, side, b)],
                          "predicted": predicted[(layer, side, b)], "measured_all_layers": measured, "head_shares": _shares(heads[(layer, side, b)])}
                records.append(record | ({"probe_kl": probed[layer]} if (side, b) == ("key", min(config.bits)) else {}))
    steps.close()
    return records


def _head_raw(fisher, base, layers, specs, bits, scored: int) -> dict[tuple[int, str, int], list[float]]:
    """The Fisher's second-order KL of every (layer, side, width), per kv head: sum over the head's stored elements of
    E[g^2] * delta^2 / 2 per scored token, delta the codec's real error on the prompt (sinks and window as stored)."""
    out = {}
    for layer in layers:
        old = base.layers[layer]
        exact = {"key": old.keys, "value": old.values}
        for s, side in enumerate(SIDES):
            for b in bits:
                delta = _stored(old, _probe(layer, side, specs[(side, b)]), layer).dequantized()[s].float() - exact[side].float()
                out[(layer, side, b)] = ((fisher[layer][s] * delta.square()).sum(dim=(0, 2, 3)) / (2 * scored)).tolist()
    return out


def _shares(row: list[float]) -> list[float]:
    """Each head's part of a layer's prediction (equal parts when the prediction is 0)."""
    total = sum(row)
    return [x / total for x in row] if total > 0 else [1 / len(row)] * len(row)


def _corrected_predictions(model, base, ref, scored, heads, layers, bits, specs, steps) -> tuple[dict, dict, dict]:
    """(raw, predicted, probed): the Fisher's second-order KL of every (layer, side, width) (the sum of its heads' in
    `heads`), the same with each layer's key predictions scaled by its key probe at the narrowest width over their
    prediction there, and those probes."""
    narrow = min(bits)
    raw = {cell: sum(row) for cell, row in heads.items()}
    predicted, probed = dict(raw), {}
    for layer in layers:
        probed[layer] = _kl(_score(model, _probe_cache(base, _probe(layer, "key", specs[("key", narrow)]), layer), scored), ref).mean().item()
        steps.update(1)
        if raw[(layer, "key", narrow)] > 0:
            for b in bits:
                predicted[(layer, "key", b)] = raw[(layer, "key", b)] * probed[layer] / raw[(layer, "key", narrow)]
    return raw, predicted, probed


def _uniform_cache(base, method: MethodConfig, layers: Sequence[int]):
    """A copy of the prefilled reference cache `base` whose `layers` hold the prompt through `method`'s codecs."""
    cache = copy.deepcopy(base)
    for layer in layers:
        cache.layers[layer] = _stored(cache.layers[layer], method, layer)
    cache.method = method
    return cache


def _stored(old, method: MethodConfig, layer: int):
    """A new layer holding reference layer `old`'s prompt K/V through `method`'s codecs for `layer`."""
    new = KVPackLayer(method.for_layer(layer), layer, old.model_config, old.rope)
    new.update(old.keys, old.values)  # kvpack attention is off: the layer compresses the prompt at once, as after a prefill
    return new
