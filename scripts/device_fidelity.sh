#!/usr/bin/env bash
# One H200 call (under 10 minutes) of issue 17's fidelity session (docs/fidelity.md). The proxy, its training state
# and the benchmark's work live in /tmp, which survives only while the machine stays warm: run the calls back to
# back. Modes run in order, each bounded by the call's time left (LIMIT_S, default 585 s; set it below the run's
# limit when less device time than that is left: the device kills the call at its limit).
# Usage on the device (carry .whl):
#   bash scripts/device_fidelity.sh "$OUT" COMMIT train        # train the proxy, pausing before the call's end
#                                                              # (exit 3, state saved); ExLlamaV3's extension
#                                                              # builds beside it (setsid: it outlives the call)
#   bash scripts/device_fidelity.sh "$OUT" COMMIT train bench  # continue training; once the proxy is written,
#                                                              # the benchmark's missing rows (--resume), JOBS
#                                                              # (default 4) at once
#   bash scripts/device_fidelity.sh "$OUT" COMMIT checks bench # the GPU kernel checks in the background (pytest -v
#                                                              # to checks.log), beside the benchmark
#   RECIPES=seed,retained-k4 bash ... bench                 # only these rows (bench_fidelity --recipes)
#   EXL_TOKENS=32 bash ... bench                               # ExLlamaV3's calibration rows of 32 tokens
#   BENCH_ARGS="--rows 32 --tokens 256" bash ... bench         # more bench_fidelity options, one line split at
#                                                              # spaces (a CPU-trained proxy's sizes: docs/fidelity.md)
#   BENCH_WORK=/tmp/fid96 bash ... bench                     # another work dir (default /tmp/fid): a run at other
#                                                              # --rows or --tokens must not meet the first's files
#   EXL_BUILD=0 bash ... unpack                               # no ExLlamaV3 build this machine (its row already
#                                                              # measured, or not wanted): bench runs without it
#   RESUME_FROM=bench/results/F.json bash ... bench            # start the work dir's results from a committed
#                                                              # file (same proxy and settings): its rows are kept
#   EXL_BUILD_JOBS=16 bash ... unpack build                    # the extension build on that many cores (default
#                                                              # 4, beside training); `build` waits for it
#   bash ... unpack bench                                      # first add the carried .proxy-parts/NN to /tmp/proxy
#   ... cache                                                  # return Triton's kernel cache (compiled and autotuned
#                                                              # kernels, ~6 minutes of a cold machine's first
#                                                              # training step) as $OUT/triton-cache.tgz.NN parts;
#                                                              # here: cat them into .triton-cache/cache.tgz (ignored)
#                                                              # and carry .triton-cache next session
# The benchmark runs ExLlamaV3's converter last, once its extension is built. Each call copies what it has into
# $OUT: proxy.json, fidelity_proxy.json, the logs.
set -u
OUT=${1:?output dir}; COMMIT=${2:?commit}; shift 2; MODES=("$@")
LOG="$OUT/run.log"; t0=$(date +%s)
left() { echo $(( ${LIMIT_S:-585} - ($(date +%s) - t0) )); }
source scripts/device_env.sh
if [[ ${EXL_BUILD:-1} == 0 ]]; then  # `build` finds the rc and does not wait
  [[ -e /tmp/exl-build.log ]] || { echo "EXL_BUILD=0: no ExLlamaV3 extension build on this machine" >/tmp/exl-build.log
                                   echo skipped >/tmp/exl-build.rc; }
elif [[ ! -e /tmp/exl-build.log ]]; then  # once per machine, on a few cores so the corpus and kernels keep theirs
  # its exit status lands in /tmp/exl-build.rc, which `build` waits for
  MAX_JOBS=${EXL_BUILD_JOBS:-4} setsid nice -n 10 bash -c \
    "python3 -c 'import exllamav3.ext'; rc=\$?; [[ \$rc == 0 ]] && touch /tmp/exl-built; echo \$rc >/tmp/exl-build.rc" \
    >/tmp/exl-build.log 2>&1 < /dev/null &
elif [[ -n ${EXL_BUILD_JOBS:-} ]]; then
  echo "EXL_BUILD_JOBS ignored: the extension build began in an earlier call" >>"$LOG"
fi
export TRITON_CACHE_DIR=/tmp/triton-cache
if [[ -e .triton-cache/cache.tgz && ! -e $TRITON_CACHE_DIR ]]; then  # a carried cache of an earlier session
  mkdir -p "$TRITON_CACHE_DIR" && tar xzf .triton-cache/cache.tgz -C "$TRITON_CACHE_DIR"
  echo "Triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files carried in" >>"$LOG"
fi
FID=${BENCH_WORK:-/tmp/fid}  # the benchmark's work and results; another one for other --rows or --tokens
mkdir -p /tmp/proxy "$FID"
if [[ -n ${RESUME_FROM:-} && ! -e $FID/fidelity_proxy.json ]]; then  # bench --resume keeps its rows that match
  cp "$RESUME_FROM" "$FID/fidelity_proxy.json" && echo "resuming from $RESUME_FROM" >>"$LOG"
