"""A store run by an unprivileged user who was given the device (a udev
rule, a chown) or a directory for a store file: engines run as such users.
Nothing in the store's life (format, io_uring or thread I/O with O_DIRECT,
the exclusive claim, the journal, reopen) may need root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvblock
from kvblock import KVStore
from kvblock.store.launch import wait_for_server

NOBODY = 65534
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "non_root_store.py"
pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to hand a device to another user")


def as_nobody(*cmd: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]


def run_as_nobody(*args: str) -> str:
    out = subprocess.run(as_nobody(sys.executable, str(SCRIPT), *args),
                         capture_output=True, text=True, timeout=120,
                         cwd=SCRIPT.parents[2], stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("engine", ["uring", "threads"])
def test_a_user_given_a_block_device_runs_a_store_on_it(loop_device, monkeypatch, engine):
    monkeypatch.setenv("KVBLOCK_IO_ENGINE", engine)
    dev = loop_device(64 << 20)
    owner = os.stat(dev)
    os.chown(dev, NOBODY, NOBODY)
    try:
        out = run_as_nobody(dev)
    finally:   # the node outlives the loop device: the next test to get it must find root's
        os.chown(dev, owner.st_uid, owner.st_gid)
    assert f"engine {engine}" in out and f"busy {dev}" in out and "reopened 5" in out


def test_a_user_given_a_directory_runs_and_serves_a_store_file_in_it(tmp_path):
    home = Path("/var/tmp") / f"kvblock-nobody-{os.getpid()}-{tmp_path.name}"
    home.mkdir(mode=0o700)
    server = None
    try:
        os.chown(home, NOBODY, NOBODY)
        path = kvblock.create_file(home / "kv.img", 64 << 20)
        os.chown(path, NOBODY, NOBODY)
        out = run_as_nobody(str(path))
        assert f"busy {path}" in out and "reopened 5" in out
        # `kvblock serve` as that user (as a service unit's User= would run
        # it), and a rank of that user on its socket.
        sock = str(home / "kv.sock")
        log = tmp_path / "serve.log"
        with open(log, "w") as out:
            server = subprocess.Popen(as_nobody(sys.executable, "-m", "kvblock", "serve",
                                                str(path), "--socket", sock),
                                      cwd=SCRIPT.parents[2], stdin=subprocess.DEVNULL,
                                      stdout=out, stderr=subprocess.STDOUT)
        wait_for_server(sock, timeout=60, proc=server)
        assert "served 7" in run_as_nobody(str(path), sock)
        server.terminate()
        assert server.wait(60) == 0, log.read_text()
        with KVStore.open([str(path)]) as store:       # what the server committed
            assert store.stats()["blocks"] == 7
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(home)


def test_a_second_server_of_another_user_on_a_live_socket_is_refused_cleanly(tmp_path):
    """Root serves a store on a socket in a shared directory; another user
    starts `kvblock serve` with the same --socket.  It must stop with a
    clear, typed error (not a traceback), and root's server keeps its
    socket."""
    from kvblock.store.server import serve_in_background
    from tests.store.workload import small_store

    shared = Path("/var/tmp") / f"kvblock-shared-{os.getpid()}-{tmp_path.name}"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    try:
        sock = str(shared / "kv.sock")
        theirs = small_store(shared / "nobody.img")
        os.chown(theirs, NOBODY, NOBODY)
        with serve_in_background([small_store(tmp_path / "root.img")], sock):
            inode = os.stat(sock).st_ino
            out = subprocess.run(as_nobody(sys.executable, "-m", "kvblock", "serve", theirs,
                                           "--socket", sock),
                                 capture_output=True, text=True, timeout=120,
                                 cwd=SCRIPT.parents[2], stdin=subprocess.DEVNULL)
            said = out.stdout + out.stderr
            assert out.returncode != 0 and "Traceback" not in said, said
            assert "cannot tell whether a store server listens" in said, said
            assert "permission denied" in said and "another --socket path" in said, said
            assert os.stat(sock).st_ino == inode
        # root's server is gone; the fence file it left beside the socket is
        # root's: said so, with what to do
        assert not os.path.exists(sock) and os.path.exists(sock + ".fence")
        out = subprocess.run(as_nobody(sys.executable, "-m", "kvblock", "serve", theirs,
                                       "--socket", sock),
                             capture_output=True, text=True, timeout=120,
                             cwd=SCRIPT.parents[2], stdin=subprocess.DEVNULL)
        said = out.stdout + out.stderr
        assert out.returncode == 4 and "Traceback" not in said, said    # DevicePermissionError
        assert "kv.sock.fence" in said and "another user" in said, said
    finally:
        shutil.rmtree(shared)
