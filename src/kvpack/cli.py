"""`kvpack` command line: demo, eval, compare, calibrate (plus `models` and `methods` listings).

Options come from flags or a TOML file (`--config run.toml`): top-level keys apply to every
command, a `[compare]` / `[eval]` / `[demo]` table to that command only; flags win over the file.
Keys are the flag names with underscores: model, methods, context, ppl_tokens, needle_lengths, ...

Every argument (method names, counts, output paths, optional packages) is checked before the
model loads: a bad one ends the command with one line on stderr and exit status 2. A method that
fails mid-run gets a `failed: ...` row, the run goes on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from ._optional import MissingDependency, install_hint, missing_message, require
from .models import DEFAULT_MODEL, MODELS, TINY_MODEL, list_models

# The commands import the rest of kvpack inside their functions, on purpose: the evaluation modules need the `eval`
# extra (tqdm, matplotlib), whose absence each command reports as one line naming the install, after the arguments
# are checked; at module level the import itself would fail first, with a traceback.

# The demo runs in CI: one needle length, three depths, one needle of each kind per cell (6 trials per method,
# ~2.5 s each at 1K tokens on 2 CPU cores); `eval` and `compare` default to the full grid.
DEMO = {"context": 2048, "ppl_tokens": 512, "needle_lengths": [1024], "needle_depths": [0.0, 0.5, 1.0], "needle_trials": 1,
        "decode_tokens": 16, "fidelity_steps": 4}


def _list(value, cast=str) -> list | None:
    if value is None:
        return None
    if not isinstance(value, str | list | tuple):
        raise ValueError(f"expected a comma-separated string or a list, got {value!r}")
    items = value.split(",") if isinstance(value, str) else value
    return [cast(v.strip() if isinstance(v, str) else v) for v in items if str(v).strip()]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with defaults for these options")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registry name {list_models()}, a local HF directory or a .gguf file")
    p.add_argument("--context", type=int, default=2048, help="tokens prefilled into the cache before anything is measured")
    p.add_argument("--text", default="news", choices=["news", "shakespeare", "pydoc"], help="real text corpus")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model weights and activations")
    p.add_argument("--ppl-tokens", type=int, default=2048, help="tokens scored after the prefix")
    p.add_argument("--chunk", type=int, default=256, help="scored tokens per forward")
    p.add_argument("--needle-lengths", help="comma-separated prompt lengths (default: context/4,context/2,context)")
    p.add_argument("--needle-depths", default="0,0.25,0.5,0.75,1", help="comma-separated needle depths in [0, 1] (0: first tokens, 1: last)")
    p.add_argument("--needle-trials", type=int, default=2, help="distinct needles of each kind per (length, depth) cell")
    p.add_argument("--needle-kinds", default="passkey,fact", help="comma-separated: passkey (a 5-digit number), fact (a sentence, scored on its key word)")
    p.add_argument("--no-needle", dest="needle", action="store_false", help="skip needle-in-a-haystack")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens timed for decode speed")
    p.add_argument("--fidelity-steps", type=int, default=8, help="decode steps compared for attention fidelity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default); 1 is steadier on a shared machine")
    p.add_argument("--json", help="write {config, rows} JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvpack", description="Compressed KV caches: evaluate methods on real models, offline.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the default model with and without compression: memory, perplexity, needle, speed")
    _common(demo)
    demo.add_argument("--method", default=None, help="kvpack method (default: kvpack.DEFAULT_METHOD)")
    demo.set_defaults(**{k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in DEMO.items()})
    ev = sub.add_parser("eval", help="every metric for one method vs the uncompressed cache")
    _common(ev)
    ev.add_argument("--method", default=None, help="kvpack method or peer (default: kvpack.DEFAULT_METHOD)")
    cmp_ = sub.add_parser("compare", help="several methods and peers side by side: table, JSON rows, PNG plots")
    _common(cmp_)
    cmp_.add_argument("--methods", default="fp16,kivi:2,turboquant:k3v3,hf-quanto:4,hf-hqq:4,dynamic", help="comma-separated")
    cmp_.add_argument("--plot", help="PNG path: Pareto plot and needle heatmaps")
    cmp_.add_argument("--draws", type=int, default=1,
                      help="rotation draws per method that draws at random (@seed=0..N-1), reported as the mean and spread")
    cal = sub.add_parser("calibrate", help="measure a model's per-layer K/V sensitivity once, for the auto:<target> methods")
    cal.add_argument("--config", help="TOML file with defaults for these options")
    cal.add_argument("--model", default=DEFAULT_MODEL, help=f"registry name {list_models()}, a local HF directory or a .gguf file")
    cal.add_argument("--out", help="profile path (default: <model>.json in $KVPACK_PROFILE_DIR, else ~/.cache/kvpack/profiles, "
                                   "where auto:<target> looks)")
    cal.add_argument("--text", default="pydoc", choices=["pydoc", "shakespeare", "news"], help="calibration text (news is the evaluation's)")
    cal.add_argument("--prefix", type=int, default=2048, help="prompt tokens in each probe cache (the context the profile is for)")
    cal.add_argument("--tokens", type=int, default=256, help="tokens scored through each probe cache")
    cal.add_argument("--offset", type=int, default=0, help="first token of the text used")
    cal.add_argument("--mode", default="fisher", choices=["fisher", "probe"],
                     help="fisher: backward passes predict most cells (about a minute); probe: one forward per (layer, K or V, width), 10x longer")
    cal.add_argument("--draws", type=int, default=4, help="backward passes of --mode fisher")
    cal.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model weights and activations")
    cal.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    cal.add_argument("--quiet", action="store_true", help="no progress bar")
    sub.add_parser("models", help="list registry models")
    sub.add_parser("methods", help="list kvpack methods and peers")
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    return next(a for a in parser._subparsers._group_actions if a.dest == "command").choices[command]


def _read_toml(path: str) -> dict:
    """The TOML file's table; ValueError with one line for a missing or malformed file."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = require("tomli", "reading --config TOML files on Python 3.10")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {path}: not valid TOML ({err})") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over the `--config` file over defaults; exits with status 2 and one line on any bad argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        subparser = _subparser(parser, args.command)
        try:
            data = _read_toml(args.config)
        except (ValueError, MissingDependency) as err:
            subparser.error(str(err))
        section = data.get(args.command, {})
        values = {k: v for k, v in data.items() if not isinstance(v, dict)} | section
        known = {a.dest for a in subparser._actions}
        unknown = sorted(k for k in (k.replace("-", "_") for k in values) if k not in known)
        if unknown:
            subparser.error(f"unknown keys in {args.config}: {unknown}")
        subparser.set_defaults(**{k.replace("-", "_"): v for k, v in values.items()})
        args = parser.parse_args(argv)
    checks = {"demo": validate, "eval": validate, "compare": validate, "calibrate": validate_calibrate}
    if args.command in checks:
        try:
            checks[args.command](args, _subparser(parser, args.command))
        except (ValueError, MissingDependency) as err:
            _subparser(parser, args.command).error(str(err))
    return args


