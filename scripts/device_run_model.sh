#!/usr/bin/env bash
# One H200 call (under 10 minutes) for issue 16, the whole model from dummy weights. Installs the carried wheels
# (.whl/, scripts/device_wheels.sh), then one mode. Every step is bounded by `timeout`; a benchmark mode writes
# $OUT/model_h200_MODE.json after each part, the others' results are refreshed in $OUT/results.tgz, the log is
# $OUT/run.log. Several modes run one after another in one call, each
# bounded by the time left (e.g. `serve checks compiled`).
# Usage on the device:
#   bash scripts/device_run_model.sh "$OUT" COMMIT checks    # GPU tests: fused mHC kernel, engine vs the CPU reference
#                                                            # (fla KDA, whole-step graphs, bf16), resident experts,
#                                                            # the EXL3 cores (one-row K-bit core), KDA, speculation
#   bash scripts/device_run_model.sh "$OUT" COMMIT quick     # --quick: graphs check, decode 1k, prefill 8k, classes
#   bash scripts/device_run_model.sh "$OUT" COMMIT decode    # graphs, decode 1k and 32k, classes
#   bash scripts/device_run_model.sh "$OUT" COMMIT prefill   # prefill 8k, 64k, 200k
#   bash scripts/device_run_model.sh "$OUT" COMMIT compiled  # decode 1k with the decode math torch.compile'd
#   bash scripts/device_run_model.sh "$OUT" COMMIT mtp       # MTP speculation at batch 1, 1k: draft, verify and
#                                                            # rollback ms per k = 1..3, measured tok/s (MTP resident);
#                                                            # the drafts read a K copy of lm_head when DRAFT_HEAD_BITS
#                                                            # is set (model_h200_mtp_draft_headK.json), and a copy of
#                                                            # the MTP layer (K linears, K2 experts) when DRAFT_MTP_BITS
#                                                            # is set too (..._mtpK; the tier mode takes both); parts
#                                                            # $MTP_PARTS (default mtp; classes add the GB10 projection)
#   bash scripts/device_run_model.sh "$OUT" COMMIT tier      # the speed tier (--retained-bits $TIER_BITS, default 4;
#                                                            # --head-bits $TIER_HEAD_BITS, --retained-exact-layers
#                                                            # $TIER_EXACT when set; --retained-layer-bits
#                                                            # $TIER_LAYER_BITS instead of --retained-bits when set;
#                                                            # --compile-decode when TIER_COMPILE
#                                                            # is set; --dense-linear-max-weights $TIER_DENSE when
#                                                            # set): graphs check, decode 1k, classes, MTP (or
#                                                            # $TIER_PARTS); fills the report's speed_tier, written to
#                                                            # model_h200_tier_k{bits}_head{K}_exact{N}[_compiled][_denseN].json
#   bash scripts/device_run_model.sh "$OUT" COMMIT serve     # `glmquant serve --load-format dummy` answers OpenAI
#                                                            # requests (scripts/serve_probe.py)
# ROUTED_EXPERTS=E with any benchmark mode: MoE layers built with E of the model's routed experts (an H100's 80 GB;
# a step reads the same experts per token; bench_model.py --routed-experts), the report named ..._eE.json.
# then, here: python scripts/bench_model.py --merge model_h200_decode.json model_h200_prefill.json \
#                --out bench/results/model_h200.json
set -u
OUT=${1:?output dir}; COMMIT=${2:?commit}; shift 2; MODES=("${@:-quick}")
RES=/tmp/res; mkdir -p "$RES"; LOG="$OUT/run.log"
source scripts/device_env.sh
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s" >>"$LOG"; tar czf "$OUT/results.tgz" -C "$RES" .; }
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())" >>"$LOG" 2>&1
left() { echo $(( ${LIMIT_S:-580} - ($(date +%s) - t0) )); }  # LIMIT_S: below the call's limit when less device time is left
# the drafts' own file (mtp and tier modes): lm_head at DRAFT_HEAD_BITS, and the MTP layer at DRAFT_MTP_BITS
draft=(${DRAFT_HEAD_BITS:+--draft-head-bits "$DRAFT_HEAD_BITS"} ${DRAFT_MTP_BITS:+--draft-mtp-bits "$DRAFT_MTP_BITS"})
draft_name=${DRAFT_HEAD_BITS:+_draft_head$DRAFT_HEAD_BITS}${DRAFT_MTP_BITS:+_mtp$DRAFT_MTP_BITS}
for MODE in "${MODES[@]}"; do
  if (( $(left) < 30 )); then echo "== $MODE skipped: under 30 s left" >>"$LOG"; continue; fi
  case $MODE in
    checks)
      stamp "GPU checks: mHC kernel, engine vs CPU reference (fla, graphs, bf16), resident experts"
      mapfile -t tests < scripts/gpu_tests.txt  # the GPU tests, one list for every device script
      timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -rs "${tests[@]}" \
        >"$RES/pytest.log" 2>&1
      echo "pytest exit $?" >>"$LOG"; continue ;;
    serve)
      stamp "serve --load-format dummy: OpenAI requests"
      timeout "$(left)" python3 scripts/serve_probe.py --config tests/data/glm-5.3-flash/config.json \
        --commit "$COMMIT" --out "$RES/serve_h200.json" >>"$LOG" 2>&1
      echo "serve probe exit $?" >>"$LOG"; continue ;;
    quick) args=(--quick --parts graphs,decode,prefill,classes,kernels) ;;  # the MTP layer stays unread
    decode) args=(--parts graphs,decode,classes,kernels) ;;
    prefill) args=(--parts prefill) ;;
    compiled) args=(--quick --parts graphs,decode,classes,kernels --compile-decode) ;;
    mtp) args=(--quick --parts "${MTP_PARTS:-mtp}" "${draft[@]}")
         MODE=mtp$draft_name ;;
    tier) if [[ -n ${TIER_LAYER_BITS:-} ]]; then retained=(--retained-layer-bits "$TIER_LAYER_BITS"); k=layers
          else retained=(--retained-bits "${TIER_BITS:-4}"); k=${TIER_BITS:-4}; fi
          args=(--quick "${retained[@]}" ${TIER_HEAD_BITS:+--head-bits "$TIER_HEAD_BITS"}
                ${TIER_EXACT:+--retained-exact-layers "$TIER_EXACT"} ${TIER_COMPILE:+--compile-decode}
                ${TIER_DENSE:+--dense-linear-max-weights "$TIER_DENSE"}
                --parts "${TIER_PARTS:-graphs,decode,classes,mtp}" "${draft[@]}")  # the mtp part: the tier's mtp_speedup
          MODE=tier_k${k}_head${TIER_HEAD_BITS:-16}_exact${TIER_EXACT:-0}${TIER_COMPILE:+_compiled}${TIER_DENSE:+_dense$TIER_DENSE}$draft_name ;;
    *) echo "mode must be checks, serve, quick, decode, prefill, compiled, mtp or tier, not $MODE" >>"$LOG"; continue ;;
  esac
  stamp "bench_model.py ${args[*]}"
  timeout "$(left)" python3 scripts/bench_model.py --commit "$COMMIT" "${args[@]}" \
    ${ROUTED_EXPERTS:+--routed-experts "$ROUTED_EXPERTS"} \
    --out "$OUT/model_h200_$MODE${ROUTED_EXPERTS:+_e$ROUTED_EXPERTS}.json" >>"$LOG" 2>&1  # in $OUT: a call killed at its limit keeps every part saved
  echo "bench exit $?" >>"$LOG"
done
stamp "done"
