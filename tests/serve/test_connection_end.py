"""What the server gives back when a connection ends (StoreServer._release):
every reader pin, every allocation (after the write fence), every open
admission offer, whatever one of them raises."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from kvblock.index.keys import normalize_keys
from kvblock.store.protocol import encode_keys, encode_msg, recv_msg
from kvblock.store.server import _Session, serve_in_background
from tests.serve.test_serve import _store_file
from tests.store.workload import run_data, run_keys


def _call(conn, op, **args):
    conn.sendall(encode_msg({"op": op, **args}))
    reply = recv_msg(conn)
    assert reply["ok"], reply
    return reply["result"]


def _stored(st, keys):
    """``keys`` stored on the served store itself (admit_after offers)."""
    for _ in range(st.admission.admit_after):
        if st.put_run(keys, run_data(keys)):
            return
    raise AssertionError("not stored")


def _session_with_every_kind(server, conn):
    """A session holding a reader pin, an allocation and an open offer;
    returns (session, the allocation's region, the offer's key)."""
    st = server.store
    keys, offered = run_keys(1, 2), normalize_keys(run_keys(2, 2))
    _stored(st, keys)
    s = _Session(conn, 10 ** 6)
    with st._lock:
        s.readers[1] = st._segments(normalize_keys(keys))   # (the store's keys: raw, none)
    run = s.readers[1][0][0]
    assert len(s.readers[1]) == 1 and run.pins == 1 and st.regions.pins[run.region] == 1
    region, offset, run_id, gen = st._begin_put(st.layout(2).run_bytes)
    s.writers[2] = (region, run_id, offset, gen, 2)
    assert server._op_admit(s, encode_keys(offered))["verdict"] == "rejected"
    assert server._op_admit(s, encode_keys(offered))["verdict"] == "ok"
    assert list(s.offers.values()) == [(offered, True)]
    assert st.admission._offers.get(offered[0]) is None      # used up
    return s, region, offered[0]


@pytest.mark.parametrize("failing", ["readers", "offers"])
@pytest.mark.parametrize("error", [OSError("test: EIO"), KeyboardInterrupt()])
def test_an_error_releasing_one_kind_of_pin_still_releases_the_others(tmp_path, failing,
                                                                     error, monkeypatch):
    """_release unpinned the readers and gave back the open offers before
    it handed the allocations to the write fence: an error there (an
    OSError freeing an emptied region, a KeyboardInterrupt) left the
    connection's allocations pinned for good (and the offers too, when
    the readers' unpin raised).  Every kind is released whatever another
    raises; the error still comes out."""
    path = _store_file(tmp_path)
    a, b = socket.socketpair()
    with serve_in_background([path], str(tmp_path / "kv.sock"), admit_after=2) as server, \
            a, b:
        st = server.store
        s, region, offered = _session_with_every_kind(server, a)
        if failing == "readers":
            real = st._unpin

            def unpin(segs):
                real(segs)              # the pins dropped, then it failed
                raise error
            monkeypatch.setattr(st, "_unpin", unpin)
        else:
            def give_back(offers):
                raise error
            monkeypatch.setattr(st, "_give_back_offers", give_back)
        with pytest.raises(type(error)):
            server._release(s)
        monkeypatch.undo()
        assert not s.readers and not s.writers and not s.offers
        server._release_dropped_writers()     # (no rank writes: the fence passes)
        assert int(st.regions.pins.sum()) == 0, st.regions.pins
        if failing == "readers":              # the offer went back too
            assert st.admission._offers.get(offered) == st.admission.admit_after - 1


def test_a_connection_whose_release_fails_still_leaves_the_server(tmp_path, monkeypatch):
    """A connection's end whose release raised (here the readers' unpin:
    an OSError freeing an emptied region) ended the session's thread with
    the session still listed: the server counted it a client for good
    (idle_exit never came) and its allocation stayed pinned.  Now the
    release is said in the log, the session leaves, the space goes back."""
    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock) as server:
        st = server.store
        keys = run_keys(1, 2)
        _stored(st, keys)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with conn:
            conn.connect(sock)
            assert _call(conn, "segments", keys=encode_keys(normalize_keys(keys)))["pin"]
            assert _call(conn, "allocate", nblocks=2)["wid"]
            (s,) = server._sessions.values()
            real = st._unpin

            def unpin(segs):
                real(segs)
                raise OSError("test: EIO")
            monkeypatch.setattr(st, "_unpin", unpin)
        s.thread.join(10)
        assert not s.thread.is_alive()
        assert server.client_count() == 0
        monkeypatch.undo()
        server._release_dropped_writers()     # (no rank writes: the fence passes)
        assert int(st.regions.pins.sum()) == 0, st.regions.pins


@pytest.mark.parametrize("plan_stood", [False, True])
def test_a_declined_offer_of_a_put_runs_cut_by_its_connections_end_is_given_back(
        tmp_path, plan_stood):
    """put_runs admits its runs told count=False: a declined run's offer
    stays counted in the server's admission, and is counted (count_rejected)
    once the call's plan stands, or given back (give_back) when the call is
    refused.  A connection that ended between the two (the rank died, or
    gave the connection up, mid-put_runs) left the offer counted, though
    the call stood for nothing: the key's next offer, which should be its
    first, was admitted at once (admit_after=2).  The server gives back the
    declined offers whose call had not stood when the connection ended;
    those counted by count_rejected stay."""
    from kvblock.store.client import RemoteStore

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    a, b = run_keys(1, 2), run_keys(2, 2)
    with serve_in_background([path], sock, admit_after=2) as server:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with conn:
            conn.connect(sock)
            offers = []
            for keys in (a, b):
                answer = _call(conn, "admit", keys=encode_keys(normalize_keys(keys)),
                               count=False)
                assert answer["verdict"] == "rejected"
                offers.append(answer["offer"])
            if plan_stood:
                _call(conn, "count_rejected", runs=2, offers=offers)
            (s,) = server._sessions.values()
        s.thread.join(10)
        assert server.client_count() == 0
        with RemoteStore(sock) as r:
            if plan_stood:      # the offers counted: these are the second ones
                assert r.put_runs([(a, run_data(a)), (b, run_data(b))]) == [2, 2]
            else:               # none counted: these are the first ones
                assert r.put_runs([(a, run_data(a)), (b, run_data(b))]) == [0, 0]
                assert r.put_runs([(a, run_data(a)), (b, run_data(b))]) == [2, 2]


def test_count_rejected_settles_its_own_calls_declined_offers_not_another_threads(tmp_path):
    """Two threads' put_runs on one RemoteStore share its connection.
    count_rejected took the oldest declined offers open on the connection,
    whichever call counted them: thread 1's declined offer of ``k`` (its
    call not yet planned) was taken for thread 2's, whose own declined
    offer of ``e`` stayed open.  Thread 1's call then refused, it gave
    ``k`` back (right), and the connection's end gave ``e`` back too,
    though thread 2's plan stood: its offer was cancelled (admit_after=3:
    e's count fell from 1 to 0).  count_rejected now names the declined
    runs' first keys, and the server settles those."""
    import threading

    from kvblock.errors import ConfigError
    from kvblock.store.client import RemoteStore
    from tests.serve.test_write_fence import _in_thread

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    k, x, d, e = (run_keys(i, 2) for i in (1, 2, 3, 4))
    with serve_in_background([path], sock, admit_after=3) as server:
        adm = server.store.admission
        nk, nx, nd, ne = (normalize_keys(keys)[0] for keys in (k, x, d, e))
        with RemoteStore(sock) as r:
            real_admit = r._admit
            k_counted, go = threading.Event(), threading.Event()

            def admit(keys, count=True, record=None):
                if keys[0] == nx:        # thread 1, its first run admitted: waits, then refused
                    k_counted.set()
                    assert go.wait(20)
                    raise ConfigError("test: thread 1's call refused")
                return real_admit(keys, count, record)
            r._admit = admit
            box = _in_thread(lambda: r.put_runs([(k, run_data(k)), (x, run_data(x))]))
            assert k_counted.wait(20)
            # thread 2 (here): both runs declined, its plan stands
            assert r.put_runs([(d, run_data(d)), (e, run_data(e))]) == [0, 0]
            go.set()
            box["thread"].join(20)
            assert isinstance(box.get("error"), ConfigError), box
            (s,) = server._sessions.values()
        s.thread.join(10)
        assert server.client_count() == 0
        assert adm._offers.get(nk) is None            # thread 1's: given back once
        assert adm._offers.get(nd) == 1 and adm._offers.get(ne) == 1, \
            "thread 2's declined offers (its plan stood) were given back"


