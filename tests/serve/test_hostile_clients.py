"""A store server is shared by the ranks of an engine: a client that speaks
the wire protocol wrongly (a bug, another release, a hostile peer) must get
a typed error or lose its connection, and never close the store for the
others, corrupt it or leak pins.  These tests talk to the server over a raw
Unix socket, then check that another client is still served correctly."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.errors import ConfigError
from kvblock.index import normalize_keys
from kvblock.store.client import RemoteStore
from kvblock.store.protocol import encode_keys, encode_msg, recv_msg
from kvblock.store.server import serve_in_background
from tests.store.workload import GEOM, REGION, run_data, run_keys
from tests.support.timeouts import HelloWait

MIB = 1 << 20


@pytest.fixture
def store_file(tmp_path):
    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, region_size=REGION, journal_bytes=256 << 10).close()
    yield path
    os.unlink(path)


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "kv.sock")


def _raw(sock_path) -> socket.socket:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(20)
    raw.connect(sock_path)
    return raw


def _ask(raw, **req) -> dict:
    raw.sendall(encode_msg(req))
    return recv_msg(raw)


def _admit_and_allocate(raw) -> tuple[bytes, dict, dict]:
    """A raw client's first steps of a one-block put: (key, admit's and
    allocate's answers)."""
    key = os.urandom(16)
    admit = _ask(raw, op="admit", keys=encode_keys([key]))
    alloc = _ask(raw, op="allocate", nblocks=1)
    assert admit["ok"] and alloc["ok"], (admit, alloc)
    return key, admit, alloc


def _still_serves(server, sock_path, tag: int) -> None:
    """Another client puts and reads a run back byte for byte; nothing stays pinned."""
    r = RemoteStore(sock_path)
    try:
        keys = run_keys(tag, 3)
        assert r.put_run(keys, run_data(keys)) == 3
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert r.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))
        assert r.stats()["pinned_regions"] == 0
    finally:
        r.close()
    assert not server.store.closed


@pytest.mark.parametrize("checksums", ["string", "nested"])
def test_a_commit_with_malformed_checksums_is_refused_not_fatal(store_file, sock, checksums):
    """A commit whose checksums have the right count but are not a list of
    64-bit integers (a string of that length, a list of lists) passed the
    count check and failed only in the journal commit's leader, which
    closed the store: the server stopped, for every rank."""
    with serve_in_background([store_file], sock) as server:
        nr = server.store.geometry.run_checksums
        bad = "7" * nr if checksums == "string" else [[1, 2]] * nr
        raw = _raw(sock)
        try:
            key = os.urandom(16)
            admit = _ask(raw, op="admit", keys=encode_keys([key]))
            assert admit["ok"], admit
            alloc = _ask(raw, op="allocate", nblocks=1)
            assert alloc["ok"], alloc
            reply = _ask(raw, op="commit", wid=alloc["result"]["wid"],
                         keys=encode_keys([key]), checksums=bad,
                         clears=admit["result"]["clears"])
            assert not server.store.closed, f"one client's bad commit closed the store: {reply}"
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert "checksums" in reply["message"]
            assert int(server.store.regions.pins.sum()) == 0   # the allocation given back
        finally:
            raw.close()
        _still_serves(server, sock, 1)


@pytest.mark.parametrize("count", ["\u00b2", "9" * 5000])
def test_a_commit_with_a_malformed_clear_ticket_is_a_config_error(store_file, sock, count):
    """A clear ticket (admit's, carried back by commit) or a removed
    cursor whose count isdigit() takes but int() refuses (a superscript
    digit, past 4300 digits) was answered with an untyped ServerError
    ('ValueError: invalid literal for int()'); it is a ConfigError naming
    the ticket, with the allocation given back."""
    with serve_in_background([store_file], sock) as server:
        raw = _raw(sock)
        try:
            key, admit, alloc = _admit_and_allocate(raw)
            tag = admit["result"]["clears"].partition(":")[0]
            reply = _ask(raw, op="commit", wid=alloc["result"]["wid"], keys=encode_keys([key]),
                         checksums=[0] * server.store.geometry.run_checksums,
                         clears=f"{tag}:{count}")
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert "clear ticket" in reply["message"]
            assert int(server.store.regions.pins.sum()) == 0 and not server.store.index.runs
        finally:
            raw.close()
        _still_serves(server, sock, 9)


