"""A lost store server: RemoteStore(reconnect=True) and connect() with
devices make a new connection in the background (starting a new server
when none answers), calls fail at once meanwhile, and a pin of the lost
connection can never release one of the new connection's."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.errors import ConfigError
from kvblock.store.client import PROTOCOL, RemoteStore, ServerGoneError, connect
from kvblock.index import normalize_keys
from kvblock.store.protocol import decode_keys
from kvblock.store.server import serve_in_background
from tests.serve.test_serve import _kill_servers_of, _store_file
from tests.store.workload import run_data, run_keys
from tests.support.servers import exit_code_in_child, wait_reconnected
from tests.support.timeouts import GENEROUS_S, hold_checkpoint, short_timeout_on


def _served(tmp_path, **client):
    """A store file served in this process, and a client of it."""
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock)
    return sock, path, server, RemoteStore(sock, **client)


def _wait_alive(store, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not store.server_alive:
        assert time.monotonic() < deadline, f"{store!r} did not reconnect"
        time.sleep(0.02)


def test_reconnects_to_a_restarted_server_and_keeps_pins_apart(tmp_path, monkeypatch):
    from kvblock.store import client as client_mod

    # The reconnect thread's attempts wait until the test lets go (HELD_S at
    # most): a call that waited for a server (or for an attempt) would take
    # HELD_S, one that fails at once takes a small part of it on any load.
    HELD_S = 30.0
    go = threading.Event()
    real_once = client_mod._reconnect_once

    def held_once(store, warned):
        go.wait(HELD_S)
        return real_once(store, warned)
    monkeypatch.setattr(client_mod, "_reconnect_once", held_once)
    sock, path, server, r = _served(tmp_path, reconnect=True)
    try:
        a, b = run_keys(1, 2), run_keys(2, 2)
        r.put_run(a, run_data(a))
        old = r.pin(a)                          # a pin of the first connection
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(ServerGoneError, match="reconnecting"):
            r.lookup(a)
        with pytest.raises(ServerGoneError):
            r.put_run(b, run_data(b))
        took = time.monotonic() - t0
        assert took < HELD_S / 2, f"failing calls waited {took:.1f} s for a server"
        server = serve_in_background([path], sock)
        go.set()
        _wait_alive(r)
        assert r.counters["reconnects"] == 1
        assert r.lookup(a) == 2
        r.put_run(b, run_data(b))               # an allocation, then a pin: the new
        new = r.pin(a)                          # server numbers them as the old one did
        assert new.pin == old.pin, "the test needs colliding pin ids"
        assert server.store.regions.pins.sum() == 1
        r.unpin(old)                            # the lost connection's: not the new one
        assert server.store.regions.pins.sum() == 1
        r.unpin(new)
        assert server.store.regions.pins.sum() == 0
        got = np.zeros_like(run_data(b))
        assert r.get_run(b, got) == 2 and np.array_equal(got, run_data(b))
    finally:
        go.set()
        r.close()
        server.stop()


def test_without_reconnect_the_store_stays_gone(tmp_path):
    sock, path, server, r = _served(tmp_path)
    try:
        server.stop()
        with pytest.raises(ServerGoneError, match="restart it"):
            r.lookup(run_keys(1, 1))
        server = serve_in_background([path], sock)
        time.sleep(1.0)
        with pytest.raises(ServerGoneError):
            r.lookup(run_keys(1, 1))
    finally:
        r.close()
        server.stop()


def test_a_killed_server_is_restarted_by_a_client(tmp_path):
    """connect() with devices: after a SIGKILL of the server, one of the
    clients starts a new one (under the lock file) and both reconnect; what
    was committed is there, byte for byte."""
    sock = str(tmp_path / "run" / "kvblock" / "kv.sock")   # the directories are made
    path = _store_file(tmp_path)
    stores = []
    try:
        for _ in range(2):
            stores.append(connect(sock, [path], reconnect=True, timeout=30))
        first = stores[0].server_pid
        assert stores[1].server_pid == first
        keys = run_keys(5, 3)
        stores[0].put_run(keys, run_data(keys))
        os.kill(first, signal.SIGKILL)
        assert wait_reconnected(stores, first) != first
        got = np.zeros_like(run_data(keys))
        assert stores[1].get_run(keys, got) == 3 and np.array_equal(got, run_data(keys))
        more = run_keys(6, 2)
        stores[1].put_run(more, run_data(more))
        assert stores[0].lookup(more) == 2
    finally:
        for s in stores:
            s.close()
        _kill_servers_of(sock)


def test_a_hung_server_costs_one_bounded_wait(tmp_path):
    """An answer that does not come within the call's timeout abandons the
    connection (ServerGoneError), and a new one is made once the server
    answers again."""
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock)
    hang, unhang = threading.Event(), threading.Event()
    real = server._op_lookup

    def slow_lookup(s, keys):
        if hang.is_set():
            unhang.wait(30)     # answers only once the test has seen the timeout
        return real(s, keys)
    server._op_lookup = slow_lookup
    r = RemoteStore(sock, reconnect=True)
    try:
        keys = run_keys(9, 1)
        r.put_run(keys, run_data(keys))
        hang.set()
        t0 = time.monotonic()
        with pytest.raises(ServerGoneError, match="did not answer lookup in time"):
            r.contains_nowait(keys[0], 0.001, timeout=0.2)
        assert time.monotonic() - t0 < 10       # its 0.2 s, not the server's 30 s
        hang.clear()
        unhang.set()
        _wait_alive(r)
        assert r.contains_nowait(keys[0], 0.001, timeout=0.2) is True
    finally:
        r.close()
        server.stop()


def test_a_forked_child_never_reconnects(tmp_path):
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    with serve_in_background([path], sock):
        r = RemoteStore(sock, reconnect=True)
        try:
            def child():
                for _ in range(2):
                    try:
                        r.lookup(run_keys(0, 1))
                        return 2
                    except ServerGoneError as e:
                        if "forked" not in str(e):
                            return 3
                    time.sleep(1.0)    # a reconnect would have happened by now
                return 0
            assert exit_code_in_child(child) == 0
            assert r.lookup(run_keys(0, 1)) == 0      # the parent's connection works
        finally:
            r.close()


@pytest.mark.parametrize("where", ["connect", "reconnect"])
def test_a_fork_as_a_connection_is_made_closes_it_in_the_child(tmp_path, where, monkeypatch):
    """A fork (another thread's) between open_socket and the session's
    entry in the store's sessions (RemoteStore() before it is live, or a
    reconnect's _new_session): the at-fork handler did not know the socket,
    so the child kept a copy of the parent's connection to the server,
    which then saw it open after the parent closed it (its pins held for
    as long as the child lived).  The child closes every connection the
    client made."""
    from kvblock.store import client as client_mod
    from tests.serve.test_pin_lease import _until

    real, armed, checked = client_mod.open_socket, [False], []

    def forking_open_socket(path, timeout):
        sock = real(path, timeout)
        if armed[0]:
            armed[0] = False
            fd, ino = sock.fileno(), os.fstat(sock.fileno()).st_ino

            def child():
                try:
                    return 1 if os.fstat(fd).st_ino == ino else 0   # still open: kept
                except OSError:
                    return 0                                        # closed
            checked.append(exit_code_in_child(child))
        return sock
    monkeypatch.setattr(client_mod, "open_socket", forking_open_socket)
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    with serve_in_background([path], sock) as server:
        if where == "connect":
            armed[0] = True
            r = RemoteStore(sock)
        else:
            r = RemoteStore(sock)
            armed[0] = True
            s = r._new_session()
            s.close()
        try:
            assert checked == [0], "the forked child kept the connection being made"
        finally:
            r.close()
        _until(lambda: server.client_count() == 0)


def test_socket_directories(tmp_path):
    """A socket in a missing directory: made; one that cannot be made or
    bound: a ConfigError naming the path."""
    path = _store_file(tmp_path)
    sock = str(tmp_path / "a" / "b" / "kv.sock")
    with serve_in_background([path], sock):
        with RemoteStore(sock) as r:
            assert r.lookup(run_keys(0, 1)) == 0
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot make the directory .*file"):
        serve_in_background([path], str(blocker / "kv.sock"))
    with pytest.raises(ConfigError, match="holds at most 107"):     # before any mkdir
        serve_in_background([path], str(tmp_path / ("x" * 120) / "kv.sock"))
    assert not (tmp_path / ("x" * 120)).exists()
    with KVStore.open([path]) as store:       # every refusal let the store go
        assert store.lookup(run_keys(0, 1)) == 0


def test_a_start_lock_that_cannot_be_opened_is_a_config_error(tmp_path):
    """connect() with devices, no server answering: the rank opens the start
    lock <socket>.lock.  One it cannot open (here a directory; for another
    user's 0600 file, EACCES) is a ConfigError naming it, not a raw OSError."""
    from kvblock.store.launch import ensure_server

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    os.mkdir(sock + ".lock")
    with pytest.raises(ConfigError, match=r"kv\.sock\.lock"):
        ensure_server(sock, [path])
    assert not os.path.exists(sock)                    # nothing was started


def test_one_reconnect_per_outage_and_a_refused_store_stays_refused(tmp_path):
    """Threads calling while the session is replaced start one reconnect,
    not one each (a second would replace the healthy new session); a server
    that now serves another store is refused once, without new attempts."""
    sock, path, server, r = _served(tmp_path, reconnect=True)
    try:
        stop = threading.Event()

        def call():
            while not stop.is_set():
                try:
                    r.lookup(run_keys(0, 1))
                except ServerGoneError:
                    pass
        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for cycle in range(1, 4):
            server.stop()
            server = serve_in_background([path], sock)
            deadline = time.monotonic() + 20
            while r.counters["reconnects"] < cycle or not r.server_alive:
                assert time.monotonic() < deadline, "no reconnect"
                time.sleep(0.01)
            time.sleep(1.2)                # a second reconnect would have replaced it by now
            assert r.counters["reconnects"] == cycle
        stop.set()
        for t in threads:
            t.join()
        server.stop()
        other = str(tmp_path / "other.img")
        import shutil
        shutil.copy(path, other)
        KVStore.format([other], KVStore.open([path], readonly=True).geometry, force=True).close()
        server = serve_in_background([other], sock)      # another store on the socket
        with pytest.raises(ServerGoneError):
            r.lookup(run_keys(0, 1))
        deadline = time.monotonic() + 10
        while "now serves another store" not in repr(r._session.gone):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(20):
            with pytest.raises(ServerGoneError, match="now serves another store"):
                r.lookup(run_keys(0, 1))
            time.sleep(0.05)
        assert not [t for t in threading.enumerate() if t.name == "kvblock-reconnect"]
    finally:
        r.close()
        server.stop()


def test_a_dropped_store_is_collected_while_reconnecting(tmp_path):
    import gc
    import weakref

    sock, path, server, r = _served(tmp_path, reconnect=True)
    server.stop()
    with pytest.raises(ServerGoneError):
        r.lookup(run_keys(0, 1))          # the reconnect thread starts, finds nobody
    time.sleep(1.5)                       # and waits between attempts
    ref = weakref.ref(r)
    del r
    deadline = time.monotonic() + 10
    while ref() is not None:
        gc.collect()
        assert time.monotonic() < deadline, "the reconnect thread kept the store alive"
        time.sleep(0.1)
    deadline = time.monotonic() + 15
    while [t for t in threading.enumerate() if t.name == "kvblock-reconnect"]:
        assert time.monotonic() < deadline, "the reconnect thread never ended"
        time.sleep(0.1)


@contextlib.contextmanager
def _a_read_stuck_on_the_server(tmp_path, **client):
    """A RemoteStore (``client`` options) whose thread's get_run of a stored
    key waits on the server until ``go`` is set: (store, key, go, that thread)."""
    sock = str(tmp_path / "kv.sock")
    server = serve_in_background([_store_file(tmp_path)], sock)
    real = server._op_segments
    go, arrived = threading.Event(), threading.Event()

    def stuck_segments(s, keys):
        arrived.set()
        go.wait(20)
        return real(s, keys)
    server._op_segments = stuck_segments
    r = RemoteStore(sock, timeout=30, **client)
    try:
        keys = run_keys(3, 1)
        r.put_run(keys, run_data(keys))
        t = threading.Thread(target=lambda: r.get_run(keys, np.zeros_like(run_data(keys))))
        t.start()
        # the call is on the server (sent, its answer awaited) before the
        # test looks: a sleep here lost that race on a loaded machine
        assert arrived.wait(20), "the read never reached the server"
        yield r, keys[0], go, t
    finally:
        go.set()
        r.close()
        server.stop()


def test_a_lookup_behind_an_overdue_call_answers_false_at_once(tmp_path):
    """contains_nowait / touch_nowait say they answer False (0) at once
    while another call has waited past ``timeout`` for its answer (a hung
    server), but they waited the whole ``wait`` for the connection first:
    a caller with a longer wait paid it on every key."""
    with _a_read_stuck_on_the_server(tmp_path) as (r, key, go, t):
        time.sleep(0.6)                     # that call is overdue for a timeout of 0.5 s
        assert r.answer_overdue(0.5)
        wait = 10.0
        start = time.monotonic()
        assert r.contains_nowait(key, wait, timeout=0.5) is False
        assert r.touch_nowait([key], wait, timeout=0.5) == 0
        # waiting for the connection would cost ``wait`` per call
        assert time.monotonic() - start < wait / 2, "it waited for the connection"
        go.set()
        t.join(10)
        assert r.contains_nowait(key, 3.0, timeout=0.5) is True


def test_a_lookup_does_not_wait_behind_a_stuck_call(tmp_path):
    """contains_nowait answers None (RETRY) while another thread's call is in
    flight, and False once that call has waited longer than its timeout (a
    hung server), not RETRY for as long as the stuck call's own limit."""
    with _a_read_stuck_on_the_server(tmp_path, reconnect=True) as (r, key, go, t):
        # in flight (the fixture saw it reach the server), not yet overdue
        # for a generous timeout, however slowly this thread was scheduled
        assert r.contains_nowait(key, 0.001, timeout=GENEROUS_S) is None
        time.sleep(0.6)
        assert r.answer_overdue(0.5)
        assert r.contains_nowait(key, 0.001, timeout=0.5) is False
        go.set()
        t.join(10)
        assert r.contains_nowait(key, 0.001, timeout=0.5) is True


def test_a_fork_while_locks_are_held_neither_hangs_nor_inherits_the_start_lock(tmp_path):
    """The at-fork handler takes no lock (a thread may hold one at the fork),
    close() in the child does not wait for a call in flight in the parent,
    and a child forked while a server is being started does not keep
    <socket>.lock locked."""
    import fcntl

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    with serve_in_background([path], sock):
        r = RemoteStore(sock, reconnect=True)
        try:
            s = r._session
            with s._held_lock, s.lock:             # as if inside hold() and a call
                def child():
                    try:
                        r.lookup(run_keys(0, 1))
                        return 1
                    except ServerGoneError as e:
                        r.close()
                        return 0 if "forked" in str(e) else 2
                assert exit_code_in_child(child) == 0      # it hangs on a held lock
            assert r.lookup(run_keys(0, 1)) == 0
        finally:
            r.close()

    from kvblock.store.client import ensure_server
    sock2 = str(tmp_path / "two.sock")
    forked = []

    def prepare():                               # runs under the start lock
        pid = os.fork()
        if pid == 0:
            time.sleep(20)
            os._exit(0)
        forked.append(pid)
    try:
        ensure_server(sock2, [path], prepare=prepare)
        fd = os.open(sock2 + ".lock", os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # the child does not hold it
        finally:
            os.close(fd)
    finally:
        for pid in forked:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        _kill_servers_of(sock2)


def test_a_server_of_another_release_is_refused_once_and_said_so(tmp_path, monkeypatch,
                                                                   caplog):
    """An in-place upgrade restarts the server from another release: its
    protocol differs, so the client stops retrying at once and every call
    says why, instead of failing as 'gone' for ever."""
    import logging

    import kvblock.store.server as server_mod
    from kvblock.errors import ProtocolMismatchError

    sock, path, server, r = _served(tmp_path, reconnect=True)
    try:
        server.stop()
        monkeypatch.setattr(server_mod, "PROTOCOL", 99)
        server = serve_in_background([path], sock)
        with caplog.at_level(logging.ERROR, logger="kvblock"):
            with pytest.raises(ServerGoneError):
                r.lookup(run_keys(0, 1))
            deadline = time.monotonic() + 10
            while "speaks store protocol" not in repr(r._session.gone):
                assert time.monotonic() < deadline, "the mismatch was never named"
                time.sleep(0.05)
        assert any("run one kvblock release" in rec.getMessage() for rec in caplog.records)
        with pytest.raises(ServerGoneError, match=f"speaks store protocol {PROTOCOL}, this server"):
            r.lookup(run_keys(0, 1))
        assert not [t for t in threading.enumerate() if t.name == "kvblock-reconnect"]
        with pytest.raises(ProtocolMismatchError, match="run one kvblock release"):
            RemoteStore(sock)
    finally:
        r.close()
        server.stop()


def test_a_copy_of_the_store_served_at_the_socket_is_refused(tmp_path):
    """A rank reconnects to a server of a copy of its store's image (same
    uuid, another file): it would do its I/O on its own file and commit it
    to the copy (acknowledged puts of other ranks dropped by false checksum
    failures, published runs whose bytes are elsewhere).  Refused."""
    import shutil

    from kvblock.errors import GeometryMismatchError
    from kvblock.store.server import spawn_server
    from tests.support.servers import stop_server

    path = _store_file(tmp_path)
    copy = str(tmp_path / "copy.img")
    shutil.copyfile(path, copy)
    sock = str(tmp_path / "kv.sock")
    server = spawn_server([path], sock)
    rank = RemoteStore(sock, reconnect=True)
    try:
        keys = run_keys(1, 2)
        rank.put_run(keys, run_data(keys))
        server.send_signal(signal.SIGKILL)
        server.wait(20)
        server = spawn_server([copy], sock)
        with pytest.raises(ServerGoneError):
            rank.lookup(keys)                      # notices the outage
        deadline = time.monotonic() + 20
        while rank._refused is None:
            assert time.monotonic() < deadline, "the copy's server was not refused"
            time.sleep(0.05)
        assert "another medium" in rank._refused
        with pytest.raises(ServerGoneError, match="another medium"):
            rank.lookup(keys)
        with pytest.raises(GeometryMismatchError, match="another medium"):
            RemoteStore(sock, devices=[path])       # nor taken at a first connect
    finally:
        rank.close()
        stop_server(server.pid)
        server.wait(20)


def test_connect_refuses_a_server_of_other_devices(tmp_path):
    """connect(sock, devices): the store served there must be on those
    devices (two replicas templating only their devices would otherwise
    share one store, and restarts would then refuse both for good)."""
    from kvblock.errors import GeometryMismatchError

    from tests.store.workload import small_store

    a, b = small_store(tmp_path / "a.img"), small_store(tmp_path / "b.img")
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([a], sock):
        with connect(sock, [a]) as rank:
            assert rank.lookup(run_keys(0, 1)) == 0
        with pytest.raises(GeometryMismatchError, match="not on .*b.img"):
            connect(sock, [b])


@pytest.mark.parametrize("closed_during", ["restart", "medium check"])
def test_a_reconnect_that_ends_after_close_leaves_no_open_files(tmp_path, monkeypatch,
                                                                closed_during):
    """close() while the reconnect thread starts a new server (which takes
    as long as the store's recovery) or checks the new one's medium: the
    thread ends quietly, and the new server's fence files, which its hello
    hands over, do not outlive the closed store (they hold store device 0
    open, a loop device too)."""
    from kvblock.store import client

    sock, path, server, r = _served(tmp_path, reconnect=True)
    server.stop()
    entered, closed, restarted = threading.Event(), threading.Event(), []

    def wait_for_close():
        entered.set()
        assert closed.wait(20)

    def restart():                        # a server that comes up after close()
        if closed_during == "restart":
            wait_for_close()
        restarted.append(serve_in_background([path], sock))
    r._restart = restart
    same_medium = client.same_medium

    def slow_same_medium(a, b):
        same = same_medium(a, b)
        if closed_during == "medium check":
            entered.set()
            closed.wait(2)                # (a close() that waits for the check: 2 s)
        return same
    monkeypatch.setattr(client, "same_medium", slow_same_medium)
    try:
        with pytest.raises(ServerGoneError):
            r.lookup(run_keys(0, 1))      # the reconnect thread starts
        assert entered.wait(20)
        r.close()
        closed.set()
        deadline = time.monotonic() + 20
        while [t for t in threading.enumerate() if t.name == "kvblock-reconnect"]:
            assert time.monotonic() < deadline, "the reconnect thread never ended"
            time.sleep(0.05)
        assert restarted, "the test needs the server started after close()"
        restarted.pop().stop()
        held = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass                          # listdir's own
        assert not [p for p in held if p in (path, sock + ".fence")], \
            f"the closed store still holds its files open: {held}"
    finally:
        closed.set()
        for s in restarted:
            s.stop()


def test_close_does_not_hang_on_a_ping_a_hung_server_never_answers(tmp_path, monkeypatch):
    """No timeout= and a hung server: the heartbeat's ping (sent while the
    rank holds a pin) never gets its answer.  close(), with no call of the
    caller's in flight, used to wait for that ping for good (an engine that
    never exits); it ends the connection under it after CLOSE_WAIT_S."""
    from kvblock.store import client

    monkeypatch.setattr(client, "CLOSE_WAIT_S", 1.0)
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock, pin_lease=0.4)   # pings every 0.1 s
    pinged, hung = threading.Event(), threading.Event()

    def ping(s):
        pinged.set()
        hung.wait(60)                     # a server that hangs (stopped, deadlocked)
    r = RemoteStore(sock)
    try:
        keys = run_keys(1, 2)
        r.put_run(keys, run_data(keys))
        r.pin(keys)
        monkeypatch.setattr(server, "_op_ping", ping)   # from here on the server hangs
        assert pinged.wait(10)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("out", r.close()), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "close() waits for the hung server's answer to a ping"
    finally:
        hung.set()
        r.close()
        server.stop()


def test_a_start_lock_held_by_a_stopped_rank_does_not_hang_the_others(tmp_path):
    """A rank stopped (SIGSTOP, a debugger) while it holds <socket>.lock to
    start the server: another rank's connect() waits no longer than its
    start_timeout and then raises ServerError naming the lock; and a server
    that starts meanwhile (an operator's `kvblock serve`) is used at once,
    lock or not."""
    import subprocess
    import sys

    from kvblock.errors import ServerError
    from kvblock.store.launch import ensure_server

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({sock + '.lock'!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.lockf(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        outcome = []

        def start(**kw):
            try:
                ensure_server(sock, [path], **kw)
                outcome.append("returned")
            except ServerError as e:
                outcome.append(e)

        t = threading.Thread(target=start, kwargs={"start_timeout": 1.0}, daemon=True)
        t.start()
        t.join(15)
        assert not t.is_alive(), "connect() hung behind a start lock held by a stopped rank"
        assert isinstance(outcome[0], ServerError) and "kv.sock.lock" in str(outcome[0])
        assert not os.path.exists(sock)                    # nothing was started

        outcome.clear()
        t = threading.Thread(target=start, daemon=True)    # default start_timeout
        t.start()
        with serve_in_background([path], sock):
            t.join(15)
            assert not t.is_alive() and outcome == ["returned"]
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_refused_rank_reconnects_once_its_store_is_served_again(tmp_path, monkeypatch):
    """A rank that found another store served at its socket was refused for
    good: after the operator restarted the server on the right store, its
    calls kept failing until the engine was restarted.  A later call tries
    again (at most every REFUSED_RETRY_S) and the rank serves again."""
    from kvblock.store import client as client_mod
    from tests.store.workload import small_store

    monkeypatch.setattr(client_mod, "REFUSED_RETRY_S", 0.0, raising=False)
    sock, path, server, r = _served(tmp_path, reconnect=True)
    other = small_store(tmp_path / "other.img")
    try:
        keys = run_keys(4, 2)
        assert r.put_run(keys, run_data(keys)) == 2
        server.stop()
        server = serve_in_background([other], sock)       # the wrong store, for a while
        with pytest.raises(ServerGoneError):
            r.lookup(keys)
        deadline = time.monotonic() + 20
        while r._refused is None:
            assert time.monotonic() < deadline, "the other store was not refused"
            time.sleep(0.02)
        server.stop()
        server = serve_in_background([path], sock)        # the operator's fix
        deadline = time.monotonic() + 20
        while True:
            try:
                assert r.lookup(keys) == 2
                break
            except ServerGoneError:
                assert time.monotonic() < deadline, "the refused rank never reconnected"
                time.sleep(0.05)
        out = np.zeros_like(run_data(keys))
        assert r.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
    finally:
        r.close()
        server.stop()


def test_a_copy_of_any_device_of_the_served_store_is_refused(tmp_path):
    """Only device 0 was checked to be the medium the server serves: a rank
    given a copy of device 1 (same store uuid and device index, another
    file) connected, and wrote its runs there while the server published
    them for the original.  Every device is checked now."""
    import shutil

    from kvblock import create_file
    from kvblock.errors import GeometryMismatchError
    from tests.store.workload import GEOM, REGION

    paths = [str(tmp_path / f"kv{i}.img") for i in range(2)]
    for p in paths:
        create_file(p, 8 << 20)
    KVStore.format(paths, GEOM, region_size=REGION).close()
    copy = str(tmp_path / "copy1.img")
    shutil.copyfile(paths[1], copy)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background(paths, sock):
        with pytest.raises(GeometryMismatchError, match="another medium than .*copy1.img"):
            RemoteStore(sock, devices=[paths[0], copy])
        with pytest.raises(GeometryMismatchError, match="copy1.img"):
            connect(sock, [paths[0], copy])
        with RemoteStore(sock, devices=paths[::-1]) as rank:    # the very media: served
            keys = [run_keys(i, 2) for i in range(4)]           # runs on both devices
            for k in keys:
                rank.put_run(k, run_data(k))
            for k in keys:
                out = np.zeros_like(run_data(k))
                assert rank.get_run(k, out) == 2 and np.array_equal(out, run_data(k))


def test_a_rank_in_another_directory_opens_the_devices_of_a_server_given_relative_paths(
        tmp_path, monkeypatch):
    """`kvblock serve kv0.img kv1.img` (paths relative to where it started):
    a rank given no devices opens the server's paths, which hello sent as
    typed, so a rank working in another directory failed with
    'kv0.img: no such device or file' (or found another kv0.img there).
    hello names the devices by absolute paths."""
    from kvblock import create_file
    from tests.store.workload import GEOM, REGION

    store_dir, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store_dir.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(store_dir)
    names = ["kv0.img", "kv1.img"]
    for name in names:
        create_file(name, 8 << 20)
    KVStore.format(names, GEOM, region_size=REGION).close()
    sock = str(tmp_path / "kv.sock")
    with serve_in_background(names, sock):
        monkeypatch.chdir(elsewhere)
        with RemoteStore(sock) as rank:
            assert [d.path for d in rank.io.devices] == [str(store_dir / n) for n in names]
            keys = [run_keys(i, 2) for i in range(4)]           # runs on both devices
            for k in keys:
                assert rank.put_run(k, run_data(k)) == 2
            for k in keys:
                out = np.zeros_like(run_data(k))
                assert rank.get_run(k, out) == 2 and np.array_equal(out, run_data(k))


def test_hello_names_a_device_path_through_a_symlinked_directory_as_the_server_opened_it(
        tmp_path, monkeypatch):
    """The server made its relative device paths absolute with abspath,
    which folds '..' by the text: 'lnk/../kv0.img', lnk a symlink to a
    directory elsewhere, is the kv0.img beside lnk's target (the file the
    server opened), but abspath made it the kv0.img beside lnk, which is
    not there, so a rank given no devices failed with DeviceNotFoundError
    even in the server's own directory.  The server's working directory is
    put in front of a relative path and the rest left to the kernel."""
    from kvblock import create_file
    from tests.store.workload import GEOM, REGION

    data, work = tmp_path / "data", tmp_path / "work"
    (data / "a").mkdir(parents=True)
    work.mkdir()
    (work / "lnk").symlink_to(data / "a")
    monkeypatch.chdir(work)
    names = ["lnk/../kv0.img", "lnk/../kv1.img"]
    for name in names:
        create_file(name, 8 << 20)
    assert (data / "kv0.img").exists() and not (work / "kv0.img").exists()
    KVStore.format(names, GEOM, region_size=REGION).close()
    sock = str(tmp_path / "kv.sock")
    with serve_in_background(names, sock), RemoteStore(sock) as rank:
        assert [os.path.realpath(d.path) for d in rank.io.devices] == \
            [str(data / "kv0.img"), str(data / "kv1.img")]
        keys = [run_keys(i, 2) for i in range(4)]           # runs on both devices
        for k in keys:
            assert rank.put_run(k, run_data(k)) == 2
        for k in keys:
            out = np.zeros_like(run_data(k))
            assert rank.get_run(k, out) == 2 and np.array_equal(out, run_data(k))


def test_a_rank_given_one_device_twice_is_told_so(tmp_path):
    """A rank's devices name one device twice (the same path, or a symlink to
    it) instead of each device of the store: refused as KVStore.open refuses
    it, naming both names, not as a device "not in the server's order" (a
    rank takes the devices in any order)."""
    from kvblock import create_file
    from kvblock.errors import MissingDeviceError
    from tests.store.workload import GEOM, REGION

    paths = [str(tmp_path / f"kv{i}.img") for i in range(2)]
    for p in paths:
        create_file(p, 8 << 20)
    KVStore.format(paths, GEOM, region_size=REGION).close()
    link = str(tmp_path / "link0.img")
    os.symlink(paths[0], link)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background(paths, sock):
        for devices in ([paths[0], link], [paths[1], paths[1]]):
            want = f"{devices[0]} and {devices[1]} are the same device; give each device once"
            with pytest.raises(ConfigError) as e:
                RemoteStore(sock, devices=devices)
            assert str(e.value) == want
            with pytest.raises(ConfigError) as e:
                connect(sock, devices, start=False)
            assert str(e.value) == want
        import shutil

        copy = str(tmp_path / "copy0.img")              # device 0 twice, by its content
        shutil.copyfile(paths[0], copy)
        with pytest.raises(MissingDeviceError, match=r"copy0.img is not device #1 of store "
                                                     r".*give each device of the store once"):
            RemoteStore(sock, devices=[paths[0], copy])
        with RemoteStore(sock, devices=[paths[1], link]) as rank:   # each once, any names
            keys = run_keys(1, 2)
            rank.put_run(keys, run_data(keys))
            out = np.zeros_like(run_data(keys))
            assert rank.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))


@pytest.mark.parametrize("field", ["region_size", "max_run_blocks"])
def test_a_malformed_hello_while_reconnecting_is_retried(tmp_path, monkeypatch, caplog, field):
    """A server whose hello lacks a field (KeyError in the client) is a
    failed attempt like any other: the reconnect thread says so and keeps
    trying, so once a proper server answers the store reconnects without
    another call starting a new thread."""
    import logging

    from kvblock.store.server import StoreServer

    sock, path, server, r = _served(tmp_path, reconnect=True)
    hellos = []
    real_hello = StoreServer._op_hello

    def bad_hello(self, s, protocol, pid=None):
        answer = real_hello(self, s, protocol, pid)
        hellos.append(answer.pop(field))
        return answer
    try:
        server.stop()
        monkeypatch.setattr(StoreServer, "_op_hello", bad_hello)
        server = serve_in_background([path], sock)
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            with pytest.raises(ServerGoneError):
                r.lookup(run_keys(0, 1))            # starts the reconnect thread
            deadline = time.monotonic() + 10
            while not hellos:
                assert time.monotonic() < deadline, "no reconnect was tried"
                time.sleep(0.02)
            monkeypatch.setattr(StoreServer, "_op_hello", real_hello)
            _wait_alive(r, 10)                      # no call meanwhile: the thread retried
        assert any("reconnecting to" in rec.getMessage() and field in rec.getMessage()
                   for rec in caplog.records)
        assert r.lookup(run_keys(0, 1)) == 0
    finally:
        r.close()
        server.stop()


def test_a_server_too_busy_to_accept_is_not_taken_for_none(tmp_path, monkeypatch):
    """A server whose listen backlog is full (its accept thread behind many
    ranks connecting at once) refuses a connect with a timeout with EAGAIN
    at once.  That was read as 'no server there': connect() took the start
    lock and spawned a second `kvblock serve`, which refused ('already
    listens'), and the rank failed with that ServerError instead of
    waiting.  A connect waits out its timeout for a place in the backlog,
    then raises ServerBusyError; nobody starts a server beside a live one."""
    import socket

    from kvblock.errors import ServerBusyError
    from kvblock.store import server as server_mod
    from kvblock.store.launch import ensure_server, wait_for_server

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    spawned = []
    monkeypatch.setattr(server_mod, "spawn_server",
                        lambda *a, **kw: spawned.append(a) or pytest.fail("spawned a server"))
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    queued = []
    try:
        busy.bind(sock)
        busy.listen(0)                 # a server that accepts nobody for now
        while True:                    # its backlog filled
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            queued.append(c)
            c.setblocking(False)
            try:
                c.connect(sock)
            except BlockingIOError:
                break
        start = time.monotonic()
        with pytest.raises(ServerBusyError, match=r"kv\.sock"):
            connect(sock, [path], timeout=0.5)
        assert time.monotonic() - start >= 0.5        # it waited for a place
        ensure_server(sock, [path], start_timeout=5)   # a server answers there
        wait_for_server(sock, timeout=5)
        assert spawned == []
    finally:
        for c in queued:
            c.close()
        busy.close()
        os.unlink(sock)



def _slow_close(server, seconds=3.0, until: threading.Event | None = None):
    """Make ``server``'s store close (its checkpoint) take ``seconds``,
    past the devices' busy_timeout (or last ``until`` is set, 60 s at
    most); the event is set when it begins."""
    closing = threading.Event()
    real_close = server.store.close

    def slow_close():
        closing.set()
        if until is None:
            time.sleep(seconds)
        else:
            until.wait(60)
        real_close()

    server.store.close = slow_close
    return closing


@pytest.mark.parametrize("when", ["closing", "accepted"])
def test_a_rank_connecting_while_the_server_stops_reaches_a_new_one(tmp_path, monkeypatch,
                                                                    when):
    """A rank connects while the server stops (its store's close, the
    checkpoint, is slow): its connection waits in the listen backlog
    ("closing"), or the accept loop took it just as stop() began and closed
    it ("accepted").  Either way connect() finds no server and starts one,
    which gave up on the devices the stopping one still held (ServerError).
    Now the stopping server stops listening first and the new one waits for
    the devices while their holder is a stopping server: the rank is served
    by the new server and reads what the old one stored."""
    from kvblock.store import server as server_mod

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    keys = run_keys(3, 2)
    server = serve_in_background([path], sock)
    accepted, gate = threading.Event(), threading.Event()
    r, stopper = None, threading.Thread(target=server.stop)
    try:
        with RemoteStore(sock) as first:
            first.put_run(keys, run_data(keys))
        closing = _slow_close(server)
        if when == "closing":
            stopper.start()
            assert closing.wait(10)
            r = connect(sock, [path], timeout=30, start_timeout=60)
        else:
            class HeldSession(server_mod._Session):
                def __init__(self, *a):
                    super().__init__(*a)
                    accepted.set()
                    gate.wait(30)            # the accept loop, between accept and serve

            monkeypatch.setattr(server_mod, "_Session", HeldSession)
            out = {}

            def rank():
                try:
                    out["store"] = connect(sock, [path], timeout=30, start_timeout=60)
                except BaseException as e:  # noqa: BLE001  (said by the assert below)
                    out["error"] = e

            t = threading.Thread(target=rank)
            t.start()
            assert accepted.wait(10)
            stopper.start()
            assert server._halt.wait(10)         # stop() began
            gate.set()
            t.join(90)
            assert "error" not in out, repr(out.get("error"))
            r = out["store"]
        assert r.server_pid != os.getpid()       # a new server, in its own process
        got = np.zeros_like(run_data(keys))
        assert r.get_run(keys, got) == 2 and np.array_equal(got, run_data(keys))
        stopper.join(30)
        assert server.stopped.is_set()
    finally:
        gate.set()
        if r is not None:
            r.close()
        server.stop()
        if stopper.is_alive():
            stopper.join(30)
        _kill_servers_of(sock)


def test_a_store_held_by_no_stopping_server_still_fails_fast(tmp_path):
    """Only a stopping server is waited for: a store that another process
    (here a KVStore open in this one) holds refuses a new server on a socket
    a server served before with DeviceBusyError, after the devices'
    busy_timeout, not after the wait for a stopping server."""
    from kvblock.errors import DeviceBusyError

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    serve_in_background([path], sock).stop()       # leaves kv.sock.fence behind
    assert os.path.exists(sock + ".fence")
    with KVStore.open([path]):
        start = time.monotonic()
        with pytest.raises(DeviceBusyError, match=r"kv\.img"):
            serve_in_background([path], sock)
        assert time.monotonic() - start < 10
    assert not os.path.exists(sock)


def test_a_server_that_ends_its_stop_just_as_the_new_one_finds_it_busy_is_waited_for(
        tmp_path, monkeypatch):
    """The stopping server lets go of the devices (and of its mark) just
    after the new server's open found them busy, before the new one looks
    for the mark: the mark was held when the new server began, so it opens
    again rather than failing with DeviceBusyError on devices now free."""
    from kvblock.store import server as server_mod

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    keys = run_keys(4, 2)
    old = serve_in_background([path], sock)
    with RemoteStore(sock) as r:
        r.put_run(keys, run_data(keys))
    closing = _slow_close(old, seconds=1.5)
    stopper = threading.Thread(target=old.stop)
    real = server_mod.KVStore

    class EndsMeanwhile:
        calls = 0

        @classmethod
        def open(cls, devices, **options):
            cls.calls += 1
            try:
                return real.open(devices, **options)
            except server_mod.DeviceBusyError:
                assert old.stopped.wait(30)   # the old server's stop ends right here
                raise

    monkeypatch.setattr(server_mod, "KVStore", EndsMeanwhile)
    new = None
    try:
        stopper.start()
        assert closing.wait(10)
        new = serve_in_background([path], sock)
        assert EndsMeanwhile.calls == 2
        got = np.zeros_like(run_data(keys))
        with RemoteStore(sock) as r:
            assert r.get_run(keys, got) == 2 and np.array_equal(got, run_data(keys))
    finally:
        stopper.join(30)
        old.stop()
        if new is not None:
            new.stop()


def test_a_server_waiting_for_a_stopping_one_stops_on_sigterm(tmp_path):
    """`kvblock serve` waiting (up to 120 s) for a stopping server's
    devices stops when it is told to (SIGTERM, Ctrl-C), not once the wait
    is over: here the old server holds its devices until the new one
    has exited."""
    import subprocess
    import sys

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    old = serve_in_background([path], sock)
    release = threading.Event()
    closing = _slow_close(old, until=release)
    stopper = threading.Thread(target=old.stop)
    proc = None
    try:
        stopper.start()
        assert closing.wait(10)
        proc = subprocess.Popen([sys.executable, "-m", "kvblock", "serve", path, "--socket",
                                 sock], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        seen = []
        for line in proc.stderr:              # EOF if it exits first (said by the assert)
            seen.append(line)
            if "waiting for it" in line:
                break
        assert "waiting for it" in "".join(seen), "".join(seen)
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(timeout=20)    # the old server holds on until then
        except subprocess.TimeoutExpired:
            pytest.fail("kvblock serve went on waiting for the devices after SIGTERM")
        assert status != 0 and not os.path.exists(sock)   # it served nothing
    finally:
        release.set()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            proc.stderr.close()
        stopper.join(30)
        old.stop()


def test_a_server_that_waited_in_vain_for_a_stopping_one_says_so(tmp_path, monkeypatch):
    """A new server that waited the whole STOPPING_WAIT_S for a stopping
    server's devices failed with the open's bare DeviceBusyError ("stop
    the other process"), not saying a stopping server was waited for."""
    from kvblock.errors import DeviceBusyError
    from kvblock.store import launch

    monkeypatch.setattr(launch, "STOPPING_WAIT_S", 0.5)
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    old = serve_in_background([path], sock)
    release = threading.Event()
    closing = _slow_close(old, until=release)
    stopper = threading.Thread(target=old.stop)
    try:
        stopper.start()
        assert closing.wait(10)
        with pytest.raises(DeviceBusyError, match=r"still held them after 0\.5 s") as e:
            serve_in_background([path], sock)
        assert "kv.img" in str(e.value)
    finally:
        release.set()
        stopper.join(30)
        old.stop()


def _restart_between(r, server_box, path, sock, method, at=2, **server_options):
    """Wrap ``r.<method>`` so that before its ``at``-th call the in-process
    server is stopped, a new one started (with ``server_options``) and ``r``
    reconnected to it."""
    real, calls = getattr(r, method), []

    def wrapped(*args, **kw):
        calls.append(1)
        if len(calls) == at:
            old_session = r._session
            server_box[0].stop()
            server_box[0] = serve_in_background([path], sock, **server_options)
            deadline = time.monotonic() + 20
            while r._session is old_session or not r.server_alive:
                with contextlib.suppress(ServerGoneError):
                    r.lookup([bytes(16)])   # finds the old session gone, reconnects
                assert time.monotonic() < deadline, "no reconnect"
                time.sleep(0.02)
        return real(*args, **kw)
    setattr(r, method, wrapped)
    return calls


def test_a_restart_between_the_pieces_of_a_put_fails_it_and_says_no_lie(tmp_path):
    """A run longer than max_run_blocks is put in pieces.  A server restart
    (and reconnect) between two pieces made the later piece carry the old
    server's clear ticket: refused as "cleared", the put returned 0 and
    counted cleared_puts while its first piece stayed published.  The later
    pieces are bound to the first one's server: the put raises
    ServerGoneError, as a put does when its server dies between pieces with
    no reconnect yet, and counts no clear."""
    sock, path, server, r = _served(tmp_path, reconnect=True)
    box = [server]
    try:
        step = r.max_run_blocks
        big = run_keys(7, step + 3)
        _restart_between(r, box, path, sock, "_put_one")
        with pytest.raises(ServerGoneError):
            r.put_run(big, run_data(big))
        del r._put_one
        assert r.counters["cleared_puts"] == 0
        assert r.lookup(big) == step             # the first piece stays, as committed
        assert r.put_run(big, run_data(big)) == len(big)
        got = np.zeros_like(run_data(big))
        assert r.get_run(big, got) == len(big) and np.array_equal(got, run_data(big))
    finally:
        r.close()
        box[0].stop()


def test_a_restart_between_the_groups_of_put_runs_fails_it_and_says_no_lie(tmp_path):
    """put_runs publishes its pieces in groups (one commit each); a run
    longer than a group spans two.  A restart (and reconnect) between the
    groups made the later group carry the old server's clear ticket: it was
    refused, the run answered 0 and counted cleared_puts while its pieces
    in the first group stayed published.  Bound to the server of the first
    commit, the call raises ServerGoneError (the groups before stay, as
    documented for an error while a group is written)."""
    sock, path, server, r = _served(tmp_path, reconnect=True)
    box = [server]
    try:
        step = r.max_run_blocks
        per_group = len(r._groups([(0, [b""] * step, None)] * 64, r.journal_bytes)[0])
        big, small = run_keys(8, step * (per_group + 1)), run_keys(9, 2)
        items = [(big, run_data(big)), (small, run_data(small))]
        _restart_between(r, box, path, sock, "_put_group")
        with pytest.raises(ServerGoneError):
            r.put_runs(items)
        del r._put_group
        assert r.counters["cleared_puts"] == 0
        assert r.lookup(big) == step * per_group     # the first group stays, as committed
        assert r.put_runs(items) == [len(big), len(small)]
        got = np.zeros_like(run_data(big))
        assert r.get_run(big, got) == len(big) and np.array_equal(got, run_data(big))
    finally:
        r.close()
        box[0].stop()


def test_a_reconnect_takes_the_new_servers_verify_default_unless_one_was_given(tmp_path):
    """verify=None means "the server's": after a reconnect to a server
    restarted with another --verify, the rank follows the new one (its
    hello is read again); a verify the rank was given stays its own."""
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock, verify="always")
    follows = RemoteStore(sock, reconnect=True)
    own = RemoteStore(sock, reconnect=True, verify="always")
    try:
        assert follows.verify == own.verify == "always"
        server.stop()
        for r in (follows, own):
            with pytest.raises(ServerGoneError):
                r.lookup(run_keys(1, 1))
        server = serve_in_background([path], sock, verify="never")
        _wait_alive(follows)
        _wait_alive(own)
        assert follows.counters["reconnects"] == own.counters["reconnects"] == 1
        assert follows.verify == "never"
        assert own.verify == "always"
    finally:
        follows.close()
        own.close()
        server.stop()


def test_a_reconnect_to_a_server_that_verifies_makes_cuda_loads_verify_too(tmp_path,
                                                                           monkeypatch):
    """The load path into CUDA memory is chosen once per store and cached;
    kvikio reads bypass the host checksums, so verify="always" means the
    host path.  A rank following the server's verify default (verify=None)
    that chose kvikio under a server with --verify never must not keep
    reading through kvikio, unverified, after a reconnect to one with
    --verify always."""
    from kvblock.io.gpu import gpu_path

    monkeypatch.setenv("KVBLOCK_GPU_PATH", "kvikio")
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock, verify="never")
    follows = RemoteStore(sock, reconnect=True)
    try:
        assert gpu_path(follows) == "kvikio"
        server.stop()
        with pytest.raises(ServerGoneError):
            follows.lookup(run_keys(1, 1))
        server = serve_in_background([path], sock, verify="always")
        _wait_alive(follows)
        assert follows.verify == "always"
        assert gpu_path(follows) == "host"
    finally:
        follows.close()
        server.stop()


def test_a_rank_connecting_while_a_server_recovers_uses_it_and_starts_none(tmp_path):
    """A `kvblock serve` that holds the devices but does not listen yet (a
    long recovery: an operator's server started with the engine, or one a
    rank started and then died): a rank's connect() used to start a second
    server, which found the devices busy and exited, and connect() failed
    with ServerError although a server was about to answer.  It waits for
    the starting server (up to start_timeout), then writes and reads through
    it."""
    import subprocess
    import sys

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    first = subprocess.Popen([sys.executable, "-m", "kvblock", "serve", path, "--socket", sock],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)

    def holds_store() -> bool:
        try:
            return any(os.readlink(f"/proc/{first.pid}/fd/{f}") == path
                       for f in os.listdir(f"/proc/{first.pid}/fd"))
        except OSError:
            return False

    resume = None
    try:
        deadline = time.monotonic() + 30
        while not holds_store():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(first.pid, signal.SIGSTOP)          # as a recovery of millions of blocks
        resume = threading.Timer(3.0, os.kill, (first.pid, signal.SIGCONT))
        resume.start()
        store = connect(sock, [path], start_timeout=30)
        try:
            assert store.stats()["server_pid"] == first.pid
            keys = run_keys(1, 3)
            assert store.put_run(keys, run_data(keys)) == 3
            out = np.zeros_like(run_data(keys))
            assert store.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))
        finally:
            store.close()
    finally:
        if resume is not None:
            resume.join()
        first.terminate()
        first.wait(30)
        _kill_servers_of(sock)


