"""The write fence (kvblock/store/fence.py): a rank's write of a dead
server's allocation never lands on space a restarted server handed out
again, and a new owner of the store waits for writes still in flight."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.errors import DeviceBusyError, KVBlockError
from kvblock.store import fence as fence_mod
from kvblock.store.client import RemoteStore, ServerGoneError
from kvblock.store.server import serve_in_background
from tests.serve.test_serve import _store_file
from tests.store.workload import run_data, run_keys


class _Stall:
    """``obj.<method>`` stops the calling thread (after the real call when
    ``after``, else before it) until ``go`` is set."""

    def __init__(self, obj, method: str, after: bool = False):
        self.reached, self.go = threading.Event(), threading.Event()
        real = getattr(obj, method)

        def stalled(*args, **kw):
            out = real(*args, **kw) if after else None
            self.reached.set()
            assert self.go.wait(30)
            return out if after else real(*args, **kw)
        setattr(obj, method, stalled)


def _in_thread(fn):
    """Run ``fn()`` in a thread; a dict that gets its result or exception."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001  (the test looks at it)
            box["error"] = e
    box["thread"] = t = threading.Thread(target=run, daemon=True)
    t.start()
    return box


def _stalled_put(store: RemoteStore):
    """Start a put of 2 blocks on ``store`` in a thread and wait until it
    stops inside its write: (the _Stall, the thread's box, the keys)."""
    stall = _Stall(store, "_write_run")
    keys = run_keys(1, 2)
    box = _in_thread(lambda: store.put_run(keys, run_data(keys)))
    assert stall.reached.wait(20)
    return stall, box, keys


def _release_fenced_writer(stall, box, a: RemoteStore, b: RemoteStore, kb, why: str) -> None:
    """Let A's stalled write go on after B stored ``kb`` where A was to
    write: A's write is refused (fenced), and B's run reads back whole."""
    stall.go.set()
    box["thread"].join(20)
    got = np.zeros_like(run_data(kb))
    assert b.get_run(kb, got) == 2
    assert np.array_equal(got, run_data(kb)), why
    assert isinstance(box.get("error"), ServerGoneError), box
    assert a.counters["fenced_writes"] == 1


def _allocations(store: RemoteStore) -> list:
    """Record the (region, offset) of every allocation ``store`` gets."""
    seen = []
    real = store._call_on

    def call_on(s, op, **args):
        out = real(s, op, **args)
        if op == "allocate":
            seen.append((out["region"], out["offset"]))
        return out
    store._call_on = call_on
    return seen


def test_a_write_of_a_dead_servers_allocation_is_refused(tmp_path):
    """Rank A is allocated space, stalls before writing; the server stops and
    a new one hands the same space to rank B, which commits there.  A's write
    must not land: without the fence B reads A's bytes (verify="never")."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    a = RemoteStore(sock, verify="never")
    b = None
    try:
        a_space = _allocations(a)
        stall = _Stall(a, "_stage_run", after=True)     # staged, not yet written
        ka, kb = run_keys(1, 2), run_keys(2, 2)
        box = _in_thread(lambda: a.put_run(ka, run_data(ka)))
        assert stall.reached.wait(20)
        server.stop()
        server = serve_in_background([path], sock)
        b = RemoteStore(sock, verify="never")
        b_space = _allocations(b)
        assert b.put_run(kb, run_data(kb)) == 2
        assert b_space == a_space, "the test needs the new server to reuse A's space"
        _release_fenced_writer(stall, box, a, b, kb, "a dead server's allocation was written over")
        assert "was not written" in str(box["error"])
    finally:
        a.close()
        if b is not None:
            b.close()
        server.stop()


def test_a_new_owner_waits_for_a_write_in_flight(tmp_path, monkeypatch):
    """Rank A stops inside its write; the server stops.  Opening the store
    waits for A (and gives up with a DeviceBusyError that names the device
    and the way out when A takes too long); once A's write is done the
    store opens, and A's run, never committed, is not there."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    a = RemoteStore(sock, verify="never")
    try:
        stall, box, ka = _stalled_put(a)
        server.stop()
        monkeypatch.setattr(fence_mod, "FENCE_WAIT_S", 0.3)
        with pytest.raises(DeviceBusyError, match=r"stopped \(state T\)") as e:
            KVStore.open([path])
        assert path in str(e.value)
        monkeypatch.setattr(fence_mod, "FENCE_WAIT_S", 30.0)
        opening = _in_thread(lambda: serve_in_background([path], sock))
        time.sleep(0.5)
        assert opening["thread"].is_alive(), "the store opened while a rank still wrote to it"
        stall.go.set()
        opening["thread"].join(20)
        server = opening["out"]
        box["thread"].join(20)
        assert isinstance(box.get("error"), ServerGoneError), box   # its commit found no server
        with RemoteStore(sock) as b:
            assert b.lookup(ka) == 0
    finally:
        a.close()
        server.stop()


