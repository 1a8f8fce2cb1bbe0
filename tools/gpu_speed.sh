#!/usr/bin/env bash
# Issue 41's proof on one GPU, at most ~4 minutes, everything written under $OUT as it goes
# (on the device tool: `bash tools/gpu_speed.sh`; run `make gpu-check` first when the tree
# changed since its last report). In order, each part under its own time limit so a slow one
# leaves the others' results:
#   1. benchmarks/gpu_profile.py, eager: the nanoGPT-style baseline and funcpipe's GPT (bf16
#      parameters with float32 sums and master weights; float32 under autocast)
#   2. the same, torch.compile'd
#   3. the demo on one GPU (--size large, the planner's microbatches, 20 steps): tokens/s, MFU
#   4. the planner's prediction for that run (funcpipe plan, the same layout)
# Results: $OUT/gpu_profile.jsonl (one JSON line per run), $OUT/demo/summary.json, *.log.
set -u
OUT=${OUT:-gpu-speed}
DEVICE=${GPU_SPEED_DEVICE:-cuda}  # cpu with GPU_SPEED_SIZE=tiny: a dry run of the script itself
SIZE=${GPU_SPEED_SIZE:-large}
mkdir -p "$OUT"
PY=${GPU_PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
part() { echo "== $1 ($(date +%T))" | tee -a "$OUT/parts.log"; }

part "gpu_profile eager"
timeout 70 "$PY" benchmarks/gpu_profile.py --device "$DEVICE" --size "$SIZE" --steps 5 --warmup 2 --compile none \
    --out "$OUT/gpu_profile.jsonl" > "$OUT/gpu_profile_eager.log" 2>&1
part "gpu_profile compiled"
timeout 100 "$PY" benchmarks/gpu_profile.py --device "$DEVICE" --size "$SIZE" --steps 5 --warmup 3 --compile default \
    --out "$OUT/gpu_profile.jsonl" > "$OUT/gpu_profile_compiled.log" 2>&1
part "demo large, one GPU"
timeout 60 "$PY" -m funcpipe demo --device "$DEVICE" --size "$SIZE" --pipeline 1 --tensor 1 --steps 20 \
    --eval-every 0 --out "$OUT/demo" > "$OUT/demo.log" 2>&1
part "planner"
MB=$(grep -o '"microbatches": [0-9]*' "$OUT/demo/summary.json" 2>/dev/null | head -1 | grep -o '[0-9]*$')
"$PY" -m funcpipe plan --layers 24 --hidden 1024 --heads 16 --vocab 256 --seq 1024 \
    --global-batch 32 --gpus 1 --gpu h100-sxm --microbatch $((32 / ${MB:-1})) --json \
    > "$OUT/plan.json" 2> "$OUT/plan.log"
part "done"
tail -n 3 "$OUT"/*.log