@pytest.mark.parametrize("how", ["no devices", "start=False"])
def test_a_rank_that_may_not_start_a_server_waits_for_one_starting(tmp_path, monkeypatch,
                                                                   how):
    """A rank that cannot start a server (connect() given no devices, or
    start=False) while one is starting there (its mark held: recovering
    the store) failed at once with ServerGoneError 'start one with kvblock
    serve', though one was about to answer.  It waits for that server (up
    to start_timeout), and connects once it listens."""
    from kvblock.store import launch

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    looks = threading.Semaphore(0)
    real = launch.server_starting

    def server_starting(socket_path):
        try:
            return real(socket_path)
        finally:
            looks.release()
    monkeypatch.setattr(launch, "server_starting", server_starting)
    args = (([path],), {"start": False}) if how == "start=False" else ((), {})
    result: dict = {}

    def rank():
        try:
            result["store"] = connect(sock, *args[0], start_timeout=60, **args[1])
        except BaseException as e:     # noqa: BLE001  (asserted on below)
            result["error"] = e
    mark = launch.announce_starting(sock)    # a server starting there (not listening yet)
    server = None
    t = threading.Thread(target=rank)
    try:
        t.start()
        for _ in range(2):             # it looked at the mark twice: it waits
            while not looks.acquire(timeout=0.05):
                assert t.is_alive(), f"connect() did not wait: {result}"
        assert t.is_alive(), f"connect() did not wait: {result}"
        server = serve_in_background([path], sock)
        launch.started(mark)
        mark = None
        t.join(60)
        assert not t.is_alive() and "store" in result, result
        with result["store"] as store:
            assert store.server_pid == os.getpid()
            keys = run_keys(1, 2)
            assert store.put_run(keys, run_data(keys)) == 2
    finally:
        if mark is not None:
            launch.started(mark)
        t.join(60)
        if result.get("store") is not None:
            result["store"].close()
        if server is not None:
            server.stop()