def test_a_server_waits_for_a_rank_that_fences_on_its_socket(tmp_path, monkeypatch):
    """A rank whose device node is another inode (a container's own /dev) is
    fenced through ``<socket>.fence``: a server starting on that socket waits
    for its write."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    serve_in_background([path], sock).stop()         # makes <socket>.fence
    rank = fence_mod.WriteFence([fence_mod.os.open(fence_mod.socket_fence_path(sock),
                                                   fence_mod.os.O_RDONLY)])
    monkeypatch.setattr(fence_mod, "FENCE_WAIT_S", 0.3)
    try:
        with rank.writing():
            with pytest.raises(DeviceBusyError, match=r"kv\.sock\.fence"):
                serve_in_background([path], sock)
        serve_in_background([path], sock).stop()      # and with the write done it starts
    finally:
        rank.close()


def test_a_rank_on_another_inode_and_socket_path_is_fenced(tmp_path, loop_device,
                                                           monkeypatch):
    """The server sends the files it fences on with its hello: a rank that
    reaches the store through a loop device over the server's store file (a
    container's own device node) and the socket through a symlink (its own
    <socket>.fence is not there) still holds the server's locks."""
    from tests.serve.test_serve import _format
    from tests.support.loopdev import backing_of

    dev = loop_device(8 << 20)
    store_file = backing_of(dev)
    _format(store_file)
    sock = str(tmp_path / "kv.sock")
    (tmp_path / "elsewhere").mkdir()
    alias = str(tmp_path / "elsewhere" / "kv.sock")
    os.symlink(sock, alias)
    server = serve_in_background([store_file], sock)
    a = RemoteStore(alias, devices=[dev], verify="never")
    try:
        stall, box, ka = _stalled_put(a)
        server.stop()
        monkeypatch.setattr(fence_mod, "FENCE_WAIT_S", 0.3)
        with pytest.raises(DeviceBusyError):
            serve_in_background([store_file], sock)
        stall.go.set()
        box["thread"].join(20)
        assert isinstance(box.get("error"), ServerGoneError), box
        server = serve_in_background([store_file], sock)
    finally:
        a.close()
        server.stop()


def test_a_server_that_sends_no_fence_files_is_refused(tmp_path, monkeypatch):
    import socket

    import kvblock.store.session as session_mod
    from kvblock.errors import ProtocolMismatchError

    monkeypatch.setattr(socket, "send_fds", lambda *args: None)   # (the server's only use)
    monkeypatch.setattr(session_mod, "FENCE_FILES_WAIT_S", 0.5)
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    try:
        with pytest.raises(ProtocolMismatchError, match="did not send its fence files"):
            RemoteStore(sock)
    finally:
        server.stop()


def test_a_server_short_of_descriptors_at_hello_is_retried_not_refused(tmp_path, monkeypatch):
    """A server that cannot open the fence files it hands out (out of
    descriptors), or closes the connection right after hello, is a passing
    trouble: the rank is told so (ServerError / ServerGoneError, which a
    reconnecting rank retries), never ProtocolMismatchError, which would
    make it refuse that server for good."""
    import socket

    from kvblock.errors import ProtocolMismatchError, ServerError, ServerGoneError
    from kvblock.store.server import StoreServer

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    try:
        real = StoreServer._fence_files

        def out_of_fds(self):
            raise OSError(24, "Too many open files")
        monkeypatch.setattr(StoreServer, "_fence_files", out_of_fds)
        with pytest.raises(ServerError, match="cannot hand out its fence files now") as e:
            RemoteStore(sock)
        assert not isinstance(e.value, ProtocolMismatchError)
        monkeypatch.setattr(StoreServer, "_fence_files", real)

        def hang_up(conn, *args):
            conn.shutdown(socket.SHUT_RDWR)
        monkeypatch.setattr(socket, "send_fds", hang_up)
        with pytest.raises(ServerGoneError, match="closed the connection right after hello"):
            RemoteStore(sock)
        monkeypatch.undo()
        with RemoteStore(sock) as rank:                  # and then it serves again
            assert rank.lookup([b"k"]) == 0
    finally:
        server.stop()