# -- validation: everything that can be known before the model loads --------------------------------
def _check_types(args, subparser: argparse.ArgumentParser) -> None:
    """Values from a TOML file bypass argparse's `type` and `choices`: check them like flags."""
    for action in subparser._actions:
        value, flag = getattr(args, action.dest, None), (action.option_strings or [action.dest])[-1]
        if value is None or action.dest in ("help", "config"):
            continue
        expected = (int, float) if action.type is float else int
        if action.type in (int, float) and (isinstance(value, bool) or not isinstance(value, expected)):
            raise ValueError(f"{flag} must be {'an integer' if action.type is int else 'a number'}, got {value!r}")
        if action.nargs == 0 and isinstance(action.const, bool) and not isinstance(value, bool):  # store_true / store_false
            raise ValueError(f"{action.dest} must be true or false, got {value!r}")
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{flag} must be one of {', '.join(action.choices)}, got {value!r}")


def _numbers(flag: str, value, cast) -> list:
    try:
        return _list(value, cast) or []
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be comma-separated {'integers' if cast is int else 'numbers'}, got {value!r}") from None


def check_method(name: str) -> None:
    """ValueError naming the problem (and the valid names) unless `name` is a kvpack method or a peer."""
    from .peers import PEERS, is_peer
    from .registry import METHODS, get_method, list_methods, split_suffixes

    if is_peer(name):
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}; peers: {', '.join(PEERS)}")
        return
    base, _ = split_suffixes(name)  # `@anchors=`, `@window=`, `@seed=`: raises for a malformed one
    family, _, arg = base.partition(":")
    if family == "auto":  # its profile is checked once the model is loaded (it is per model)
        from .auto import parse_auto

        parse_auto(arg)
        return
    if family not in METHODS:
        raise ValueError(f"unknown method {name!r}; kvpack methods: {', '.join(list_methods())}; peers: {', '.join(PEERS)}")
    get_method(name)  # raises for bad options, e.g. kivi:3 or int8@seed=1


