"""Pin leases: a store server drops the connection of a client that holds
pins and sends nothing for ``pin_lease`` seconds (a stopped process), so
its pins cannot fill the store; a live client pings and keeps them; the
allocations of a dropped client are given back only once its write in
flight is done, and its later writes are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvblock.store.client import RemoteStore, ServerGoneError
from kvblock.store.server import serve_in_background
from tests.serve.test_serve import _store_file
from tests.serve.test_shared_clear import _wait_in
from tests.serve.test_write_fence import _allocations, _in_thread, _release_fenced_writer, _Stall
from tests.store.workload import run_data, run_keys
from tests.support.races import LockStandIn
from tests.support.servers import stop_process, stop_server
from tests.support.timeouts import GENEROUS_S, QuietPasses, hold_checkpoint, short_timeout_on

# Pings go every LEASE/4: a lease of 0.5 s could expire a live session whose process
# stalled ~0.4 s (two test processes and a loop device on two cores).
LEASE = 1.0

_PINNING_RANK = """
import sys, time
from kvblock.store.client import RemoteStore
from tests.store.workload import run_keys
store = RemoteStore(sys.argv[1])
store.pin(run_keys(1, 2))
print("pinned", flush=True)
time.sleep(600)
"""


def _reap(proc) -> None:
    """End a rank process that may be stopped (SIGSTOP)."""
    if proc is not None:
        proc.kill()
        os.kill(proc.pid, signal.SIGCONT)
        proc.wait()
        proc.stdout.close()


def _until(what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _read_ended_whole(server, r, read, got, keys) -> None:
    """The read in flight on ``r`` (``read``: its _in_thread box) returned
    every block, none a lapsed miss, and its pins were given back."""
    read["thread"].join(20)
    assert read.get("out") == len(keys), read
    assert np.array_equal(got, run_data(keys))
    assert r.counters["lapsed_pin_gets"] == 0
    _until(lambda: server.store.regions.pins.sum() == 0, timeout=5)


def _dropped_allocation_given_back_and_leases_go_on(server, sock, a, given_back) -> None:
    """Rank ``a`` (its heartbeat off, as if its process were stopped), its
    put stalled between its allocation and its write: the lease drops it
    and its allocation is given back (``given_back()`` then checks how the
    lease thread got there), the lease still drops a quiet rank after, and
    ``a``'s put, let go, fails."""
    stall = _Stall(a, "_stage_run", after=True)   # allocated, not writing
    ka = run_keys(1, 2)
    box = _in_thread(lambda: a.put_run(ka, run_data(ka)))
    try:
        assert stall.reached.wait(20)
        assert server.store.regions.pins.sum() == 1
        _until(lambda: server.expired_sessions == 1)
        _until(lambda: server.store.regions.pins.sum() == 0, timeout=15)
        given_back()
        b = RemoteStore(sock)                   # and the lease still drops the quiet
        b._heartbeat = False
        try:
            kb = run_keys(2, 1)
            b.put_run(kb, run_data(kb))
            assert b.pin(kb)
            _until(lambda: server.expired_sessions == 2)
        finally:
            b.close()
    finally:
        stall.go.set()
        box["thread"].join(20)
    assert isinstance(box.get("error"), ServerGoneError), box


def test_a_stopped_ranks_pins_lapse_and_a_live_ranks_stay(tmp_path, monkeypatch):
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    passes = QuietPasses(monkeypatch)
    server = serve_in_background([path], sock, pin_lease=LEASE)
    keys = run_keys(1, 2)
    proc = None
    try:
        with RemoteStore(sock) as live:
            live.put_run(keys, run_data(keys))
            pin = live.pin(keys)
            # idle, but its process pings: a lease pass that would drop it
            # unpinged (begun 1.5 leases from now) leaves it
            passes.past(time.monotonic() + 1.5 * LEASE)
            assert server.store.regions.pins.sum() == 1
            got = np.zeros_like(run_data(keys))
            assert live.get_run(keys, got) == 2 and np.array_equal(got, run_data(keys))
            live.unpin(pin)
        assert server.store.regions.pins.sum() == 0
        proc = subprocess.Popen([sys.executable, "-c", _PINNING_RANK, sock],
                                stdout=subprocess.PIPE, cwd=os.getcwd())
        assert proc.stdout.readline().strip() == b"pinned"
        assert server.store.regions.pins.sum() == 1
        stop_process(proc.pid)
        _until(lambda: server.store.regions.pins.sum() == 0)
        assert server.expired_sessions == 1
        assert server.store.evict(all=True) == 1   # its region can go
    finally:
        _reap(proc)
        server.stop()