@pytest.mark.parametrize("junk", [[1, 2], "x", None])
def test_a_commit_runs_with_a_malformed_entry_gives_back_every_allocation(store_file, sock,
                                                                          junk):
    """commit_runs releases every allocation it names, whatever the answer
    (protocol.py; the client counts them released once it asked).  One
    entry of ``puts`` that is not [wid, keys, checksums] was refused before
    any was taken: the well-formed entries' allocations stayed pinned for
    as long as the connection lived (their regions never evicted)."""
    with serve_in_background([store_file], sock) as server:
        raw = _raw(sock)
        try:
            key, admit, alloc = _admit_and_allocate(raw)
            good = [alloc["result"]["wid"], encode_keys([key]),
                    [0] * server.store.geometry.run_checksums]
            reply = _ask(raw, op="commit_runs", puts=[good, junk],
                         clears=admit["result"]["clears"])
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert int(server.store.regions.pins.sum()) == 0 and not server.store.index.runs
            assert not server.store.closed
        finally:
            raw.close()
        _still_serves(server, sock, 12)


@pytest.mark.parametrize("op", ["commit", "commit_runs"])
def test_a_commit_missing_an_argument_gives_back_its_allocation(store_file, sock, op):
    """A commit (or commit_runs) without its clear ticket (or another
    argument) was refused when its arguments were bound, before it took its
    allocations: they stayed pinned for as long as the connection lived."""
    with serve_in_background([store_file], sock) as server:
        raw = _raw(sock)
        try:
            key, _, alloc = _admit_and_allocate(raw)
            wid, sums = alloc["result"]["wid"], [0] * server.store.geometry.run_checksums
            if op == "commit":
                reply = _ask(raw, op="commit", wid=wid, keys=encode_keys([key]),
                             checksums=sums)
            else:
                reply = _ask(raw, op="commit_runs", puts=[[wid, encode_keys([key]), sums]])
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert "clears" in reply["message"], reply
            assert int(server.store.regions.pins.sum()) == 0 and not server.store.index.runs
        finally:
            raw.close()
        _still_serves(server, sock, 13)


def test_drop_runs_naming_a_run_twice_drops_it_once(store_file, sock):
    """drop_runs with a run id twice (a client's duplicate, or a read
    error's list of runs that names one run per segment) took the run out
    twice: its region's live-run count fell once per mention, so a sealed
    region with other live runs counted as empty and was reclaimed (trimmed)
    under them."""
    with serve_in_background([store_file], sock) as server:
        st = server.store
        r = RemoteStore(sock)
        try:
            for i in range(12):             # fills and seals the first region
                r.put_run(run_keys(i, 3), run_data(run_keys(i, 3)))
            first = st.index.locate(st.index.runs[min(st.index.runs)].key(0))[0]
            region = first.region
            live = int(st.regions.live[region])
            assert st.regions.open != region and live > 1
            raw = _raw(sock)
            try:            # as many times as the region holds runs
                reply = _ask(raw, op="drop_runs", run_ids=[first.run_id] * live)
                assert reply == {"ok": True, "result": 1}, reply
            finally:
                raw.close()
            in_region = [run for run in st.index.runs.values() if run.region == region]
            assert int(st.regions.live[region]) == len(in_region) == live - 1
            out = np.zeros(3 * GEOM.block_bytes, np.uint8)
            for i in range(1, 12):          # every other run reads back whole
                keys = run_keys(i, 3)
                assert r.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys)), i
            assert r.get_run(run_keys(0, 3), out) == 0
        finally:
            r.close()
        _still_serves(server, sock, 2)


