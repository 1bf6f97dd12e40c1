#!/usr/bin/env bash
# kvpack's GPU checks in one pass (docs/guide/gpu.md): the Triton kernel tests compiled for the GPU, decode attention
# against SDPA over bf16 K/V, and end-to-end greedy decode against DynamicCache at batch 1 and 32.
#
#   bash scripts/gpu_check.sh [MODEL]    # MODEL: a registry name (default qwen2.5-0.5b) or a model directory
#
# Results go to $OUT (default bench/results/gpu): run.log, attention-cuda.{json,png}, attention-cuda-shard.{json,png},
# decode-cuda-b{1,32}.json. RANDOM_WEIGHTS=1 builds MODEL (then a directory holding its config.json) with random
# weights: decode speed only, for a machine without the weights (fixed-width codecs cost the same on any weights).
# STAGES picks stages (default "tests attention profile decode"; "sweep" times kernel variants to sweep-pairs.json; "ncu"
# profiles one call of each kernel with Nsight Compute; "step" times a layer's step eager and from CUDA graphs, to
# attention-cuda-step.json; "candidates" times the default against
# `+ropemean` and a `heads` method, keys with a pre-RoPE bias, to attention-cuda-candidates-d{64,128}.json; "tcq" times the
# default against its `+tcq` form, to attention-cuda-tcq.json; "throughput" runs each cache at the batch it fits in a 40 GiB
# KV budget at 32K tokens, to throughput-cuda-32k.json); each has its own time limit (T_TESTS, T_ATTN,
# T_ATTN_SHARD, T_TCQ, T_PROFILE, T_DECODE seconds); a failing stage does not stop the rest. profile.json: scripts/gpu_profile.py.
set -u
OUT=${OUT:-bench/results/gpu}
MODEL=${1:-qwen2.5-0.5b}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVPACK_KERNELS=torch  # the CPU kernels (C++) never run here: no build
unset TRITON_INTERPRET
log() { echo "== $(date +%T) $*" | tee -a "$OUT/run.log"; }
stage() { local limit=$1; shift; log "$*"; timeout "$limit" "$@" 2>&1 | tee -a "$OUT/run.log"; log "exit ${PIPESTATUS[0]}"; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT/run.log"
python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$OUT/run.log"

STAGES=" ${STAGES:-tests attention profile decode} "
want() { [[ "$STAGES" == *" $1 "* ]]; }

want tests && stage "${T_TESTS:-140}" env KVPACK_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/test_triton_kernels.py tests/test_triton_shard.py ${TEST_K:+-k "$TEST_K"} ${TEST_ARGS:-}

attn=(python3 -m kvpack.bench.attention --device cuda --dtype bfloat16 --contexts 8192 32768 --shapes d64-gqa7 d128-gqa4 --reps 20)
want attention && stage "${T_ATTN:-90}" "${attn[@]}" --batch 1 32 --methods turboquant:k3v2 int8 --out "$OUT/attention-cuda.json"
want attention && stage "${T_ATTN_SHARD:-70}" "${attn[@]}" --batch 1 --methods shard --out "$OUT/attention-cuda-shard.json"  # its PCA / k-means fit runs on the CPU

# Widths per kv head as `auto:<target>/head` builds them (K and V share the groups; each group a fused pair).
heads_json() {  # kv_heads -> a method JSON: heads alternate between tq3/tq2, tq4/tq3 and (from 3 groups) int8/int8
    python3 -c "import json, sys; from kvpack.cache.serialize import method_to_json; from kvpack.registry import CodecSpec, MethodConfig
kv, g = int(sys.argv[1]), int(sys.argv[2]); heads = [i % g for i in range(kv)]
tq = lambda b: {'codec': 'turboquant', 'options': {'bits': b}}; i8 = {'codec': 'int8', 'options': {}}
k, v = [tq(3), tq(4), i8][:g], [tq(2), tq(3), i8][:g]
print(json.dumps(method_to_json(MethodConfig('heads', CodecSpec('heads', {'heads': heads, 'codecs': k}), CodecSpec('heads', {'heads': heads, 'codecs': v})))))" "$@"
}
default="turboquant:k3v2@anchors=0.5%@window=32"
if want candidates; then
    heads_json 2 2 > "$OUT/heads-2.json"; heads_json 8 3 > "$OUT/heads-8.json"
    stage "${T_ATTN:-90}" "${attn[@]}" --shapes d64-gqa7 --batch 1 32 --key-bias 1.0 --out "$OUT/attention-cuda-candidates-d64.json" \
        --methods "$default" "${default/k3v2/k3v2+ropemean}" "$OUT/heads-2.json"
    stage "${T_ATTN:-90}" "${attn[@]}" --shapes d128-gqa4 --batch 1 32 --key-bias 1.0 --out "$OUT/attention-cuda-candidates-d128.json" \
        --methods "$default" "${default/k3v2/k3v2+ropemean}" "$OUT/heads-8.json"
fi

# Trellis-coded codes (`+tcq`) against the default they extend: the kernel reads each channel's window of bits.
# Their encode runs as batched torch Viterbi on the GPU (set-up, not timed), so this stage has a longer limit.
want tcq && stage "${T_TCQ:-300}" "${attn[@]}" --batch 1 32 --key-bias 1.0 --out "$OUT/attention-cuda-tcq.json" \
    --methods "${default/k3v2/k3v2+ropemean}" "${default/k3v2/k3v2+ropemean+tcq}"

config=$MODEL
want profile && [ "${RANDOM_WEIGHTS:-0}" != 1 ] && config=$(python3 -c "from kvpack.models import MODELS, gguf_path, _converted_dir; import sys; m = sys.argv[1]; print(_converted_dir(MODELS[m].name, gguf_path(MODELS[m])) if m in MODELS else m)" "$MODEL")
want profile && stage "${T_PROFILE:-90}" python3 scripts/gpu_profile.py --config-dir "$config" --out "$OUT/profile.json"

weights=()
[ "${RANDOM_WEIGHTS:-0}" = 1 ] && weights=(--random-weights)
# 72 warmup steps pass a block flush (every 64 tokens), so Triton compiles the encode kernel before the timed steps.
want decode && for batch in 1 32; do
    stage "${T_DECODE:-120}" python3 -m kvpack.bench.decode --device cuda --dtype bfloat16 --model "$MODEL" "${weights[@]}" \
        --batch "$batch" --contexts 8192,32768 --methods dynamic,turboquant:k3v2,int8 --steps 128 --warmup 72 \
        --json "$OUT/decode-cuda-b$batch.json"
done
# Kernel variants at batch 32, 32K (tiles, warps, stages, centroid pairs, word loads), with registers and bandwidth share.
want sweep && stage "${T_SWEEP:-150}" python3 scripts/gpu_sweep.py --shapes b32-kv8-g4-d128 b32-kv2-g7-d64 --kernels tq tq-turn int8 \
    --variants base before before-t64-s1 select-s1 bytes t32 t128 t128-w8 t64-w8 s2 --out "$OUT/sweep-pairs.json"
# Nsight Compute on one call of each kernel as shipped and as before: issue slots, stalls, occupancy, memory throughput.
if want ncu; then
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for cfg in "tq-turn base" "tq-turn before-t64-s1" "tq base" "int8 base"; do
        set -- $cfg
        stage "${T_NCU:-40}" env PYTHONPATH="scripts:${PYTHONPATH:-}" "$NCU" --clock-control none --section SpeedOfLight --section Occupancy \
            --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
            -k regex:attention_kernel --launch-skip 1 --launch-count 1 python3 scripts/gpu_ncu.py --kernel "$1" --variant "$2"
    done
fi
# A layer's decode step at 32K (the default, plain TurboQuant, int8), eager and replayed from CUDA graphs, with the
# bytes each step reads as a share of the copy bandwidth.
want step && stage "${T_STEP:-150}" python3 -m kvpack.bench.attention --device cuda --dtype bfloat16 --contexts 32768 \
    --shapes d64-gqa7 d128-gqa4 --batch 1 32 --reps 20 --key-bias 1.0 --graph --out "$OUT/attention-cuda-step.json" \
    --methods "${default/k3v2/k3v2+ropemean}" turboquant:k3v2 int8
# The user's figure: decode tokens/s in a fixed KV budget, each cache at the largest batch its measured bytes fit.
want throughput && stage "${T_THROUGHPUT:-240}" python3 -m kvpack.bench.throughput --device cuda --dtype bfloat16 --model "$MODEL" \
    "${weights[@]}" --context 32768 --kv-budget-gib "${KV_GIB:-40}" --steps 32 --methods "dynamic,${default/k3v2/k3v2+ropemean}" --json "$OUT/throughput-cuda-32k.json"
log done