def test_a_dropped_ranks_write_in_flight_keeps_its_space_until_done(tmp_path, monkeypatch):
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    passes = QuietPasses(monkeypatch)
    server = serve_in_background([path], sock, pin_lease=LEASE)
    a = RemoteStore(sock, verify="never")
    a._heartbeat = False                        # as if its process were stopped
    try:
        stall = _Stall(a, "_write_run")         # inside the fence, mid-write
        ka = run_keys(1, 2)
        box = _in_thread(lambda: a.put_run(ka, run_data(ka)))
        assert stall.reached.wait(20)
        _until(lambda: server.expired_sessions == 1)
        with RemoteStore(sock) as b:            # others still write meanwhile
            for i in range(2, 6):
                kb = run_keys(i, 2)
                assert b.put_run(kb, run_data(kb)) == 2
                # a lease tick begun since (its give-back of the dropped
                # connections' allocations, then its lease pass) has run
                passes.past(time.monotonic())
            assert server.store.regions.pins.sum() == 1, "a writer's space was freed mid-write"
            stall.go.set()
            box["thread"].join(20)
            assert isinstance(box.get("error"), ServerGoneError), box
            _until(lambda: server.store.regions.pins.sum() == 0, timeout=5)
            assert b.lookup(ka) == 0
    finally:
        a.close()
        server.stop()


def test_a_dropped_ranks_later_write_is_refused(tmp_path):
    """Stalled between its allocation and its write past the lease: the
    space goes to rank B, and A's write must not land on B's run."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock, pin_lease=LEASE)
    a = RemoteStore(sock, verify="never")
    a._heartbeat = False
    b = RemoteStore(sock, verify="never")
    try:
        a_space, b_space = _allocations(a), _allocations(b)
        stall = _Stall(a, "_stage_run", after=True)
        ka = run_keys(1, 2)
        box = _in_thread(lambda: a.put_run(ka, run_data(ka)))
        assert stall.reached.wait(20)
        _until(lambda: server.store.regions.pins.sum() == 0)
        server.store.evict(all=True)            # its region can be written again
        i = 2
        while a_space[0] not in b_space:        # B writes until it reuses A's space
            assert i < 2000, f"B never got A's space {a_space}: {b_space[-5:]}"
            kb = run_keys(i, 2)
            assert b.put_run(kb, run_data(kb)) == 2
            i += 1
        _release_fenced_writer(stall, box, a, b, kb, "a dropped rank's write landed on B's run")
    finally:
        a.close()
        b.close()
        server.stop()


def test_a_request_the_server_has_not_read_yet_keeps_the_pins(tmp_path, monkeypatch):
    """A starved server reads a ping late: a connection with a request
    waiting in its socket is alive, however long ago the last one was read."""
    import threading

    import kvblock.store.server as server_mod

    delay = threading.Event()
    real = server_mod.recv_msg
    passes = QuietPasses(monkeypatch)

    def late(conn):
        if delay.is_set():
            delay.clear()
            # the next request waits unread until a lease pass has run that
            # would have dropped the connection by its last read alone
            passes.past(time.monotonic() + 1.5 * LEASE)
        return real(conn)
    monkeypatch.setattr(server_mod, "recv_msg", late)
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock, pin_lease=LEASE)
    keys = run_keys(1, 2)
    try:
        with RemoteStore(sock) as r:
            r._heartbeat = False
            r.put_run(keys, run_data(keys))
            delay.set()
            pin = r.pin(keys)
            assert r.lookup(keys) == 2        # read by the server 4 leases later
            assert server.expired_sessions == 0
            assert server.store.regions.pins.sum() == 1
            r.unpin(pin)
    finally:
        server.stop()


def test_a_shorter_lease_after_a_reconnect_is_kept_to(tmp_path, monkeypatch):
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    passes = QuietPasses(monkeypatch)
    server = serve_in_background([path], sock)          # the default lease, 60 s
    keys = run_keys(1, 2)
    try:
        with RemoteStore(sock, reconnect=True) as r:
            r.put_run(keys, run_data(keys))
            server.stop()
            server = serve_in_background([path], sock, pin_lease=2 * LEASE)

            def reconnected():
                try:
                    return r.lookup(keys) == 2 and r.counters["reconnects"] == 1
                except ServerGoneError:
                    return False
            _until(reconnected, timeout=20)
            r.pin(keys)
            passes.past(time.monotonic() + 3 * LEASE)      # 1.5 of the new 2-LEASE leases
            assert server.expired_sessions == 0, "the rank pinged at the old lease's pace"
            assert server.store.regions.pins.sum() == 1
    finally:
        server.stop()


_STOPPED_WHILE_ANSWERED = """
import os, signal, sys
import kvblock.store.client as client
from tests.store.workload import run_keys
store = client.RemoteStore(sys.argv[1])
store.pin(run_keys(1, 2))
print("pinned", flush=True)
real = client.recv_msg
def stopped_then_read(sock):           # stopped right after sending its request
    os.kill(os.getpid(), signal.SIGSTOP)
    return real(sock)