def _check_writable(flag: str, path: str, suffixes: tuple[str, ...] | None = None) -> None:
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    if suffixes is not None and target.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {path}: unsupported file type {target.suffix or '(none)'!r}; use one of {', '.join(suffixes)}")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")


def _check_model(name: str) -> None:
    path = Path(name).expanduser()
    if name == TINY_MODEL or name in MODELS or (path / "config.json").is_file() or path.is_file() and path.suffix == ".gguf":
        return
    raise ValueError(f"unknown model {name!r}: expected one of {', '.join(list_models())}, a local HF model directory (with config.json) or a .gguf file")


def validate(args, subparser: argparse.ArgumentParser) -> None:
    """Check every argument of demo/eval/compare before any work starts; ValueError / MissingDependency with one line."""
    _check_types(args, subparser)
    for flag, value, low in [
        ("--context", args.context, 16), ("--ppl-tokens", args.ppl_tokens, 1), ("--chunk", args.chunk, 1),
        ("--decode-tokens", args.decode_tokens, 1), ("--fidelity-steps", args.fidelity_steps, 1),
        ("--threads", args.threads, 0), ("--seed", args.seed, 0), ("--needle-trials", args.needle_trials, 1),
        ("--draws", getattr(args, "draws", 1), 1),
    ]:
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    lengths = _numbers("--needle-lengths", args.needle_lengths, int)
    if any(n < 1 for n in lengths):
        raise ValueError(f"--needle-lengths must be positive token counts, got {args.needle_lengths!r}")
    depths = _numbers("--needle-depths", args.needle_depths, float)
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"--needle-depths must be numbers in [0, 1], got {args.needle_depths!r}")
    try:
        methods = _list(args.methods) if args.command == "compare" else [args.method] if args.method else []
    except ValueError as err:
        raise ValueError(f"--methods: {err}") from None
    if args.command == "compare" and not methods:
        from .peers import PEERS
        from .registry import list_methods

        raise ValueError(f"--methods is empty; give comma-separated names from: {', '.join(list_methods())}, {', '.join(PEERS)}")
    for name in methods:
        check_method(name)
    _check_model(args.model)
    require("tqdm.auto", "kvpack's evaluation (progress bars)")
    from .eval.needle import KINDS  # after the check above: the evaluation modules need tqdm

    try:
        kinds = _list(args.needle_kinds)
    except ValueError as err:
        raise ValueError(f"--needle-kinds: {err}") from None
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"--needle-kinds must be comma-separated names from {', '.join(KINDS)}, got {args.needle_kinds!r}")
    if args.json:
        _check_writable("--json", args.json)
    if getattr(args, "plot", None):
        require("matplotlib", "--plot")
        from matplotlib.backend_bases import FigureCanvasBase

        _check_writable("--plot", args.plot, tuple("." + ext for ext in FigureCanvasBase.get_supported_filetypes()))


def validate_calibrate(args, subparser: argparse.ArgumentParser) -> None:
    """Check every argument of calibrate before the model loads."""
    from .auto import CalibrationConfig

    _check_types(args, subparser)
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    CalibrationConfig(text=args.text, prefix=args.prefix, tokens=args.tokens, offset=args.offset, mode=args.mode, draws=args.draws)
    _check_model(args.model)
    require("tqdm.auto", "kvpack calibrate (progress bar)")
    if args.out:
        _check_writable("--out", args.out, (".json",))


def _eval_config(args, methods: list[str]):
    from .eval.runner import EvalConfig

    return EvalConfig(
        model=args.model, methods=methods, context=args.context, ppl_tokens=args.ppl_tokens, chunk=args.chunk,
        needle_lengths=_list(args.needle_lengths, int), needle_depths=_list(args.needle_depths, float), needle=args.needle,
        needle_trials=args.needle_trials, needle_kinds=_list(args.needle_kinds),
        decode_tokens=args.decode_tokens, fidelity_steps=args.fidelity_steps, text=args.text, dtype=args.dtype, seed=args.seed,
        threads=args.threads,
    )


def _load(cfg):
    from . import models

    with install_hint(f"loading {cfg.model}"):
        try:
            return models.load_model(cfg.model, dtype=cfg.torch_dtype)
        except ImportError as err:
            if type(err) is ImportError and "gguf" in str(err).lower():  # transformers' own words name no install line
                raise MissingDependency(missing_message("gguf", f"loading the GGUF model {cfg.model}")) from err
            raise