def test_close_waits_for_a_write_in_flight_in_another_thread(tmp_path):
    """close() from one thread while another writes: the connection (and
    with it the server's pin on the space) stays until the write is done,
    so the server cannot hand that space out under it."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    a = RemoteStore(sock, verify="never")
    try:
        stall, box, ka = _stalled_put(a)
        closing = _in_thread(a.close)
        time.sleep(0.5)
        assert closing["thread"].is_alive(), "close() did not wait for the write"
        assert server.store.regions.pins.sum() == 1, "the space was given back mid-write"
        stall.go.set()
        closing["thread"].join(20)
        box["thread"].join(20)
        assert "error" not in closing, closing
        deadline = time.monotonic() + 10
        while server.store.regions.pins.sum():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with RemoteStore(sock, verify="never") as b:   # the put got in before the close, or not
            if box.get("out") == 2:
                got = np.zeros_like(run_data(ka))
                assert b.get_run(ka, got) == 2 and np.array_equal(got, run_data(ka))
            else:
                assert isinstance(box.get("error"), KVBlockError), box
                assert b.lookup(ka) == 0
    finally:
        a.close()
        server.stop()


def test_a_store_dropped_without_close_leaves_no_open_files(tmp_path):
    import gc

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    try:
        with RemoteStore(sock) as warm:         # the first client warms caches up
            warm.put_run(run_keys(0, 1), run_data(run_keys(0, 1)))
        gc.collect()
        before = len(os.listdir("/proc/self/fd"))
        for i in range(1, 4):
            r = RemoteStore(sock)
            r.put_run(run_keys(i, 1), run_data(run_keys(i, 1)))
            del r
        gc.collect()
        deadline = time.monotonic() + 10     # its threads let go of it within a tick
        while len(os.listdir("/proc/self/fd")) > before:
            assert time.monotonic() < deadline, os.listdir("/proc/self/fd")
            time.sleep(0.05)
            gc.collect()
    finally:
        server.stop()


def test_a_write_close_gave_up_waiting_for_keeps_its_space_until_done(tmp_path, monkeypatch):
    """close() waits CLOSE_WAIT_S for a write in flight in another thread,
    then lets go of the connection.  The server gave the write's space back
    at once (a connection that ends is fenced only when the server dropped
    it) and close() closed the fence files, whose locks the write held, so
    the late write landed on the run of a rank that got the space meanwhile
    (B read A's bytes with verify="never").  The space stays pinned until
    the write is done, then is given back."""
    from kvblock.store import client as client_mod

    monkeypatch.setattr(client_mod, "CLOSE_WAIT_S", 0.3)
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    a = RemoteStore(sock, verify="never")
    b = RemoteStore(sock, verify="never")
    try:
        a_space, b_space = _allocations(a), _allocations(b)
        stall, box, ka = _stalled_put(a)          # inside its write, under the fence
        a.close()                                 # gives up on it after 0.3 s
        deadline = time.monotonic() + 20          # the server has seen the connection end
        while server.client_count() != 1:         # (and released what it held): B's only
            assert time.monotonic() < deadline, "A's connection did not end on the server"
            time.sleep(0.01)
        server.store.evict(all=True)
        stored = []
        for i in range(2, 800):                   # about twice round the store
            if a_space[0] in b_space:
                break
            kb = run_keys(i, 2)
            assert b.put_run(kb, run_data(kb)) == 2
            stored.append(kb)
        stall.go.set()
        box["thread"].join(20)
        got = np.zeros_like(run_data(stored[0]))
        for kb in stored:                         # every B run still stored is B's bytes
            if b.get_run(kb, got) == 2:
                assert np.array_equal(got, run_data(kb)), \
                    "a write close() gave up on landed on another rank's run"
        deadline = time.monotonic() + 10          # then A's space is given back
        while server.store.regions.pins.sum():
            assert time.monotonic() < deadline, "A's space stayed pinned after its write"
            time.sleep(0.02)
    finally:
        a.close()
        b.close()
        server.stop()


def test_a_server_that_keeps_its_store_gives_back_the_allocations_stop_dropped(tmp_path):
    """StoreServer(close_store=False).stop() ends every connection; one
    that held an allocation (a put under way) leaves it to the write
    fence, which the lease thread serves no more once stop began: the
    store the caller keeps must get the space back (after the write in
    flight, which the fence waits for), not keep the region pinned."""
    from kvblock.store.server import StoreServer

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    store = KVStore.open([path])
    server = StoreServer(store, sock, close_store=False).start()
    r = RemoteStore(sock)
    try:
        stall, box, keys = _stalled_put(r)       # allocated, its write stopped
        assert store.regions.pins.sum() == 1
        stopper = _in_thread(lambda: server.stop(timeout=10))
        time.sleep(0.5)
        assert "out" not in stopper, "stop() did not wait for the write in flight"
        stall.go.set()
        stopper["thread"].join(20)
        assert "error" not in stopper, stopper.get("error")
        box["thread"].join(20)
        assert store.regions.pins.sum() == 0, "stop() left the dropped allocation pinned"
        assert store.lookup(keys) == 0
    finally:
        stall.go.set()
        r.close()
        server.stop()
        store.close()


def test_a_socket_path_given_as_bytes_is_fenced_on(tmp_path):
    """A socket path given as bytes (an os path as much as a str one: the
    socket connects by it) failed on both sides as a TypeError where the
    fence file's name was made from it (bytes + '.fence'): the server's
    start, and a rank's connect after its hello, its devices opened."""
    sock, path = os.fsencode(str(tmp_path / "kv.sock")), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    try:
        assert os.path.exists(str(tmp_path / "kv.sock.fence"))
        with RemoteStore(sock, verify="never") as a:
            assert len(a._fence._own) == 2, "the rank does not fence on <socket>.fence"
            keys = run_keys(1, 2)
            assert a.put_run(keys, run_data(keys)) == 2
            got = np.zeros_like(run_data(keys))
            assert a.get_run(keys, got) == 2 and np.array_equal(got, run_data(keys))
    finally:
        server.stop()


def test_a_rank_given_a_bytes_socket_path_starts_its_server(tmp_path):
    """connect(bytes_path, devices) finding no server starts one: the start
    lock's name was made from the path (bytes + '.lock'), a TypeError."""
    from kvblock.store.client import connect
    from tests.support.servers import stop_server

    sock, path = os.fsencode(str(tmp_path / "kv.sock")), _store_file(tmp_path)
    rank = connect(sock, [path])
    try:
        keys = run_keys(1, 2)
        assert rank.put_run(keys, run_data(keys)) == 2
        assert os.path.exists(str(tmp_path / "kv.sock.lock"))
    finally:
        rank.close()
        stop_server(rank.server_pid)


@pytest.mark.parametrize("where", ["device", "socket"])
def test_a_server_told_to_stop_while_it_waits_for_a_ranks_write_stops(tmp_path, monkeypatch,
                                                                      where):
    """A server start waits for ranks' writes in flight twice: in the
    store's open (on device 0) and before it listens (on <socket>.fence).
    Neither wait looked at the stop event SIGTERM / Ctrl-C set (kvblock
    serve's), so a server told to stop went on waiting up to FENCE_WAIT_S
    (60 s) each time.  It gives up at once, DeviceBusyError saying why."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    serve_in_background([path], sock).stop()         # makes <socket>.fence
    held = path if where == "device" else fence_mod.socket_fence_path(sock)
    rank = fence_mod.WriteFence([os.open(held, os.O_RDONLY)])
    # what a server that does not look at its stop waits: one that does
    # stops in a small part of it, however loaded the machine
    monkeypatch.setattr(fence_mod, "FENCE_WAIT_S", 60.0)

    real_lock, fencing = fence_mod._ofd_lock, threading.Event()

    def ofd_lock(fd, kind, wait, byte=fence_mod.FENCE_BYTE):
        took = real_lock(fd, kind, wait, byte)
        if not took:
            fencing.set()            # an owner found the rank's write: it waits
        return took
    monkeypatch.setattr(fence_mod, "_ofd_lock", ofd_lock)
    stop = threading.Event()
    try:
        with rank.writing():
            opening = _in_thread(lambda: serve_in_background([path], sock, stop=stop))
            assert fencing.wait(30), "the server did not wait for the write"
            assert opening["thread"].is_alive()      # waiting for the write
            stop.set()
            opening["thread"].join(fence_mod.FENCE_WAIT_S / 2)
            stopped_in_time = not opening["thread"].is_alive()
        opening["thread"].join(20)
        if "out" in opening:
            opening["out"].stop()
        assert stopped_in_time, "the server went on waiting for the write after its stop"
        assert isinstance(opening.get("error"), DeviceBusyError), opening
        assert "told to stop" in str(opening["error"]) and held in str(opening["error"])
        assert not os.path.exists(sock)
        serve_in_background([path], sock).stop()      # nothing left behind
    finally:
        rank.close()


def test_an_allocation_released_after_stop_gave_up_on_its_connection_is_given_back(tmp_path):
    """StoreServer(close_store=False).stop() waits ``timeout`` for each
    connection's thread; one still answering a request then (a slow call)
    released its allocation later, onto the queue of the lease thread,
    which had ended, after stop had given back the queue: the store the
    caller keeps had that region pinned for good.  A release after stop
    gives the allocation back itself, once the writes in flight are done."""
    from kvblock.store.server import StoreServer

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    store = KVStore.open([path])
    server = StoreServer(store, sock, close_store=False).start()
    rank = _RankHeldAtStop(server, sock)
    try:
        session = rank.stop_gives_up()
        with rank.fence.writing():                    # the rank's write in flight
            rank.go.set()
            session.thread.join(0.5)
            assert store.regions.pins.sum() == 1, "given back under a write in flight"
        session.thread.join(20)
        assert not session.thread.is_alive()
        assert store.regions.pins.sum() == 0, "the allocation released after stop stayed pinned"
    finally:
        rank.close()
        server.stop()
        store.close()


class _RankHeldAtStop:
    """A rank's connection to ``server`` (close_store=False), spoken raw:
    its hello said (the fence files served to ``fence`` as a rank's client
    does) and one block allocated; ``stop_gives_up()`` then has a ping
    held in the server (until ``go`` is set) while ``server.stop()`` gives
    up on the connection's thread, and returns its session, whose thread
    lives on to release the allocation after stop."""

    def __init__(self, server, sock: str):
        import socket

        self.server, self.sock = server, sock
        self.entered, self.go = threading.Event(), threading.Event()
        self.fence = None
        self.raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.raw.settimeout(20)

    def _ask(self, **req):
        from kvblock.store.protocol import encode_msg, recv_msg

        self.raw.sendall(encode_msg(req))
        return recv_msg(self.raw)

    def stop_gives_up(self):
        import socket

        from kvblock.store.protocol import PROTOCOL, encode_msg

        def held_ping(s):
            self.entered.set()
            assert self.go.wait(30)
        self.server._op_ping = held_ping
        self.raw.connect(self.sock)
        assert self._ask(op="hello", protocol=PROTOCOL, pid=os.getpid())["ok"]
        _, fds, _, _ = socket.recv_fds(self.raw, 1, 16)
        self.fence = fence_mod.WriteFence()
        self.fence.served(fds)
        assert self._ask(op="allocate", nblocks=1)["ok"]
        assert self.server.store.regions.pins.sum() == 1
        (session,) = self.server._sessions.values()
        self.raw.sendall(encode_msg({"op": "ping"}))  # held in the server
        assert self.entered.wait(20)
        self.server.stop(timeout=0.3)                 # gives up on that thread
        assert session.thread.is_alive()
        return session

    def close(self) -> None:
        self.go.set()
        self.raw.close()
        if self.fence is not None:
            self.fence.close()


class _NumberTaken:
    """``module.reopen`` as it is called on ``fd`` (the first time): the
    store is closed first (a user's close() in another thread, the server
    keeping the store open), and an unrelated open in the same process
    takes the descriptor number it freed (here made sure of with dup2)
    before the real reopen runs."""

    def __init__(self, monkeypatch, module, store, fd: int, decoy: str):
        self.fired = False
        self.fd = fd
        real = module.reopen

        def racing(n, flags, *args, **kw):
            if not self.fired and n == fd:
                self.fired = True
                store.close()
                d = os.open(decoy, os.O_RDWR | os.O_CLOEXEC)
                if d != fd:
                    os.dup2(d, fd)
                    os.close(d)
            return real(n, flags, *args, **kw)
        monkeypatch.setattr(module, "reopen", racing)

    def let_go(self):
        if self.fired:
            os.close(self.fd)      # the decoy's descriptor, on the number it took
            self.fired = False


def test_a_hello_as_the_store_closes_sends_no_other_file_as_device_0(tmp_path, monkeypatch):
    """The server reopened its device 0 for a rank's hello by the store's
    descriptor number: closed meanwhile (the caller's store.close(), the
    server started with close_store=False) and the number taken by an
    unrelated open, the rank got that file as the store's device 0 (and
    was told the server serves "another medium, a copy of the store?").
    It is told the store is closed, and no other file goes out."""
    from kvblock.errors import StoreClosedError
    from kvblock.store import server as server_mod
    from kvblock.store.server import StoreServer

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    decoy = str(tmp_path / "unrelated.txt")
    with open(decoy, "wb") as f:
        f.write(b"x" * 4096)
    store = KVStore.open([path])
    server = StoreServer(store, sock, close_store=False).start()
    race = _NumberTaken(monkeypatch, server_mod, store, store.io.devices[0].fd, decoy)
    try:
        with pytest.raises(StoreClosedError):
            RemoteStore(sock).close()
        assert race.fired
    finally:
        race.let_go()
        server.stop()
        store.close()


def test_a_late_give_back_as_the_store_closes_fences_on_no_other_file(tmp_path, monkeypatch):
    """A connection released after stop() (close_store=False) fences on
    store device 0 by the store's descriptor number: closed meanwhile (the
    caller's store.close()) and the number taken by an unrelated open (here
    another store's device, a rank writing there), the fence locked that
    file: its turnstile held that store's writers back, and it waited on
    their writes (then said regions of this store stayed pinned).  The
    fence locks no file but the store's own."""
    import fcntl

    from kvblock.store.server import StoreServer

    sock = str(tmp_path / "kv.sock")
    path = _store_file(tmp_path)
    decoy = str(tmp_path / "other.img")
    with open(decoy, "wb") as f:
        f.write(b"\0" * 4096)
    decoy_id = (os.stat(decoy).st_dev, os.stat(decoy).st_ino)
    store = KVStore.open([path])
    server = StoreServer(store, sock, close_store=False).start()
    locked = []
    real_lock = fence_mod._ofd_lock

    def recording_lock(fd, kind, wait, byte=fence_mod.FENCE_BYTE):
        if kind == fcntl.F_WRLCK:     # an owner's (a rank's are shared)
            st = os.fstat(fd)
            locked.append((st.st_dev, st.st_ino))
        return real_lock(fd, kind, wait, byte)

    monkeypatch.setattr(fence_mod, "FENCE_WAIT_S", 0.3)
    monkeypatch.setattr("kvblock.store.server.FENCE_WAIT_S", 0.3)
    rank = _RankHeldAtStop(server, sock)
    other_rank = race = None
    try:
        session = rank.stop_gives_up()
        # another store's rank, writing on the file that takes the number
        other_rank = fence_mod.WriteFence([os.open(decoy, os.O_RDONLY | os.O_CLOEXEC)])
        race = _NumberTaken(monkeypatch, fence_mod, store, store.io.devices[0].fd, decoy)
        monkeypatch.setattr(fence_mod, "_ofd_lock", recording_lock)
        with other_rank.writing():
            rank.go.set()
            session.thread.join(20)
        assert not session.thread.is_alive()
        assert race.fired
        assert decoy_id not in locked, "the fence locked a file that is not the store's"
    finally:
        rank.close()
        if race is not None:
            race.let_go()
        server.stop()
        store.close()
        if other_rank is not None:
            other_rank.close()


