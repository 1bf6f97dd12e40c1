"""`auto:<target>`: bit widths per layer and per K/V (TurboQuant 2-4 bits, int8), allocated from a calibration profile.

The profile is measured once per model by `kvpack.auto.calibrate` (`kvpack calibrate --model NAME`).

Allocation (`allocate`, `method_from_profile`). The additive model: the KL of a cache compressing several
(layer, side)s at once is the sum of their probes' KLs (second order, KL ~ e^T F e / 2 of the logit error, and
the errors of independent codecs do not correlate), and the mean NLL delta on text the model predicts well is
about that KL, so a perplexity target t (ppl_method / ppl_base <= 1 + t) becomes the budget

    sum over (l, side) of s(l, side, b(l, side)) <= log(1 + t).

Each (layer, side) then takes the width minimizing the cache's real bytes per token within that budget: an exact
multiple-choice knapsack, a dynamic program over integer block bytes (read from an encoded block, norms
included). docs/notes/auto.md measures how well the assumption holds on the evaluation text.

Widths per kv head (`auto:<target>/head`). Every record also carries `head_shares`: each kv head's part of the Fisher's
prediction for its (layer, side, width) (`_head_raw`, the same E[g^2] * delta^2 summed over one head's elements; the probe
mode runs the `draws` backward passes for it too). The knapsack then takes one item per (layer, side, kv head), each head
costing its part of the block, and a layer whose heads differ stores them with the `heads` codec (kvpack/codecs/heads.py).

Profiles are JSON under `$KVPACK_PROFILE_DIR`, else `<kvpack cache>/profiles`, one per model, named after the model
(`smollm2-135m.json`) and holding its fingerprint (architecture, rotary hashes, a weight sample): a profile for
another model, or a damaged one, is refused with the file's name and the command that makes a new one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .models import MODELS, cache_dir
from .registry import DEFAULT_GRAIN, GRAINS, CodecSpec, LayerCodecs, MethodConfig, get_method, parse_auto, target_name
from .support import atomic_write, model_fingerprint

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


class ProfileError(ValueError):
    """A missing, damaged or foreign calibration profile; the message names the file and the command that makes one."""


# -- targets and codecs ---------------------------------------------------------------------------------
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
    name, path = model_name(model), getattr(model.config, "_name_or_path", "") or ""
    if name in MODELS:
        return f"kvpack calibrate --model {name}"
    if path:
        return f"kvpack calibrate --model {path}"
    return f"kvpack.auto.save_profile(kvpack.auto.calibrate(model, tokenizer), {str(profile_path(model))!r})"


def profile_dir() -> Path:
    return Path(os.environ.get("KVPACK_PROFILE_DIR") or cache_dir() / "profiles")


def profile_path(model) -> Path:
    return profile_dir() / f"{model_name(model)}.json"


def save_profile(profile: dict, path: str | os.PathLike) -> Path:
    """Write `profile` to `path` atomically (a reader sees the old file or the whole new one); creates its directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(profile, indent=1) + "\n").encode())
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