def _answer(conn, op, **args):
    conn.sendall(encode_msg({"op": op, **args}))
    return recv_msg(conn)


def test_count_rejected_without_keys_is_refused(tmp_path):
    """Since protocol 14 every client names the declined runs in
    count_rejected (protocol 15: by their offer ids); the form naming none
    (the oldest declined offers open on the connection, whichever call
    counted them) stayed served.  A request naming none is now a protocol
    error, answered ConfigError: nothing counted, no offer settled."""
    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    a, b = normalize_keys(run_keys(1, 2)), normalize_keys(run_keys(2, 2))
    with serve_in_background([path], sock, admit_after=2) as server:
        st = server.store
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(sock)
            offers = []
            for keys in (a, b):
                answer = _call(conn, "admit", keys=encode_keys(keys), count=False)
                assert answer["verdict"] == "rejected"
                offers.append(answer["offer"])
            (s,) = server._sessions.values()
            reply = _answer(conn, "count_rejected", runs=2)
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert "'offers'" in reply["message"], reply
            assert st.counters["admission_rejected_runs"] == 0
            assert list(s.offers.values()) == [(a, False), (b, False)]
            # naming them: counted, settled
            assert _call(conn, "count_rejected", runs=2, offers=offers) is None
            assert st.counters["admission_rejected_runs"] == 2 and not s.offers