# A rank whose io_uring breaks under its write and whose drain cannot wait
# for the I/O the kernel took (io_uring_wait_cqe_timeout failing): the
# native call returns with that I/O's result slot never written, the rest
# ECANCELED.  The rank says how its put failed and waits on stdin.
_RANK_WITH_A_WRITE_LEFT_IN_FLIGHT = """
import errno, json, sys
from kvblock.errors import IOFailedError
from kvblock.io import native
from kvblock.io.engine import OP_WRITE
from kvblock.store.client import RemoteStore
from tests.store.workload import run_data, run_keys
real = native.lib()
class Broken:
    def __getattr__(self, name):
        return getattr(real, name)
    def kvb_ring_run(self, handle, op, n, addrs, devs, offsets, lens, qd, results, lat, h):
        if op != OP_WRITE:
            return real.kvb_ring_run(handle, op, n, addrs, devs, offsets, lens, qd, results,
                                     lat, h)
        for i in range(1, n):        # I/O 0 taken, never reaped: its slot left as it was
            results[i] = -errno.ECANCELED
        return -errno.ENXIO
r = RemoteStore(sys.argv[1], engine="uring")
print("ready", flush=True)
sys.stdin.readline()
native.lib = lambda: Broken()
keys, s = run_keys(1, 2), r._session
try:
    r.put_run(keys, run_data(keys))
    out = {"error": None}
except IOFailedError as e:
    out = {"error": type(e).__name__, "in_flight": e.in_flight,
           "message": str(e),
           "path": e.path, "given_up": s.gone is not None}
print(json.dumps(out), flush=True)
sys.stdin.readline()
r.close()
"""


