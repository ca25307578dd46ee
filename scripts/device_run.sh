#!/usr/bin/env bash
# One H200 session that records every GPU figure of the project: ExLlamaV3 1.6.5 is installed from the carried
# wheels (.whl/) and its CUDA extension compiled in the background (~5 min) while our own Triton kernels are
# checked; then the codec cross-check, the exllamav3-layout interop, encode throughput and MoE decode benches.
# Usage on the device: bash scripts/device_run.sh "$OUT"   (results: $OUT/results.tgz and $OUT/run.log)
set -u
OUT=${1:?output dir}
RES=/tmp/res; mkdir -p "$RES"; LOG="$OUT/run.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/tex PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s" >>"$LOG"; }
( python3 -c "import exllamav3.ext, exllamav3; print('exllamav3', exllamav3.__version__, 'extension ready')" >"$RES/build.log" 2>&1 ) &
BUILD=$!
stamp "kernels check (ours, while exllamav3 builds)"
[ -f scripts/gpu_kernels_check.py ] && timeout 240 python3 scripts/gpu_kernels_check.py --out "$RES" >>"$LOG" 2>&1
stamp "waiting for the exllamav3 build"
wait $BUILD; tail -3 "$RES/build.log" >>"$LOG"
stamp "codec cross-check"
timeout 150 python3 scripts/gpu_exl3_crosscheck.py --out "$RES" --skip-torch >>"$LOG" 2>&1
stamp "exllamav3 interop"
timeout 120 python3 scripts/gpu_exllamav3_interop.py --out "$RES" >>"$LOG" 2>&1
stamp "encode benches"
for mode in natural all; do timeout 90 python3 scripts/bench_encode.py --device cuda --experts 2 --mode $mode --out "$RES" >>"$LOG" 2>&1; done
stamp "moe decode bench"
[ -f scripts/bench_moe_decode.py ] && timeout 120 python3 scripts/bench_moe_decode.py --with-exllamav3 --out "$RES" >>"$LOG" 2>&1
stamp "done"
tar czf "$OUT/results.tgz" -C "$RES" .