def test_a_rank_waiting_for_a_server_that_never_listens_is_told_so(tmp_path):
    """The wait above is bounded by start_timeout; its error names the socket."""
    from kvblock.errors import ServerError
    from kvblock.store import launch

    sock = str(tmp_path / "kv.sock")
    mark = launch.announce_starting(sock)
    try:
        with pytest.raises(ServerError, match="has not listened after 0.2 s") as e:
            connect(sock, start_timeout=0.2)
        assert sock in str(e.value)
    finally:
        launch.started(mark)


def test_a_server_in_a_removed_working_directory_serves_absolute_device_paths(
        tmp_path, monkeypatch):
    """hello's device paths took os.getcwd() for every path, absolute ones
    too: a server started from a working directory since removed (a
    deploy's old release folder, a test's tmp dir) failed to start with an
    untyped FileNotFoundError though every device path was absolute and
    needs no working directory (abspath asked for it only for a relative
    path).  Absolute paths go as given; a rank opens them."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with serve_in_background([path], sock), RemoteStore(sock) as rank:
        assert [d.path for d in rank.io.devices] == [path]
        keys = run_keys(1, 2)
        assert rank.put_run(keys, run_data(keys)) == 2
        out = np.zeros_like(run_data(keys))
        assert rank.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))


@pytest.mark.parametrize("restart_before", ["_count_rejected", "_admit"])
def test_a_new_server_counts_no_rejection_it_did_not_decide(tmp_path, restart_before):
    """put_runs' admits say count=false and the rank counts the declined
    runs with count_rejected once its plan stands.  A restart (and
    reconnect) between the admits and count_rejected, or between two
    admits, sent the count to the new server: its admission_rejected_runs
    counted runs the old server declined, which it never saw.  The call's
    admits and its count go to one server: the call raises ServerGoneError
    (as a put whose server died midway) and the new server counts nothing."""
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    box = [serve_in_background([path], sock, admit_after=2)]
    r = RemoteStore(sock, reconnect=True)
    try:
        a, b = run_keys(1, 2), run_keys(2, 2)
        _restart_between(r, box, path, sock, restart_before,
                         at=1 if restart_before == "_count_rejected" else 2)
        with pytest.raises(ServerGoneError):
            r.put_runs([(a, run_data(a)), (b, run_data(b))])
        delattr(r, restart_before)
        assert box[0].store.counters["admission_rejected_runs"] == 0
        assert r.stats()["admission_rejected_runs"] == 0
    finally:
        r.close()
        box[0].stop()


def test_a_restart_between_a_puts_admit_and_its_write_fails_it_and_gives_back_nothing(
        tmp_path):
    """A single-run put admits its run, then allocates, writes and commits.
    A restart (and reconnect) between the admit and the allocation sent the
    rest to the new server: the commit carried the old server's clear
    ticket, was refused, the put answered 0 and counted cleared_puts (no
    clear came), and the offer given back reached the new server, which
    had never counted it: it admitted the key's next offer at once (with
    admit_after=2 the first one is declined).  The put's calls go to one
    server, as put_runs': the put raises ServerGoneError."""
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    box = [serve_in_background([path], sock, admit_after=2)]
    r = RemoteStore(sock, reconnect=True)
    try:
        a = run_keys(1, 2)
        assert r.put_run(a, run_data(a)) == 0          # the first offer: declined
        _restart_between(r, box, path, sock, "_put_one", at=1, admit_after=2)
        with pytest.raises(ServerGoneError):
            r.put_run(a, run_data(a))                  # admitted by the old server
        del r._put_one
        assert r.counters["cleared_puts"] == 0
        # the new server saw no offer of it: the first one there is declined
        assert r.put_run(a, run_data(a)) == 0
        assert r.put_run(a, run_data(a)) == 2
    finally:
        r.close()
        box[0].stop()


