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
8x faster (docs/auto.md).

Allocation (`allocate`, `method_from_profile`). The additive model: the KL of a cache compressing several
(layer, side)s at once is the sum of their probes' KLs (second order, KL ~ e^T F e / 2 of the logit error, and
the errors of independent codecs do not correlate), and the mean NLL delta on text the model predicts well is
about that KL, so a perplexity target t (ppl_method / ppl_base <= 1 + t) becomes the budget

    sum over (l, side) of s(l, side, b(l, side)) <= log(1 + t).

Each (layer, side) then takes the width minimizing the cache's real bytes per token within that budget: an exact
multiple-choice knapsack, a dynamic program over integer block bytes (read from an encoded block, norms
included). docs/auto.md measures how well the assumption holds on the evaluation text.

Widths per kv head (`auto:<target>/head`). Every record also carries `head_shares`: each kv head's part of the Fisher's
prediction for its (layer, side, width) (`_head_raw`, the same E[g^2] * delta^2 summed over one head's elements; the probe
mode runs the `draws` backward passes for it too). The knapsack then takes one item per (layer, side, kv head), each head
costing its part of the block, and a layer whose heads differ stores them with the `heads` codec (kvpack/codecs/heads.py).

Profiles are JSON under `$KVPACK_PROFILE_DIR`, else `<kvpack cache>/profiles`, one per model, named after the model
(`smollm2-135m.json`) and holding its fingerprint (architecture, rotary hashes, a weight sample): a profile for
another model, or a damaged one, is refused with the file's name and the command that makes a new one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .registry import CodecSpec, LayerCodecs, MethodConfig, get_method

PROFILE_FORMAT = "kvpack-profile"
PROFILE_VERSION = 1
# Widths a (layer, side) may take: TurboQuant at 2, 3 and 4 bits, and 8 = the `int8` codec, for the few layers whose
# keys even 4 bits cannot hold (SmolLM2's layer-18 keys cost 0.032 nats at 4 bits in an 8K pydoc context, 77% of the
# whole cache's predicted loss: without an 8-bit rung no target under +4.2% was reachable there).
BITS = (2, 3, 4, 8)
INT8 = 8
SIDES = ("key", "value")
MODES = ("probe", "fisher")
BLOCK = 64  # tokens per encoded block whose bytes are the allocation's costs (the methods' block_size)
SAMPLE = 4096  # values per parameter in the weight digest
_TARGET = re.compile(r"(\d+(?:\.\d*)?|\.\d+)%")


class ProfileError(ValueError):
    """A missing, damaged or foreign calibration profile; the message names the file and the command that makes one."""


# -- targets and codecs ---------------------------------------------------------------------------------
def parse_target(arg: str) -> float:
    """'1%' -> 0.01: the allowed perplexity increase over the uncompressed cache, a fraction in (0, 1]."""
    match = _TARGET.fullmatch(arg.strip()) if isinstance(arg, str) else None
    value = float(match[1]) / 100 if match else math.nan
    if not 0 < value <= 1:
        raise ValueError(f"auto takes a perplexity target in percent, above 0 and at most 100 (auto:<number>%, e.g. auto:0.5%, auto:1%, auto:2%), got {arg!r}")
    return value


# What one width covers: a (layer, side) (`auto:1%/layer`) or a (layer, side, kv head) (`auto:1%/head`, when the profile
# splits its KL over heads: `has_head_shares`); `auto:1%` is DEFAULT_GRAIN.
GRAINS = ("layer", "head")
DEFAULT_GRAIN = "layer"


def parse_auto(arg: str) -> tuple[float, str]:
    """'1%' -> (0.01, DEFAULT_GRAIN); '1%/head' -> (0.01, "head"): the target and the grain widths are allocated at."""
    target, slash, grain = arg.partition("/") if isinstance(arg, str) else (arg, "", "")
    if slash and grain not in GRAINS:
        raise ValueError(f"auto takes auto:<target>%, auto:<target>%/layer (one width per layer and K/V) or auto:<target>%/head "
                         f"(one per kv head), got auto:{arg}")
    return parse_target(target), grain or DEFAULT_GRAIN


def target_name(target: float, grain: str = DEFAULT_GRAIN) -> str:
    return f"auto:{100 * target:g}%" + ("" if grain == DEFAULT_GRAIN else f"/{grain}")


