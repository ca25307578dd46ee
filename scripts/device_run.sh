#!/usr/bin/env bash
# One H200 call (under 10 minutes) that records the GPU figures of the kernels and the ExLlamaV3 interop:
# ExLlamaV3 1.6.5 is installed from the carried wheels (.whl/) and its CUDA extension compiled in the
# background (~5 min) while our kernels are checked and benchmarked; then the exllamav3-layout interop.
# Benchmarks that can hit a device-side assert run one process per case, so an assert costs one row.
# Usage on the device: bash scripts/device_run.sh "$OUT" [BENCH_ARGS...]   (results: $OUT/results.tgz,
# refreshed after each step, and $OUT/run.log). BENCH_ARGS go to bench_moe_decode.py for ours.
set -u
OUT=${1:?output dir}; shift
RES=/tmp/res; mkdir -p "$RES"; LOG="$OUT/run.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 TORCH_EXTENSIONS_DIR=/tmp/tex PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s" >>"$LOG"; tar czf "$OUT/results.tgz" -C "$RES" .; }
setsid bash -c "python3 -c 'import exllamav3.ext; print(\"exllamav3 extension ready\")' >'$RES/build.log' 2>&1" &
BUILD=$!
stamp "kernels check (ours, while exllamav3 builds)"
timeout 240 python3 scripts/gpu_kernels_check.py --out "$RES" >>"$LOG" 2>&1
stamp "moe decode bench: ours"
timeout 100 python3 scripts/bench_moe_decode.py --impls ours "$@" --out "$RES/ours" >>"$LOG" 2>&1
for b in 16 64; do
  stamp "moe decode bench: BF16 batch $b"
  timeout 40 python3 scripts/bench_moe_decode.py --impls bf16 --layouts plain --batches $b --reps 50 --out "$RES/bf16_b$b" >>"$LOG" 2>&1
done
stamp "waiting for the exllamav3 build"
while kill -0 $BUILD 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt 420 ]; do sleep 5; done
tail -3 "$RES/build.log" >>"$LOG"
stamp "exllamav3 interop"
timeout 100 python3 scripts/gpu_exllamav3_interop.py --out "$RES" >>"$LOG" 2>&1
stamp "done"
