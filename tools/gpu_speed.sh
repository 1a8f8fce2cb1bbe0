#!/usr/bin/env bash
# Issue 41's proof on one GPU: at most GPU_SPEED_SECONDS (240) in all, everything written under
# $OUT as it goes, in at most five files (the device tool returns 8 files a call; gpu-check's
# report, test log and JUnit XML take the others):
#   speed.log           every part's output, each headed with its start time and time limit
#   gpu_profile.jsonl   benchmarks/gpu_profile.py, one JSON line per run as it ends
#   demo_summary.json   the demo's summary.json (tokens/s, MFU, peak memory, simulated step)
#   plan.json           the planner's prediction for the demo's run (funcpipe plan, same layout)
#   plan_calibrate.json benchmarks/plan_calibrate.py: GEMM, memory-bound and attention speeds
# On the device tool, one call: the tests, then this (docs/gpu.md, "The proof of issue 41"):
#   make gpu-check GPU_CHECK_ARGS="--no-demo --test-timeout 200 --out $OUT/check"; bash tools/gpu_speed.sh
# The parts, most important first, each under min(its cap, the time left), so a part that runs
# long (a cold inductor compile of 24 blocks takes a minute or more) leaves the earlier parts'
# results and costs only the later ones:
#   1. eager: the nanoGPT-style baseline and funcpipe's GPT in both precisions (8 microbatches)
#   2. the demo on one GPU (--size large, the planner's microbatches, 20 steps)
#   3. the planner's prediction for that run, and the speeds it is calibrated on (this GPU's)
#   4. funcpipe's GPT torch.compile'd (bf16 parameters, float32 sums and master weights)
#   5. the baseline torch.compile'd
#   6. funcpipe's GPT with CUDA graphs (mode="reduce-overhead"), if time is left
# A dry run of the script itself on the CPU: GPU_SPEED_DEVICE=cpu GPU_SPEED_SIZE=tiny.
set -u
OUT=${OUT:-gpu-speed}
DEVICE=${GPU_SPEED_DEVICE:-cuda}
SIZE=${GPU_SPEED_SIZE:-large}
PY=${GPU_PYTHON:-python3}
DEADLINE=$(($(date +%s) + ${GPU_SPEED_SECONDS:-240}))
WORK=$(mktemp -d)
mkdir -p "$OUT"
LOG="$OUT/speed.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# part_to FILE NAME CAP COMMAND...: run COMMAND under min(CAP, seconds left less 5 for the kill's
# grace), its standard output into FILE (empty: speed.log), its errors into speed.log; skipped
# when under 15 s are left. part NAME CAP COMMAND...: the same into speed.log.
part_to() {
    local file=$1 name=$2 cap=$3 left
    shift 3
    left=$((DEADLINE - $(date +%s) - 5))
    if ((left < 10)); then
        echo "== $name: skipped, $((left + 5))s left of the script's time" | tee -a "$LOG"
        return
    fi
    ((cap > left)) && cap=$left
    echo "== $name ($(date +%T), at most ${cap}s)" | tee -a "$LOG"
    timeout -k 5 "$cap" "$@" >> "${file:-$LOG}" 2>> "$LOG"
    echo "== $name: exit $? ($(date +%T))" | tee -a "$LOG"
}
part() { part_to "" "$@"; }

profile() {  # profile CAP COMPILE MODELS PRECISIONS WARMUP
    part "gpu_profile --compile $2 --models $3" "$1" "$PY" benchmarks/gpu_profile.py \
        --device "$DEVICE" --size "$SIZE" --steps 5 --warmup "$5" --compile "$2" --models "$3" \
        --precisions "$4" --out "$OUT/gpu_profile.jsonl"
}

profile 60 none nanogpt,funcpipe bf16-master,fp32-autocast 2
part "demo --size $SIZE, one GPU" 90 "$PY" -m funcpipe demo --device "$DEVICE" --size "$SIZE" \
    --pipeline 1 --tensor 1 --steps 20 --eval-every 0 --out "$WORK/demo"
cp "$WORK/demo/summary.json" "$OUT/demo_summary.json" 2>/dev/null
MB=$(grep -o '"microbatches": [0-9]*' "$OUT/demo_summary.json" 2>/dev/null | head -1 | grep -o '[0-9]*$')
# the planner prices the demo's own run: its size, the microbatch size it chose, this GPU
GPU=$("$PY" -c 'import json, sys; from funcpipe.cli.demo_options import planner_gpu
print(planner_gpu(json.load(open(sys.argv[1]))["device"]) or "h100-sxm")' "$OUT/demo_summary.json" 2>/dev/null || echo h100-sxm)
[ -n "${MB:-}" ] || echo "== (no demo summary: the planner prices 1 microbatch of 32, not the demo's run)" | tee -a "$LOG"
part_to "$OUT/plan.json" "planner --gpu $GPU --microbatch $((32 / ${MB:-1}))" 30 "$PY" -m funcpipe plan \
    --layers 24 --hidden 1024 --heads 16 --vocab 256 --seq 1024 --global-batch 32 --gpus 1 \
    --gpu "$GPU" --microbatch $((32 / ${MB:-1})) --json
# the efficiencies the planner is calibrated on, on this GPU (to recalibrate it if it misses)
part_to "$OUT/plan_calibrate.json" plan_calibrate 40 "$PY" benchmarks/plan_calibrate.py
# issue 54: a pair's turns against an async collective's stream rules (a stand-in: one GPU)
part "pair_streams" 30 "$PY" benchmarks/pair_streams.py --device "$DEVICE" \
    --json "$OUT/pair_streams.json"
# issue 53: the MoE GPT on one GPU (8 experts, top 2, every block): tokens/s, MFU, expert load
part "demo --experts 8 --top-k 2, one GPU" 60 "$PY" -m funcpipe demo --device "$DEVICE" \
    --size "$SIZE" --experts 8 --top-k 2 --pipeline 1 --tensor 1 --steps 20 --eval-every 0 \
    --out "$WORK/moe"
cp "$WORK/moe/summary.json" "$OUT/moe_summary.json" 2>/dev/null
profile 90 default funcpipe bf16-master 3
profile 90 default nanogpt fp32-autocast 3
profile 90 reduce-overhead funcpipe bf16-master 3  # CUDA graphs, with what time is left
echo "== done ($(date +%T))" | tee -a "$LOG"
rm -rf "$WORK"