@pytest.mark.parametrize("args", [{"all": "false"}, {"all": 0.5}, {"older_than": "1e300"},
                                  {"older_than": "soon"}, {"older_than": float("nan")},
                                  {"older_than": 10 ** 400}])
def test_evict_with_arguments_of_the_wrong_type_is_refused(store_file, sock, args):
    """evict's ``all`` was taken by truthiness and ``older_than`` through
    float(): a client sending the string "false" (or a cutoff as a string)
    had every unpinned region of the shared store evicted, and a cutoff that
    is no number got an untyped ValueError back.  Both are ConfigError now,
    and nothing is evicted."""
    with serve_in_background([store_file], sock) as server:
        r = RemoteStore(sock)
        try:
            for i in range(12):             # fills and seals the first region
                r.put_run(run_keys(i, 3), run_data(run_keys(i, 3)))
            raw = _raw(sock)
            try:
                reply = _ask(raw, op="evict", **args)
            finally:
                raw.close()
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert server.store.counters["evicted_regions"] == 0
            out = np.zeros(3 * GEOM.block_bytes, np.uint8)
            for i in range(12):
                keys = run_keys(i, 3)
                assert r.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys)), i
            assert r.evict(0) == 0 and r.evict_older_than(0) == 0
            # refused on the client too: bool("false") is True
            with pytest.raises(ConfigError, match="all must be True or False"):
                r.evict(all="false")
            with pytest.raises(ConfigError, match="give nbytes or all=True"):
                r.evict()
            assert server.store.counters["evicted_regions"] == 0
        finally:
            r.close()
        _still_serves(server, sock, 3)


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


@pytest.mark.parametrize("request_, field", [
    (b'["op", "lookup"]', "JSON object"),
    (b'"lookup"', "JSON object"),
    (b"null", "JSON object"),
    (b"{not json", "JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON"),                  # nested past the recursion limit
    (b'{"op": "lookup", "keys": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON"),
    (b'{"op": "drop_runs", "run_ids": 5}', "run_ids"),
    (b'{"op": "drop_runs", "run_ids": null}', "run_ids"),
    (b'{"op": "drop_runs", "run_ids": "111"}', "run_ids"),
    (b'{"op": "drop_runs", "run_ids": [[1]]}', "run_ids"),
    (b'{"op": "drop_runs", "run_ids": [true]}', "run_ids"),
    (b'{"op": "drop_runs", "run_ids": [], "why": []}', "why"),
    (b'{"op": "drop_runs", "run_ids": [], "why": {"checksum": 1}}', "why"),
    (b'{"op": "unpin", "pin": [1]}', "pin"),
    (b'{"op": "unpin", "pin": true}', "pin"),
    (b'{"op": "abort", "wid": {"a": 1}}', "wid"),
    (b'{"op": "commit", "wid": [1], "keys": "", "checksums": [], "clears": "x:0"}', "wid"),
    (b'{"op": "allocate", "nblocks": true}', "blocks"),
    (b'{"op": "admit", "keys": ""}', "keys"),               # no keys: no run, no duplicate
    (b'{"op": "removed", "cursor": "ab:\\u00b2"}', "cursor"),
    (b'{"op": "removed", "cursor": "ab:' + b"9" * 5000 + b'"}', "cursor"),
    (b'{"op": "delete_prefix", "prefix": "zz"}', "not hex"),
    (b'{"op": "delete_prefix", "prefix": ""}', "1 to 8 bytes"),
    (b'{"op": "delete_prefix", "prefix": [' + b"1," * 50_000 + b'1]}', "hex string"),
])
def test_a_malformed_request_is_a_config_error_naming_the_field(store_file, sock, request_,
                                                                field):
    """A request that is no JSON object (a list, a string, null, broken
    JSON) or an argument of the wrong type (run_ids not a list of run ids,
    a pin or allocation id that is a list) was answered with a generic
    ServerError ("TypeError: unhashable type", "'int' object is not
    iterable"), null closed the connection, and ``true`` passed for id 1
    (dropping run 1 of the shared store, releasing pin 1).  Each is a
    ConfigError naming what was expected; the connection, its pins and the
    store stay as they were."""
    with serve_in_background([store_file], sock) as server:
        st = server.store
        r = RemoteStore(sock)
        raw = _raw(sock)
        try:
            keys = run_keys(7, 3)
            assert r.put_run(keys, run_data(keys)) == 3
            runs = dict(st.index.runs)
            # this connection holds pin 1 (a read) and allocation 2 (a write)
            seg = _ask(raw, op="segments", keys=encode_keys(normalize_keys(keys)))
            alloc = _ask(raw, op="allocate", nblocks=1)
            assert seg["ok"] and alloc["ok"], (seg, alloc)
            pins, counters = int(st.regions.pins.sum()), dict(st.counters)
            raw.sendall(_frame(request_))
            reply = recv_msg(raw)
            assert reply is not None, "the connection was closed"
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert field in reply["message"], reply
            assert len(reply["message"]) < 1000, "the bad value quoted whole"
            # nothing dropped, released or allocated; the connection still serves
            assert dict(st.index.runs) == runs and int(st.regions.pins.sum()) == pins
            assert dict(st.counters) == counters
            assert _ask(raw, op="unpin", pin=seg["result"]["pin"]) == {"ok": True, "result": None}
            assert _ask(raw, op="abort", wid=alloc["result"]["wid"]) == \
                {"ok": True, "result": None}
            assert int(st.regions.pins.sum()) == 0
            out = np.zeros(3 * GEOM.block_bytes, np.uint8)
            assert r.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))
        finally:
            raw.close()
            r.close()
        _still_serves(server, sock, 4)