def test_count_rejected_refuses_ids_of_offers_not_declined_on_this_connection(tmp_path):
    """count_rejected counted ``runs`` declined runs whatever offer ids it
    named: the id of an admitted offer (or one not open on the
    connection, or one named twice) counted a run as declined that no
    admit declined, in a counter that never goes down, and left that
    offer open.  Such a request is now refused (ConfigError): nothing
    counted, no offer settled."""
    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    a = normalize_keys(run_keys(1, 2))
    with serve_in_background([path], sock, admit_after=2) as server:
        st = server.store
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(sock)
            declined = _call(conn, "admit", keys=encode_keys(a), count=False)
            admitted = _call(conn, "admit", keys=encode_keys(a), count=False)
            assert (declined["verdict"], admitted["verdict"]) == ("rejected", "ok")
            (s,) = server._sessions.values()
            for offers in ([admitted["offer"]], [declined["offer"], declined["offer"]],
                           [declined["offer"] + 1000]):
                reply = _answer(conn, "count_rejected", runs=len(offers), offers=offers)
                assert reply["ok"] is False and reply["error"] == "ConfigError", reply
                assert st.counters["admission_rejected_runs"] == 0, offers
                assert list(s.offers.values()) == [(a, False), (a, True)], offers
            # the declined one named: counted, settled
            assert _call(conn, "count_rejected", runs=1, offers=[declined["offer"]]) is None
            assert st.counters["admission_rejected_runs"] == 1
            assert list(s.offers.values()) == [(a, True)]


@pytest.mark.parametrize("admitted", [False, True])
def test_give_back_gives_back_only_this_connections_offers(tmp_path, admitted):
    """give_back gave back every offer it named, open on the connection or
    not: a connection naming another's offer (a buggy or stray client)
    cancelled it in the shared admission (a declined one counted one
    offer less; an admitted one made the key's next offer admit at once),
    and the owner's own give_back, or its connection's end, then gave it
    back a second time.  Only offers open on the connection are given
    back now; the others are refused, said in a ConfigError."""
    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    k = normalize_keys(run_keys(1, 2))
    with serve_in_background([path], sock, admit_after=3) as server:
        adm = server.store.admission
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as a, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as b:
            a.connect(sock)
            b.connect(sock)
            answers = [_call(a, "admit", keys=encode_keys(k), count=False)
                       for _ in range(3 if admitted else 1)]
            assert answers[-1]["verdict"] == ("ok" if admitted else "rejected"), answers
            offer = answers[-1]["offer"]
            _call(b, "ping")
            before = dict(adm._offers)
            reply = _answer(b, "give_back", offers=[offer])
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert "not open on this connection" in reply["message"], reply
            assert dict(adm._offers) == before, "another connection's offer was given back"
            # its own connection gives it back
            assert _call(a, "give_back", offers=[offer]) is None
            if admitted:
                assert adm._offers.get(k[0]) == 2      # the next offer admits
            else:
                assert adm._offers.get(k[0]) is None   # counted no more


