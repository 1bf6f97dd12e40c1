"""The Triton attention kernels compiled for an H100/H200 (sm_90) without a GPU (`kvpack.bench.kernel_code`): every
plan the launchers ship fits the chip's shared memory, so no launch falls back to a smaller tile at run time, and the
check itself sees a plan that does not fit (the 128-token, three-stage TurboQuant tile asked 268 KB of 227 KB).

The suite runs Triton's interpreter (conftest.py), which compiles nothing, so the compiles run in one fresh process
without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = """
import json
from dataclasses import asdict
from kvpack.bench import kernel_code as kc
if not kc.available():
    print(json.dumps(None)); raise SystemExit
out = {"shipped": [dict(asdict(kc.shipped(kind, d, rows, tokens=4096, turning=turn, anchors=turn)), d=d, segment=kind + ("+turn" if turn else ""))
                   for d, rows in ((64, 7), (128, 4)) for kind, turn in (("tq", True), ("tq", False), ("int8", False))],
       "before": asdict(kc.shipped("tq", 128, 4, tokens=4096, overrides={"pairs": False, "words": False, "block_t": 128, "num_stages": 3})),
       "single": asdict(kc.shipped("tq", 128, 4, tokens=4096, overrides={"pairs": False, "words": False})),
       "limit": kc.SHARED_LIMIT[90]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend tools (ptxas, cuobjdump) to compile with")
    return out


def test_shipped_plans_fit_the_chip(compiled):
    for launch in compiled["shipped"]:
        assert launch["fits"] and launch["shared_bytes"] <= compiled["limit"], (launch["segment"], launch["d"], launch["shared_bytes"])
        assert launch["loop_instructions"] > 0 and launch["registers"] > 0


def test_a_plan_short_of_shared_memory_is_seen(compiled):
    """The plan before centroid pairs at d = 128: 128-token tiles pipelined over three stages."""
    assert not compiled["before"]["fits"] and compiled["before"]["shared_bytes"] > compiled["limit"]


def test_centroid_pairs_cut_the_loop(compiled):
    """Two channels' fp16 centroids per table read: fewer loop instructions per code than one float32 centroid per read,
    at the same tile and stage count (docs/guide/gpu.md)."""
    pairs = next(x for x in compiled["shipped"] if x["d"] == 128 and x["segment"] == "tq")
    single = compiled["single"]
    assert pairs["block_t"] == single["block_t"] and pairs["num_stages"] == single["num_stages"]
    assert pairs["per_code"] < 0.85 * single["per_code"], (pairs["per_code"], single["per_code"])