fi
missing_shards() {  # the weight shards /tmp/proxy's index names that are not there (nothing when complete)
  python3 -c 'import json, pathlib; d = pathlib.Path("/tmp/proxy/model"); idx = d / "model.safetensors.index.json"
try:
    names = set(json.loads(idx.read_text())["weight_map"].values()) if idx.is_file() else set()
except (OSError, ValueError, KeyError, AttributeError) as exc:
    print(f"proxy shard index unreadable: {idx}: {exc!r}", end=""); raise SystemExit
missing = sorted(n for n in names if not (d / n).is_file())
print("proxy shards missing: " + ", ".join(missing) if missing else "", end="")'
}
checks=
for MODE in "${MODES[@]}"; do
  echo "== $MODE at +$(( $(date +%s) - t0 ))s, $(left) s left" >>"$LOG"
  case $MODE in
    train)
      [[ -e /tmp/proxy/proxy.json ]] && continue
      # pauses (state saved) once --max-minutes of wall time have passed; SIGTERM from timeout pauses too
      timeout "$(left)" python3 scripts/train_proxy.py --out /tmp/proxy --device cuda \
        --max-minutes "$(awk -v s="$(( $(left) - 45 ))" 'BEGIN { print s / 60 }')" 2>&1 | tee -a /tmp/proxy/train.log >>"$LOG"
      echo "train exit ${PIPESTATUS[0]}" >>"$LOG"
      cp /tmp/proxy/proxy.json "$OUT/" 2>/dev/null ;;
    checks)
      mapfile -t tests < scripts/gpu_tests.txt  # the GPU tests, one list for every device script
      nice -n 5 timeout "$(left)" python3 -m pytest -v -p no:cacheprovider -rs "${tests[@]}" \
        >/tmp/checks.log 2>&1 &
      checks=$! ;;
    bench)
      [[ -e /tmp/proxy/proxy.json ]] || { echo "bench skipped: the proxy is not trained yet" >>"$LOG"; continue; }
      missing=$(missing_shards)
      if [[ -n $missing ]]; then
        echo "bench skipped: $missing (carry the other .proxy-parts, then unpack)" >>"$LOG"; continue
      fi
      extra=()
      [[ -e /tmp/exl-built ]] || extra=(--no-exllamav3)  # still building
      [[ -n ${RECIPES:-} ]] && extra+=(--recipes "$RECIPES")
      [[ -n ${EXL_TOKENS:-} ]] && extra+=(--exllamav3-tokens "$EXL_TOKENS")
      if [[ -n ${BENCH_ARGS:-} ]]; then read -ra more <<<"$BENCH_ARGS"; extra+=("${more[@]}"); fi
      # a torch extension lock left behind makes every later import of exllamav3 wait: show what the build left
      [[ -e /tmp/exl-built ]] && find /tmp/tex -maxdepth 2 \( -name lock -o -name '*.so' \) -printf '%p %s B\n' >>"$LOG"
      # the results file lives in $OUT while the benchmark runs: a call killed at the device's limit (which may be
      # below LIMIT_S when little device time is left) still returns every row measured
      cp "$FID/fidelity_proxy.json" "$OUT/" 2>/dev/null
      timeout "$(left)" python3 scripts/bench_fidelity.py --proxy /tmp/proxy --device cuda --work "$FID" \
        --results "$OUT/fidelity_proxy.json" --commit "$COMMIT" --resume --jobs "${JOBS:-4}" "${extra[@]}" 2>&1 \
        | tee -a "$FID/bench.log" >>"$LOG"
      echo "bench exit ${PIPESTATUS[0]} ($([[ -e /tmp/exl-built ]] && echo "with" || echo "without") exllamav3; ${extra[*]:-})" >>"$LOG"
      cp "$OUT/fidelity_proxy.json" "$FID/" 2>/dev/null ;;
    build)
      until [[ -e /tmp/exl-build.rc ]] || (( $(left) <= 5 )); do sleep 5; done
      if [[ -e /tmp/exl-built ]]; then echo "exllamav3 extension: built" >>"$LOG"
      else
        echo "exllamav3 extension: not built ($(cat /tmp/exl-build.rc 2>/dev/null || echo "still building"))" >>"$LOG"
        tail -5 /tmp/exl-build.log >>"$LOG"
      fi ;;
    unpack)
      # a proxy trained elsewhere, packed by scripts/pack_proxy.sh into parts that one call's carry may not hold
      # together: each call carries some .proxy-parts/NN (carry them by name) and this adds them to /tmp/proxy
      found=0
      for part in .proxy-parts/*/part.tar.xz; do
        [[ -e $part ]] || continue
        found=1
        if tar xJf "$part" -C /tmp/proxy; then echo "unpacked $part" >>"$LOG"; else echo "unpack of $part FAILED" >>"$LOG"; fi
      done
      (( found )) || echo "unpack: no .proxy-parts/*/part.tar.xz carried" >>"$LOG"
      missing_shards >>"$LOG" ;;
    cache)
      # it must travel back (4 parts of 15 MiB) and out again beside the wheels and the tree (64 MiB a call)
      tar czf /tmp/triton-cache.tgz -C "$TRITON_CACHE_DIR" .
      size=$(du -b /tmp/triton-cache.tgz | cut -f1)
      if (( size < 36 << 20 )); then split -b 15M -d /tmp/triton-cache.tgz "$OUT/triton-cache.tgz."; fi
      echo "Triton cache: $size bytes, $(ls "$OUT" | grep -c triton-cache) parts returned" >>"$LOG" ;;
    *) echo "mode must be train, checks, bench, build, unpack or cache, not $MODE" >>"$LOG" ;;
  esac
done
[[ -n $checks ]] && { wait "$checks"; echo "checks exit $?" >>"$LOG"; }  # not the extension build: it may
                                                                            # outlive the call
cp /tmp/proxy/proxy.json "$OUT/" 2>/dev/null
# at most 8 files come back: run.log, proxy.json, fidelity_proxy.json, logs.tgz and up to 4 cache parts
tar czf "$OUT/logs.tgz" --ignore-failed-read -C /tmp proxy/train.log "${FID#/tmp/}/bench.log" "${FID#/tmp/}/exllamav3-convert.log" exl-build.log \
  checks.log 2>/dev/null
echo "== collected at +$(( $(date +%s) - t0 ))s" >>"$LOG"