@pytest.mark.parametrize("call", ["put_runs", "put_run"])
def test_a_ctrl_c_waiting_to_send_a_give_back_leaves_the_offers_to_give_back(tmp_path, call):
    """The client emptied the offers it gives back before it sent them (so
    that a caller calling again after a KeyboardInterrupt sends none
    twice), then waited for the connection's lock (another thread's call
    in flight): a Ctrl-C there lost them, though nothing was sent.  The
    caller's second call found none, and the server kept them open until
    the connection ended (a declined offer stayed counted: the key's next
    offer admitted at once, admit_after=2; an admitted one stayed used up:
    the key needed two offers more).  Offers not sent are put back for the
    caller's call again (put_run's give_back is called again too)."""
    import threading

    from kvblock.errors import ConfigError
    from kvblock.store.client import RemoteStore

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    k, x = run_keys(1, 2), run_keys(2, 2)
    nk, nx = normalize_keys(k)[0], normalize_keys(x)[0]
    with serve_in_background([path], sock, admit_after=2) as server:
        adm = server.store.admission
        with RemoteStore(sock) as r:
            main = threading.current_thread()
            real_lock, armed = r._session.lock, []

            class CtrlCWaiting:
                """The connection's lock; a Ctrl-C lands as the test's thread
                waits for it, once armed."""

                def acquire(self, blocking=True, timeout=-1):
                    if armed and threading.current_thread() is main:
                        armed.clear()
                        raise KeyboardInterrupt
                    return real_lock.acquire(blocking, timeout)

                def release(self):
                    real_lock.release()

                def locked(self):
                    return real_lock.locked()

                def __enter__(self):
                    self.acquire()
                    return self

                def __exit__(self, *exc):
                    self.release()
            r._session.lock = CtrlCWaiting()
            real_admit = r._admit

            def admit(keys, count=True, record=None):
                if keys[0] == nx:           # the call refused after k's admit
                    armed.append(1)         # its give_back of k's offer: Ctrl-C
                    raise ConfigError("test: x refused")
                return real_admit(keys, count, record)
            r._admit = admit
            if call == "put_runs":
                with pytest.raises(KeyboardInterrupt):
                    r.put_runs([(k, run_data(k)), (x, run_data(x))])
                assert not armed
                assert adm._offers.get(nk) is None, "k's declined offer was not given back"
            else:
                assert r.put_run(k, run_data(k)) == 0        # the first offer: declined
                real_put_one = r._put_one

                def put_one(*args, **kwargs):   # admitted, then its write fails
                    armed.append(1)             # its give_back of k's offer: Ctrl-C
                    raise ConfigError("test: the write failed")
                r._put_one = put_one
                with pytest.raises(KeyboardInterrupt):
                    r.put_run(k, run_data(k))
                r._put_one = real_put_one
                assert not armed
                assert adm._offers.get(nk) == 1, "k's admitted offer was not given back"
            assert r.server_alive
            (s,) = server._sessions.values()
            assert not s.offers


