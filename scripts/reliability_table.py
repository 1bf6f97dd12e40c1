"""Run the reliability tests and write the table of docs/guide/reliability.md (case class, cases, passed, what a user sees).

    python scripts/reliability_table.py            # runs pytest on the files below, rewrites the table
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = 250  # hypothesis examples per property test in the `ci` profile (tests/test_properties.py)
DOC = ROOT / "docs" / "guide" / "reliability.md"

# (case class, file, test-name regex, what the user sees when the case is refused or goes wrong)
CLASSES = [
    ("Left-padded batches (every method, with and without `enable`)", "test_padding.py", r".", "pads stay exact; a padded row reads what it reads alone"),
    ("Sliding-window models (Gemma-3 layer types, Mistral-style `sliding_window`)", "test_sliding.py", r".", "transformers' own window kept; ratios vs what DynamicCache holds"),
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


def run(files: list[str]) -> ET.Element:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files], cwd=ROOT, check=False)
        return ET.parse(xml).getroot()


def table(root: ET.Element) -> str:
    rows = ["| case class | cases | passed | what the user sees |", "|---|---:|---:|---|"]
    for label, file, pattern, sees in CLASSES:
        cases = [c for c in root.iter("testcase") if c.get("classname", "").endswith(file[:-3]) and re.search(pattern, c.get("name", ""))]
        failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
        skipped = [c for c in cases if c.find("skipped") is not None]
        # A hypothesis test is one pytest case of many drawn examples: count examples (a failure falsifies its test).
        scale = EXAMPLES if file == "test_properties.py" else 1
        rows.append(f"| {label} | {scale * len(cases)} | {scale * (len(cases) - len(failed) - len(skipped))} | {sees} |")
    return "\n".join(rows)


def main() -> None:
    root = run([f"tests/{f}" for f in dict.fromkeys(c[1] for c in CLASSES)])
    text = DOC.read_text()
    start, end = text.index("<!-- table -->") + len("<!-- table -->"), text.index("<!-- /table -->")
    DOC.write_text(text[:start] + "\n" + table(root) + "\n" + text[end:])
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