def test_a_connection_that_never_says_hello_is_closed(store_file, sock, monkeypatch):
    """A peer that connects and says nothing (a port scanner, a hung or
    hostile process) kept a server thread and a descriptor for good, and
    enough of them starved the server.  It is closed once the hello wait
    is over; a client that said hello stays connected however long it
    keeps quiet."""
    wait = HelloWait(monkeypatch)      # r's hello is not raced against it
    with serve_in_background([store_file], sock, hello_timeout=0.5) as server:
        r = RemoteStore(sock)
        try:
            silent = _raw(sock)
            wait.let_go()
            try:
                assert silent.recv(1) == b""        # the server closed it
            finally:
                silent.close()
            deadline = time.monotonic() + 30        # its thread ends
            while server.client_count() != 1:
                assert time.monotonic() < deadline, "the silent connection's session stayed"
                time.sleep(0.02)
            wait.passes(2)                          # r kept quiet past the wait, looked at
            assert r.stats()["clients"] == 1        # only r is left, and it is served
            keys = run_keys(5, 2)
            assert r.put_run(keys, run_data(keys)) == 2
        finally:
            r.close()
        wait.hold()                 # another client's hello, not raced
        _still_serves(server, sock, 5)


@pytest.mark.parametrize("late", [False, True])
def test_connections_past_max_clients_are_refused_with_a_typed_error(store_file, sock,
                                                                     monkeypatch, late):
    """Nothing bounded the connections a server took: each one a thread and
    a descriptor, until the process ran out and every rank hung.  Past
    max_clients a connection is refused with ServerBusyError naming the
    socket and the limit (also when the refusal reached the client before
    its hello went out, ``late``); the clients connected are served, and a
    place given back is taken again."""
    from kvblock.errors import ServerBusyError
    from kvblock.store import client as client_mod

    with serve_in_background([store_file], sock, max_clients=2) as server:
        a, b = RemoteStore(sock), RemoteStore(sock)
        try:
            if late:    # the hello goes out after the server answered and closed
                real = client_mod.open_socket

                def slow_open(path, timeout):
                    conn = real(path, timeout)
                    conn.settimeout(10)
                    conn.recv(1, socket.MSG_PEEK)
                    return conn
                monkeypatch.setattr(client_mod, "open_socket", slow_open)
            with pytest.raises(ServerBusyError) as e:
                RemoteStore(sock)
            assert sock in str(e.value) and "2" in str(e.value)
            monkeypatch.undo()
            keys = run_keys(6, 2)
            assert a.put_run(keys, run_data(keys)) == 2
            out = np.zeros(2 * GEOM.block_bytes, np.uint8)
            assert b.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
            b.close()
            deadline = time.monotonic() + 30         # b's place is given back
            while server.client_count() >= 2:
                assert time.monotonic() < deadline, "b's session stayed after its close()"
                time.sleep(0.02)
            with RemoteStore(sock) as c:
                assert c.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
            assert a.stats()["refused_connections"] == 1
        finally:
            a.close()
            b.close()


