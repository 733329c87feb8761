"""A store run by an unprivileged user who was given the device (a udev
rule, a chown) or a directory for a store file: engines run as such users.
Nothing in the store's life (format, io_uring or thread I/O with O_DIRECT,
the exclusive claim, the journal, reopen) may need root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvblock

NOBODY = 65534
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "non_root_store.py"
pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to hand a device to another user")


def run_as_nobody(target: str) -> str:
    out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                          "--clear-groups", sys.executable, str(SCRIPT), target],
                         capture_output=True, text=True, timeout=120,
                         cwd=SCRIPT.parents[2], stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("engine", ["uring", "threads"])
def test_a_user_given_a_block_device_runs_a_store_on_it(loop_device, monkeypatch, engine):
    monkeypatch.setenv("KVBLOCK_IO_ENGINE", engine)
    dev = loop_device(64 << 20)
    os.chown(dev, NOBODY, NOBODY)
    out = run_as_nobody(dev)
    assert f"engine {engine}" in out and f"busy {dev}" in out and "reopened 5" in out


def test_a_user_given_a_directory_runs_a_store_file_in_it(tmp_path):
    home = Path("/var/tmp") / f"kvblock-nobody-{os.getpid()}-{tmp_path.name}"
    home.mkdir(mode=0o700)
    try:
        os.chown(home, NOBODY, NOBODY)
        path = kvblock.create_file(home / "kv.img", 64 << 20)
        os.chown(path, NOBODY, NOBODY)
        out = run_as_nobody(str(path))
        assert f"busy {path}" in out and "reopened 5" in out
    finally:
        for p in home.iterdir():
            p.unlink()
        home.rmdir()