client.recv_msg = stopped_then_read
store.present([os.urandom(16) for _ in range(60000)])   # an answer larger than the buffer
"""


def test_a_rank_stopped_before_taking_a_large_answer_loses_its_pins(tmp_path):
    """The lease passes by sessions whose answer is being sent; a rank
    stopped before it read a ~360 KB answer left the server blocked in that
    send, and its pins held as long as it stayed stopped.  A send that
    takes nothing for a lease now ends the session like the lease does."""
    from kvblock.store.server import spawn_server

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = spawn_server([path], sock, pin_lease=1)
    keys = run_keys(1, 2)
    proc = None
    try:
        with RemoteStore(sock) as w:
            w.put_run(keys, run_data(keys))
        proc = subprocess.Popen([sys.executable, "-c", _STOPPED_WHILE_ANSWERED, sock],
                                stdout=subprocess.PIPE, cwd=os.getcwd())
        assert proc.stdout.readline().strip() == b"pinned"
        with RemoteStore(sock) as other:
            _until(lambda: other.stats()["pinned_regions"] == 0, timeout=20)
            assert other.stats()["expired_sessions"] == 1
            assert other.evict(all=True) == 1
    finally:
        _reap(proc)
        stop_server(server.pid)
        server.wait(30)


def test_leases_outlive_a_server_short_of_descriptors(tmp_path, monkeypatch):
    """Giving a dropped rank's allocation back opens the fence files anew;
    out of descriptors for a moment (EMFILE, many ranks), that must be a
    try that failed (later tries give it back, the leases still run), not
    the end of the thread that runs them (its space then stayed pinned and
    no quiet rank was ever dropped again)."""
    import errno

    from kvblock.store import fence

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock, pin_lease=LEASE)
    a = RemoteStore(sock, verify="never")
    a._heartbeat = False                        # as if its process were stopped
    try:
        short = {"left": 3}
        reopen = fence.reopen

        def out_of_descriptors(fd, flags, *file):
            if short["left"] > 0:
                short["left"] -= 1
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return reopen(fd, flags, *file)
        monkeypatch.setattr(fence, "reopen", out_of_descriptors)

        def tries_failed():
            assert short["left"] == 0
        _dropped_allocation_given_back_and_leases_go_on(server, sock, a, tries_failed)
    finally:
        a.close()
        server.stop()


def test_a_quiet_rank_is_dropped_whatever_its_descriptor_number(tmp_path):
    """A server with many open files (ranks' connections): a connection
    whose descriptor is past FD_SETSIZE (1024) cannot be select()ed; its
    lease must still run (select's ValueError once kept its pins for good)."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock, pin_lease=LEASE)
    filler = []
    try:
        while not filler or filler[-1] < 1100:       # the next ones are past 1024
            filler.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        a = RemoteStore(sock)
        a._heartbeat = False                  # as if its process were stopped
        try:
            ka = run_keys(1, 2)
            a.put_run(ka, run_data(ka))
            assert a.pin(ka)
            assert server.store.regions.pins.sum() == 1
            _until(lambda: server.expired_sessions == 1)
            _until(lambda: server.store.regions.pins.sum() == 0)
        finally:
            a.close()
    finally:
        for fd in filler:
            os.close(fd)
        server.stop()


def test_a_read_on_an_abandoned_connection_past_descriptor_1023_is_no_miss(tmp_path, monkeypatch):
    """A connection abandoned after a timeout while a read holds pins on it
    (the server lives, the pins hold): the read's bytes count.  Whether the
    server's end closed was asked with select(), which fails past
    descriptor 1023, and that was taken for a closed connection (a miss)."""

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock)
    let_go = hold_checkpoint(server)      # answered once the client gave up
    short_timeout_on(monkeypatch, {"checkpoint"}, 0.3)
    filler = []
    try:
        while not filler or filler[-1] < 1100:       # the next ones are past 1024
            filler.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        a = RemoteStore(sock, timeout=GENEROUS_S)
        try:
            ka = run_keys(1, 2)
            a.put_run(ka, run_data(ka))
            pinned, go = _wait_in(a, "_segments")
            out = np.zeros(run_data(ka).nbytes, np.uint8)
            box = _in_thread(lambda: a.get_run(ka, out))
            assert pinned.wait(20)
            try:
                a.checkpoint()                  # times out: the connection is abandoned
            except ServerGoneError:
                pass
            else:
                raise AssertionError("the checkpoint did not time out")
            let_go()
            go.set()
            box["thread"].join(20)
            assert box.get("out") == 2, box
            assert np.array_equal(out, run_data(ka).reshape(-1).view(np.uint8))
            assert a.counters["lapsed_pin_gets"] == 0
        finally:
            let_go(wait=False)
            a.close()
    finally:
        for fd in filler:
            os.close(fd)
        server.stop()


def test_a_lease_of_infinity_serves_and_never_expires_and_nan_is_refused(tmp_path):
    """pin_lease=inf (no lease, from Python) must not kill the accept thread
    on the first connection (its send timeout was int(inf)); a lease too long
    for the kernel's timeout is kept to as far as it goes; nan is refused."""
    import pytest

    from kvblock.errors import ConfigError
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    for lease, said in ((float("inf"), None), (1e19, 1e19)):
        server = serve_in_background([path], sock, pin_lease=lease)
        try:
            with RemoteStore(sock, timeout=10) as r:
                keys = run_keys(1, 2)
                r.put_run(keys, run_data(keys))
                assert r.lookup(keys) == 2
                assert r.stats()["pin_lease"] == said
        finally:
            server.stop()
    with pytest.raises(ConfigError, match="pin_lease"):
        serve_in_background([path], sock, pin_lease=float("nan"))
    assert not os.path.exists(sock)


def test_the_servers_other_times_are_checked_as_the_lease_is(tmp_path):
    """idle_exit and hello_timeout from Python: text raised a bare TypeError
    (a comparison with 0), nan meant "never" silently; both are ConfigErrors
    naming the setting, as pin_lease's are; 0 and inf still mean never."""
    import pytest

    from kvblock.errors import ConfigError
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    for name in ("idle_exit", "hello_timeout"):
        for bad in ("5", float("nan"), True):
            with pytest.raises(ConfigError, match=name):
                serve_in_background([path], sock, **{name: bad})
            assert not os.path.exists(sock)
    server = serve_in_background([path], sock, idle_exit=float("inf"), hello_timeout=0)
    try:
        assert server.idle_exit is None and server.hello_timeout is None
    finally:
        server.stop()


class _SendTimeouts:
    """The served connections' sockets, their sends that took nothing for
    SO_SNDTIMEO (a lease) counted in ``count``: a test waits for a few, in
    place of a sleep meant to outlast the send timeout (on a loaded
    machine the server's thread may not have met it by the sleep's end).
    Make it before the server."""

    def __init__(self, monkeypatch):
        import threading

        from kvblock.store import server as server_mod

        self.count, lock = 0, threading.Lock()
        counted = self
        real_init = server_mod._Session.__init__

        class Counting:
            def __init__(self, conn):
                self._conn = conn

            def __getattr__(self, name):
                return getattr(self._conn, name)

            def send(self, data, *flags):
                try:
                    return self._conn.send(data, *flags)
                except (BlockingIOError, TimeoutError):
                    with lock:
                        counted.count += 1
                    raise

        def init(session, conn, sid):
            real_init(session, Counting(conn), sid)
        monkeypatch.setattr(server_mod._Session, "__init__", init)


def test_a_client_holding_no_pins_is_not_dropped_for_a_slow_read(tmp_path, monkeypatch):
    """The send timeout (one lease) ended any connection whose client took
    nothing of an answer for a lease, and counted it expired, though it
    held no pins: README says the lease drops only connections holding
    pins.  A client holding none that reads its large answer late gets it."""
    import socket

    from kvblock.store.protocol import encode_keys, encode_msg, recv_msg
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    keys = [i.to_bytes(16, "little") for i in range(1, 200_001)]   # ~1 MB of answer
    timeouts, passes = _SendTimeouts(monkeypatch), QuietPasses(monkeypatch)
    with serve_in_background([path], sock, pin_lease=0.3, hello_timeout=0) as server:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.settimeout(30)
            raw.connect(sock)
            raw.sendall(encode_msg({"op": "present", "keys": encode_keys(keys)}))
            # unread: the server's send takes nothing for a lease, three
            # times, and a lease pass runs while it waits
            # (or the connection ended for it: then the answer is cut short)
            _until(lambda: timeouts.count >= 3 or server.expired_sessions, timeout=20)
            passes.past(time.monotonic())
            answer = recv_msg(raw)
            assert answer is not None and answer["ok"], answer
            assert answer["result"] == [False] * len(keys)
            assert server.expired_sessions == 0
        finally:
            raw.close()


def test_close_releases_the_pins_of_an_abandoned_connection(tmp_path, monkeypatch):
    """A call timed out (a slow server), so the connection holding a pin
    the caller took was abandoned: it stays open while the pin is held
    (I/O may be under it).  close() then closed only the connection calls
    went to, not the abandoned one: with leases off (--pin-lease 0) its pin
    stayed on the server for good (its region never evicted), where close()
    says the server releases the connection's pins."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    keys = run_keys(1, 2)
    with serve_in_background([path], sock, pin_lease=0) as server:
        let_go = hold_checkpoint(server)      # answered once the client gave up
        short_timeout_on(monkeypatch, {"checkpoint"}, 0.2)
        r = RemoteStore(sock, timeout=GENEROUS_S, reconnect=True)
        try:
            r.put_run(keys, run_data(keys))
            pin = r.pin(keys)                 # the caller never unpins
            with pytest.raises(ServerGoneError, match="did not answer checkpoint in time"):
                r.checkpoint()
            let_go()
            _until(lambda: r.counters["reconnects"] == 1)
            assert r.lookup(keys) == 2        # the new connection serves
        finally:
            let_go(wait=False)
            r.close()
        _until(lambda: server.client_count() == 0, timeout=5.0)
        assert server.store.regions.pins.sum() == 0
        assert server.store.evict(all=True) == 1
        del pin


def test_a_put_that_close_waits_for_keeps_its_lease(tmp_path, monkeypatch):
    """close() waits for a put in flight to commit, but it stopped the
    heartbeat at once: a put slower than the server's pin lease (a slow
    device) lost its connection meanwhile, and its commit raised
    ServerGoneError where close() had promised to let it finish.  The
    heartbeat goes on while close() waits for puts."""
    from tests.store.test_close_in_flight import _close_while

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    passes = QuietPasses(monkeypatch)
    with serve_in_background([path], sock, pin_lease=LEASE) as server:
        rank = RemoteStore(sock)
        keys = run_keys(3, 2)
        reached, go = _wait_in(rank, "_write_allocated")      # written, commit next

        def lease_time():
            # close() waits; unpinged, the lease would lapse by this pass
            passes.past(time.monotonic() + 1.5 * LEASE)
            assert server.expired_sessions == 0
        assert _close_while(rank, reached, go, lambda: rank.put_run(keys, run_data(keys)),
                            lease_time) == 2
        assert server.store.lookup(keys) == 2


@pytest.mark.parametrize("reconnect", [True, False])
def test_the_pins_of_an_abandoned_connection_outlive_the_lease(tmp_path, reconnect, monkeypatch):
    """A call timed out (a slow server), so the connection holding a pin the
    caller still holds was abandoned: it stays open while the pin is held,
    and the server lives, so the pin must hold.  The heartbeat pinged only
    the connection calls go to (the new one after a reconnect, none at all
    without): the server dropped the abandoned one after its lease, and
    the pinned run could be evicted and its space reused under the read."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    keys = run_keys(1, 2)
    passes = QuietPasses(monkeypatch)
    with serve_in_background([path], sock, pin_lease=LEASE) as server:
        let_go = hold_checkpoint(server)      # answered once the client gave up
        short_timeout_on(monkeypatch, {"checkpoint"}, 0.3)
        r = RemoteStore(sock, timeout=GENEROUS_S, reconnect=reconnect)
        try:
            r.put_run(keys, run_data(keys))
            pin = r.pin(keys)                 # the caller holds it on
            with pytest.raises(ServerGoneError, match="did not answer checkpoint in time"):
                r.checkpoint()
            let_go()
            if reconnect:
                _until(lambda: r.counters["reconnects"] == 1)
            # unpinged, the abandoned connection lapses at the lease
            # thread's first pass a lease later: wait for a pass past that
            passes.past(time.monotonic() + 1.5 * LEASE)
            assert server.expired_sessions == 0, "the abandoned connection's pin lapsed"
            assert server.store.regions.pins.sum() == 1
            assert server.store.evict(all=True) == 0
            if reconnect:
                got = np.zeros_like(run_data(keys))
                assert r.get_run(keys, got) == 2 and np.array_equal(got, run_data(keys))
            r.unpin(pin)
            _until(lambda: server.store.regions.pins.sum() == 0, timeout=5)
            assert server.expired_sessions == 0
        finally:
            let_go(wait=False)
            r.close()