def test_a_given_back_offer_settles_that_offer_not_another_of_its_first_key(tmp_path):
    """Two threads' puts on one RemoteStore, both admitted, of runs with one
    first key (``long`` = k0 k1 k2 and ``short`` = k0 k1).  The server
    matched a give_back by the first key and admitted alone, latest first:
    thread A's give_back of ``long`` (its write failed) settled thread B's
    open offer of ``short``; B then stored ``short`` whole, and ``long``'s
    offer, given back already, stayed open and went back a second time at
    the connection's end: k0's next offer (after another run of k0 had used
    the count up) was admitted at once (admit_after=2).  Offers are now
    named by the id admit answered, and give_back settles exactly those."""
    import threading

    from kvblock.errors import ConfigError
    from kvblock.store.client import RemoteStore
    from tests.serve.test_write_fence import _in_thread

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    long, short, other = run_keys(1, 3), run_keys(1, 2), [run_keys(1, 1)[0], b"other-blk1"]
    k0 = normalize_keys(long)[0]
    with serve_in_background([path], sock, admit_after=2) as server:
        adm = server.store.admission
        with RemoteStore(sock) as r:
            real_put_one = r._put_one
            admitted = {3: threading.Event(), 2: threading.Event()}
            go = {3: threading.Event(), 2: threading.Event()}

            def put_one(keys, *args, **kwargs):     # admitted: waits, then A's fails
                n = len(keys)
                admitted[n].set()
                assert go[n].wait(20)
                if n == 3:
                    raise ConfigError("test: A's write failed")
                return real_put_one(keys, *args, **kwargs)
            r._put_one = put_one
            assert r.put_run(long, run_data(long)) == 0           # k0's first offer
            a = _in_thread(lambda: r.put_run(long, run_data(long)))
            assert admitted[3].wait(20)
            assert r.put_run(short, run_data(short)) == 0         # k0 counted again
            b = _in_thread(lambda: r.put_run(short, run_data(short)))
            assert admitted[2].wait(20)
            go[3].set()                       # A gives its offer back
            a["thread"].join(20)
            assert isinstance(a.get("error"), ConfigError), a
            go[2].set()                       # B stores its run whole
            b["thread"].join(20)
            assert b.get("out") == 2, b
            (s,) = server._sessions.values()
            assert not s.offers, f"offers left open: {s.offers}"
            # another run of k0 uses the count up (admitted: A gave back)
            with RemoteStore(sock) as r2:
                assert r2.put_run(other, run_data(other)) == 2
                assert adm._offers.get(k0) is None
                sessions = list(server._sessions.values())
        for each in sessions:
            each.thread.join(10)
        assert server.client_count() == 0
        assert adm._offers.get(k0) is None, "long's offer was given back a second time"


def test_an_admit_of_a_stored_run_at_the_open_offers_bound_answers_duplicate(
        tmp_path, monkeypatch):
    """admit refused every offer on a connection at OPEN_OFFERS_KEPT open
    offers, a run the store holds whole too: such an admit opens no offer
    (duplicate, nothing to give back), yet a put_runs of many runs, some
    of them stored, failed on it with ConfigError.  It answers duplicate
    now; only an offer that would be tracked is refused."""
    from kvblock.store import server as server_mod

    monkeypatch.setattr(server_mod, "OPEN_OFFERS_KEPT", 1)
    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    a, d = normalize_keys(run_keys(1, 2)), normalize_keys(run_keys(2, 2))
    with serve_in_background([path], sock, admit_after=2) as server:
        _stored(server.store, d)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(sock)
            assert _call(conn, "admit", keys=encode_keys(a), count=False)["offer"]
            answer = _call(conn, "admit", keys=encode_keys(d), count=False)
            assert answer["verdict"] == "duplicate", answer


def test_an_offer_past_the_open_offers_bound_is_refused_not_the_oldest_dropped(
        tmp_path, monkeypatch):
    """A connection's open offers past OPEN_OFFERS_KEPT dropped the oldest
    from the server's tracking unsaid (a put_runs of more runs than the
    bound: LMCache's puts are one-key runs): its give_back was refused
    (logged at debug by the client) and its count stayed (a declined one:
    the key's next offer admitted too early; an admitted one: used up),
    and the connection's end did not give it back either.  The offer past
    the bound is refused now (ConfigError, nothing counted); every offer
    counted stays tracked and is given back."""
    from kvblock.store import server as server_mod

    monkeypatch.setattr(server_mod, "OPEN_OFFERS_KEPT", 2)
    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    a, b, c = (normalize_keys(run_keys(i, 2)) for i in (1, 2, 3))
    with serve_in_background([path], sock, admit_after=3) as server:
        adm = server.store.admission
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(sock)
            offers = [_call(conn, "admit", keys=encode_keys(keys), count=False)["offer"]
                      for keys in (a, b)]
            reply = _answer(conn, "admit", keys=encode_keys(c), count=False)
            assert reply["ok"] is False and reply["error"] == "ConfigError", reply
            assert "open offers" in reply["message"], reply
            assert adm._offers.get(c[0]) is None, "the refused offer was counted"
            assert _call(conn, "give_back", offers=offers[::-1]) is None
            assert adm._offers.get(a[0]) is None and adm._offers.get(b[0]) is None
            # settled: room again
            assert _call(conn, "admit", keys=encode_keys(c), count=False)["offer"]