def test_a_hello_taken_while_the_hello_wait_runs_out_is_answered_not_cut_off(
        store_file, sock, monkeypatch):
    """A starved server (its connection thread not run for the whole hello
    wait) checks the socket before it closes a connection that has not said
    hello: a hello waiting there is as good as said.  But the connection's
    thread could take the hello between that look and the lease thread's
    look at the socket: the hello was answered yes, then the connection was
    closed under the client (ServerGoneError from a live server).  A hello
    taken by then is answered and the connection kept."""
    import select as select_mod
    import threading
    import types

    from kvblock.store import server as server_mod

    looked = threading.Event()

    class RacingPoll:      # the lease thread's look: the hello is taken meanwhile
        def __init__(self):
            self.p = select_mod.poll()

        def register(self, conn, events):
            self.p.register(conn, events)

        def poll(self, timeout):
            self.p.poll(10_000)        # a hello waiting, however late the client sent it
            looked.set()
            deadline = time.monotonic() + 20
            while self.p.poll(0) and time.monotonic() < deadline:
                time.sleep(0.005)
            return self.p.poll(0)

    serve = server_mod.StoreServer._serve

    def starved_serve(self, s):     # runs once the hello wait is over
        looked.wait(20)
        return serve(self, s)

    monkeypatch.setattr(server_mod, "select",
                        types.SimpleNamespace(poll=RacingPoll, POLLIN=select_mod.POLLIN))
    monkeypatch.setattr(server_mod.StoreServer, "_serve", starved_serve)
    wait = HelloWait(monkeypatch, held=False)
    with serve_in_background([store_file], sock, hello_timeout=0.2) as server:
        r = RemoteStore(sock)
        try:
            assert looked.is_set()
            wait.passes(2)          # the pass that looked is done, and the next
            keys = run_keys(8, 2)
            assert r.put_run(keys, run_data(keys)) == 2
            out = np.zeros(2 * GEOM.block_bytes, np.uint8)
            assert r.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
            assert server.client_count() == 1
        finally:
            r.close()
        wait.hold()                 # another client's hello, not raced
        _still_serves(server, sock, 8)


@contextlib.contextmanager
def _a_connection_closing(server, sock, keys):
    """A client that stored and pinned ``keys`` has closed its connection,
    and the server's cleanup of it (giving its pins back) is held until the
    block ends; yields the keys."""
    entered, go = threading.Event(), threading.Event()
    real = server.store._unpin

    def slow_unpin(segs):          # the closing session's cleanup, held
        entered.set()
        go.wait(20)
        return real(segs)
    a = RemoteStore(sock)
    try:
        assert a.put_run(keys, run_data(keys)) == 2
        a.pin(keys)
        server.store._unpin = slow_unpin
        a.close()
        assert entered.wait(20), "the closed connection's pins were never released"
        yield keys
    finally:
        go.set()
        a.close()
        server.store.__dict__.pop("_unpin", None)


def test_a_closing_connection_does_not_count_toward_max_clients(store_file, sock):
    """A connection whose client has gone (its pins being given back) kept
    its place under max_clients until that cleanup was done, so a rank
    reconnecting right after many others left was refused with
    ServerBusyError while nobody was being served."""
    with serve_in_background([store_file], sock, max_clients=1) as server:
        with _a_connection_closing(server, sock, run_keys(7, 2)) as keys:
            with RemoteStore(sock) as b:          # refused with ServerBusyError before
                assert b.lookup(keys) == 2


