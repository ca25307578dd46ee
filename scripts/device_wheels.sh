#!/usr/bin/env bash
# Fill .whl/ (ignored; carried to the H200 with `carry: [".whl"]`) with what the device's Python 3.12 lacks beside
# its torch, triton and transformers: glmquant's own dependencies (the server's FastAPI stack, typer, the OpenAI
# client), fla-core and flash-linear-attention for KDA, and ExLlamaV3 1.6.5 with its dependencies. About 25 MB.
# The device scripts install them with --no-deps into /tmp/site, ahead of the device's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d .whl \
  typer==0.29.2 click==8.5.1 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.20.0 \
  fastapi==0.165.0 annotated-doc==0.0.7 starlette==1.10.0 uvicorn==0.55.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 \
  prometheus_client==0.26.0 openai==3.57.0 jiter==0.19.0 distro==1.9.0 httpx2==2.16.2 httpcore2==2.16.2 \
  truststore==0.10.5 idna==3.20 certifi==2026.5.20 pillow==13.0.0 psutil==7.2.2 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
  fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2 \
  exllamav3==1.6.5 marisa-trie==1.4.1 llguidance==1.6.1
ls .whl | wc -l
