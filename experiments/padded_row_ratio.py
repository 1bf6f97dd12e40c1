"""A left-padded row in a batch against the same row alone, on SmolLM2 and news text.

KL of the shorter (left-padded) row's logits against its exact logits (uncompressed, unbatched), over the prefill's
last position and `STEPS` teacher-forced steps: once in the batch, once alone, with the same method; the ratio is
batch / alone (1.0: padding costs nothing). A method that draws rotations or seeds runs at `@seed=0,1,2` and the
ratio is the mean batch KL over the mean alone KL, with each draw's ratio beside it: one draw's KL moves by more than
the padding does. Usage: `python experiments/padded_row_ratio.py [METHOD ...]`; the rows go to
`bench/results/padded-row-ratio-smollm2-135m.json`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpack
from kvpack.bench.env import environment
from kvpack.models import load_model
from kvpack.registry import DEFAULT_METHOD, get_method, list_methods
from kvpack.text import load_text

LONG, SHORT, STEPS, DRAWS = 320, 192, 16, 3
METHODS = [DEFAULT_METHOD, *list_methods()]


def run(model, ids: torch.Tensor, mask: torch.Tensor, cache, cont: torch.Tensor) -> torch.Tensor:
    """Prefill then teacher-forced single-token steps; logits `(batch, 1 + steps, vocab)`."""
    out = []
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        out.append(model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1])
        for t in range(cont.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = pos[:, -1:] + 1
            out.append(model(cont[:, t : t + 1], attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = p_logits.float().log_softmax(-1)
    return float((p.exp() * (p - q_logits.float().log_softmax(-1))).sum(-1).mean())


def main(methods: list[str]) -> None:
    model, tok = load_model("smollm2-135m")
    text = load_text("news")
    a = tok(text[:6000], return_tensors="pt").input_ids[0, :LONG]
    b = tok(text[30000:36000], return_tensors="pt").input_ids[0, :SHORT]
    cont = tok(text[50000:52000], return_tensors="pt").input_ids[0, : 2 * STEPS].view(2, STEPS)
    ids = torch.full((2, LONG), tok.pad_token_id if tok.pad_token_id is not None else 0)
    mask = torch.zeros(2, LONG, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, LONG - SHORT :], mask[1, LONG - SHORT :] = b, 1
    alone_ids, alone_mask = ids[1:, LONG - SHORT :], mask[1:, LONG - SHORT :]
    exact = run(model, alone_ids, alone_mask, DynamicCache(), cont[1:])[0]
    env = environment("python experiments/padded_row_ratio.py", methods)
    print(f"# {env['command']} | {env['cpu']} | torch {env['torch']}, kvpack {env['kvpack']} at {env['git_sha']}")
    rows = []
    print(f"# SmolLM2-135M fp32, rows of {LONG} and {SHORT} news tokens (the second left-padded by {LONG - SHORT}), {STEPS} steps")
    for enabled in (True, False):
        (kvpack.enable if enabled else kvpack.disable)(model)
        for m in methods:
            start = time.perf_counter()
            draws = [m]
            try:
                draws = [get_method(m).with_seed(seed).name for seed in range(DRAWS)]
            except ValueError:  # draws nothing at random: one run is every run
                pass
            kls = []
            for name in draws:
                batch = run(model, ids, mask, kvpack.KVCache(model, name), cont)[1]
                alone = run(model, alone_ids, alone_mask, kvpack.KVCache(model, name), cont[1:])[0]
                kls.append((kl(exact, batch), kl(exact, alone)))
            kb, ka = (sum(x[i] for x in kls) / len(kls) for i in (0, 1))
            each = " ".join(f"{b / a:.2f}" for b, a in kls)
            rows.append({"method": m, "enabled": enabled, "kl_batch": kb, "kl_alone": ka, "ratio": kb / ka,
                         "draws": [{"method": n, "kl_batch": b, "kl_alone": a, "ratio": b / a} for n, (b, a) in zip(draws, kls, strict=True)]})
            print(f"enable={enabled!s:5} {m:48s} KL batch {kb:.3e} alone {ka:.3e} ratio {kb / ka:.2f} (draws: {each}) "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    kvpack.disable(model)
    setup = {"model": "smollm2-135m", "dtype": "float32", "text": "news", "long": LONG, "short": SHORT, "steps": STEPS, "draws": DRAWS}
    path = Path("bench/results/padded-row-ratio-smollm2-135m.json")
    path.write_text(json.dumps({"environment": env, "setup": setup, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:] or METHODS)