def test_stats_count_no_closing_connection_as_a_client(store_file, sock):
    """stats()["clients"] counted a connection whose client had gone (its
    pins being given back) as served, unlike max_clients: a monitor saw
    more clients than the server serves, and more than --max-clients."""
    with serve_in_background([store_file], sock, max_clients=1) as server:
        with _a_connection_closing(server, sock, run_keys(9, 2)):
            with RemoteStore(sock) as b:
                assert b.stats()["clients"] == 1      # b; a is gone


def test_ranks_dropping_one_run_at_once_count_it_once(store_file, sock):
    """Tensor-parallel ranks read the same runs together, so a damaged run
    fails every rank's checksum at once and each asks drop_runs for it.
    The server counted the runs it found before dropping them: two requests
    that both looked before either dropped counted one failure twice."""
    with serve_in_background([store_file], sock) as server:
        st = server.store
        r = RemoteStore(sock)
        try:
            keys = run_keys(5, 3)
            assert r.put_run(keys, run_data(keys)) == 3
            (run_id,) = st.index.runs
            both_looked = threading.Barrier(2)
            drop = st._drop_runs

            def after_both_looked(*args, **kw):     # each request's drop waits for the other
                with contextlib.suppress(threading.BrokenBarrierError):
                    both_looked.wait(timeout=2)
                return drop(*args, **kw)

            st._drop_runs = after_both_looked
            replies = []

            def rank():
                raw = _raw(sock)
                try:
                    replies.append(_ask(raw, op="drop_runs", run_ids=[run_id]))
                finally:
                    raw.close()

            ranks = [threading.Thread(target=rank) for _ in range(2)]
            for t in ranks:
                t.start()
            for t in ranks:
                t.join(20)
            assert [reply["ok"] for reply in replies] == [True, True], replies
            assert run_id not in st.index.runs
            assert st.counters["checksum_failures"] == 1
            assert r.stats()["checksum_failures"] == 1
        finally:
            r.close()
        _still_serves(server, sock, 6)


def test_a_listener_that_fails_stops_the_server_instead_of_answering_nobody(store_file, sock):
    """An accept() error other than running out of descriptors or memory
    ended the accept thread and left the server running, answering no one
    (its clients' reconnects found it alive and waited forever)."""
    import errno

    class Broken:
        def __init__(self, real):
            self.real = real

        def accept(self):
            raise OSError(errno.EINVAL, "Invalid argument")

        def __getattr__(self, name):
            return getattr(self.real, name)

    with serve_in_background([store_file], sock) as server:
        server._listener = Broken(server._listener)
        assert server.stopped.wait(10), "the server kept running without a listener"
        assert isinstance(server.failed, OSError) and server.failed.errno == errno.EINVAL
        assert server.store.closed


def test_a_connection_whose_hello_failed_is_still_closed_by_the_hello_wait(
        store_file, sock, monkeypatch):
    """A hello answered no because the server could not hand out its fence
    files (out of descriptors) marked the connection as having said hello
    all the same: the hello wait no longer closed it, so a peer that then
    kept quiet held a server thread and a descriptor (and a place under
    max_clients) for good.  Only a hello answered yes counts."""
    import errno

    from kvblock.store import server as server_mod

    real = server_mod.StoreServer._fence_files
    failing = [True]

    def fence_files(self):
        if failing[0]:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(self)
    monkeypatch.setattr(server_mod.StoreServer, "_fence_files", fence_files)
    wait = HelloWait(monkeypatch)      # the hello is answered before the wait runs
    with serve_in_background([store_file], sock, hello_timeout=0.3) as server:
        raw = _raw(sock)
        try:
            reply = _ask(raw, op="hello", protocol=server_mod.PROTOCOL, pid=os.getpid())
            assert reply["ok"] is False and "fence files" in reply["message"], reply
            failing[0] = False
            wait.let_go()
            assert raw.recv(1) == b"", "the connection stayed open past the hello wait"
        finally:
            raw.close()
        deadline = time.monotonic() + 30
        while server.client_count():
            assert time.monotonic() < deadline, "its session stayed"
            time.sleep(0.02)
        wait.hold()                 # another client's hello, not raced
        _still_serves(server, sock, 10)


