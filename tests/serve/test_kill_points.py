"""Several processes, one store, killed at chosen points of a put: a server
SIGKILLed between a commit's journal write and its answer, or while a rank
stalled after its allocation has not written yet.  The process stops at the
point (it says so on stdout and waits on stdin) and is killed there.  (A
rank killed between its data write and its commit: test_serve.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.store.client import RemoteStore, ServerGoneError
from kvblock.store.server import serve_in_background, spawn_server
from tests.serve.test_serve import ROOT, _output, _store_file
from tests.store.workload import run_data, run_keys

# A store server that stops once a commit's records are durable (before it
# answers), says "journaled" and waits on stdin: killed there.
_SERVER_STOPPING_AFTER_JOURNAL = """
import sys, threading
from kvblock.store.store import KVStore
from kvblock.store.server import serve_in_background
real = KVStore._publish_puts
def publish(self, runs, clears):
    out = real(self, runs, clears)
    print("journaled", flush=True)
    sys.stdin.readline()
    return out
KVStore._publish_puts = publish
serve_in_background([sys.argv[1]], sys.argv[2])
print("listening", flush=True)
threading.Event().wait()
"""


def _server(code: str, path: str, sock: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code, path, sock], cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    line = p.stdout.readline()
    if line != "listening\n":
        p.kill()
        raise AssertionError(line + _output(p))
    return p


def _read_back(store, keys) -> None:
    out = np.zeros_like(run_data(keys))
    assert store.get_run(keys, out) == len(keys), f"{keys[0]!r} not stored whole"
    assert np.array_equal(out, run_data(keys)), f"{keys[0]!r}: wrong bytes"


@pytest.mark.parametrize("how", ["put_run", "put_runs"])
def test_a_server_killed_between_a_commits_journal_write_and_its_answer(tmp_path, how):
    """The commit's records are durable, its answer never comes: the rank
    must not say the run was stored (it cannot know), and must not say it
    was not; once the store is reopened the run is there, every byte, and a
    put of it again (the rank's retry, on a new server) is a duplicate."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    a, b = run_keys(1, 2), run_keys(2, 3)
    server = _server(_SERVER_STOPPING_AFTER_JOURNAL, path, sock)
    try:
        r = RemoteStore(sock)
        got = []

        def put():
            try:
                if how == "put_run":
                    got.append(r.put_run(a, run_data(a)))
                else:
                    got.append(r.put_runs([(a, run_data(a)), (b, run_data(b))]))
            except BaseException as e:  # noqa: BLE001  (looked at below)
                got.append(e)
        t = threading.Thread(target=put)
        t.start()
        line = server.stdout.readline()
        assert line == "journaled\n", line + _output(server)
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        t.join(30)
        assert len(got) == 1 and isinstance(got[0], ServerGoneError), got
        assert "not stored" not in str(got[0]), got[0]
        r.close()
    finally:
        if server.poll() is None:
            server.kill()
        server.stdin.close()
        _output(server)
    with KVStore.open([path]) as st:
        for keys in ((a,) if how == "put_run" else (a, b)):
            _read_back(st, keys)
    with serve_in_background([path], sock) as srv, RemoteStore(sock) as r:
        for keys in ((a,) if how == "put_run" else (a, b)):
            _read_back(r, keys)
        assert r.put_runs([(a, run_data(a)), (b, run_data(b))]) == [2, 3]
        assert r.stats()["put_duplicate_runs"] >= 1
        assert srv.store.regions.pins.sum() == 0


# A rank that stops with its run staged, before its write (its allocation
# made: "staged <region> <offset>"), goes on at a line on stdin and says
# how the put ended.
_RANK_STALLED_BEFORE_ITS_WRITE = """
import sys
from kvblock.store.client import RemoteStore, ServerGoneError
from tests.store.workload import run_data, run_keys
r = RemoteStore(sys.argv[1], verify="never")
real_stage, real_call = r._stage_run, r._call_on
def call_on(s, op, **args):
    out = real_call(s, op, **args)
    if op == "allocate":
        print("staged", out["region"], out["offset"], flush=True)
        sys.stdin.readline()
    return out
r._call_on = call_on
keys = run_keys(1, 2)
try:
    r.put_run(keys, run_data(keys))
    print("stored", flush=True)
except ServerGoneError as e:
    print("refused", r.counters["fenced_writes"], e, flush=True)
"""


def test_a_rank_stalled_before_its_write_while_the_server_is_killed_is_fenced(tmp_path):
    """Rank A (a process) is allocated space and stops before writing; the
    server is SIGKILLed and a new one hands the same space to rank B, which
    commits there.  A's write, let go on, is refused, and B's run reads back
    whole (verify="never": A's bytes would be read as B's), through the
    server and in one process once it too is killed."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)

    server = spawn_server([path], sock, timeout=30)
    a = subprocess.Popen([sys.executable, "-c", _RANK_STALLED_BEFORE_ITS_WRITE, sock],
                         cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    kb = run_keys(2, 2)
    try:
        line = a.stdout.readline()
        assert line.startswith("staged "), line + _output(a)
        a_space = tuple(map(int, line.split()[1:]))
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        server = spawn_server([path], sock, timeout=30)
        with RemoteStore(sock, verify="never") as b:
            real, b_space = b._call_on, []

            def call_on(s, op, **args):
                out = real(s, op, **args)
                if op == "allocate":
                    b_space.append((out["region"], out["offset"]))
                return out
            b._call_on = call_on
            assert b.put_run(kb, run_data(kb)) == 2
            assert b_space == [a_space], "the test needs the new server to reuse A's space"
            a.stdin.write("go\n")
            a.stdin.flush()
            out = _output(a)
            assert out.startswith("refused 1 "), out
            assert "was not written" in out, out
            _read_back(b, kb)
        server.send_signal(signal.SIGKILL)
        server.wait(30)
    finally:
        for p in (a, server):
            if p.poll() is None:
                p.kill()
                p.wait(30)
        a.stdin.close()
        if not a.stdout.closed:
            a.stdout.close()
    with KVStore.open([path], verify="never") as st:
        _read_back(st, kb)
        assert st.lookup(run_keys(1, 2)) == 0