@pytest.mark.parametrize("how", ["put_run", "put_runs"])
def test_an_admitted_offer_is_settled_when_its_last_piece_commits_though_a_piece_left(
        tmp_path, how, monkeypatch):
    """A long run admitted (admit_after=2) is put in pieces; its first
    piece was evicted before the last one committed.  The put is done
    (every piece published: it answers the run's blocks, and KVStore's
    offer stays used up), but the server settled an admitted offer only
    when its run was stored whole: it stayed open on the connection, and
    the connection's end gave it back, so the key's next offer (its first
    since the put) was admitted at once.  The commit of the last piece
    settles the offer, whatever left the store meanwhile."""
    from kvblock.store.client import RemoteStore

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock, admit_after=2) as server:
        st = server.store
        adm = st.admission
        m = st.max_run_blocks
        # seven pieces: put_runs commits them in two groups (six regions
        # of the store's 28 at most in one)
        keys = run_keys(1, 7 * m)
        nkeys = normalize_keys(keys)
        other = run_keys(2, 1)                     # put_runs: a second run
        real_publish = type(st)._publish_puts

        def publish(self, runs, clears):
            if any(r.keys.startswith(nkeys[6 * m]) for r in runs):     # the last piece
                assert self.evict(all=True) >= 1                 # the first ones go
                assert self.index.prefix_length(nkeys) == 0
            return real_publish(self, runs, clears)

        def put(r):
            if how == "put_run":
                return [r.put_run(keys, run_data(keys))]
            return r.put_runs([(keys, run_data(keys)), (other, run_data(other))])[:1]
        with RemoteStore(sock) as r:
            assert put(r) == [0]                   # keys[0]'s first offer: declined
            monkeypatch.setattr(type(st), "_publish_puts", publish)
            assert put(r) == [7 * m]               # admitted: every piece published
            monkeypatch.undo()
            (s,) = server._sessions.values()
            assert not [k for k, admitted in s.offers.values() if admitted], \
                "the done put's offer is open on the connection"
        s.thread.join(10)
        assert server.client_count() == 0
        assert adm._offers.get(nkeys[0]) is None, "the done put's offer was given back"
        with RemoteStore(sock) as r:
            assert put(r) == [0], "the key's next offer was admitted at once"


@pytest.mark.parametrize("how", ["put_run", "put_runs"])
def test_a_put_cut_before_its_commit_goes_out_gives_back_its_allocations(tmp_path, how,
                                                                         monkeypatch):
    """A Ctrl-C landing in a put as its commit waits for the connection's
    lock (another thread's call in flight): the put had marked its
    allocations as the server's to release ("sent") before the request went
    out, so nothing gave them back, and the server held them pinned for as
    long as the connection lived (a live rank is never quiet for a lease:
    the regions were never evicted nor freed).  A commit cut before it went
    out aborts them, as an allocation whose write failed is."""
    from kvblock.store.client import RemoteStore as RS

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    a, b = run_keys(1, 2), run_keys(2, 3)
    with serve_in_background([path], sock) as server, RS(sock) as r:
        real, cut = RS._call_on, []

        def call_on(self, s, op, **args):
            if op in ("commit", "commit_runs") and not cut:
                cut.append(op)
                raise KeyboardInterrupt     # before the lock is taken: nothing sent
            return real(self, s, op, **args)
        monkeypatch.setattr(RS, "_call_on", call_on)
        with pytest.raises(KeyboardInterrupt):
            if how == "put_run":
                r.put_run(a, run_data(a))
            else:
                r.put_runs([(a, run_data(a)), (b, run_data(b))])
        assert cut
        _allocations_given_back(server, r, a, b)


@pytest.mark.parametrize("at", ["_call_locked", "_call_on"])
@pytest.mark.parametrize("how", ["put_run", "put_runs"])
def test_a_put_cut_as_its_allocate_returns_gives_back_the_allocation(tmp_path, how, at,
                                                                     monkeypatch):
    """A Ctrl-C landing as an allocate call returns (its answer read, the
    connection not given up: after _call_locked's try, in _call_on's with
    exit, before the put assigns the answer): the put never learnt the
    allocation's id, so it aborted nothing, and the server held the space
    pinned for as long as the connection lived (a live rank's lease never
    lapses).  The answer is recorded as it is read: the put aborts it."""
    from kvblock.store.client import RemoteStore as RS

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    a, b = run_keys(1, 2), run_keys(2, 3)
    # put_runs: cut at its second allocate (the first one's answer is the put's)
    cut_at = 1 if how == "put_run" else 2
    with serve_in_background([path], sock) as server, RS(sock) as r:
        _cut_as_it_returns(monkeypatch, r, at, "allocate", cut_at, how, a, b)
        _allocations_given_back(server, r, a, b)


