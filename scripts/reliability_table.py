"""The table of docs/guide/reliability.md (case class, cases, passed, what a user sees), from test results.

    bash scripts/test.sh && python scripts/reliability_table.py    # the test command writes .test-results.xml; rewrite the table
    python scripts/reliability_table.py --check                      # CI: the table is what the last test run gives
    python scripts/reliability_table.py --nightly --check            # CI: also the 10,000-example property profiles (~3 min on
                                                                     #   2 cores), recorded in bench/results/reliability-nightly.json

Every pytest run writes `.test-results.xml` (`--junitxml` in pyproject's pytest options), so the table is counted
from the run CI just did, without running anything twice. The nightly rows come from the `--nightly` run's file,
which records its date, commit, seconds and the examples hypothesis actually ran (a fixed hypothesis seed: the same
10,000 examples on every run, so CI is reproducible; change `NIGHTLY_SEED` to explore others).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kvpack.bench.env import environment  # noqa: E402  (the repository's own source, installed or not)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = 250  # hypothesis examples per property test in the `ci` profile (tests/test_properties.py)
DOC = ROOT / "docs" / "guide" / "reliability.md"
RESULTS = ROOT / ".test-results.xml"
NIGHTLY_SEED = 0
NIGHTLY = ROOT / "bench" / "results" / "reliability-nightly.json"
# (case class, test file, test name, what the user sees): the hypothesis properties the nightly profile runs
NIGHTLY_TESTS = [
    ("Property-based sequences (hypothesis, `nightly` profile)", "test_properties.py", "test_cache_follows_dynamic_layer_within_codec_error",
     "lengths equal to DynamicLayer's; read-back within the codecs' own error"),
    ("Any finite magnitude, stored finite or refused (hypothesis, `nightly` profile)", "test_extremes.py",
     "test_any_finite_magnitude_is_stored_finite_or_refused", "finite K/V and attention, or a refusal before anything is stored"),
]

# (case class, file, test-name regex, what the user sees when the case is refused or goes wrong)
CLASSES = [
    ("Left-padded batches (every method, with and without `enable`)", "test_padding.py", r".", "pads stay exact; a padded row reads what it reads alone"),
    ("Batches: each row's fitted state from its own tokens (state, kernels, selection, files)", "test_rows.py", r".",
     "a row stored and read as in a batch of one"),
    ("Sliding-window models (Gemma-3 layer types, Mistral-style `sliding_window`)", "test_sliding.py", r".", "windows coded (rotated int8 rows by default, `@sliding=METHOD`) holding the same tokens and reading as the mask does, or transformers' own window kept (`@sliding=exact`); ratios vs what DynamicCache holds"),
    ("Crop, reorder, batch select/repeat (block runs)", "test_blocks.py", r".", "compressed prefix bit-identical after crop"),
    ("Generation modes vs DynamicCache (greedy, sampling, beam, assisted, padding)", "test_cache.py", r"matches|reproduce|crop|assisted|beam|sampling", "same tokens for lossless methods"),
    ("Bad input, overflow, construction and option errors", "test_validation.py", r".", "a ValueError/TypeError naming the problem and the fix; cache unchanged"),
    ("Silent fallbacks, layer API, copies, export, rollback", "test_api_contract.py", r".", "an error instead of a different computation; all layers of a forward or none"),
    ("transformers' own cache tests, adapted", "test_transformers_conformance.py", r".", "DynamicCache behaviour within the codec's round trip"),
    ("Property-based sequences (hypothesis, `ci` profile)", "test_properties.py", r".", "lengths equal to DynamicLayer's; read-back within the codecs' own error"),
    ("Long run: 10,000 decode steps", "test_long_run.py", r".", "memory linear, O(1) copies per token, RSS flat"),
    ("CLI misuse", "test_cli.py", r".", "exit code 2 and one line naming the argument, before any work"),
    ("Extreme magnitudes, 1e-8 to 1e30 (every method, fp32 / bf16 / fp16)", "test_extremes.py", r".", "finite K/V and attention, or a refusal before anything is stored"),
    ("Saved caches under a fuzzer (truncations, flips, header edits, huge claims, another model)", "test_fuzz_saved.py", r".", "CacheFileError naming the problem; no crash, hang or huge allocation"),
    ("Threads (own caches on one model; one cache shared)", "test_threads.py", r".", "the same tokens as alone; a RuntimeError for a shared cache"),
    ("Models whose rotary embedding kvpack cannot read (GPT-J)", "test_rope_fallback.py", r".", "one warning naming what is lost; methods without a position-free form refuse"),
]


def table(root: ET.Element, nightly: dict | None) -> str:
    rows = ["| case class | cases | passed | what the user sees |", "|---|---:|---:|---|"]
    for label, file, pattern, sees in CLASSES:
        cases = [c for c in root.iter("testcase") if c.get("classname", "").endswith(file[:-3]) and re.search(pattern, c.get("name", ""))]
        if not cases:
            raise SystemExit(f"{RESULTS.name} holds no results of tests/{file}: run the whole test command (bash scripts/test.sh) first")
        failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
        skipped = [c for c in cases if c.find("skipped") is not None]
        # A hypothesis test is one pytest case of many drawn examples: count examples (a failure falsifies its test).
        scale = EXAMPLES if file == "test_properties.py" else 1
        rows.append(f"| {label} | {scale * len(cases)} | {scale * (len(cases) - len(failed) - len(skipped))} | {sees} |")
    for label, _, name, sees in NIGHTLY_TESTS:
        run = (nightly or {}).get("tests", {}).get(name)
        if run is None:
            rows.append(f"| {label}: not run yet (`--nightly`) | 0 | 0 | {sees} |")
            continue
        passed = run["examples"] if run["outcome"] == "passed" else 0
        rows.append(f"| {label} | {run['examples']:,} | {passed:,} | {sees} |")
    return "\n".join(rows)


def run_nightly() -> dict:
    """Each nightly property under `KVPACK_HYPOTHESIS_PROFILE=nightly`, with hypothesis's statistics (examples it ran)."""
    out = {"environment": environment("python scripts/reliability_table.py --nightly", []), "seed": NIGHTLY_SEED, "tests": {}}
    env = {**os.environ, "KVPACK_HYPOTHESIS_PROFILE": "nightly"}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # the properties run side by side, one thread each
        procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={Path(tmp) / f'{i}.xml'}",
                                   "--hypothesis-show-statistics", f"--hypothesis-seed={NIGHTLY_SEED}", f"tests/{file}::{name}"], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i, (_, file, name, _) in enumerate(NIGHTLY_TESTS)]
        outputs = [p.communicate()[0] for p in procs]
    for (_, file, name, _), proc, stdout in zip(NIGHTLY_TESTS, procs, outputs, strict=True):
        # hypothesis's statistics: "- 9,870 passing, 0 failing, and 130 invalid test cases" per phase (reuse, generate, shrink)
        phases = re.findall(r"([\d,]+) passing, ([\d,]+) failing", stdout)
        passing = [int(p.replace(",", "")) for p, _ in phases]
        failing = [int(f.replace(",", "")) for _, f in phases]
        outcome = "passed" if proc.returncode == 0 else "failed"
        out["tests"][name] = {"file": f"tests/{file}", "outcome": outcome, "examples": sum(passing) + sum(failing),
                              "seconds": round(time.perf_counter() - start, 1), "tail": stdout[-2000:] if outcome != "passed" else ""}
        print(f"{name}: {outcome}, {sum(passing) + sum(failing)} examples in {out['tests'][name]['seconds']:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the table differs from the last test run's")
    ap.add_argument("--nightly", action="store_true", help="run the 10,000-example profiles first and record them")
    args = ap.parse_args(argv)
    if args.nightly:
        NIGHTLY.write_text(json.dumps(run_nightly(), indent=1) + "\n")
        print(f"wrote {NIGHTLY.relative_to(ROOT)}")
    if not RESULTS.is_file():
        raise SystemExit(f"no {RESULTS.name}: run the test command (bash scripts/test.sh) first")
    nightly = json.loads(NIGHTLY.read_text()) if NIGHTLY.is_file() else None
    text = DOC.read_text()
    start, end = text.index("<!-- table -->") + len("<!-- table -->"), text.index("<!-- /table -->")
    want = text[:start] + "\n" + table(ET.parse(RESULTS).getroot(), nightly) + "\n" + text[end:]
    if args.check:
        if want != text:
            print(f"{DOC.relative_to(ROOT)}'s table is not what the last test run gives: run python scripts/reliability_table.py")
            return 1
        print(f"{DOC.relative_to(ROOT)}'s table matches the last test run")
        return 0
    DOC.write_text(want)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
