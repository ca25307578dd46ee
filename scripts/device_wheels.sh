#!/usr/bin/env bash
# Fill .whl/ (ignored; carried to the H200 with `carry: [".whl"]`) with what the device's Python 3.12 lacks beside
# its torch, triton and transformers: glmquant's own dependencies (the server's FastAPI stack, typer, the OpenAI
# client), fla-core and flash-linear-attention for KDA, and ExLlamaV3 1.6.5 with its dependencies. About 25 MB.
# The device scripts install them with --no-deps into /tmp/site, ahead of the device's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
  --platform any)
get() { python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl "$@"; }
# glmquant's own dependencies that the device lacks, with everything they need (none of them needs torch)
get typer==0.29.2 fastapi==0.165.0 uvicorn==0.55.0 openai==3.57.0 prometheus_client==0.26.0 psutil==7.2.2 \
  pillow==13.0.0 pydantic==2.14.4 rich==15.0.0
# torch's companions, without their requirements (torch, triton and transformers are the device's own)
get --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2 exllamav3==1.6.5 marisa-trie==1.4.1 \
  llguidance==1.6.1
ls .whl | wc -l