@pytest.mark.parametrize("many", [False, True])
def test_an_offer_of_a_put_abandoned_after_a_timeout_is_given_back_once_reconnected(
        tmp_path, many, monkeypatch):
    """A put admitted by a live server whose allocation is not answered in
    time (timeout=): its connection is abandoned, and the offer it gives
    back went to that connection, refused there: the server's admission
    kept the offer used up, so after the reconnect (to the same server)
    the key's next offer was declined again (admit_after=2: a third
    offer to store it).  The server gives the offer back itself once the
    abandoned connection ends there (the client no longer sends it again
    on its new connection: given back twice, see
    test_a_declined_offer_is_given_back_once_not_again_on_a_new_connection),
    and given back once: the put after it is admitted, and stores the run.
    (Only the allocation's answer has the short timeout=, every other
    call a generous one; the allocation waits until the test lets it go.)"""
    from tests.serve.test_pin_lease import _until

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock, admit_after=2)
    real, hang = server._op_allocate, threading.Event()
    entered, release = threading.Event(), threading.Event()

    def slow_allocate(s, **kw):
        if hang.is_set():
            entered.set()
            release.wait(60)
        return real(s, **kw)
    server._op_allocate = slow_allocate
    short_timeout_on(monkeypatch, {"allocate"}, 0.5, when=hang.is_set)   # the hung answer
    r = RemoteStore(sock, reconnect=True, timeout=GENEROUS_S)
    try:
        a, b = run_keys(1, 2), run_keys(2, 2)

        def put():
            if many:    # put_runs' own path (several runs: its give_back of the unstored)
                return r.put_runs([(a, run_data(a)), (b, run_data(b))])[0]
            return r.put_run(a, run_data(a))
        assert put() == 0                        # the first offers: declined
        hang.set()
        with pytest.raises(ServerGoneError, match="allocate"):
            put()                                # admitted, then abandoned
        hang.clear()
        assert entered.is_set()                  # (its allocation was what timed out)
        old = r._session
        deadline = time.monotonic() + 60
        while r._session is old or not r.server_alive:
            with contextlib.suppress(ServerGoneError):
                r.lookup([bytes(16)])
            assert time.monotonic() < deadline, "no reconnect"
            time.sleep(0.02)
        assert r.server_pid == os.getpid()       # the same server
        # the abandoned connection still on the server: its offer still used up
        assert server.store.admission._offers.get(normalize_keys(a)[0]) is None
        release.set()                            # its allocation answered: it ends there
        _until(lambda: server.store.admission._offers.get(normalize_keys(a)[0]) == 1)
        assert put() == 2                        # admitted: the offer came back
        assert server.store.admission._offers.get(normalize_keys(a)[0]) is None
    finally:
        release.set()
        r.close()
        server.stop()


