#!/usr/bin/env bash
# One H200 call (under 10 minutes) for the encode figures: the CUDA Viterbi kernel's GPU tests, the whole-layer
# encode benchmark (bench_encode.py: our kernel, then ExLlamaV3's kernel in the same process once its extension,
# built in the background from the carried wheels in .whl/, is ready) and a torchrun world-size-1 encode of the
# tiny model on CUDA. Usage on the device: bash scripts/device_encode.sh "$OUT" [experts]   (results in $OUT)
set -u
OUT=${1:?output dir}; EXPERTS=${2:-288}
LOG="$OUT/run.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 TORCH_EXTENSIONS_DIR=/tmp/tex PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s" >>"$LOG"; }
setsid bash -c "python3 -c 'import exllamav3.ext; print(\"exllamav3 extension ready\")' >'$OUT/exllamav3_build.log' 2>&1" &
BUILD=$!
stamp "GPU test of the CUDA encoder"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/exl3/test_encode.py -k cuda >"$OUT/gpu_tests.log" 2>&1
tail -1 "$OUT/gpu_tests.log" >>"$LOG"
stamp "whole-layer encode benchmark ($EXPERTS experts, our kernel)"
timeout 400 python3 scripts/bench_encode.py --experts "$EXPERTS" --out "$OUT" >>"$LOG" 2>&1
stamp "waiting for the exllamav3 build"
while kill -0 $BUILD 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt 470 ]; do sleep 5; done
tail -2 "$OUT/exllamav3_build.log" >>"$LOG"
stamp "kernels side by side and compare encodes"
timeout 85 python3 scripts/bench_encode.py --compare --compare-experts 4 --out "$OUT" >>"$LOG" 2>&1
stamp "torchrun world size 1 on CUDA (tiny model)"
T=/tmp/tiny; python3 -m glmquant fixture $T/src >>"$LOG" 2>&1 && \
python3 -m glmquant observe $T/src --out $T/obs --rows 4 --tokens 64 >>"$LOG" 2>&1 && \
timeout 40 torchrun --standalone --nproc-per-node 1 -m glmquant encode $T/src --out $T/art --observations $T/obs \
  --device cuda >"$OUT/torchrun_ws1.log" 2>&1; echo "torchrun rc=$?" >>"$LOG"; tail -2 "$OUT/torchrun_ws1.log" >>"$LOG"
stamp "done"