def codec_spec(side: str, bits: int) -> CodecSpec:
    """The codec of `side` at `bits`, exactly as the fixed methods build it (`turboquant:kXvY`; `int8` for 8)."""
    method = get_method("int8" if bits == INT8 else f"turboquant:k{bits}v{bits}")
    return method.key if side == "key" else method.value


def _width_name(bits: int) -> str:
    return "int8" if bits == INT8 else f"{bits} bits"


def spec_bits(spec: CodecSpec) -> int:
    """The width `codec_spec` built `spec` for."""
    return INT8 if spec.codec == "int8" else int(spec.options["bits"])


def block_bytes(spec: CodecSpec, head_dim: int, kv_heads: int) -> int:
    """Real bytes of one encoded block of BLOCK tokens `(1, kv_heads, BLOCK, head_dim)`: every tensor it holds."""
    x = torch.randn(1, kv_heads, BLOCK, head_dim, generator=torch.Generator().manual_seed(0))
    return spec.build(head_dim, kv_heads).encode(x).nbytes()


# -- model identity and profile files -------------------------------------------------------------------
def weights_digest(model) -> str:
    """sha256 of a strided sample (SAMPLE values) of every parameter, rounded to bfloat16.

    Tells a fine-tune from its base in milliseconds (the architecture fingerprint cannot); the rounding makes a
    checkpoint loaded in float32 or bfloat16 the same model, as its profile is.
    """
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLE)].to(torch.bfloat16).cpu()
        digest.update(f"{name}{tuple(param.shape)}".encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def fingerprint(model) -> dict:
    """The saved caches' model fingerprint (kvpack.cache.serialize: type, architecture and rotary config fields) plus
    `weights_digest`. Its hashes of the rotary buffers are left out: they change with the dtype the model is cast to."""
    from .cache.serialize import model_fingerprint

    saved = model_fingerprint(model)
    return {"model_type": saved["model_type"], "config": saved["config"], "weights": weights_digest(model)}


def model_name(model) -> str:
    """The model's directory name (a registry name for registry models), else its type and a fingerprint hash."""
    path = getattr(model.config, "_name_or_path", "") or ""
    if path:
        return Path(path).name
    digest = hashlib.sha256(json.dumps(fingerprint(model), sort_keys=True).encode()).hexdigest()[:12]
    return f"{getattr(model.config, 'model_type', 'model')}-{digest}"


def calibrate_command(model) -> str:
    """The command that writes this model's profile where `auto:<target>` looks for it."""
    from .models import MODELS

    name, path = model_name(model), getattr(model.config, "_name_or_path", "") or ""
    if name in MODELS:
        return f"kvpack calibrate --model {name}"
    if path:
        return f"kvpack calibrate --model {path}"
    return f"kvpack.auto.save_profile(kvpack.auto.calibrate(model, tokenizer), {str(profile_path(model))!r})"


def profile_dir() -> Path:
    from .models import cache_dir

    return Path(os.environ.get("KVPACK_PROFILE_DIR") or cache_dir() / "profiles")


def profile_path(model) -> Path:
    return profile_dir() / f"{model_name(model)}.json"


def save_profile(profile: dict, path: str | os.PathLike) -> Path:
    """Write `profile` to `path` atomically (a reader sees the old file or the whole new one); creates its directory."""
    from .cache.serialize import _atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, (json.dumps(profile, indent=1) + "\n").encode())
    return path


def load_profile(model, path: str | os.PathLike | None = None) -> dict:
    """The profile of `model` (at `path`, else `profile_path(model)`), checked to be whole and for this very model."""
    path = Path(path) if path is not None else profile_path(model)
    command = calibrate_command(model)
    try:
        profile = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"no calibration profile for this model at {path}; make it (once, a few minutes on a CPU) with: {command}") from None
    except (OSError, ValueError) as err:
        raise ProfileError(f"{path} is not a readable kvpack calibration profile ({err}); make it again with: {command}") from err
    _check_profile(profile, path, command)
    saved, now = profile["fingerprint"], fingerprint(model)
    if saved != now:
        diffs = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        raise ProfileError(f"{path} was calibrated for another model (it differs in: {', '.join(diffs)}); make this model's with: {command}")
    return profile