def _run(args, methods: list[str]) -> tuple[object, list[dict]]:
    import torch

    from .eval.runner import run

    cfg = _eval_config(args, methods)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    model, tokenizer = _load(cfg)
    print(f"loaded {cfg.model} in {time.perf_counter() - start:.1f} s; {cfg.context}-token context, {cfg.text} text, {cfg.dtype}", flush=True)
    _check_profiles(model, methods)
    # Rows are saved after every method, so an interrupted comparison keeps what it measured.
    save = (lambda rows: _write_json(args, cfg, rows, quiet=True)) if args.json else None
    return cfg, run(model, tokenizer, cfg, progress=not args.quiet, log=lambda s: print(s, flush=True), on_row=save)


def _check_profiles(model, methods: list[str]) -> None:
    """auto:<target> methods resolve now (ValueError naming `kvpack calibrate ...`), not after the baseline has run."""
    from .auto import auto_method

    for name in methods:
        if name.partition(":")[0] == "auto":
            auto_method(model, name)


def _write_json(args: argparse.Namespace, cfg, rows: list[dict], quiet: bool = False, draws: list[dict] | None = None) -> None:
    """`{config, env, rows}` to `args.json` (if given), and `draws` (each method's mean over rotation draws) when there
    are any; `env` names the command line as the user typed it."""
    path = args.json
    if not path:
        return
    from .bench.env import environment
    from .eval.runner import config_dict

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # The stamp (git SHA, versions, CPU, threads, command line) is what makes a result reproducible.
    out = {"config": config_dict(cfg), "environment": environment("kvpack", args.argv), "rows": rows} | ({"draws": draws} if draws else {})
    Path(path).write_text(json.dumps(out, indent=1))
    if not quiet:
        print(f"wrote {path}")


def _default_method(method: str | None) -> str:
    from .registry import DEFAULT_METHOD

    return method or DEFAULT_METHOD


def cmd_demo(args) -> int:
    method = _default_method(args.method)
    start = time.perf_counter()
    cfg, rows = _run(args, [method])
    from .eval.report import format_table

    print()
    print(format_table(rows))
    base, row = rows[0], rows[-1]
    print()
    if row.get("status") != "ok":
        print(f"{method} could not run: {row['status']}")
        return 1
    print(f"kvpack demo: {cfg.model}, {row['tokens']} tokens of real news text in the cache, method {method}")
    print(f"  memory:     {base['total_bytes'] / 2**20:.1f} MiB uncompressed ({cfg.dtype}) -> {row['total_bytes'] / 2**20:.1f} MiB "
          f"({row['ratio_vs_fp16']:.2f}x smaller than fp16, {base['total_bytes'] / row['total_bytes']:.2f}x smaller than the {cfg.dtype} cache)")
    ci = row.get("ppl_delta_ci")  # paired bootstrap over the scored tokens: how far 512 tokens pin the delta down
    interval = f", 95% interval {ci[0]:+.1f}% to {ci[1]:+.1f}%" if ci else ""
    print(f"  perplexity: {base['ppl']:.3f} -> {row['ppl']:.3f} ({row['ppl_delta_pct']:+.2f}%{interval}) over {row['ppl_tokens']} tokens "
          "that read the compressed cache")
    print(f"  needle:     {row['needle_found']}/{row['needle_total']} found (uncompressed {base['needle_found']}/{base['needle_total']})")
    print(f"  decode:     {row['decode_tok_s']:.1f} tok/s (uncompressed {base['decode_tok_s']:.1f} tok/s, timed one after the other; "
          "a side-by-side speed ratio: python -m kvpack.bench.decode)")
    print(f"  attention:  worst layer cosine {row['cosine_min']:.4f} vs uncompressed")
    print(f"total {time.perf_counter() - start:.0f} s")
    _write_json(args, cfg, rows)
    return 0


def cmd_eval(args) -> int:
    from .eval.report import format_table

    cfg, rows = _run(args, [_default_method(args.method)])
    print()
    print(format_table(rows))
    _write_json(args, cfg, rows)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def expand_draws(methods: list[str], draws: int) -> list[str]:
    """Each kvpack method that draws at random (rotations, sketches, k-means starts) at `@seed=0 .. draws-1`, unless its
    name already picks a draw; other methods and peers once."""
    from .registry import SEED_SUFFIX, get_method

    out = []
    for name in methods:
        if draws > 1 and SEED_SUFFIX not in name:
            try:
                get_method(name).with_seed(0)
            except (ValueError, KeyError):  # draws nothing at random, a peer, or auto:<target> (resolved with the model)
                pass
            else:
                out += [f"{name}{SEED_SUFFIX}{seed}" for seed in range(draws)]
                continue
        out.append(name)
    return out


