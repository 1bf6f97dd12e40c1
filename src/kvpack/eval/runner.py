"""Run every metric for a list of methods on one model and one text; one JSON-ready row per method.

Per method, three passes over the same real tokens, each with a fresh cache:
1. prefill `context` tokens (timed) -> memory report -> `fidelity_steps` teacher-forced decode steps
   with the attention outputs captured -> `decode_tokens` greedy steps (timed);
2. perplexity: prefill `context` tokens, score the next `ppl_tokens` in chunks of `chunk`, keeping
   every token's NLL;
3. needle grid: lengths x depths x kinds x trials, one fresh cache per trial.
The uncompressed `dynamic` baseline always runs first; deltas and ratios are taken against it. The
perplexity delta carries a paired bootstrap interval over the per-token NLL differences (same tokens,
both caches) and needle recall a Wilson interval (stats.py); the per-token NLLs stay out of the JSON.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from ..models import DEFAULT_MODEL
from ..text import token_stream
from . import fidelity, needle
from .memory import memory_report
from .methods import BASELINE, MethodUnavailable, attention_for, make_cache
from .perplexity import PerplexityResult, delta, delta_ci, perplexity
from .speed import measure_speed, warmup
from .stats import DEFAULT_BLOCK, BootstrapConfig

DEFAULT_COMPARE = ["fp16", "kivi:2", "turboquant:k3v3", "hf-quanto:4", "hf-hqq:4", "dynamic"]


@dataclass
class EvalConfig:
    """What to measure. needle_lengths None means (context // 4, context // 2, context).

    The needle grid: every length x depth cell gets `needle_trials` distinct needles of each kind in
    `needle_kinds` (passkey, fact). The defaults give 3 lengths x 5 depths x 2 kinds x 2 trials = 60
    trials per method: a perfect score's Wilson 95% interval is then [0.94, 1], where 3 trials give [0.44, 1].
    ppl_ci_resamples, ppl_ci_block: the paired bootstrap of the perplexity delta (stats.BootstrapConfig).
    """

    model: str = DEFAULT_MODEL
    methods: list[str] = field(default_factory=lambda: ["turboquant:k4v4"])
    context: int = 2048
    ppl_tokens: int = 2048
    chunk: int = 256
    needle_lengths: list[int] | None = None
    needle_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    needle_trials: int = 2
    needle_kinds: list[str] = field(default_factory=lambda: list(needle.KINDS))
    needle_tokens: int = 10
    decode_tokens: int = 32
    fidelity_steps: int = 8
    text: str = "news"
    dtype: str = "float32"
    seed: int = 0
    needle: bool = True
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    ppl_ci_resamples: int = 2000
    ppl_ci_block: int = DEFAULT_BLOCK

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.context < 16 or self.ppl_tokens < 1 or self.chunk < 1:
            raise ValueError(f"need context >= 16, ppl_tokens >= 1, chunk >= 1; got {self.context}, {self.ppl_tokens}, {self.chunk}")
        if not all(0.0 <= d <= 1.0 for d in self.needle_depths):
            raise ValueError(f"needle depths must be in [0, 1], got {self.needle_depths}")
        if self.needle_trials < 1:
            raise ValueError(f"needle_trials must be >= 1, got {self.needle_trials}")
        if not self.needle_kinds or any(k not in needle.KINDS for k in self.needle_kinds):
            raise ValueError(f"needle kinds must be from {', '.join(needle.KINDS)}; got {self.needle_kinds}")
        _ = self.bootstrap  # builds the bootstrap config, so bad options fail now rather than after the first method

    @property
    def lengths(self) -> list[int]:
        return self.needle_lengths or sorted({self.context // 4, self.context // 2, self.context})

    @property
    def bootstrap(self) -> BootstrapConfig:
        return BootstrapConfig(resamples=self.ppl_ci_resamples, block=self.ppl_ci_block, seed=self.seed)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def evaluate_method(model, tokenizer, method: str, cfg: EvalConfig, ids: torch.Tensor, progress: bool = True) -> dict:
    """All metrics for one method. The row's "attention" holds raw per-layer outputs (dropped before JSON)."""
    start = time.perf_counter()
    new_cache = lambda: make_cache(model, method)  # noqa: E731
    probe: dict = {}

    def after_prefill(cache):
        probe["memory"] = memory_report(cache, model.config)
        probe["attention"], logits = fidelity.capture_attention(model, cache, ids[cfg.context : cfg.context + cfg.fidelity_steps])
        return logits

    with attention_for(model, method):
        warmup(model, new_cache)
        speed = measure_speed(model, ids[: cfg.context], new_cache(), cfg.decode_tokens, after_prefill, progress)
        ppl = perplexity(model, ids, new_cache(), cfg.context, cfg.chunk, cfg.ppl_tokens, progress=progress)
        trials = (
            needle.needle_grid(model, tokenizer, new_cache, cfg.lengths, cfg.needle_depths, cfg.text, cfg.seed, cfg.needle_tokens,
                               progress, cfg.needle_trials, cfg.needle_kinds)
            if cfg.needle
            else []
        )
    mem = probe["memory"]
    recall = needle.summarize(trials)
    return {
        "model": cfg.model, "method": method, "context": cfg.context, "status": "ok",
        "tokens": mem["tokens"], "total_bytes": mem["total_bytes"], "fp16_bytes": mem["fp16_bytes"],
        "bytes_per_token": mem["bytes_per_token"], "ratio_vs_fp16": mem["fp16_bytes"] / mem["total_bytes"],
        "segments": mem.get("segments"),
        **({"archive_tokens": mem["archive"]["tokens"], "archive_ratio_vs_fp16": mem["archive"]["ratio"]} if "archive" in mem else {}),
        "ppl": ppl.ppl, "nll": ppl.nll, "ppl_tokens": ppl.tokens, "chunk": ppl.chunk, "token_nll": ppl.token_nll,
        "needle_found": recall["found"], "needle_total": recall["total"], "needle_ci": recall["ci"],
        "needle_kinds": recall["kinds"], "needle_cells": recall["cells"], "needle": [t.as_dict() for t in trials],
        **{k: v for k, v in speed.as_dict().items() if k != "prompt_tokens"},
        "attention": probe["attention"], "seconds": time.perf_counter() - start,
        "text": cfg.text, "dtype": cfg.dtype,
    }


def _with_deltas(row: dict, base: dict, cfg: EvalConfig) -> dict:
    if row["status"] != "ok" or base.get("status") != "ok":
        return row
    result = PerplexityResult(row["ppl"], row["nll"], row["ppl_tokens"], row["context"], row["chunk"], row["token_nll"])
    reference = PerplexityResult(base["ppl"], base["nll"], base["ppl_tokens"], base["context"], base["chunk"], base["token_nll"])
    row["ppl_delta_pct"], row["ppl_delta_abs"] = delta(result, reference)
    row["ppl_delta_ci"] = list(delta_ci(result, reference, cfg.bootstrap))
    row["decode_ratio"] = row["decode_tok_s"] / base["decode_tok_s"]
    layers = fidelity.compare_outputs(base["attention"], row["attention"])
    row["fidelity"] = layers
    row.update(fidelity.summarize(layers))
    return row


def run(model, tokenizer, cfg: EvalConfig, progress: bool = True, log=print, on_row=None) -> list[dict]:
    """Rows for the baseline and every method in cfg.methods (unavailable ones reported, not raised).

    `on_row(rows)` is called with the finished rows after each method, so a long comparison can
    save as it goes; every row is complete (deltas included) when it is handed over.
    """
    n_tokens = cfg.context + max(cfg.ppl_tokens, cfg.fidelity_steps) + 1
    ids = token_stream(tokenizer, cfg.text, n_tokens)
    methods = [BASELINE] + [m for m in cfg.methods if m != BASELINE]
    rows: list[dict] = []
    base: dict = {}
    for method in tqdm(methods, desc="methods", unit="method", disable=not progress):
        row = _evaluate_or_report(model, tokenizer, method, cfg, ids, progress, log)
        if method == BASELINE:
            base = row
        rows.append(_finish(_with_deltas(row, base, cfg), base, cfg))
        if on_row is not None:
            on_row(rows)
    for key in _IN_MEMORY:
        base.pop(key, None)
    return rows


def _evaluate_or_report(model, tokenizer, method: str, cfg: EvalConfig, ids: torch.Tensor, progress: bool, log) -> dict:
    try:
        row = evaluate_method(model, tokenizer, method, cfg, ids, progress)
        log(f"  {method}: done in {row['seconds']:.0f} s")
        return row
    except MethodUnavailable as err:
        log(f"  {method}: unavailable: {err}")
        return {"model": cfg.model, "method": method, "context": cfg.context, "status": f"unavailable: {err}"}
    except Exception as err:  # one broken method must not lose a long comparison; the row says what failed
        if method == BASELINE:
            raise
        log(f"  {method}: failed: {type(err).__name__}: {err}")
        return {"model": cfg.model, "method": method, "context": cfg.context, "status": f"failed: {type(err).__name__}: {err}"}


_IN_MEMORY = ("attention", "token_nll")  # tensors the deltas need, too big (or not JSON) for the rows


def _finish(row: dict, base: dict, cfg: EvalConfig) -> dict:
    """The JSON-ready copy of a row (raw attention outputs and per-token NLLs dropped; the baseline keeps its own)."""
    out = {k: v for k, v in row.items() if k not in _IN_MEMORY}
    if row is not base:
        for key in _IN_MEMORY:
            row.pop(key, None)
    out["baseline"] = row["method"] == BASELINE
    out["requested"] = row["method"] in cfg.methods
    return out


def config_dict(cfg: EvalConfig) -> dict:
    return {**asdict(cfg), "needle_lengths": cfg.lengths}