@pytest.mark.parametrize("lost", ["admit", "give_back"])
def test_a_declined_offer_is_given_back_once_not_again_on_a_new_connection(
        tmp_path, lost, monkeypatch):
    """A put_runs refused after its admits gives its declined offers back.
    Where that give_back could not go out (another admit's answer lost:
    the connection abandoned) or went out but its answer was lost, the
    client kept the offers as owed and sent them again on its next
    connection to the same server.  But the server had given them back
    already: itself when the abandoned connection ended, or on the
    give_back that reached it.  Given back twice, a declined offer counted
    one offer less: another rank's offer of the key made meanwhile was
    cancelled (admit_after=3: rank B's offer count fell from 1 to 0, and
    the key needed a fourth offer to be stored).  Now each offer is given
    back once: by the put on its connection, or by the server when that
    connection ends."""
    from tests.serve.test_pin_lease import _until

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    with serve_in_background([path], sock, admit_after=3) as server:
        adm = server.store.admission
        k, x, y = run_keys(1, 2), run_keys(2, 2), run_keys(3, 2)
        k0, x0 = normalize_keys(k)[0], normalize_keys(x)[0]     # (as admission keeps them)
        hold, entered, release = threading.Event(), threading.Event(), threading.Event()
        real_admit, real_give_back = server._op_admit, server._op_give_back

        def admit(s, keys, count=True):
            if hold.is_set() and decode_keys(keys)[0] == x0:
                if lost == "admit":          # answered once the client has given up
                    entered.set()
                    release.wait(20)
                else:                        # the call is refused after its first admit
                    raise ConfigError("test: x refused")
            return real_admit(s, keys, count)

        def give_back(s, offers):
            out = real_give_back(s, offers)
            if hold.is_set() and lost == "give_back":   # given back, its answer held
                entered.set()
                release.wait(20)
            return out
        server._op_admit, server._op_give_back = admit, give_back
        short_timeout_on(monkeypatch, {lost}, 0.3, when=hold.is_set)
        with RemoteStore(sock, timeout=GENEROUS_S, reconnect=True) as a, \
                RemoteStore(sock, timeout=GENEROUS_S) as b:
            hold.set()
            with pytest.raises((ServerGoneError, ConfigError)):
                a.put_runs([(k, run_data(k)), (x, run_data(x))])
            assert entered.is_set()
            hold.clear()
            release.set()
            # the abandoned connection ended on the server: k's declined
            # offer given back once (there, or by the give_back that came)
            _until(lambda: adm._offers.get(k0) is None and adm._offers.get(x0) is None)
            assert b.put_run(k, run_data(k)) == 0      # rank B's first offer: declined
            assert adm._offers.get(k0) == 1
            _wait_alive(a)
            assert a.put_run(y, run_data(y)) == 0      # a's next put on its new connection
            assert adm._offers.get(k0) == 1, "rank B's offer was cancelled"
            assert b.put_run(k, run_data(k)) == 0      # the second offer
            assert b.put_run(k, run_data(k)) == 2      # the third: admitted


