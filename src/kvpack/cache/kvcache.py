"""`KVCache`: a transformers `Cache` whose full-attention layers are compressed by a kvpack method."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from .. import kernels
from ..allocator import auto_method
from ..primitives.validation import DEBUG
from ..registry import BUDGET_ONLY, DEFAULT_METHOD, CodecSpec, MethodConfig, apply_suffixes, get_method, split_suffixes
from ..support import layer_kinds, rope_per_layer, rotary_from_config, text_config
from . import prompt_widths, serialize
from .budget import BudgetEvent, BudgetSplit, LayerShare, MemoryBudget, PromptTarget, rematerialize
from .layer import PENDING, KVPackLayer, deepcopy_sharing
from .placement import Placement, PlacementPolicy
from .policies import build_placement
from .tracker import QualityTracker

# Architectures whose attention modules were verified to call `past_key_values.update` with
# post-RoPE keys and dispatch through AttentionInterface (transformers 5.x).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma2", "phi3", "olmo2", "smollm3", "granite")

# Makes "is this cache free? then it is mine" one step across threads (held for a few attribute reads, never while
# computing). A module lock rather than one per cache: a cache must stay deep-copyable and picklable.
_CLAIM = threading.Lock()


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Leading pad tokens per row `(batch,)` of a 2-D mask (1 = token, 0 = pad).

    Only left padding moves tokens: masked tokens elsewhere (a prompt that contains the pad id, from
    which `generate` builds its mask) stay where they are; attention masks them like any cache does.
    """
    return (attention_mask == 0).long().cumprod(-1).sum(-1)


def _watch_attention_mask(model) -> None:
    """Install (once per model) a forward pre-hook that hands each forward's attention mask to its kvpack cache."""
    if getattr(model, "_kvpack_mask_hook", False):
        return

    def hook(_module, args, kwargs):
        # A forward that broke off between a layer's update and its attention left that layer waiting; a new
        # forward starts clean, or its first untagged attention (another cache) would be refused.
        PENDING.layer = None
        cache = _cache_argument(kwargs)
        if isinstance(cache, KVCache):
            claimed = cache.claim()  # this thread's until the forward returns: another thread's forward through it is refused
            try:
                cache.begin_forward()  # before the model reads get_seq_length() for its positions
                cache.observe_attention_mask(kwargs.get("attention_mask"))
                cache.observe_input_ids(kwargs.get("input_ids", args[0] if args else None))
            except BaseException:
                if claimed:
                    cache.release()
                raise
        return None

    def release(_module, _args, kwargs, _output):
        cache = _cache_argument(kwargs)
        if isinstance(cache, KVCache):
            cache.release()

    def placed(module, _args, kwargs, _output):  # after a forward that returned: a prompt that waits for its widths gets them
        cache = _cache_argument(kwargs)
        if isinstance(cache, KVCache):
            cache.place_prompt(module)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model.register_forward_hook(release, with_kwargs=True, always_call=True)
    model.register_forward_hook(placed, with_kwargs=True)
    model._kvpack_mask_hook = True


def _cache_argument(kwargs: dict):
    # transformers >= 5.24 passes the cache as `cache` (`past_key_values` is deprecated); earlier 5.x as `past_key_values`.
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _on_cpu(model) -> bool:
    try:
        return next(model.parameters()).device.type == "cpu"
    except (AttributeError, StopIteration, TypeError):
        return False


def _resolve(method: str | MethodConfig, model_or_config) -> MethodConfig:
    """A registry name or config; `auto:<target>` reads the model's calibration profile (kvpack/auto.py)."""
    base, suffixes = split_suffixes(method) if isinstance(method, str) else (method, {})
    if suffixes:  # `name@seed=N`, `name@anchors=P%`: options of the same method
        return apply_suffixes(_resolve(base, model_or_config), suffixes)
    if isinstance(method, str) and method.partition(":")[0] == "auto":
        return auto_method(model_or_config, method)
    return get_method(method)


def _uses_positions(method: MethodConfig) -> bool:
    return any(spec.uses_positions for spec in method.specs())