def test_a_raw_clients_zero_key_is_the_stand_in_every_client_uses(store_file, sock):
    """The all-zero key stands for superseded positions in checkpoints, so
    clients store it under a stand-in (normalize_key).  A raw client's
    admit and commit of 16 zero bytes went into the index as is: a lookup
    of that key (by any client: it asks for the stand-in) missed the run,
    and the checkpoint wrote its position as superseded.  The server maps
    the key at its boundary as the clients do."""
    zero = bytes(16)
    with serve_in_background([store_file], sock) as server:
        raw = _raw(sock)
        try:
            admit = _ask(raw, op="admit", keys=encode_keys([zero]))
            alloc = _ask(raw, op="allocate", nblocks=1)
            assert admit["ok"] and alloc["ok"], (admit, alloc)
            reply = _ask(raw, op="commit", wid=alloc["result"]["wid"], keys=encode_keys([zero]),
                         checksums=[0] * server.store.geometry.run_checksums,
                         clears=admit["result"]["clears"])
            assert reply["ok"] and reply["result"] == 1, reply
            lookup = _ask(raw, op="lookup", keys=encode_keys([zero]))
            assert lookup["result"] == 1, lookup
        finally:
            raw.close()
        assert zero not in server.store.index
        r = RemoteStore(sock)
        try:
            assert r.lookup([zero]) == 1 and r.lookup([0]) == 1
        finally:
            r.close()


def test_a_hello_to_a_server_whose_store_has_closed_is_a_typed_error(store_file, sock):
    """hello is answered on a closed store (so that another release's client
    still learns of the protocol mismatch), but its answer read the store's
    devices, which a closed store no longer has: a rank connecting to a
    server whose store had closed (a metadata write failed; it is stopping)
    got an untyped ServerError ("AttributeError: 'NoneType' object has no
    attribute 'devices'").  It is StoreClosedError, as every other request
    gets."""
    from kvblock.store.server import PROTOCOL

    with serve_in_background([store_file], sock) as server:
        raw = _raw(sock)
        try:
            server.store.close()        # as a failed metadata write does
            # (the server stops after this answer: one request only)
            reply = _ask(raw, op="hello", protocol=PROTOCOL, pid=os.getpid())
            assert reply["ok"] is False and reply["error"] == "StoreClosedError", reply
            assert "closed" in reply["message"] and sock in reply["message"], reply
        finally:
            raw.close()


@pytest.mark.parametrize("pid", ["x" * 4096, 1.5, [1], True, -1])
def test_a_hello_whose_pid_is_no_process_id_is_refused(store_file, sock, pid):
    """hello's pid was kept as sent and written into the server's log when
    the connection was dropped: a string of any length (a frame's worth)
    went to the log.  A pid is a process id or absent."""
    from kvblock.store.server import PROTOCOL

    with serve_in_background([store_file], sock):
        raw = _raw(sock)
        try:
            reply = _ask(raw, op="hello", protocol=PROTOCOL, pid=pid)
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert "pid" in reply["message"] and len(reply["message"]) < 300, reply
            reply = _ask(raw, op="hello", protocol=PROTOCOL, pid=os.getpid())
            assert reply["ok"] is True, reply
        finally:
            raw.close()


@pytest.mark.parametrize("extra", [{"all": True}, {"nbytes": 1 << 20}])
def test_evict_older_than_with_another_criterion_is_refused(store_file, sock, extra):
    """evict with older_than took the age and silently ignored all=true or
    nbytes beside it (a client asking for both got less than one of them
    says)."""
    with serve_in_background([store_file], sock) as server:
        keys = run_keys(3, 1)
        with RemoteStore(sock) as rank:
            rank.put_run(keys, run_data(keys))
        raw = _raw(sock)
        try:
            reply = _ask(raw, op="evict", older_than=time.time() + 60, **extra)
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
        finally:
            raw.close()
        assert server.store.lookup(keys) == 1          # nothing evicted