def _cut_as_it_returns(monkeypatch, r, at, op, cut_at, how, a, b) -> None:
    """Run put_run(a) (``how``) or put_runs([a, b]) on RemoteStore ``r``
    with a KeyboardInterrupt raised as its ``cut_at``-th ``op`` call
    returns from RemoteStore method ``at`` (its answer read, the caller
    never seeing it)."""
    from kvblock.store.client import RemoteStore as RS

    real, answers = getattr(RS, at), []

    def call(self, s, name, *args, **kwargs):
        out = real(self, s, name, *args, **kwargs)
        if name == op:
            answers.append(out)
            if len(answers) == cut_at:
                raise KeyboardInterrupt     # the answer came, the caller never saw it
        return out
    monkeypatch.setattr(RS, at, call)
    with pytest.raises(KeyboardInterrupt):
        if how == "put_run":
            r.put_run(a, run_data(a))
        else:
            r.put_runs([(a, run_data(a)), (b, run_data(b))])
    monkeypatch.undo()
    assert len(answers) == cut_at


def _allocations_given_back(server, r, a, b) -> None:
    """After a cut put of ``a`` (and ``b``): the server holds no allocation
    of it on the live connection and no region pinned, nothing was
    published, and the rank goes on (put again, stored and read back whole)."""
    (s,) = server._sessions.values()
    assert not s.writers, "the allocations of the cut put stay on the connection"
    assert server.store.regions.pins.sum() == 0, "a region stays pinned"
    assert r._session.held == 0 and r.server_alive
    assert r.lookup(a) == 0                  # nothing published
    _put_and_read_back(r, a, b)


def _put_and_read_back(r, a, b) -> None:
    """put_runs([a, b]) on ``r`` stores both whole, and they read back."""
    assert r.put_runs([(a, run_data(a)), (b, run_data(b))]) == [2, 3]
    for keys in (a, b):
        out = np.zeros_like(run_data(keys))
        assert r.get_run(keys, out) == len(keys) and np.array_equal(out, run_data(keys))


@pytest.mark.parametrize("at", ["_call_locked", "_call_on"])
@pytest.mark.parametrize("how", ["put_run", "put_runs"])
def test_a_put_cut_as_its_admit_returns_gives_back_the_offer(tmp_path, how, at, monkeypatch):
    """A Ctrl-C landing as an admit call returns (its answer read, the
    connection not given up: after _call_locked's try, in _call_on's with
    exit, before _admit noted the offer): the put never learnt the offer's
    id, so it gave nothing back, and the offer stayed open on the live
    connection until it ended: the key's next offer was taken for a repeat
    (declined under admit_after=2, where the offer given back admits it at
    once).  The offer is recorded as its answer is read: the put gives it
    back."""
    from kvblock.store.client import RemoteStore as RS

    sock, path = str(tmp_path / "kv.sock"), _store_file(tmp_path)
    a, b = run_keys(1, 2), run_keys(2, 3)
    with serve_in_background([path], sock, admit_after=2) as server, RS(sock) as r:
        # each run offered once: its next offer is admitted
        assert r.put_runs([(a, run_data(a)), (b, run_data(b))]) == [0, 0]
        (s,) = server._sessions.values()
        assert not s.offers
        # put_runs: cut at its second admit (the first one's offer is the put's)
        cut_at = 1 if how == "put_run" else 2
        _cut_as_it_returns(monkeypatch, r, at, "admit", cut_at, how, a, b)
        assert not s.offers, f"offers left open on the connection: {s.offers}"
        assert r.server_alive and list(server._sessions.values()) == [s], \
            "the connection was given up"
        assert r.lookup(a) == 0                  # nothing published
        # the offers were given back: the runs are admitted at once, stored
        # and read back whole
        _put_and_read_back(r, a, b)