def _check_codecs(method: MethodConfig, text, model_type: str) -> None:
    """Build each codec of the method once for this model's head size, so bad options fail here, not mid-generate."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for spec in method.specs():
        try:
            codec = spec.build(head_dim, kv_heads)
        except ValueError as err:
            raise ValueError(
                f"method {method.name!r} cannot run on {model_type!r} with head_dim {head_dim} and {kv_heads} kv heads: {err}. "
                "int8 and turboquant (e.g. 'turboquant:k3v3') work with any head size"
            ) from err
        if method.anchors and codec.token_multiple > 1:
            raise ValueError(
                f"method {method.name!r}: anchors need a codec that codes each token on its own, and {spec.codec!r} codes groups "
                f"of {codec.token_multiple} tokens together; drop '@anchors=' or use a per-token method such as 'turboquant:k3v2'"
            )


def _without_positions(method: MethodConfig) -> MethodConfig | None:
    """`method` with its position-reading options off (TurboQuant's `rope_center`: keys centered on the plain mean),
    for a model whose rotary embedding kvpack cannot read; None when a codec has no position-free form (Shard's
    un-RoPEd PCA keys, KVQuant's pre-RoPE keys)."""

    def plain(spec: CodecSpec | None) -> CodecSpec | None:
        if spec is None or not spec.uses_positions:
            return spec
        if spec.codec == "turboquant":
            return CodecSpec(spec.codec, {**spec.options, "rope_center": False})
        raise LookupError(spec.codec)

    try:
        tiers = tuple(dataclasses.replace(t, key=plain(t.key), value=plain(t.value)) for t in method.tiers)
        layers = tuple(dataclasses.replace(e, key=plain(e.key), value=plain(e.value)) for e in method.layer_codecs)
        sides = {a: plain(getattr(method, a)) for a in ("key", "value", "prefill_key", "prefill_value")}
    except LookupError:
        return None
    return dataclasses.replace(method, tiers=tiers, layer_codecs=layers, **sides)


@serialize.register_cache_type
class KVCache(Cache):
    """A compressed KV cache to pass as `model.generate(past_key_values=...)`.

    model_or_config: the model (its rotary parameters are read for codecs that read positions, e.g. Shard) or its
    config (those codecs then read the rotary module transformers builds from it). method: a registry name ("turboquant:k3v3",
    "kivi:2", "shard", ...) or a `MethodConfig`. Layer kinds are read from the config as
    `DynamicCache(config=...)` reads them (`layer_kinds`): sliding-window layers (Gemma3's local
    layers, every layer of a Mistral-style config with `sliding_window` and no `layer_types`) keep
    transformers' own bounded window; every full-attention layer is compressed. tracker: a
    `QualityTracker` to measure codec fidelity on flushed blocks (see `track`). budget: a `MemoryBudget`
    (bytes held after any forward; needs `kvpack.enable(model)`): past it the cache compresses further, then
    evicts its oldest blocks, whose K/V `rematerialize(model)` recomputes (kvpack/cache/budget.py). placement: the
    policies that decide where blocks go, when they move, what stays exact and what the budget evicts, by name
    (`kvpack.cache.policies.POLICIES`) or as objects, in order (kvpack/cache/placement.py); None: anchors, tiers, budget.
    """

    def __init__(
        self,
        model_or_config,
        method: str | MethodConfig = DEFAULT_METHOD,
        allow_untested: bool = False,
        tracker: QualityTracker | None = None,
        budget: MemoryBudget | None = None,
        placement: Placement | Sequence[str | PlacementPolicy] | None = None,
    ):
        config, text = text_config(model_or_config)
        model_type = getattr(text, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES and not allow_untested:
            raise ValueError(
                f"kvpack has not been verified on model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}. "
                "Pass allow_untested=True to try it (its attention must apply RoPE before calling cache.update)."
            )
        self.method = _resolve(method, model_or_config)
        self.model_config = config
        chosen = build_placement(placement)  # before any layer: a bad policy name fails here
        model = model_or_config if hasattr(model_or_config, "config") else None
        kinds = layer_kinds(text)
        if any(kind == "full_attention" for kind, _ in kinds):
            _check_codecs(self.method, text, model_type)
        needs_rope = _uses_positions(self.method)
        # From a config, the rotary module the model itself would build from it: the same inv_freq and scaling.
        ropes = rope_per_layer(model if model is not None else (rotary_from_config(text) if needs_rope else None), kinds)
        unread = [i for i, (kind, _) in enumerate(kinds) if kind == "full_attention" and ropes[i] is None]
        fallback = _without_positions(self.method) if needs_rope and unread else None
        if fallback is not None:  # e.g. GPT-J's partial rotary inside its attention module: keep the method, minus positions
            warnings.warn(
                f"{type(model).__name__ if model is not None else model_type!r} gives no rotary module kvpack can read (layer "
                f"{unread[0]} first), so method {self.method.name!r} runs without its position terms: TurboQuant keys are "
                "centered on their plain mean instead of the mean RoPE turns ('+ropemean' off), which loses some accuracy "
                "where keys carry a large constant part",
                RuntimeWarning,
                stacklevel=2,
            )
            self.method, needs_rope = fallback, False
        sliding = self.method.sliding_method()
        if sliding is not None and any(kind == "sliding_attention" for kind, _ in kinds):
            _check_codecs(sliding, text, model_type)
        layers = []
        for idx, (kind, window) in enumerate(kinds):
            if kind == "sliding_attention" and sliding is not None:
                if ropes[idx] is None and _uses_positions(sliding):
                    raise ValueError(
                        f"sliding-window layers' method {sliding.name!r} reads token positions and needs the rotary embedding of "
                        f"layer {idx}, which this {model_type!r} model does not give; pass the model itself or use '@sliding=int8'"
                    )
                layers.append(KVPackLayer(sliding, idx, config, ropes[idx]))
                layers[-1].sliding_window = window
                if placement is not None:
                    layers[-1].placement = chosen
            elif kind in ("sliding_attention", "chunked_attention"):
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))
            elif kind == "full_attention":
                if ropes[idx] is None and needs_rope:
                    source = type(model).__name__ if model is not None else f"transformers' {model_type!r} config"
                    raise ValueError(
                        f"method {self.method.name!r} reads token positions (keys without RoPE, or centered on a mean RoPE turns) and "
                        f"needs the rotary embedding of layer {idx}, but {source} gives no rotary module kvpack can read; pass the "
                        "model itself (KVCache(model, ...)) or use a method without positions (e.g. 'turboquant:k3v2', 'int8')"
                    )
                layers.append(KVPackLayer(self.method.for_layer(idx), idx, config, ropes[idx]))
                if placement is not None:
                    layers[-1].placement = chosen
            else:
                raise ValueError(f"layer {idx} of {model_type!r} has type {kind!r}; kvpack handles full and sliding attention only")
        if not any(isinstance(layer, KVPackLayer) for layer in layers):
            warnings.warn(
                f"every layer of this {model_type!r} model is sliding-window (window {kinds[0][1]}) and method {self.method.name!r} "
                "keeps the windows exact: like DynamicCache, kvpack keeps only the window, uncompressed, and compresses nothing; "
                "drop '@sliding=exact' (or name a method with '@sliding=METHOD') to code the windows",
                stacklevel=2,
            )
        super().__init__(layers=layers)
        self._journal: list[tuple[object, dict]] = []  # (layer, snapshot) of the running forward
        self._last_layer = -1
        self.tracker: QualityTracker | None = None
        if tracker is not None:
            self.track(tracker)
        self.budget: MemoryBudget | None = None
        if self.method.prompt_ratio:  # one shared record of the prompt's bytes against the method's byte target
            target = PromptTarget(self.method.prompt_ratio, tuple(layer.layer_idx for layer in self.compressed_layers()))
            for layer in self.compressed_layers():
                layer.prompt_target = target
        self.budget_events: list[BudgetEvent] = []  # every demotion, eviction and rematerialization, in order
        self.token_ids: torch.Tensor | None = None  # (batch, tokens) ids seen by forwards, kept while a budget is set
        if budget is not None:
            self.set_budget(budget)
        elif self.method.tiers and all(tier.after >= BUDGET_ONLY for tier in self.method.tiers):
            warnings.warn(
                f"method {self.method.name!r} archives blocks only when a memory budget needs their bytes, and this cache "
                "has none: every token stays in the warm tier. Pass budget=kvpack.MemoryBudget(max_bytes) (or call "
                "cache.set_budget) to bound it, or name an age boundary (e.g. tiered:1024:shard)",
                stacklevel=2,
            )
        self.prompt_widths: dict | None = None  # what `place_prompt` did: {"promoted", "demoted", "seconds"} or why not
        self._prompt_ids: torch.Tensor | None = None
        if self.method.fisher_tail:
            if model is None:
                raise ValueError(f"method {self.method.name!r} runs the model over its prompt's last tokens to place key widths, "
                                 "so it needs the model itself: KVCache(model, ...), not a config")
            for layer in self.compressed_layers():
                layer.hold_prompt = True
            for layer in self.layers:  # the Fisher pass reads the prefix's K/V as the prompt's forward left them
                if isinstance(layer, DynamicSlidingWindowLayer) and hasattr(layer, "activate_past_recording"):
                    layer.activate_past_recording()  # keeps every token until the widths are placed (place_prompt)
        if model is not None:
            _watch_attention_mask(model)
            if any(isinstance(layer, KVPackLayer) for layer in layers) and _on_cpu(model):
                kernels.available()  # builds the CPU kernels now (with a message) rather than inside the first decode step

    def track(self, tracker: QualityTracker | None) -> QualityTracker | None:
        """Report every block a compressed layer encodes to `tracker` (None stops tracking); returns it."""
        self.tracker = tracker
        for layer in self.layers:
            if isinstance(layer, KVPackLayer):
                vars(layer).pop("tracker", None)  # untracked layers keep the class default, so their attributes stay as saved
                if tracker is not None:
                    layer.tracker = tracker
        return tracker

    def compressed_layers(self) -> list[KVPackLayer]:
        """The full-attention layers kvpack compresses: what a budget splits, a prompt target sizes and `@fisher` places
        (compressed sliding-window layers hold a bounded window and are not among them)."""
        return [layer for layer in self.layers if isinstance(layer, KVPackLayer) and layer.sliding_window is None]

    def set_budget(self, budget: MemoryBudget | None) -> None:
        """Keep the compressed layers within `budget` from the next forward on (None: no limit).

        A smaller budget than what the cache holds takes effect at the next flush; tokens already evicted stay
        evicted until `rematerialize`."""
        if budget is not None and not isinstance(budget, MemoryBudget):
            raise TypeError(f"budget must be a kvpack.MemoryBudget or None, got {type(budget).__name__}")
        self.budget = budget
        layers = self.compressed_layers()
        split = BudgetSplit(budget.max_bytes, tuple(layer.layer_idx for layer in layers)) if budget is not None and layers else None
        for layer in layers:
            vars(layer).pop("budget", None)  # layers without a budget keep the class default
            if split is not None:
                layer.budget = LayerShare(split, layer.layer_idx, budget.compress_first, len(layers), self.budget_events)
                split.members[layer.layer_idx] = layer

    def rematerialize(self, model) -> int:
        """Recompute the evicted tokens' K/V with `model` and store them again (all or nothing); returns the tokens
        restored per layer. The budget must leave room for them (else BudgetError, nothing changed)."""
        self._forget_journal()
        return rematerialize(self, model)

    def place_prompt(self, model) -> None:
        """After the prompt's forward, a `fisher_tail` cache places its key widths (kvpack/cache/prompt_widths.py) and
        compresses the prompt it held exact; a batch of rows of one length gets one set of widths for all. A prompt it
        cannot place from (left-padded rows, no input ids, or too short to leave a compressed block before its tail)
        keeps the method's own widths, with a warning."""
        layers = self.compressed_layers()
        if not layers or not layers[0].hold_prompt:
            return
        method, ids = self.method, self._prompt_ids
        need = method.fisher_tail + method.sink_tokens + method.window + method.block_size
        try:
            if ids is None or layers[0].pad is not None or ids.shape[1] != self.get_seq_length() or ids.shape[1] < need:
                got = "inputs_embeds" if ids is None else "left-padded rows" if layers[0].pad is not None else f"{ids.shape[1]} tokens"
                why = f"a prompt of {need} tokens or more from input_ids, its rows unpadded (got {got})"
                warnings.warn(f"method {method.name!r} places key widths from {why}; this prompt keeps its 3-bit keys everywhere",
                              RuntimeWarning, stacklevel=2)
                self.prompt_widths = {"skipped": why}
            else:
                self.prompt_widths = prompt_widths.place(self, model, ids)
        finally:
            placed = self.prompt_widths if self.prompt_widths and "promoted" in self.prompt_widths else {"promoted": [], "demoted": []}
            # The widths become the cache's method (per-layer codecs), which a saved file keeps and a loaded one builds.
            self.method = prompt_widths.placed_method(method, placed["promoted"], placed["demoted"])
            self._prompt_ids = None
            for layer in layers:
                layer.method = self.method.for_layer(layer.layer_idx)
                layer._codecs.pop("stream_key", None)  # none is built before the first flush; a stale one would keep 3 bits
                layer.hold_prompt = False
                layer.flush()
            for layer in self.layers:
                if isinstance(layer, DynamicSlidingWindowLayer) and getattr(layer, "record_past", False):
                    layer.record_past = False  # back to the window (what its own update keeps: the last window - 1)
                    if layer.is_initialized:
                        layer.keys, layer.values = layer.keys[:, :, -layer.sliding_window + 1:], layer.values[:, :, -layer.sliding_window + 1:]

    def observe_input_ids(self, input_ids: torch.Tensor | None) -> None:
        """Record a forward's `input_ids (batch, new)` after the ids of the tokens the cache holds (budget only):
        the ids of evicted tokens are what `rematerialize` runs the model over. A prompt whose key widths wait for
        it (`fisher_tail`) keeps its ids until they are placed."""
        if self.method.fisher_tail and self.compressed_layers() and self.compressed_layers()[0].hold_prompt:
            self._prompt_ids = input_ids if input_ids is not None and input_ids.dim() == 2 else None
        if self.budget is None:
            return
        held = self.get_seq_length()
        known = self.token_ids if self.token_ids is not None and self.token_ids.shape[1] >= held else None
        if input_ids is None or input_ids.dim() != 2 or (known is None and held):
            self.token_ids = None  # a forward with inputs_embeds: ids of some tokens are unknown from here on
            return
        prev = known[:, :held] if known is not None else input_ids[:, :0]
        self.token_ids = torch.cat([prev, input_ids.to(prev.device)], dim=1) if prev.shape[0] == input_ids.shape[0] else None

    # -- all layers of one forward, or none --------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append one layer's new tokens. A rejected update undoes the layers this forward already updated.

        Each layer's state is snapshotted (references, no copies) before its update; the snapshots of
        the running forward form a journal, restarted when the layer index wraps around (a new forward).
        A forward that broke off between layers (an exception in the model between two updates) leaves
        layers of different lengths: the next forward finds them and rolls that forward back first.
        """
        claimed = self.claim()  # outside a model forward (no hook claimed it): this thread's for the update only
        try:
            if layer_idx <= self._last_layer:
                self.begin_forward()
            self._last_layer = layer_idx
            layer = self.layers[layer_idx]
            self._journal.append((layer, layer.snapshot() if isinstance(layer, KVPackLayer) else dict(vars(layer))))
            try:
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
            except Exception:
                self._rollback()
                raise
        finally:
            if claimed:
                self.release()

    def claim(self) -> bool:
        """Make this cache the calling thread's; True if it was free (the caller releases it), False if already this
        thread's. Raises RuntimeError while another thread holds it: two threads interleaving their layers' updates
        would corrupt both sequences without an error."""
        me = threading.get_ident()
        with _CLAIM:
            owner = self.__dict__.get("_owner")
            if owner == me:
                return False
            if owner is not None:
                raise RuntimeError(
                    "this KVCache is in use by another thread (a forward or update is running there): a cache holds one "
                    "sequence and cannot be shared by concurrent generations. Give each thread its own KVCache "
                    "(the model itself can be shared)."
                )
            self._owner = me
            return True

    def release(self) -> None:
        """End the calling thread's hold on this cache (a no-op where another thread holds it)."""
        with _CLAIM:
            if self.__dict__.get("_owner") == threading.get_ident():
                self._owner = None

    def begin_forward(self) -> None:
        """Start a new forward's journal, first rolling back a forward that broke off between layers."""
        lengths = {layer.get_seq_length() for layer in self.layers if getattr(layer, "is_initialized", False)}
        if len(lengths) > 1 and self._journal:
            self._rollback()
            warnings.warn(
                "the previous forward through this cache stopped between layers (an exception in the model?); its tokens were "
                "removed from every layer, so the cache holds what it held before that forward",
                RuntimeWarning,
                stacklevel=3,
            )
        self._journal, self._last_layer = [], -1

    def _rollback(self) -> None:
        for layer, state in reversed(self._journal):
            if isinstance(layer, KVPackLayer):
                layer.restore(state)
            else:
                vars(layer).clear()
                vars(layer).update(state)
        self._journal = []
        self._last_layer = -1

    def _forget_journal(self) -> None:
        """Crop, reorder and reset change every layer at once: what came before cannot be rolled back to."""
        self._journal, self._last_layer = [], -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:  # a sliding layer that dropped tokens refuses any cut: before any layer is cut
            for layer in self.layers:
                if isinstance(layer, KVPackLayer) and layer.dropped:
                    layer.truncate(layer.length + tokens_to_remove)  # raises, naming the limit
        self._forget_journal()
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self._forget_journal()
        self.token_ids = None
        super().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._forget_journal()
        self._map_ids(lambda t: t.index_select(0, beam_idx.to(t.device)))
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._forget_journal()
        self._map_ids(lambda t: t.repeat_interleave(repeats, dim=0))
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._forget_journal()
        self._map_ids(lambda t: t.index_select(0, torch.as_tensor(indices, dtype=torch.long, device=t.device)))
        super().batch_select_indices(indices)

    def _map_ids(self, fn) -> None:
        if self.token_ids is not None:
            self.token_ids = fn(self.token_ids)

    def __deepcopy__(self, memo: dict) -> KVCache:
        # A copy made while kvpack.enable is on must follow the model when it is disabled later.
        return deepcopy_sharing(self, memo, self.model_config)

    def observe_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Read each row's left padding from a forward's 2-D mask `(batch, kv_length)` (1 = token, 0 = pad).

        Called by a forward pre-hook on the model (installed by the constructor) before every forward
        that uses this cache; call it yourself before the first forward when calling the inner model
        directly. Padding is recorded on the first forward; later masks must keep it.
        """
        if attention_mask is None or attention_mask.dim() != 2:
            return
        layers = [layer for layer in self.layers if isinstance(layer, KVPackLayer)]
        if not layers:
            return
        fresh = not any(layer.length for layer in layers)
        if not fresh and attention_mask.device.type != "cpu" and not DEBUG:
            return  # checking the mask again would be a host sync per forward on an accelerator
        pad = left_padding(attention_mask)
        if fresh:
            for layer in layers:
                layer.set_padding(pad)
            return
        known = layers[0].pad if layers[0].pad is not None else torch.zeros_like(pad)
        if pad.shape != known.shape or not torch.equal(pad, known.to(pad.device)):
            raise ValueError(
                f"the attention mask's left padding {pad.tolist()} differs from the padding this cache was filled with "
                f"{known.tolist()}: kvpack takes padding from the first forward only. Use a fresh cache (or cache.reset()) "
                "for a new batch."
            )

    def save(self, path, *, token_ids: torch.Tensor | None = None, compress: bool = False) -> dict:
        """Write the compressed cache to `path` (safetensors, atomic); `compress=True` adds zstd (`kvpack[store]`).

        token_ids: the tokens the cache holds, kept in the header (`kvpack.cache.serialize.read_header`).
        Returns bytes on disk and in memory and the seconds taken. Format: docs/guide/storage.md.
        """
        return serialize.save_cache(self, path, token_ids=token_ids, compress=compress)

    @classmethod
    def load(cls, path, model) -> KVCache:
        """A cache saved by `save`, for `model`; a file for another model or a damaged file is refused."""
        return serialize.load_cache(path, model)

    def memory_report(self) -> dict:
        """Bytes actually held by the cache's tensors, per segment kind, next to an fp16 DynamicCache.

        fp16_bytes counts what transformers' DynamicCache in fp16 would hold for the same tokens
        (sliding layers at their bounded size); tokens evicted under a memory budget (`evicted_tokens`,
        per layer) are not among them. A method with older tiers also gets "archive": its oldest tier
        over all layers, `{"tier", "tokens" (per layer, the most), "bytes", "state_bytes" (its codecs'
        fitted state), "fp16_bytes", "ratio" (fp16 over bytes plus state)}`.
        """
        segments: dict[str, int] = {}
        total = fp16 = evicted = 0
        oldest = f"tier{len(self.method.tiers)}" if self.method.tiers else None
        archive = {"tier": oldest, "tokens": 0, "bytes": 0, "state_bytes": 0, "fp16_bytes": 0}
        for layer in self.layers:
            if isinstance(layer, KVPackLayer):
                if not layer.is_initialized:
                    continue
                for name, nbytes in layer.memory().items():
                    segments[name] = segments.get(name, 0) + nbytes
                    total += nbytes
                # tokens held: evicted ones hold no bytes, so they would inflate the ratio
                per_token = layer.batch * layer.kv_heads * (layer.head_dim + layer.v_head_dim) * 2
                held = layer.length - layer.evicted_tokens - layer.dropped
                if layer.sliding_window is not None:  # what transformers' sliding layer keeps, not the few yet to drop
                    held = min(held, layer.sliding_window - 1)
                fp16 += held * per_token
                evicted = max(evicted, layer.evicted_tokens)
                if oldest is not None:
                    archived = [seg for seg in list(layer.segments) if seg.kind == oldest]
                    tokens = sum(seg.length for seg in archived)
                    archive["tokens"] = max(archive["tokens"], tokens)
                    archive["bytes"] += sum(seg.nbytes() for seg in archived)
                    archive["state_bytes"] += layer.state_nbytes_by_kind().get(oldest, 0)
                    archive["fp16_bytes"] += tokens * per_token
            elif getattr(layer, "is_initialized", False):
                held = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                segments["sliding_window"] = segments.get("sliding_window", 0) + held
                total += held
                fp16 += (layer.keys.numel() + layer.values.numel()) * 2
        tokens = self.get_seq_length()
        report = {
            "method": self.method.name,
            "tokens": tokens,
            "total_bytes": total,
            "fp16_bytes": fp16,
            "ratio": fp16 / total if total else float("nan"),
            "bytes_per_token": total / tokens if tokens else float("nan"),
            "evicted_tokens": evicted,
            "segments": segments,
        }
        if oldest is not None:
            spent = archive["bytes"] + archive["state_bytes"]
            report["archive"] = archive | {"ratio": archive["fp16_bytes"] / spent if spent else float("nan")}
        return report


def _refuse_export(cache: KVCache):
    raise TypeError(
        "torch.export cannot trace a kvpack.KVCache: its segments change structure as tokens are compressed "
        "(data-dependent Python control flow). Export the model with a transformers DynamicCache or StaticCache; "
        "run kvpack eagerly (torch.compile of the model's forward works with a kvpack cache)."
    )


def _refuse_unflatten(values, context):
    raise TypeError("a kvpack.KVCache cannot be rebuilt from a flattened pytree; see the error raised when it was flattened")


# Registered so that torch.export fails with the message above instead of "Unsupported input type".
torch.utils._pytree.register_pytree_node(KVCache, _refuse_export, _refuse_unflatten, serialized_type_name="kvpack.KVCache")

