"""Candidates for the default method that are not registered methods, run through `kvpack compare`.

    python experiments/default_candidates.py --model smollm2-135m --context 2048 --no-needle \
        --methods dynamic,turboquant:k3v2,turboquant:k4v2,turboquant:k4v1,candidate:k3vq,candidate:k4vq \
        --json bench/results/default-candidates-smollm2-135m-2k.json

`candidate:kXvY-sN` is `turboquant:kXvY@seed=N` (any method name takes `@seed=N`): its rotations drawn from
base seed N instead of 0, to see how much one draw of the random rotation moves a perplexity delta.
`candidate:kXvY-wN` is `turboquant:kXvY` with an exact window of N tokens instead of 64.
`candidate:default-qr-sN` / `candidate:default-hadamard-sN` is the default method at seed N with its rotations drawn as
dense Haar (QR) matrices or as randomized Hadamards (the default's own for power-of-two head sizes), to see whether the
draw-to-draw spread belongs to the Hadamard's structure. `candidate:kXvq` is the default's key codec at X bits (centered, channel-scaled TurboQuant) with Shard's
value codec (Hadamard + k-means VQ on groups of 4 channels, 8-bit indices, per-token RMS: 2.25 bits per
value, as TurboQuant's 2-bit values). One codec pair serves the prompt and the stream; VQ fits on its
first block. The measurements and the decision are in docs/notes/decisions.md.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from kvpack.cli import main
from kvpack.registry import DEFAULT_METHOD, SEED_SUFFIX, CodecSpec, MethodConfig, get_method, method


@method("candidate")
def _candidate(arg: str) -> MethodConfig:
    seeded = re.fullmatch(r"(k[1-4]v[1-4])-s(\d+)", arg)
    if seeded:  # `turboquant:kXvY@seed=N` under the name these runs' JSON rows carry
        return get_method(f"turboquant:{seeded[1]}{SEED_SUFFIX}{seeded[2]}").with_options(name=f"candidate:{arg}")
    windowed = re.fullmatch(r"(k[1-4]v[1-4])-w(\d+)", arg)
    if windowed:  # `turboquant:kXvY` with an exact window of N tokens (blocks of 64 still leave it)
        return get_method(f"turboquant:{windowed[1]}").with_options(window=int(windowed[2]), name=f"candidate:{arg}")
    rotated = re.fullmatch(r"default-(qr|hadamard)-s(\d+)", arg)
    if rotated:  # the default method with its rotations of another kind, at seed N
        base = get_method(f"{DEFAULT_METHOD}{SEED_SUFFIX}{rotated[2]}")
        key, value = (CodecSpec(s.codec, {**s.options, "rotation": rotated[1]}) for s in (base.key, base.value))
        return base.with_options(key=key, value=value, name=f"candidate:{arg}")
    tight = re.fullmatch(r"shard-e(\d+(?:\.\d+)?)", arg)
    if tight:  # `shard` with its key rank chosen at N% relative score error on the prompt's queries (3% by default)
        base = get_method("shard")
        key = CodecSpec("pca", {"score_error": float(tight[1]) / 100})
        return MethodConfig(f"candidate:{arg}", base.key, base.value, prefill_key=key, prefill_value=base.prefill_value)
    match = re.fullmatch(r"k([2-4])vq", arg)
    if not match:
        raise ValueError(f"candidate takes kXvq with X in 2..4 (e.g. candidate:k4vq) , kXvY-sN (a TurboQuant method at rotation seed N, e.g. candidate:k3v2-s1) or kXvY-wN (window N), got {arg!r}")
    key = CodecSpec("turboquant", {"bits": int(match[1]), "center": True, "channel_scale": 0.5})
    return MethodConfig(f"candidate:{arg}", key, CodecSpec("vq", {"token_norm": True}))


def _run(argv: list[str]) -> int:
    status = main(["compare", *argv])
    if "--json" in argv:  # the CLI stamps its own command line; name this script, which registered the candidates
        path = Path(argv[argv.index("--json") + 1])
        data = json.loads(path.read_text())
        data["environment"]["command"] = " ".join(["python experiments/default_candidates.py", *argv])
        path.write_text(json.dumps(data, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