def test_a_connection_abandoned_as_segments_is_answered_keeps_that_pin(tmp_path, monkeypatch):
    """A read's segments answered (the server pinned its runs) and, before
    the reader counted the pin on its connection, another thread's call
    timed out: the connection, holding no pin by its count, was closed at
    once, the server released the read's pins, and the read came back a
    miss (lapsed_pin_gets) though the server lived.  The pin is counted
    before the request goes out, so the connection stays open for it."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    keys = run_keys(1, 2)
    with serve_in_background([path], sock, pin_lease=0) as server:
        let_go = hold_checkpoint(server)      # answered once the client gave up
        short_timeout_on(monkeypatch, {"checkpoint"}, 0.3)
        r = RemoteStore(sock, timeout=GENEROUS_S)
        try:
            r.put_run(keys, run_data(keys))
            answered, go = _wait_in(r, "_checked_segments", before=True)
            got = np.zeros_like(run_data(keys))
            box = _in_thread(lambda: r.get_run(keys, got))
            assert answered.wait(20)
            with pytest.raises(ServerGoneError, match="did not answer checkpoint in time"):
                r.checkpoint()
            let_go()
            assert server.store.regions.pins.sum() == 1, "the read's pin was released"
            go.set()
            _read_ended_whole(server, r, box, got, keys)
        finally:
            let_go(wait=False)
            r.close()


def test_close_keeps_the_pins_of_an_abandoned_connection_while_a_read_finishes(tmp_path,
                                                                              monkeypatch):
    """close() waits (up to 30 s) for the reads in flight before it lets go
    of the connections abandoned after a timeout (their pins are under
    those reads), but it stopped the heartbeat first: with a lease shorter
    than that wait, the server dropped the abandoned connection, its pins
    lapsed, and the read came back a miss (or its run could be evicted and
    its space reused under it) though the server lived.  The heartbeat goes
    on until the calls in flight are done."""
    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    keys = run_keys(1, 2)
    passes = QuietPasses(monkeypatch)
    with serve_in_background([path], sock, pin_lease=LEASE) as server:
        let_go = hold_checkpoint(server)      # answered once the client gave up
        short_timeout_on(monkeypatch, {"checkpoint"}, 0.3)
        r = RemoteStore(sock, timeout=GENEROUS_S, reconnect=True)
        reached, go = _wait_in(r, "_segments")          # pinned, read next
        try:
            r.put_run(keys, run_data(keys))
            got = np.zeros_like(run_data(keys))
            read = _in_thread(lambda: r.get_run(keys, got))
            assert reached.wait(20)
            with pytest.raises(ServerGoneError, match="did not answer checkpoint in time"):
                r.checkpoint()                           # its connection: abandoned
            let_go()
            # (replaced: close() ends the connection calls go to at once, and the
            # reads on it turn into misses, as a rank closed during a read)
            _until(lambda: r.counters["reconnects"] == 1)
            closer = _in_thread(r.close)
            closer["thread"].join(0.5)
            assert closer["thread"].is_alive(), "close() did not wait for the read"
            # close() waits; unpinged since, the pin lapses at the lease
            # thread's first pass a lease later: wait for a pass past that
            passes.past(time.monotonic() + 1.5 * LEASE)
            assert server.expired_sessions == 0, "the abandoned connection's pin lapsed"
            assert server.store.regions.pins.sum() == 1
            go.set()
            read["thread"].join(20)
            closer["thread"].join(20)
            assert not closer["thread"].is_alive() and "error" not in closer, closer
            _read_ended_whole(server, r, read, got, keys)
        finally:
            let_go(wait=False)
            go.set()
            r.close()


def test_a_failed_lease_tick_is_logged_once_and_the_lease_thread_goes_on(tmp_path, caplog):
    """An unexpected error in one tick of the lease thread (a ValueError
    from the fence, a bug: anything but KVBlockError or OSError) ended the
    thread silently, the regions it was giving back lost with it: a dropped
    connection's allocation stayed pinned for good and no quiet rank was
    dropped again.  The tick is logged (once, with its traceback), the
    regions stay queued, and later ticks give them back."""
    import logging

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock, pin_lease=LEASE)
    a = RemoteStore(sock, verify="never")
    a._heartbeat = False                        # as if its process were stopped
    real = server._fence_writers
    left = {"n": 3}

    def broken(*args, **kw):
        if left["n"] > 0:
            left["n"] -= 1
            raise ValueError("a malformed region")
        return real(*args, **kw)
    server._fence_writers = broken
    caplog.set_level(logging.ERROR, logger="kvblock")

    def tries_failed_and_said_once():
        assert left["n"] == 0
        assert server._lease_thread.is_alive()
        said = [r for r in caplog.records if "a malformed region" in r.getMessage()
                or (r.exc_info and "a malformed region" in str(r.exc_info[1]))]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert said[0].exc_info is not None, "logged without its traceback"
    try:
        _dropped_allocation_given_back_and_leases_go_on(server, sock, a,
                                                        tries_failed_and_said_once)
    finally:
        a.close()
        server.stop()


def test_a_lease_thread_told_to_exit_stops_the_server_as_failed(tmp_path, caplog):
    """A SystemExit (or KeyboardInterrupt) raised in the lease thread asks
    it to end: the server must not serve on with no lease thread (leases
    never lapsing), nor end it silently: it stops, as failed, and says so."""
    import logging

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    server = serve_in_background([path], sock, pin_lease=LEASE)
    caplog.set_level(logging.ERROR, logger="kvblock")

    def told_to_exit(lease):
        raise SystemExit(3)
    server._drop_quiet = told_to_exit
    try:
        assert server.wait(20), "the server went on without its lease thread"
        assert isinstance(server.failed, SystemExit)
        assert any("lease thread ends" in r.getMessage() for r in caplog.records)
        assert not os.path.exists(sock)
    finally:
        server.stop()


def test_a_ping_of_an_abandoned_connection_closed_meanwhile_is_no_error():
    """Session.keep_alive (the heartbeat's ping of a connection given up on
    while pins are held on it) checked the session open, then made its
    socket non-blocking: a caller's thread releasing the last pin there
    closes the session meanwhile (close_when_released), and settimeout on
    the closed socket raised OSError (EBADF) out of keep_alive and out of
    the heartbeat loop, which has no handler: the heartbeat ended, and no
    connection of the rank was pinged again (its pins lapsed under the
    server's lease, its puts' space given away).  Closed meanwhile, it is
    not pinged: False, as for one closed before."""
    import socket

    from kvblock.store.protocol import encode_msg
    from kvblock.store.session import Session

    a, b = socket.socketpair()
    s = Session(a)
    s.hold(1)
    s.gone = "abandoned after a timeout (test)"
    real = s._peer_closed

    def closed_meanwhile():
        out = real()
        a.close()        # the socket closed under the ping (close() now waits for it)
        return out
    s._peer_closed = closed_meanwhile
    try:
        assert s.keep_alive(encode_msg({"op": "ping"})) is False
    finally:
        s.close()
        b.close()


def test_an_abandoned_connection_is_not_closed_under_its_ping():
    """Session.close() (a caller's thread releasing the last pin on an
    abandoned connection: close_when_released) closed the socket while the
    heartbeat's keep_alive was reading and sending on it: closed between
    the socket's number being taken and the system call, the number could
    be the next open()'s (another connection's socket), and the ping went
    into that stream, or peer_closed read away that connection's bytes.
    The socket is closed only once no ping uses it (and the ping, begun
    first, goes out)."""
    import socket
    import threading

    from kvblock.store.protocol import encode_msg
    from kvblock.store.session import Session

    a, b = socket.socketpair()
    s = Session(a)
    s.hold(1)
    s.gone = "abandoned after a timeout (test)"
    sending, wake = threading.Event(), threading.Event()
    seen = {"closed_under_send": False}

    class HeldSocket:
        """The socket, its send held until close() comes or waits."""

        def __getattr__(self, name):
            return getattr(a, name)

        def send(self, data):
            sending.set()
            assert wake.wait(30)
            return a.send(data)

        def close(self):
            if sending.is_set() and not sent.is_set():
                seen["closed_under_send"] = True
                wake.set()
            a.close()

    sent = threading.Event()
    s.sock = HeldSocket()
    s._held_lock = _WakingLock(wake, lambda: threading.current_thread() is closer)
    box = {}

    def ping():
        box["pinged"] = s.keep_alive(encode_msg({"op": "ping"}))
        sent.set()
    pinger = threading.Thread(target=ping, daemon=True)
    closer = threading.Thread(target=lambda: s.hold(-1), daemon=True)  # the last pin
    try:
        pinger.start()
        assert sending.wait(20)
        closer.start()
        pinger.join(20)
        closer.join(20)
        assert not seen["closed_under_send"], "the socket was closed under the ping's send"
        assert box["pinged"] is True
        assert a.fileno() == -1, "the session was not closed after the ping"
    finally:
        wake.set()
        a.close()
        b.close()


def test_a_heartbeat_that_fails_unexpectedly_is_logged_once_and_goes_on(tmp_path, caplog):
    """The client's heartbeat thread had no handler for an unexpected
    error (a bug, a MemoryError): one raised by a ping ended the thread
    silently, and the rank's pins then lapsed on the server though its
    process lived.  It is logged, once per distinct error, and the
    heartbeat goes on."""
    import logging
    import threading

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock, pin_lease=LEASE) as server, \
            RemoteStore(sock, timeout=GENEROUS_S) as r:
        real_ping, calls, again = r._ping, [], threading.Event()

        def ping():
            calls.append(1)
            if len(calls) <= 2:                 # the same error twice: logged once
                raise RuntimeError("test: a bug in the ping")
            again.set()
            return real_ping()
        with caplog.at_level(logging.DEBUG, logger="kvblock"):
            r._ping = ping
            assert again.wait(10), "the heartbeat died with the error"
        said = [rec for rec in caplog.records if "test: a bug in the ping" in rec.getMessage()
                and rec.levelno >= logging.ERROR]
        assert len(said) == 1, [rec.getMessage() for rec in caplog.records]
        assert "heartbeat" in said[0].getMessage()
        assert server.client_count() == 1


def test_hung_up_polls_the_sessions_own_socket_not_a_number_reused(monkeypatch):
    """Session.hung_up() (asked by a put before it writes, and by a read
    whether its pins hold) polled the socket by its number without
    _held_lock, which close() closes it under: a caller's thread
    releasing the last pin on an abandoned connection could close it
    between the number being taken and the poll, and the number was then
    the next open()'s (another connection's socket): a session closed
    here was answered not hung up.  It polls under the lock now (a close
    waits for it), and a session closed first is hung up."""
    import select
    import socket
    import threading
    import types

    from kvblock.store import session as session_mod
    from kvblock.store.session import Session

    a, b = socket.socketpair()
    s = Session(a)
    woken = threading.Event()
    seen = {"closed_under_poll": False}
    others = []

    def close():
        s.close()
        woken.set()
    closer = threading.Thread(target=close, daemon=True)

    class Poll:
        """select.poll, the session closed by another thread between the
        descriptor's register and the poll (or waited for)."""

        def register(self, sock, events):
            self.fd, self.events = sock if isinstance(sock, int) else sock.fileno(), events

        def poll(self, timeout=None):
            closer.start()
            assert woken.wait(20)
            if a.fileno() == -1:       # closed under the poll: its number is free
                seen["closed_under_poll"] = True
                others.extend(socket.socketpair())      # the next open() takes it
            real = select.poll()
            real.register(self.fd, self.events)
            return real.poll(timeout)

    monkeypatch.setattr(session_mod, "select", types.SimpleNamespace(
        poll=Poll, **{k: getattr(select, k) for k in dir(select) if k.startswith("POLL")}))
    s._held_lock = _WakingLock(woken, lambda: threading.current_thread() is closer)
    try:
        assert s.hung_up() is False            # its own socket, its peer there
        closer.join(20)
        assert not seen["closed_under_poll"], "the session's socket was closed under the poll"
        assert a.fileno() == -1
        monkeypatch.undo()
        assert s.hung_up() is True             # closed here: hung up
    finally:
        woken.set()
        a.close()
        b.close()
        for o in others:
            o.close()