def _check_profile(profile, path: Path, command: str) -> None:
    """The structure `method_from_profile` reads: every (layer, side, bits) once, finite non-negative KL."""
    fix = f"make it again with: {command}"
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{path} is not a kvpack calibration profile (no format {PROFILE_FORMAT!r}); {fix}")
    if profile.get("version") != PROFILE_VERSION:
        raise ProfileError(f"{path} has profile version {profile.get('version')!r}, this kvpack reads {PROFILE_VERSION}; {fix}")
    try:
        layers, bits = profile["layers"], [str(b) for b in profile["bits"]]
        if list(profile["bits"]) != sorted(set(profile["bits"])) or not set(profile["bits"]) <= set(BITS):
            raise ValueError(f"bits {profile['bits']!r} are not distinct widths from {BITS} in increasing order")
        seen = {(r["layer"], r["side"], str(r["bits"])): r["kl"] for r in profile["sensitivity"]}
        for side in SIDES:
            for b in bits:
                CodecSpec(profile["codecs"][side][b]["codec"], dict(profile["codecs"][side][b]["options"]))
                int(profile["block_bytes"][side][b])
        want = {(layer, side, b) for layer in layers for side in SIDES for b in bits}
        bad = sorted(k for k in want if not (isinstance(seen.get(k), float) and math.isfinite(seen[k]) and seen[k] >= 0))
        bad += [(r["layer"], r["side"], r["bits"]) for r in profile["sensitivity"] if "head_shares" in r and not _valid_shares(r["head_shares"], profile["kv_heads"])]
        fingerprint_ok = isinstance(profile["fingerprint"], dict)
    except (KeyError, TypeError, ValueError) as err:
        raise ProfileError(f"{path} is a damaged calibration profile ({type(err).__name__}: {err}); {fix}") from err
    if bad or set(seen) != want or not fingerprint_ok:
        raise ProfileError(f"{path} is a damaged calibration profile (missing or invalid sensitivities, e.g. {(bad or sorted(set(seen) ^ want))[:3]}); {fix}")


def _valid_shares(shares, heads: int) -> bool:
    """One finite non-negative share per kv head, summing to 1."""
    ok = isinstance(shares, list) and len(shares) == heads and all(isinstance(x, float | int) and math.isfinite(x) and x >= 0 for x in shares)
    return ok and abs(sum(shares) - 1) < 1e-6


# -- allocation ---------------------------------------------------------------------------------------------
def allocate(costs: Sequence[Sequence[int]], losses: Sequence[Sequence[float]], budget: float) -> list[int] | None:
    """The choice per item minimizing total cost subject to total loss <= budget; None when no choice fits.

    costs[i][j]: a non-negative integer (bytes of item i's choice j); losses[i][j]: its loss. Exact: a dynamic
    program over the total cost (in units of the costs' gcd) keeps, for every reachable total, the least loss
    that reaches it; the answer is the least total whose least loss fits (ties in cost: least loss).
    """
    if any(c < 0 or int(c) != c for row in costs for c in row):
        raise ValueError("costs must be non-negative integers")
    unit = math.gcd(*(int(c) for row in costs for c in row)) or 1
    total = sum(max(row) for row in costs) // unit
    best = torch.full((total + 1,), math.inf, dtype=torch.float64)
    best[0] = 0.0
    choices = []  # choices[i][t]: item i's choice on the best path to total t
    for cost_row, loss_row in zip(costs, losses, strict=True):
        options = torch.full((len(cost_row), total + 1), math.inf, dtype=torch.float64)
        for j, (c, loss) in enumerate(zip(cost_row, loss_row, strict=True)):
            shift = int(c) // unit
            options[j, shift:] = best[: total + 1 - shift] + loss
        best, pick = options.min(dim=0)
        choices.append(pick)
    fits = (best <= budget).nonzero()
    if not len(fits):
        return None
    t, out = int(fits[0]), []
    for i in range(len(costs) - 1, -1, -1):
        j = int(choices[i][t])
        out.append(j)
        t -= int(costs[i][j]) // unit
    return out[::-1]