# where the put stalls (its thread held until another call has timed out
# and the connection is given up): (put_runs of two runs?, the op whose
# answer it stalls after, how many of them) -- "write": its first run
# written (_write_allocated returned)
_PUT_STALLS = {
    "admitted": (False, "admit", 1),                  # the allocate is next
    "admitted, put_runs": (True, "admit", 2),         # the last admit answered
    "allocated": (False, "allocate", 1),              # allocate answered: counted
    "allocated, put_runs": (True, "allocate", 1),     # on the connection only then
    "written": (False, "write", 1),                   # its commit is next
    "allocated one of two": (True, "write", 1),       # the group's second allocate next
}


@pytest.mark.parametrize("where", list(_PUT_STALLS))
def test_a_put_whose_connection_another_calls_timeout_gave_up_says_so(tmp_path, where,
                                                                     monkeypatch):
    """A put in flight when another thread's call on the same RemoteStore
    timed out (timeout=): the connection that allocated its space was given
    up, so its commit could not go out.  It raised ServerGoneError saying
    the server was gone (or what another call met), though the server
    lived; where the timeout landed between the allocation and its count
    on the connection, the connection was closed at once under the put.
    Now ConnectionAbandonedError (a ServerGoneError) says what happened
    and that a retry works; nothing is left on the server (the space goes
    back, the offer is given back: with admit_after=2 the retry is
    admitted), and the retry, once reconnected, stores the run.

    Given up before its ALLOCATE request went out, the error said the
    connection "the put's space was allocated on was given up before the
    put's commit could go out", where nothing was allocated (the put was
    only admitted), or where the runs allocated before it in its group
    were given back.  It says which request could not go out and what
    became of the space (nothing allocated / given back)."""
    from kvblock.errors import ConnectionAbandonedError
    from tests.serve.test_pin_lease import _until
    from tests.serve.test_write_fence import _in_thread

    many, stall_after, nth = _PUT_STALLS[where]
    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    with serve_in_background([path], sock, admit_after=2) as server:
        # answered once the client has given up on it; only its answer has
        # the short timeout= (no call races a loaded machine)
        let_go = hold_checkpoint(server)
        short_timeout_on(monkeypatch, {"checkpoint"}, 0.3)
        r = RemoteStore(sock, timeout=GENEROUS_S, reconnect=True)
        try:
            a, b = run_keys(1, 2), run_keys(2, 2)

            def put():
                if many:
                    return r.put_runs([(a, run_data(a)), (b, run_data(b))])[0]
                return r.put_run(a, run_data(a))
            assert put() == 0                          # the first offers: declined
            reached, go, seen = threading.Event(), threading.Event(), [0]

            def stall():
                seen[0] += 1
                if seen[0] == nth:
                    reached.set()
                    assert go.wait(20)
            if stall_after == "write":
                real = r._write_allocated

                def stalled_write(*args, **kw):
                    out = real(*args, **kw)
                    stall()
                    return out
                r._write_allocated = stalled_write
            else:
                real_call_on = r._call_on

                def stalled_call(s, op, **args):
                    out = real_call_on(s, op, **args)
                    if op == stall_after:
                        stall()
                    return out
                r._call_on = stalled_call
            box = _in_thread(put)
            assert reached.wait(20)
            with pytest.raises(ServerGoneError, match="did not answer checkpoint in time"):
                r.checkpoint()
            let_go()
            go.set()
            box["thread"].join(20)
            err = box.get("error")
            assert isinstance(err, ConnectionAbandonedError), box
            assert isinstance(err, ServerGoneError)
            text = str(err).lower()
            assert "checkpoint" in text and "timeout" in text and "given up" in text, text
            assert "not stored" in text and "retry" in text, text
            assert "is gone" not in text, text
            if where.startswith("admitted") or where == "allocated one of two":
                assert "commit could go out" not in text, text
                assert "allocat" in text and "could go out" in text, text
            if where == "allocated one of two":
                assert "given back" in text, text
                assert "nothing was allocated" not in text, text
            elif where.startswith("admitted"):
                assert "nothing was allocated" in text, text
            for name in ("_write_allocated", "_call_on"):
                with contextlib.suppress(AttributeError):
                    delattr(r, name)
            _wait_alive(r)
            _until(lambda: server.store.regions.pins.sum() == 0)   # nothing held there
            assert server.store.lookup(a) == 0
            assert r.counters["put_runs"] == 0 and r.counters["cleared_puts"] == 0
            assert put() == 2                          # admitted: the offer came back
            assert r.lookup(a) == 2
            assert server.store.counters["put_runs"] == (2 if many else 1)
        finally:
            let_go(wait=False)
            r.close()