class _WakingLock(LockStandIn):
    """A session's _held_lock stood in: the thread ``waker()`` names,
    finding it held, sets ``wake`` (the holder waits for that) and then
    waits for it: what a close meeting a ping or poll in progress does."""

    def __init__(self, wake, waker):
        import threading

        self.inner, self._wake, self._waker = threading.Lock(), wake, waker

    def acquire(self, blocking=True, timeout=-1):
        if self.inner.acquire(blocking=False):
            return True
        if self._waker():
            self._wake.set()
        return self.inner.acquire(blocking, timeout)


@pytest.mark.parametrize("shape", ["whole", "part", "get_runs"])
def test_a_read_whose_pins_lapse_counts_no_bytes_read(tmp_path, monkeypatch, shape):
    """The server goes away as a read releases its pins: the read is a miss
    (0 blocks, lapsed_pin_gets), and counts no bytes_read either (README:
    bytes read "for reads that returned their blocks"), as load_blocks does;
    the helpers reading each run counted them before the pins were looked at."""
    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    server = serve_in_background([path], sock)
    try:
        keys = run_keys(1, 4)
        with RemoteStore(sock) as r:
            r.put_run(keys, run_data(keys))
            real = r._unpin

            def server_gone_first(segs):
                server.stop()
                return real(segs)
            monkeypatch.setattr(r, "_unpin", server_gone_first)
            before = dict(r.counters)
            n = 4 if shape != "part" else 2
            out = np.zeros(n * r.geometry.block_bytes, np.uint8)
            if shape == "get_runs":
                assert r.get_runs([(keys, out)]) == [0]
            else:
                assert r.get_run(keys[:n], out) == 0
            after = dict(r.counters)
        assert after["lapsed_pin_gets"] == before["lapsed_pin_gets"] + 1
        assert after["get_blocks"] == before["get_blocks"]
        assert after["bytes_read"] == before["bytes_read"]
    finally:
        server.stop()