def test_a_connection_the_server_drops_ends_for_its_peer_while_a_child_holds_a_copy(
        store_file, sock):
    """The server ends a connection it drops (here: a frame longer than any
    request) before it gives back the connection's pins, so that the rank
    sees the end before its pins lapse.  It only closed its descriptor: a
    child forked meanwhile in the server's process (a worker of a program
    serving from a thread) holds a copy of the socket, the connection
    stayed open for the rank, and its lapsed pins went unseen.  It is shut
    down first."""
    import signal

    from kvblock.store import protocol

    with serve_in_background([store_file], sock):
        raw = _raw(sock)
        try:
            assert _ask(raw, op="ping")["ok"]
            child = os.fork()               # holds a copy of every descriptor
            if child == 0:
                time.sleep(20)
                os._exit(0)
            try:
                raw.sendall((protocol.MAX_FRAME + 1).to_bytes(4, "big"))
                raw.settimeout(5)
                assert raw.recv(1) == b""         # the end, though the child lives
            finally:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
        finally:
            raw.close()


def test_a_connection_saying_hello_twice_counts_once(store_file, sock):
    """connections_total counts the connections whose hello the server
    answered (README); a client that said hello again on its connection
    was counted once per hello, so stats() said more connections than
    were ever made."""
    from kvblock.store.server import PROTOCOL

    with serve_in_background([store_file], sock) as server:
        raw = _raw(sock)
        try:
            for _ in range(3):
                reply = _ask(raw, op="hello", protocol=PROTOCOL, pid=os.getpid())
                assert reply["ok"], reply
                _, fds, _, _ = socket.recv_fds(raw, 1, 16)
                for fd in fds:
                    os.close(fd)
            assert server.connections_total == 1
        finally:
            raw.close()
        _still_serves(server, sock, 14)
        assert server.connections_total == 2


@pytest.mark.parametrize("pin_lease", [60.0, None])
def test_a_connection_that_never_says_hello_nor_reads_its_answers_is_closed(store_file, sock,
                                                                            monkeypatch,
                                                                            pin_lease):
    """A peer that sent requests without saying hello and took none of the
    answers kept the server's thread blocked sending one of them: the hello
    wait passes a connection being answered by, and the send waits on for a
    peer that holds no pins, so the connection (a thread, a descriptor, a
    place under max_clients) stayed for good, though README says one that
    has not said hello in time is closed.  A connection that has not said
    hello and has been stuck sending one answer for the hello wait is
    closed too."""
    # the wait runs once the connection is stuck (not while it is filled:
    # a closed connection broke the test's send, EPIPE, on a loaded machine)
    wait = HelloWait(monkeypatch)
    with serve_in_background([store_file], sock, hello_timeout=0.5,
                             pin_lease=pin_lease) as server:
        raw = _raw(sock)
        try:
            raw.setblocking(False)
            req, seen = encode_msg({"op": "stats"}), None
            deadline = time.monotonic() + 30
            while True:      # until the server's answers fill both buffers
                assert time.monotonic() < deadline, "the server kept reading"
                try:
                    raw.send(req)
                    seen = None
                    continue
                except BlockingIOError:
                    pass
                with server._sessions_lock:       # (none: not accepted yet)
                    sending = [s.sending for s in server._sessions.values()]
                sending = sending[0] if sending else None
                if sending is not None and sending == seen:
                    break    # one answer's send, still under way at a second look
                seen = sending
                time.sleep(0.01)
            wait.let_go()
            deadline = time.monotonic() + 15
            while server.client_count():
                assert time.monotonic() < deadline, \
                    "a connection that never said hello stayed open, blocked in a send"
                time.sleep(0.05)
        finally:
            raw.close()
        wait.hold()                 # another client's hello, not raced
        _still_serves(server, sock, 15)
