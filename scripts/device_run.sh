#!/usr/bin/env bash
# One H200 call (under 10 minutes) that re-records the kernel figures of docs/kernels.md and the ExLlamaV3 interop:
# ExLlamaV3 1.6.5 is installed from the carried wheels (.whl/) and its CUDA extension compiled in the background
# (~5 min) while our kernels are checked and benchmarked (ours and BF16, per-launch stages); then the
# exllamav3-layout interop and ExLlamaV3's fused MoE kernel, one process per (layout, batch) so that a
# device-side assert costs one row. The codec cross-check and encode benches have their own scripts.
# Usage on the device: [COMMIT=C] bash scripts/device_run.sh "$OUT"   (results: $OUT/results.tgz, refreshed after each
# step, and $OUT/run.log)
set -u
OUT=${1:?output dir}
RES=/tmp/res; mkdir -p "$RES"; LOG="$OUT/run.log"
source scripts/device_env.sh
export MAX_JOBS=12
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s" >>"$LOG"; tar czf "$OUT/results.tgz" -C "$RES" .; }
setsid bash -c "python3 -c 'import exllamav3.ext; print(\"exllamav3 extension ready\")' >'$RES/build.log' 2>&1" &
BUILD=$!
stamp "kernels check (ours, while exllamav3 builds)"
timeout 240 python3 scripts/gpu_kernels_check.py --out "$RES" ${COMMIT:+--commit "$COMMIT"} >>"$LOG" 2>&1
stamp "per-launch stage times"
timeout 100 python3 scripts/bench_moe_decode.py --stages --out "$RES/stages" >>"$LOG" 2>&1
stamp "moe decode bench: ours and BF16"
timeout 150 python3 scripts/bench_moe_decode.py --impls ours,bf16 --out "$RES" >>"$LOG" 2>&1
stamp "waiting for the exllamav3 build"
while kill -0 $BUILD 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt 420 ]; do sleep 5; done
kill -- -$BUILD 2>/dev/null  # a build still running now would not finish in this call
tail -3 "$RES/build.log" >>"$LOG"
stamp "exllamav3 interop"
timeout 60 python3 scripts/gpu_exllamav3_interop.py --out "$RES" >>"$LOG" 2>&1
stamp "moe decode bench: ExLlamaV3, one process per case"
for layout in plain tr3; do for b in 1 4 16 64; do
  [ $(( $(date +%s) - t0 )) -gt 560 ] && break 2
  timeout 30 python3 scripts/bench_moe_decode.py --impls exllamav3 --layouts $layout --batches $b --reps 50 \
    --out "$RES/exllamav3_${layout}_b$b" >>"$LOG" 2>&1
done; done
stamp "done"
