"""Start `glmquant serve --load-format dummy` (the whole model, dummy weights, the runtime's own forward) on a GPU,
send it OpenAI requests, record what came back and stop it with Ctrl-C (issue 16: the dummy-weight server answers
on the H200).

    python scripts/serve_probe.py --config tests/data/glm-5.3-flash/config.json --out serve_h200.json --commit SHA
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai


def wait_healthy(url: str, server: subprocess.Popen[bytes], limit_s: float) -> float:
    """Seconds until /health answers 200; raises if the server exits or the limit passes."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before answering /health")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"/health did not answer within {limit_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True, help="config.json of the model to serve")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--startup-limit-s", type=float, default=400)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    report: dict[str, Any] = {"command": " ".join(sys.argv), "commit": args.commit, "requests": []}
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare"
        bare.mkdir()
        shutil.copy(args.config, bare / "config.json")
        serve = [sys.executable, "-m", "glmquant", "serve", str(bare), "--load-format", "dummy", "--model-impl",
                 "glmquant", "--device", args.device, "--backend", args.backend, "--port", str(args.port),
                 "--max-model-len", "4096"]  # fmt: skip
        report["serve_command"] = " ".join(serve[1:])
        server = subprocess.Popen(serve)
        try:
            report["startup_s"] = round(wait_healthy(url, server, args.startup_limit_s), 1)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            for prompt in ("Say something about the sea.", "Write a haiku about GPUs."):
                t = time.perf_counter()
                reply = client.chat.completions.create(
                    model="bare", messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens
                )
                assert reply.usage is not None
                report["requests"].append({
                    "prompt": prompt,
                    "finish_reason": reply.choices[0].finish_reason,
                    "prompt_tokens": reply.usage.prompt_tokens,
                    "completion_tokens": reply.usage.completion_tokens,
                    "seconds": round(time.perf_counter() - t, 3),
                    "content": reply.choices[0].message.content,
                    # GLM's reply opens in thinking mode: random weights rarely close it, so the text is here
                    "reasoning_content": (reply.choices[0].message.model_extra or {}).get("reasoning_content"),
                })  # fmt: skip
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                report["health"] = json.loads(reply.read())
        finally:
            server.send_signal(signal.SIGINT)
            try:
                report["exit_code_after_ctrl_c"] = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                report["exit_code_after_ctrl_c"] = "killed after 60 s"
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