@pytest.mark.parametrize("where", ["answer", "made"])
def test_a_read_cut_as_its_segments_answer_comes_releases_its_pin(tmp_path, monkeypatch,
                                                                  where):
    """A Ctrl-C landing as a read's segments answer came back (before its
    pin was looked at, or once its segments were made): the server held
    the pin on a live connection for the connection's life (its region
    never evicted).  The read gives the pin back as it raises."""
    from kvblock.store.client import RemoteStore as RS

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    keys = run_keys(1, 2)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as r:
        r.put_run(keys, run_data(keys))
        real_call, real_check, cut = RS._call_on, RS._checked_segments, []

        class Answer(dict):
            def __getitem__(self, key):      # the answer's pin first looked at
                if key == "pin" and where == "answer" and not cut:
                    cut.append(key)
                    raise KeyboardInterrupt
                return super().__getitem__(key)

        class Made(list):
            @property
            def pin(self):
                return None

            @pin.setter
            def pin(self, value):            # the segments made, their pin set
                if where == "made" and not cut:
                    cut.append(value)
                    raise KeyboardInterrupt

        def call_on(self, s, op, **args):
            out = real_call(self, s, op, **args)
            return Answer(out) if op == "segments" else out

        def checked(self, r, nkeys, s):
            segs = real_check(self, dict(r), nkeys, s)
            made = Made(segs)
            made.__dict__.update(segs.__dict__)
            return made
        monkeypatch.setattr(RS, "_call_on", call_on)
        monkeypatch.setattr(RS, "_checked_segments", checked)
        out = np.zeros_like(run_data(keys))
        with pytest.raises(KeyboardInterrupt):
            r.get_run(keys, out)
        assert cut
        assert server.store.regions.pins.sum() == 0, "the read's pin was never released"
        assert r._session.held == 0 and r.server_alive
        monkeypatch.undo()
        assert r.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))


