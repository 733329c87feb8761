"""`kvblock demo` end to end on a short prompt: it must find identical tokens
and logits after the cold restore, and report both times to first token."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_short_prompt(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run([sys.executable, "-m", "kvblock", "demo", "--tokens", "200", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["identical_tokens_and_logits"] is True
    assert out["restored_tokens"] == 192 and out["prompt_tokens"] == 200
    assert out["ttft_recompute_s"] > 0 and out["ttft_restore_s"] > 0
    assert len(out["first_tokens"]) == 8
    assert (tmp_path / ".kvblock" / "demo.img").is_file()


def test_demo_refuses_a_device_without_yes(tmp_path, loop_device):
    dev = loop_device(64 << 20)
    res = subprocess.run([sys.executable, "-m", "kvblock", "demo", "--device", dev,
                          "--tokens", "64"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 8 and "pass --yes" in res.stderr


def test_demo_refuses_to_format_over_someone_elses_store(tmp_path):
    """--device that holds a store of another model (or a filesystem) is not
    formatted without --force; a previous demo's store needs none."""
    from kvblock import Geometry, KVStore, create_file

    path = tmp_path / "kv.img"
    create_file(path, 64 << 20)
    KVStore.format([str(path)], Geometry(2, 2, 64), model="an-engine").close()
    res = subprocess.run([sys.executable, "-m", "kvblock", "demo", "--device", str(path),
                          "--tokens", "64"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 16, res.stderr
    assert "holds kvblock store" in res.stderr and "--force" in res.stderr
    with KVStore.open([str(path)], model="an-engine") as store:   # untouched
        assert store.geometry == Geometry(2, 2, 64)