@pytest.mark.parametrize("many", [False, True])
def test_an_offer_of_a_put_abandoned_without_reconnect_is_given_back_by_the_server(
        tmp_path, many, monkeypatch):
    """reconnect=False: a put admitted by a live server whose allocation is
    not answered in time (timeout=) fails (its connection abandoned), and
    the offer it gives back is refused there.  (The client then sent such
    offers again only with reconnect=True, on its new connection; it no
    longer does.)  The server's admission kept the offer used up: the
    key's next offer, from a new RemoteStore, was declined again
    (admit_after=2).  The server gives back the offers admitted on a
    connection that ended before their puts were committed or given back."""
    from tests.serve.test_pin_lease import _until

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    with serve_in_background([path], sock, admit_after=2) as server:
        real, hold, release = server._op_allocate, threading.Event(), threading.Event()

        def slow_allocate(s, **kw):
            if hold.is_set():
                release.wait(20)        # answered once the client has given up
            return real(s, **kw)
        server._op_allocate = slow_allocate
        a, b = run_keys(1, 2), run_keys(2, 2)

        def put(r):
            if many:
                return r.put_runs([(a, run_data(a)), (b, run_data(b))])[0]
            return r.put_run(a, run_data(a))
        short_timeout_on(monkeypatch, {"allocate"}, 0.3, when=hold.is_set)   # the held answer
        with RemoteStore(sock, timeout=GENEROUS_S) as r:
            assert put(r) == 0                    # the first offers: declined
            hold.set()
            with pytest.raises(ServerGoneError, match="allocate"):
                put(r)                            # admitted, then abandoned
            hold.clear()
            release.set()
        _until(lambda: server.client_count() == 0)   # the connection ended there
        _until(lambda: server.store.regions.pins.sum() == 0)   # its space went back
        with RemoteStore(sock) as r:
            assert put(r) == 2                    # admitted: the offer came back
            assert r.lookup(a) == 2
        # a put stored, its connection ended: nothing given back for it
        assert server.store.admission._offers.get(a[0]) is None