def cmd_compare(args) -> int:
    from .eval.report import draw_summaries, format_draw_summaries, format_table, plot

    cfg, rows = _run(args, expand_draws(_list(args.methods), args.draws))
    print()
    print(format_table(rows))
    summaries = draw_summaries(rows)
    if summaries:
        print()
        print(format_draw_summaries(summaries))
    _write_json(args, cfg, rows, draws=summaries)
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    # Unavailable peers (a package not installed) are reported, not failures; a method that raised is.
    failed = [r["method"] for r in rows if r.get("status", "ok") != "ok" and not r["status"].startswith("unavailable")]
    if failed:
        print(f"kvpack compare: {len(failed)} method(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def cmd_calibrate(args) -> int:
    import torch

    from . import auto, models

    if args.threads:
        torch.set_num_threads(args.threads)
    with install_hint(f"loading {args.model}"):
        model, tokenizer = models.load_model(args.model, dtype=getattr(torch, args.dtype))
    config = auto.CalibrationConfig(text=args.text, prefix=args.prefix, tokens=args.tokens, offset=args.offset, mode=args.mode, draws=args.draws)
    probes = len(config.bits) * len(auto.SIDES)
    how = f"{probes} probes per full-attention layer" if config.mode == "probe" else f"Fisher diagonal from {config.draws} backward passes"
    print(f"calibrating {args.model}: {how}, {config.prefix}-token {config.text} prompt, {config.tokens} scored tokens", flush=True)
    profile = auto.calibrate(model, tokenizer, config, progress=not args.quiet)
    path = auto.save_profile(profile, args.out or auto.profile_path(model))
    print(f"wrote {path} in {profile['calibration']['seconds']:.0f} s")
    grains = auto.GRAINS if auto.has_head_shares(profile) else (auto.DEFAULT_GRAIN,)
    for target, grain in ((t, g) for t in (0.005, 0.01, 0.02, 0.04) for g in grains):
        name = auto.target_name(target, grain)
        try:
            info = auto.summary(auto.method_from_profile(profile, target, grain), profile)
        except ValueError as err:
            print(f"  {name:15s} {err}")
            continue
        print(f"  {name:15s} {info['mean_bits']:.2f} bits on average, compressed tokens {info['compressed_ratio_vs_fp16']:.2f}x "
              f"smaller than fp16, predicted +{100 * math.expm1(info['predicted_kl']):.2f}% perplexity")
    if args.out and Path(args.out).resolve() != auto.profile_path(model).resolve():
        print(f"auto:<target> reads {auto.profile_path(model)}; for this file set KVPACK_PROFILE_DIR={Path(args.out).parent} (and name it "
              f"{auto.profile_path(model).name}) or pass kvpack.auto.auto_method(model, 'auto:1%', profile={str(args.out)!r}) to KVCache")
    return 0


def cmd_models(_args) -> int:
    from .models import MODELS

    for spec in MODELS.values():
        print(f"{spec.name:14s} {spec.description}\n{'':14s} {spec.pip}")
    return 0


def cmd_methods(_args) -> int:
    from .peers import PEERS
    from .registry import DEFAULT_METHOD, list_methods

    print("kvpack methods: " + ", ".join(list_methods()))
    print(f"default:        {DEFAULT_METHOD} (kvpack.DEFAULT_METHOD); any name takes @anchors=P%, @window=N, @fisher=N, @sliding=METHOD and @seed=N")
    print("                auto:<target>, e.g. auto:1%: per-layer TurboQuant bits for a perplexity target, from the model's "
          "calibration profile (make it once: kvpack calibrate --model NAME); auto:1%/head: widths per kv head")
    print("peers:          " + ", ".join(PEERS))
    return 0


COMMANDS = {"demo": cmd_demo, "eval": cmd_eval, "compare": cmd_compare, "calibrate": cmd_calibrate, "models": cmd_models, "methods": cmd_methods}


def main(argv: list[str] | None = None) -> int:
    """Run one command; 0 on success, 1 when a method failed, 2 on a bad argument or a missing package."""
    try:
        args = parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # for the result JSON's env stamp
    except SystemExit as stop:  # argparse: --help (0) or a one-line error (2)
        return stop.code if isinstance(stop.code, int) else 2
    try:
        return COMMANDS[args.command](args)
    except (ImportError, ValueError) as err:  # missing model package, bad option: the message says what to do
        print(f"kvpack {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
