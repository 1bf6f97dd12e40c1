"""Replace rows of a `kvpack compare --json` file with the rows of a later run of the same protocol.

    python scripts/merge_rows.py BASE.json UPDATE.json [--plot OUT.png]

Used when one method changed after a long comparison: rerun only that method (`kvpack compare
--methods shard ...`; compare always runs its own DynamicCache baseline) and merge. Each merged row
keeps the deltas and ratios it was measured with, against the baseline of its own run; the row gets
`"merged_from": UPDATE.json`. The protocols (context, tokens scored, needle grid, dtype) must match.
BASE.json is rewritten in place.

`--needle-grid-may-differ`: a base run older than the current needle grid (depths 0.0/0.5/1.0, passkey
and fact needles) and the perplexity bootstrap interval. Perplexity must still be measured alike; each
merged row keeps its own grid (`needle_protocol`), so its recall reads against its own `needle_total`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NEEDLE = ("needle_lengths", "needle_depths", "needle_trials", "needle_kinds")
PROTOCOL = (
    "model", "context", "ppl_tokens", "chunk", "needle_lengths", "needle_depths", "needle_trials", "needle_kinds", "ppl_ci_resamples",
    "ppl_ci_block", "text", "dtype", "seed",
)


def merge(base: dict, update: dict, source: str, needle_may_differ: bool = False) -> dict:
    # Fields the base run predates (None there) only matter when the needle grid must match.
    skip = set(NEEDLE) | {k for k in PROTOCOL if base["config"].get(k) is None} if needle_may_differ else set()
    mismatch = [k for k in PROTOCOL if k not in skip and base["config"].get(k) != update["config"].get(k)]
    if mismatch:
        raise SystemExit(f"protocols differ in {mismatch}: rerun the update with the base run's options")
    grid = {k: update["config"].get(k) for k in NEEDLE} if needle_may_differ else {}
    new = {r["method"]: {**r, "merged_from": source} | ({"needle_protocol": grid} if grid else {}) for r in update["rows"] if not r.get("baseline")}
    rows = [new.pop(r["method"], r) for r in base["rows"]] + list(new.values())
    methods = base["config"]["methods"] + [m for m in update["config"]["methods"] if m not in base["config"]["methods"]]
    # each run's environment stamp: the base's, and every rerun's by file name
    stamps = {**base.get("merged_environment", {}), **({source: update["environment"]} if update.get("environment") else {})}
    return {"config": {**base["config"], "methods": methods}, **({"environment": base["environment"]} if "environment" in base else {}),
            **({"merged_environment": stamps} if stamps else {}), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base")
    p.add_argument("update")
    p.add_argument("--plot", help="redraw the compare plot from the merged rows")
    p.add_argument("--needle-grid-may-differ", action="store_true", help="merge a rerun made with a newer needle grid (see above)")
    args = p.parse_args()
    base, update = json.loads(Path(args.base).read_text()), json.loads(Path(args.update).read_text())
    merged = merge(base, update, Path(args.update).name, args.needle_grid_may_differ)
    Path(args.base).write_text(json.dumps(merged, indent=1))
    if args.plot:
        from kvpack.eval.report import plot

        plot(merged["rows"], args.plot)


if __name__ == "__main__":
    main()
