"""scripts/pack_proxy.sh: a trained proxy in carry-sized parts (everything but the weights, then one shard each) that
unpack, in any order, to the same files; anything that is not a proxy is refused."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")


def test_parts_unpack_to_the_same_proxy(tmp_path: Path) -> None:
    proxy = tmp_path / "proxy"
    files = {
        "proxy.json": b"{}",
        "model/config.json": b"{}",
        "model/model-00001-of-00002.safetensors": bytes(range(256)) * 64,
        "model/model-00002-of-00002.safetensors": b"second shard",
        "routing/layer-01.stats.safetensors": b"routing statistics",
        "corpus/heldout.jsonl": b'{"text": "x"}\n',
        "train_state.pt": b"not carried",
    }
    for name, data in files.items():
        (proxy / name).parent.mkdir(parents=True, exist_ok=True)
        (proxy / name).write_bytes(data)
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "pack_proxy.sh", work / "scripts")
    subprocess.run(["bash", str(work / "scripts" / "pack_proxy.sh"), str(proxy)], check=True, capture_output=True)

    parts = sorted((work / ".proxy-parts").glob("*/part.tar.xz"))
    members = []
    for part in parts:
        with tarfile.open(part) as tar:
            members.append(sorted(tar.getnames()))
    assert [p.parent.name for p in parts] == ["00", "01", "02"]
    assert "model/config.json" in members[0] and not any(m.endswith("-of-00002.safetensors") for m in members[0])
    assert members[1:] == [["model/model-00001-of-00002.safetensors"], ["model/model-00002-of-00002.safetensors"]]

    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    for part in reversed(parts):
        with tarfile.open(part) as tar:
            tar.extractall(unpacked, filter="data")
    got = {str(p.relative_to(unpacked)): p.read_bytes() for p in unpacked.rglob("*") if p.is_file()}
    assert got == {k: v for k, v in files.items() if k != "train_state.pt"}


def test_a_directory_without_a_trained_proxy_is_refused(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "pack_proxy.sh"), str(tmp_path)], capture_output=True, text=True
    )
    assert run.returncode == 2 and "not a trained proxy" in run.stderr
