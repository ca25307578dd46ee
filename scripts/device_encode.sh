#!/usr/bin/env bash
# One H200 call (under 10 minutes) for the encode figures (bench_encode.py): the whole tr3 layer with our kernel,
# one unit of the plain layout, optionally (EXLLAMAV3=1) both Viterbi kernels side by side with ExLlamaV3's
# extension built in the background from the carried wheels, and a torchrun world-size-1 encode of the tiny model
# on CUDA. Usage on the device: [EXLLAMAV3=1] bash scripts/device_encode.sh "$OUT" EXPERTS COMMIT   (results in $OUT)
set -u
OUT=${1:?output dir}; EXPERTS=${2:-288}; COMMIT=${3:-unknown}
LOG="$OUT/run.log"
# flash-linear-attention stays out: transformers would pick it for the tiny model's CPU observation
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v -e fla_core -e flash_linear) >>"$LOG" 2>&1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 TORCH_EXTENSIONS_DIR=/tmp/tex PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s" >>"$LOG"; }
if [ "${EXLLAMAV3:-0}" = 1 ]; then
  setsid bash -c "python3 -c 'import exllamav3.ext; print(\"exllamav3 extension ready\")' >'$OUT/exllamav3_build.log' 2>&1" &
  BUILD=$!
fi
stamp "whole-layer encode benchmark ($EXPERTS experts, tr3, our kernel)"
timeout 345 python3 scripts/bench_encode.py --experts "$EXPERTS" --commit "$COMMIT" --out "$OUT" >>"$LOG" 2>&1
stamp "plain layout, one unit of 32 experts"
timeout 60 python3 scripts/bench_encode.py --layout exllamav3 --experts 32 --commit "$COMMIT" --out "$OUT" >>"$LOG" 2>&1
if [ "${EXLLAMAV3:-0}" = 1 ]; then
  stamp "waiting for the exllamav3 build"
  while kill -0 $BUILD 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt 470 ]; do sleep 5; done
  stamp "kernels side by side and compare encodes"
  timeout 85 python3 scripts/bench_encode.py --compare --compare-experts 4 --commit "$COMMIT" --out "$OUT" >>"$LOG" 2>&1
fi
stamp "torchrun world size 1 on CUDA (tiny model)"
T=/tmp/tiny; python3 -m glmquant fixture $T/src >>"$LOG" 2>&1 && \
python3 -m glmquant observe $T/src --out $T/obs --rows 4 --tokens 64 >>"$LOG" 2>&1 && \
timeout 60 torchrun --standalone --nproc-per-node 1 -m glmquant encode $T/src --out $T/art --observations $T/obs \
  --device cuda >"$OUT/torchrun_ws1.log" 2>&1; echo "torchrun rc=$?" >>"$LOG"; tail -4 "$OUT/torchrun_ws1.log" >>"$LOG"
stamp "done"