def test_a_write_a_broken_ring_could_not_wait_for_keeps_its_space_fenced(tmp_path):
    """A rank's io_uring broke under its write and its drain could not wait
    for an I/O the kernel had taken: the write may still land.  The rank
    left the write fence and aborted the allocation, and the server gave
    the space back at once (an abort is not fenced): handed to another
    rank, the late write landed on its run.  The rank now keeps the fence
    held for as long as it lives and gives the connection up (no abort):
    the server gives the space back only once the fence passes, after the
    rank's process ended."""
    import json
    import subprocess
    import sys

    from tests.serve.test_serve import ROOT, _output

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    with serve_in_background([path], sock) as server:
        p = subprocess.Popen([sys.executable, "-c", _RANK_WITH_A_WRITE_LEFT_IN_FLIGHT, sock],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        try:
            line = p.stdout.readline()
            assert line == "ready\n", line + _output(p)
            (s,) = server._sessions.values()
            p.stdin.write("go\n")
            p.stdin.flush()
            line = p.stdout.readline()
            try:
                said = json.loads(line)
            except ValueError:
                raise AssertionError(line + _output(p)) from None
            assert said["error"] == "IOFailedError", said
            # not aborted (given back at once): the allocation stays pinned
            assert server.store.regions.pins.sum() == 1, "the space went back under the write"
            assert said["in_flight"] == 1, said
            assert said["path"] == path and path in said["message"], said
            assert "may still be in flight" in said["message"], said
            assert said["given_up"], "the connection of the write in flight was kept"
            s.thread.join(10)
            assert not s.thread.is_alive(), "the rank did not give its connection up"
            # The connection ended: the server holds the allocation until the
            # rank's writes are done, which its fence says they are not.
            server._release_dropped_writers()
            assert server.store.regions.pins.sum() == 1, "the space went back under the write"
            with pytest.raises(DeviceBusyError):
                fence_mod.fence_writers([(server._fence_fd, sock + ".fence")], 0,
                                        turnstile=False)
            p.stdin.write("exit\n")
            p.stdin.flush()
            assert p.wait(30) == 0, _output(p)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
            p.stdin.close()
        # the process ended (its fence with it): the space goes back
        deadline = time.monotonic() + 30
        while server.store.regions.pins.sum():
            assert time.monotonic() < deadline, "the space stays pinned after the rank ended"
            server._release_dropped_writers()
            time.sleep(0.01)
        with RemoteStore(sock) as r:
            keys = run_keys(2, 3)
            assert r.put_run(keys, run_data(keys)) == 3
            out = np.zeros_like(run_data(keys))
            assert r.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))
