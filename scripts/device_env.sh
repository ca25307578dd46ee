# Sourced by the device scripts (LOG set): installs the carried wheels (.whl/, scripts/device_wheels.sh) into
# /tmp/site once per machine (under a lock, so scripts started side by side in one call do not install over each
# other), puts them and the tree on PYTHONPATH, and names a missing package before any mode runs.
exec 9>/tmp/site.lock
flock 9
if [[ ! -e /tmp/site/.installed ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && touch /tmp/site/.installed
fi
flock -u 9
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex TORCH_CUDA_ARCH_LIST=9.0
python3 -c "import glmquant.runtime, glmquant.cli" >>"$LOG" 2>&1 || echo "glmquant does not import: carry its wheels" >>"$LOG"