def test_a_reconnect_starts_no_server_once_the_store_is_closed(tmp_path, monkeypatch):
    """connect(devices, reconnect=True): the reconnect thread, finding no
    server, starts one (ensure_server).  A close() that came while it was
    on its way there (here: while it looked for a server starting without
    it, the last look before the start) did not stop it: a `kvblock serve`
    was started for a store nobody used any more, and left running.  Now
    close() wins: no server process is started once close() has set the
    store closed, and no session is adopted."""
    import types

    from kvblock.store import launch, server as server_module

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock)
    r = connect(sock, [path], reconnect=True)
    reached, go, spawned = threading.Event(), threading.Event(), []
    real_wait = launch.wait_for_starting_server

    def last_look(socket_path, timeout, stop=None):
        reached.set()                     # the thread is about to start a server
        assert go.wait(20)
        return real_wait(socket_path, timeout, stop)

    def popen(cmd, **kw):                 # a server process would be started here
        spawned.append(cmd)
        raise OSError("test: no server process")
    monkeypatch.setattr(launch, "wait_for_starting_server", last_look)
    monkeypatch.setattr(server_module, "subprocess",
                        types.SimpleNamespace(Popen=popen, DEVNULL=-3))
    try:
        old = r._session
        server.stop()
        with pytest.raises(ServerGoneError):
            r.lookup(run_keys(0, 1))      # the reconnect thread starts
        assert reached.wait(20)
        thread = r._reconnector
        r.close()
        go.set()
        thread.join(20)
        assert not thread.is_alive()
        assert spawned == [], "a server was started for a closed store"
        assert r._session is old and r.counters["reconnects"] == 0
    finally:
        go.set()
        r.close()
        server.stop()


@pytest.mark.parametrize("waits_for", ["a starting server", "the start lock"])
def test_close_ends_a_reconnect_waiting_in_ensure_server(tmp_path, waits_for, monkeypatch):
    """connect(devices, reconnect=True): the reconnect thread, finding no
    server, went into ensure_server, which waits (up to start_timeout) for
    a server another process is starting there, or for this process's
    start lock another thread holds (no limit).  A close() meanwhile
    started nothing, but the thread lingered there until that wait ended,
    holding the store (and, in the lock file's wait, its descriptor).
    close() now ends it at its next look."""
    from kvblock.store import launch

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    server = serve_in_background([path], sock)
    r = connect(sock, [path], reconnect=True, start_timeout=120)
    waiting = threading.Event()
    held = threading.Lock()
    if waits_for == "a starting server":
        def starting(socket_path):           # another process's server starts there
            waiting.set()
            return True
        monkeypatch.setattr(launch, "server_starting", starting)
    else:
        real_lock = launch._START_LOCK

        class Lock:       # another thread of this process starts a server
            def acquire(self, blocking=True, timeout=-1):
                waiting.set()
                return held.acquire(blocking, timeout)

            def release(self):
                held.release()

            def __enter__(self):
                self.acquire()
                return self

            def __exit__(self, *exc):
                self.release()
        held.acquire()
        monkeypatch.setattr(launch, "_START_LOCK", Lock())
    try:
        server.stop()
        with pytest.raises(ServerGoneError):
            r.lookup(run_keys(0, 1))      # the reconnect thread starts
        assert waiting.wait(20)
        thread = r._reconnector
        r.close()
        thread.join(5)
        assert not thread.is_alive(), "the reconnect thread lingered after close()"
    finally:
        if waits_for == "the start lock":
            held.release()
            monkeypatch.setattr(launch, "_START_LOCK", real_lock)
        r.close()
        server.stop()


def test_close_ends_a_reconnects_hello_a_hung_server_never_answers(tmp_path, monkeypatch):
    """reconnect=True, no timeout=: a connection given up on (a
    contains_nowait past its own timeout) is replaced by the reconnect
    thread, whose hello the server (hung) never answers.  close() ended
    the store's own connection under a call that waited, but not the one
    the thread was saying hello on: the thread waited for good, holding
    the store and a connection open after close().  close() now ends it."""
    sock, path, server, r = _served(tmp_path, reconnect=True)
    hung, in_hello = threading.Event(), threading.Event()
    real_lookup, real_hello = server._op_lookup, server._op_hello

    def hung_lookup(s, keys):
        hung.wait(30)
        return real_lookup(s, keys)

    def hung_hello(s, **kw):
        in_hello.set()
        hung.wait(30)
        return real_hello(s, **kw)
    try:
        monkeypatch.setattr(server, "_op_lookup", hung_lookup)
        monkeypatch.setattr(server, "_op_hello", hung_hello)
        with pytest.raises(ServerGoneError):
            r.contains_nowait(run_keys(0, 1)[0], 1.0, timeout=0.2)   # given up on
        assert in_hello.wait(20)          # the thread's hello: never answered
        thread = r._reconnector
        r.close()
        thread.join(5)
        assert not thread.is_alive(), "the reconnect thread still waits after close()"
        assert r.counters["reconnects"] == 0
    finally:
        hung.set()
        r.close()
        server.stop()
