#!/usr/bin/env bash
# Pack a trained proxy (scripts/train_proxy.py's OUT) for the H200 in parts that fit beside the wheels in one call's
# 64 MiB carry: .proxy-parts/00 holds everything but the model's weight shards, .proxy-parts/01... one shard each
# (xz: a CPU proxy's 55 MB of BF16 weights pack to ~40 MB). Carry some parts per call, run
# `bash scripts/device_fidelity.sh "$OUT" COMMIT unpack ...` in each, back to back (docs/fidelity.md).
# Usage: bash scripts/pack_proxy.sh /tmp/proxy
set -euo pipefail
PROXY=${1:?proxy directory}
[[ -e $PROXY/proxy.json && -d $PROXY/model ]] || { echo "$PROXY: not a trained proxy (no proxy.json or model/)" >&2; exit 2; }
shopt -s nullglob
shards=("$PROXY"/model/*.safetensors)
(( ${#shards[@]} )) || { echo "$PROXY/model: no weight shards (*.safetensors)" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)/.proxy-parts
rm -rf "$root"
mkdir -p "$root/00"
(cd "$PROXY" && find . -type f ! -path './model/*.safetensors' ! -name 'train_state.pt*' -printf '%P\n' | sort \
  | tar cf - -T - | xz -T0 -6 >"$root/00/part.tar.xz")
n=1
for shard in "${shards[@]}"; do  # the glob sorts them
  dir=$(printf '%s/%02d' "$root" "$n")
  mkdir -p "$dir"
  (cd "$PROXY" && tar cf - "model/${shard##*/}" | xz -T0 -6 >"$dir/part.tar.xz")
  n=$((n + 1))
done
du -b "$root"/*/part.tar.xz