def _monotone(row: list[float]) -> list[float]:
    """`row` (one cell per width, narrow to wide) with each width charged at least what any wider one measured."""
    row = list(row)
    for j in range(len(row) - 2, -1, -1):
        row[j] = max(row[j], row[j + 1])
    return row


def sensitivities(profile: dict) -> dict[tuple[int, str], list[float]]:
    """The measured KL of every (layer, side) per width (in `profile["bits"]` order), made non-increasing in the width.

    A wider code has less error, so in expectation no more KL; a measurement that says otherwise is a few heavy
    tokens (SmolLM2's layer-17 keys: 3 bits 0.0020 +- 0.0014 nats, 2 bits 0.0013), read conservatively: a width
    is charged at least what any wider one measured.
    """
    kl = {(r["layer"], r["side"], r["bits"]): r["kl"] for r in profile["sensitivity"]}
    return {(layer, side): _monotone([kl[(layer, side, b)] for b in profile["bits"]]) for layer in profile["layers"] for side in SIDES}


def has_head_shares(profile: dict) -> bool:
    """Whether every record of `profile` splits its KL over the kv heads (`head_shares`; older profiles do not, and a model
    with one kv head has nothing to split): then `auto:<target>/head` allocates widths per kv head."""
    return profile["kv_heads"] > 1 and all("head_shares" in r for r in profile["sensitivity"])


def head_sensitivities(profile: dict) -> dict[tuple[int, str, int], list[float]]:
    """The KL of every (layer, side, kv head) per width: each probe's KL times the head's share of the layer's Fisher
    prediction (`head_shares`), made non-increasing in the width as `sensitivities` does."""
    rows = {(r["layer"], r["side"], r["bits"]): r for r in profile["sensitivity"]}
    out = {}
    for layer in profile["layers"]:
        for side in SIDES:
            for h in range(profile["kv_heads"]):
                out[(layer, side, h)] = _monotone([rows[(layer, side, b)]["kl"] * rows[(layer, side, b)]["head_shares"][h] for b in profile["bits"]])
    return out


def _heads_spec(pairs: list[tuple[str, str]], groups: list[tuple[str, str]], spec: dict, side: str) -> CodecSpec:
    """A `heads` codec whose kv head h, of (key, value) widths `pairs[h]`, is in group `groups.index(pairs[h])`, stored at
    that group's `side` width."""
    codecs = [{"codec": spec[(side, pair[SIDES.index(side)])].codec, "options": dict(spec[(side, pair[SIDES.index(side)])].options)} for pair in groups]
    return CodecSpec("heads", {"heads": [groups.index(pair) for pair in pairs], "codecs": codecs})


def _layer_entries(profile: dict, chosen: dict, spec: dict, per_head: bool) -> tuple[LayerCodecs, ...]:
    """`LayerCodecs` of the chosen widths: layers with the same (key, value) pair share an entry; a layer whose kv heads
    differ takes `heads` codecs with one partition for K and V (groups of heads with the same pair, so the fused
    kernels run each group as one segment)."""
    entries: dict[str, tuple[list[int], CodecSpec, CodecSpec]] = {}
    heads = profile["kv_heads"] if per_head else 1
    for layer in profile["layers"]:
        pairs = [(chosen[(layer, "key", h)], chosen[(layer, "value", h)]) for h in range(heads)]
        groups = sorted(set(pairs))
        if len(groups) == 1:
            key, value = spec[("key", groups[0][0])], spec[("value", groups[0][1])]
        else:
            key, value = _heads_spec(pairs, groups, spec, "key"), _heads_spec(pairs, groups, spec, "value")
        name = json.dumps([key.codec, key.options, value.codec, value.options], sort_keys=True)
        entries.setdefault(name, ([], key, value))[0].append(layer)
    return tuple(LayerCodecs(tuple(layers), key, value) for _, (layers, key, value) in sorted(entries.items()))