@pytest.mark.parametrize("shape", ["get_run", "get_runs", "unpin"])
def test_a_read_cut_before_its_unpin_goes_out_releases_its_pin(tmp_path, monkeypatch, shape):
    """A Ctrl-C landing in a read's unpin before the request went out (as
    it waited for the connection's lock, held by another thread's call):
    _unpin had already marked the pin released, so the read's second try
    ("cut as it began: again") released nothing, and the server held the
    pin for as long as the connection lived (its region never evicted; a
    live rank is never quiet for a lease).  The pin is kept for the second
    try, which releases it."""
    from kvblock.store.client import RemoteStore as RS

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    keys = run_keys(1, 2)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as r:
        r.put_run(keys, run_data(keys))
        real, cut = RS._call_on, []

        def call_on(self, s, op, **args):
            if op == "unpin" and not cut:
                cut.append(op)
                raise KeyboardInterrupt     # before the lock is taken: nothing sent
            return real(self, s, op, **args)
        monkeypatch.setattr(RS, "_call_on", call_on)
        out = np.zeros_like(run_data(keys))
        with pytest.raises(KeyboardInterrupt):
            if shape == "get_runs":
                r.get_runs([(keys, out)])
            elif shape == "unpin":     # an engine's pin handle (KVStore.unpin's contract)
                r.unpin(r.pin(keys))
            else:
                r.get_run(keys, out)
        assert cut
        assert server.store.regions.pins.sum() == 0, "the read's pin was never released"
        assert r._session.held == 0 and r.server_alive
        assert r.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