def method_from_profile(profile: dict, target: float, grain: str = DEFAULT_GRAIN) -> MethodConfig:
    """The `auto` method for a perplexity target (a fraction): widths within log(1 + target) of KL, per (layer, side, kv
    head) when `grain` is "head" and the profile splits its KL over heads (`has_head_shares`), else per (layer, side)."""
    if grain not in GRAINS:
        raise ValueError(f"grain must be one of {GRAINS}, got {grain!r}")
    bits = [str(b) for b in profile["bits"]]
    per_head = grain == "head" and has_head_shares(profile)
    heads = profile["kv_heads"] if per_head else 1
    items = [(layer, side, h) for layer in profile["layers"] for side in SIDES for h in range(heads)]
    sens = head_sensitivities(profile) if per_head else {(layer, side, 0): row for (layer, side), row in sensitivities(profile).items()}
    # A block's tensors are per kv head (codes and norms of each head), so one head's bytes are the layer's / heads.
    costs = [[int(profile["block_bytes"][side][b]) // heads for b in bits] for _, side, _ in items]
    losses = [sens[item] for item in items]
    budget = math.log1p(target)
    picks = allocate(costs, losses, budget)
    if picks is None:
        floor = sum(min(row) for row in losses)
        raise ValueError(
            f"{target_name(target)} asks for at most {budget:.4g} nats of KL per token, but {_width_name(max(profile['bits']))} on every layer is "
            f"predicted at {floor:.4g} (about +{100 * math.expm1(floor):.2g}% perplexity) by this model's profile: use a looser target"
            + (" or the fp16 method" if INT8 in profile["bits"] else ", or recalibrate to measure the int8 rung (kvpack calibrate)")
        )
    chosen = {item: bits[j] for item, j in zip(items, picks, strict=True)}
    spec = {(side, b): CodecSpec(profile["codecs"][side][b]["codec"], dict(profile["codecs"][side][b]["options"])) for side in SIDES for b in bits}
    top = str(max(profile["bits"]))
    # Every profiled layer has an entry; the base pair (widest) would serve only layers the profile lacks, and none are.
    return MethodConfig(target_name(target, grain), spec[("key", top)], spec[("value", top)], layer_codecs=_layer_entries(profile, chosen, spec, per_head))


def auto_method(model, method: str = "auto:1%", profile: str | os.PathLike | None = None) -> MethodConfig:
    """`auto:<target>` (`/layer` or `/head` optional: `parse_auto`) for `model`, from its profile (`profile`, else the default path);
    ProfileError names the fix."""
    target, grain = parse_auto(method.removeprefix("auto:"))
    if not hasattr(model, "named_parameters"):
        raise ValueError(f"{method} reads the model's calibration profile and checks it against the weights: pass the model, not its config")
    return method_from_profile(load_profile(model, profile), target, grain)


def head_bits(spec: CodecSpec, kv_heads: int) -> list[int]:
    """The width of each kv head under `spec`: a `heads` codec's per-group widths, else `spec_bits` on every head."""
    if spec.codec != "heads":
        return [spec_bits(spec)] * kv_heads
    widths = [spec_bits(CodecSpec(e["codec"], dict(e.get("options", {})))) for e in spec.options["codecs"]]
    return [widths[g] for g in spec.options["heads"]]


def summary(method: MethodConfig, profile: dict) -> dict:
    """Of an auto method built from `profile`: mean code bits per coordinate, bytes per compressed token (all compressed
    layers, K and V; sinks and window not counted) and their ratio to fp16, how many (layer, side)s mix widths over
    their kv heads, and the KL the profile predicts (per kv head where the profile splits it, else per layer)."""
    heads = profile["kv_heads"]
    by_head = method.name.startswith("auto:") and parse_auto(method.name.removeprefix("auto:"))[1] == "head"
    per_head = head_sensitivities(profile) if by_head and has_head_shares(profile) else None
    layer_sens = sensitivities(profile)
    cells = [(layer, side, head_bits(getattr(method.for_layer(layer), side), heads)) for layer in profile["layers"] for side in SIDES]
    bits = [b for _, _, row in cells for b in row]
    nbytes = sum(profile["block_bytes"][side][str(b)] / heads for _, side, row in cells for b in row) / BLOCK
    fp16 = len(profile["layers"]) * len(SIDES) * heads * profile["head_dim"] * 2
    if per_head is None:  # allocated per layer: every head of a cell has one width
        kl = sum(layer_sens[(layer, side)][profile["bits"].index(row[0])] for layer, side, row in cells)
    else:
        kl = sum(per_head[(layer, side, h)][profile["bits"].index(b)] for layer, side, row in cells for h, b in enumerate(row))
    return {
        "mean_bits": sum(bits) / len(bits),
        "compressed_bytes_per_token": nbytes,
        "compressed_ratio_vs_fp16": fp16 / nbytes,
        "mixed_head_cells": sum(len(set(row)) > 1 for _, _, row in cells),
        "predicted_kl": kl,
    }


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
        from .text import TEXTS

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
    from .eval.generate import cache_kwargs

    logits = model(input_ids=ids.view(1, -1).to(model.device), use_cache=True, **cache_kwargs(model, cache)).logits[0]
    return F.log_softmax(logits.double(), dim=-1)  # float64: a KL of 1e-6 nats is a difference of nearly equal sums


def calibrate(model, tokenizer, config: CalibrationConfig | None = None, progress: bool = True) -> dict:
    """Measure every (full-attention layer, side, bits) probe of `model` (see the module docstring); returns the profile."""
    from ._optional import require
    from .cache.kvcache import _text_config, layer_kinds
    from .eval.generate import forward
    from .text import token_stream

    tqdm = require("tqdm.auto", "kvpack calibration (its progress bar)").tqdm
    config = config or CalibrationConfig()
    start = time.perf_counter()
    _, text = _text_config(model)
    layers = [i for i, (kind, _) in enumerate(layer_kinds(text)) if kind == "full_attention"]
    if not layers:
        raise ValueError("this model has no full-attention layer: kvpack compresses none, so there is nothing to calibrate")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    ids = token_stream(tokenizer, config.text, config.prefix + config.tokens + 1, offset=config.offset)
    prompt, scored, targets = ids[: config.prefix], ids[config.prefix : -1], ids[config.prefix + 1 :]
    specs = {(side, b): codec_spec(side, b) for side in SIDES for b in config.bits}
    from .attention import NAME, disable, enable
    from .cache.kvcache import KVCache

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
    from . import __version__

    return {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "kvpack_version": __version__, "model": model_name(model),
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


def fisher_diagonal(model, prompt: torch.Tensor, scored: torch.Tensor, draws: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, E[g^2] for the prompt's cached keys and values `(1, kv_heads, len(prompt), head_dim)`: an unbiased
    estimate of the diagonal of sum_t F_t, the Fisher information of the scored tokens' predictions w.r.t. the cache.

    Each draw samples y_t from the model's own prediction and a random sign s_t per scored token and takes the gradient
    g of sum_t s_t * log p_t(y_t) w.r.t. the cached K/V: E_y[grad grad^T] is F_t, and the signs cancel the cross terms
    between tokens, so E[g^2] = sum_t diag(F_t). One forward of the scored tokens, `draws` backward passes.
    """
    from transformers import DynamicCache

    from .eval.generate import cache_kwargs

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)  # gradients w.r.t. the cache only: no weight gradients held
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt.view(1, -1).to(model.device), use_cache=True, **cache_kwargs(model, cache))
        leaves = []
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.detach().requires_grad_(True), layer.values.detach().requires_grad_(True)
            leaves += [layer.keys, layer.values]
        with torch.enable_grad():
            logits = model(input_ids=scored.view(1, -1).to(model.device), use_cache=True, **cache_kwargs(model, cache)).logits[0]
            logp = F.log_softmax(logits.float(), dim=-1)
            gen = torch.Generator().manual_seed(seed)
            acc = [torch.zeros_like(x, dtype=torch.float32) for x in leaves]
            rows = torch.arange(len(scored), device=logp.device)
            for i in range(draws):
                y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=gen)[:, 0].to(logp.device)
                signs = (torch.randint(0, 2, (len(scored),), generator=gen) * 2 - 1).to(logp)
                grads = torch.autograd.grad((signs * logp[rows, y]).sum(), leaves, retain_graph=i < draws - 1, allow_unused=True)
                for a, g in zip(acc, grads, strict=True):
                    if g is not None:  # a sliding-window layer's evicted positions get no gradient
                        a += g.float().square() / draws
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    return [(acc[2 * i], acc[2 * i + 1]) for i in range(len(cache.layers))]


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
    from .cache.layer import KVPackLayer

    new = KVPackLayer(method.for_layer(layer), layer, old.model_config, old.rope)
    new.update(old.keys, old.values)  # kvpack attention is off: the layer compresses the prompt at once, as after a prefill
    return new
