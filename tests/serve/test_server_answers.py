"""A rank does its own I/O at the places its store server answers: an
answer that names a place outside the store's data area (a buggy or older
server, a stray process on the socket) must be refused with a typed error
before a byte is written or read there, never taken as the run's space."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.errors import ServerError
from kvblock.store.client import RemoteStore
from kvblock.store.server import serve_in_background
from tests.store.workload import GEOM, REGION, run_data, run_keys

MIB = 1 << 20


@pytest.fixture
def served(tmp_path):
    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    KVStore.format([path], GEOM, region_size=REGION, journal_bytes=256 << 10).close()
    sock = str(tmp_path / "kv.sock")
    server = serve_in_background([path], sock)
    try:
        yield path, sock, server
    finally:
        server.stop()
        os.unlink(path)


def _metadata(path: str, server) -> bytes:
    """The bytes before the data area: superblocks, checkpoints, journal."""
    with open(path, "rb") as f:
        return f.read(server.store.regions.data_offsets[0])


def _bad_places(server):
    data0 = server.store.regions.data_offsets[0]
    count, size = server.store.regions.count, server.store.regions.size
    align = server.store.alignment
    return {
        "superblock": lambda r, o: (r, -data0 - r * size),   # device offset 0
        "before_data": lambda r, o: (-1, o),                 # a region before region 0
        "past_regions": lambda r, o: (count, o),             # past the last region
        "past_region_end": lambda r, o: (r, size - align),   # spills into the next region
        "unaligned": lambda r, o: (r, o + 512),
        "not_a_number": lambda r, o: (str(r), o),
    }


@pytest.mark.parametrize("bad", ["superblock", "before_data", "past_regions",
                                 "past_region_end", "unaligned", "not_a_number"])
def test_an_allocation_outside_the_data_area_is_refused_before_a_write(served, monkeypatch,
                                                                       bad):
    path, sock, server = served
    real = server._op_allocate
    move = _bad_places(server)[bad]

    def allocate(s, nblocks):
        a = real(s, nblocks)
        a["region"], a["offset"] = move(a["region"], a["offset"])
        return a
    monkeypatch.setattr(server, "_op_allocate", allocate)
    before = _metadata(path, server)
    r = RemoteStore(sock)
    try:
        keys = run_keys(1, 3)
        with pytest.raises(ServerError, match="allocate"):
            r.put_run(keys, run_data(keys))
        assert _metadata(path, server) == before, "the rank wrote over the store's metadata"
        monkeypatch.setattr(server, "_op_allocate", real)
        assert int(server.store.regions.pins.sum()) == 0     # the allocation given back
    finally:
        r.close()
    assert not server.store.closed


def test_put_runs_refuses_an_allocation_over_the_superblock(served, monkeypatch):
    """The same check on put_runs' grouped path (its commit_runs)."""
    path, sock, server = served
    real = server._op_allocate
    move = _bad_places(server)["superblock"]
    calls = []

    def allocate(s, nblocks):
        a = real(s, nblocks)
        calls.append(a)
        if len(calls) == 2:                  # the group's second run
            a["region"], a["offset"] = move(a["region"], a["offset"])
        return a
    monkeypatch.setattr(server, "_op_allocate", allocate)
    before = _metadata(path, server)
    r = RemoteStore(sock)
    try:
        runs = [run_keys(1, 2), run_keys(2, 2)]
        with pytest.raises(ServerError, match="allocate"):
            r.put_runs([(keys, run_data(keys)) for keys in runs])
        assert _metadata(path, server) == before, "the rank wrote over the store's metadata"
        assert int(server.store.regions.pins.sum()) == 0
        assert r.lookup(runs[0]) == 0                     # none of the group published
    finally:
        r.close()


def _segments_moved(server, how):
    """The server's segments, one answer altered by ``how`` (a run's place
    or its stretch of the request)."""
    real = server._op_segments
    data0 = server.store.regions.data_offsets[0]
    size, count = server.store.regions.size, server.store.regions.count

    def segments(s, keys):
        out = real(s, keys)
        run, pos, n, at = out["segs"][0]
        if how == "superblock":             # the run's place: device offset 0
            run[3] = -data0 - run[1] * size
        elif how == "past_regions":
            run[1] = count
        elif how == "longer_run":           # a run of another size: past its region
            run[4] = server.store.max_run_blocks
            run[3] = size - server.store.alignment
        elif how == "short_checksums":
            run[5] = run[5][:1]
        elif how == "past_the_request":     # more blocks than were asked for
            out["segs"][0] = [run, pos, n + 1, at]
        elif how == "past_the_run":
            out["segs"][0] = [run, run[4] - 1, n, at]
        elif how == "not_a_prefix":         # a stretch that is not where the prefix is
            out["segs"][0] = [run, pos, n - 1, at + 1]
        elif how == "malformed":
            out["segs"][0] = [run, pos]
        return out
    return segments


@pytest.mark.parametrize("verify", ["never", "always"])
@pytest.mark.parametrize("how", ["superblock", "past_regions", "longer_run", "short_checksums",
                                 "past_the_request", "past_the_run", "not_a_prefix",
                                 "malformed"])
def test_a_segments_answer_outside_the_run_is_refused_not_read(served, monkeypatch, how,
                                                                verify):
    """The place a rank reads a run at, and the blocks of the request it
    fills from it, come from the server's segments answer: read as
    answered, a place outside the data area (or a run of another size)
    handed back the superblock's bytes as the run's (verify="never"), a
    stretch past the request or the run failed with IndexError / numpy's
    ValueError or counted blocks never read."""
    path, sock, server = served
    keys = run_keys(1, 3)
    with RemoteStore(sock) as w:
        assert w.put_run(keys, run_data(keys)) == 3
    monkeypatch.setattr(server, "_op_segments", _segments_moved(server, how))
    r = RemoteStore(sock, verify=verify)
    try:
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        with pytest.raises(ServerError, match="segments"):
            r.get_run(keys, out)
        # nothing of the answer was taken: the pin it carried is given back
        assert int(server.store.regions.pins.sum()) == 0
        monkeypatch.setattr(server, "_op_segments", type(server)._op_segments.__get__(server))
        got = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert r.get_run(keys, got) == 3 and np.array_equal(got, run_data(keys))
    finally:
        r.close()


@pytest.mark.parametrize("field", ["data_offsets", "region_count", "region_size", "alignment"])
def test_a_hello_whose_layout_is_not_the_devices_is_refused(served, monkeypatch, field):
    """The data area a rank checks every place against is hello's: one
    that is not what the devices' superblocks say (the data area at the
    superblock, more regions than the device holds, regions of another
    size) let allocate's answers through to the store's metadata."""
    from kvblock.errors import GeometryMismatchError

    path, sock, server = served
    real = server._op_hello

    def hello(s, protocol, pid=None):
        h = real(s, protocol, pid)
        if field == "data_offsets":
            h["data_offsets"] = [0]
        elif field == "region_count":
            h["region_count"] += 64
        elif field == "region_size":
            h["region_size"] *= 2
        else:
            h["alignment"] = 512
        return h
    monkeypatch.setattr(server, "_op_hello", hello)
    before = _metadata(path, server)
    with pytest.raises(GeometryMismatchError, match="superblock"):
        r = RemoteStore(sock)
        try:    # taken: a put lands where the answered layout says
            keys = run_keys(1, 3)
            r.put_run(keys, run_data(keys))
        finally:
            r.close()
    assert _metadata(path, server) == before, "the rank wrote over the store's metadata"


@pytest.mark.parametrize("name", [["ConfigError"], None, 7, "KVStore", "Exception"])
def test_an_error_answer_naming_no_kvblock_error_is_a_server_error(name):
    """An error answer whose name is no kvblock error class (not a string:
    getattr raised TypeError; another name: anything the module holds) is
    raised as ServerError, naming what was answered."""
    from kvblock.store.protocol import raise_remote

    with pytest.raises(ServerError, match="store server"):
        raise_remote(name, "what the server said")


@pytest.mark.parametrize("geometry", [GEOM.as_dict(), "llama-3-8b", (2, 2, 32)])
def test_a_geometry_that_is_no_geometry_is_a_config_error_for_a_rank(served, geometry):
    """RemoteStore(geometry=...) (and connect's) given something other than
    a Geometry (its as_dict() from a config, a model name) raised an
    AttributeError ('dict' object has no attribute 'describe') once
    connected, where KVStore.open refuses it with a ConfigError naming the
    argument; refused before a connection is made."""
    from kvblock.errors import ConfigError
    from kvblock.store.client import connect

    path, sock, server = served
    with pytest.raises(ConfigError, match="geometry must be a kvblock.Geometry"):
        RemoteStore(sock, geometry=geometry)
    with pytest.raises(ConfigError, match="geometry must be a kvblock.Geometry"):
        connect(sock, geometry=geometry)
    with RemoteStore(sock, geometry=GEOM) as r:          # a Geometry is taken
        assert r.geometry == GEOM


@pytest.mark.parametrize("timeout", ["5", -1, 0, float("nan"), True])
def test_a_client_timeout_that_is_no_seconds_is_a_config_error(served, timeout):
    """RemoteStore(timeout="5") (connect's too: a setting read as text)
    failed in the connect with TypeError (monotonic() + "5"), -1 with
    socket's bare ValueError "Timeout value out of range", and 0 made the
    socket non-blocking, so calls failed as the server going away.  Each is
    a ConfigError naming the argument, before a connection is made."""
    from kvblock.errors import ConfigError
    from kvblock.store.client import connect

    path, sock, server = served
    for make in (RemoteStore, connect):
        with pytest.raises(ConfigError, match=r"RemoteStore: timeout must be seconds \(a "
                                              r"number > 0\) or None, got "):
            make(sock, timeout=timeout)
    assert server.connections_total == 0
    keys = run_keys(1, 2)
    with RemoteStore(sock, timeout=np.float64(30)) as r:     # a number is taken
        assert r.put_run(keys, run_data(keys)) == 2
        out = np.zeros_like(run_data(keys))
        assert r.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))


def test_a_commit_runs_answer_shorter_than_its_runs_is_refused(served, monkeypatch):
    """commit_runs answers the blocks published per run it names: an answer
    with fewer entries (a buggy or older server) was cut to it by zip, and
    put_runs answered 0 for the runs it left out, whether the server had
    published them or not.  Refused with ServerError."""
    path, sock, server = served
    real = server._op_commit_runs

    def commit_runs(s, puts=None, clears=None):
        return real(s, puts, clears)[:-1]
    monkeypatch.setattr(server, "_op_commit_runs", commit_runs)
    with RemoteStore(sock) as r:
        runs = [run_keys(1, 2), run_keys(2, 2)]
        with pytest.raises(ServerError, match="commit_runs"):
            r.put_runs([(keys, run_data(keys)) for keys in runs])


@pytest.mark.parametrize("answer", [1, True, "0", [0], None])
def test_a_commit_answer_not_the_runs_blocks_or_0_is_refused(served, monkeypatch, answer):
    """commit answers the blocks published (the run's, or 0 when a clear()
    overtook it): any truthy answer (a part of the run, True, "0", a list)
    was counted as the whole run published and put_run answered its
    length, whatever the server did; None as a clear.  Refused with
    ServerError, as commit_runs' answer is."""
    path, sock, server = served
    real = server._op_commit

    def commit(s, **request):
        real(s, **request)
        return answer
    monkeypatch.setattr(server, "_op_commit", commit)
    with RemoteStore(sock) as r:
        keys = run_keys(1, 2)
        with pytest.raises(ServerError, match="answered commit "):
            r.put_run(keys, run_data(keys))
        assert r.counters["put_runs"] == 0 and r.counters["cleared_puts"] == 0
        assert int(server.store.regions.pins.sum()) == 0


@pytest.mark.parametrize("how", ["short", "long", "not_flags"])
def test_a_present_answer_not_one_flag_per_key_is_refused(served, monkeypatch, how):
    """present answers one flag per key asked: an answer of another length
    was taken as it came (np.array), so put_runs planned from flags of
    other keys (a run whose last key an earlier run of the call does not
    write was counted stored, a duplicate, and never written) and
    present() handed it on.  Refused with ServerError."""
    path, sock, server = served
    real = server._op_present

    def present(s, keys):
        out = real(s, keys)
        return {"short": out[:-1], "long": out + [True], "not_flags": ["no"] * len(out)}[how]
    monkeypatch.setattr(server, "_op_present", present)
    with RemoteStore(sock) as r:
        a, b = run_keys(1, 2), run_keys(2, 1)
        with pytest.raises(ServerError, match="answered present"):
            r.present(a)
        # the second run's first key is the first run's: its last one decides
        with pytest.raises(ServerError, match="answered present"):
            r.put_runs([(a, run_data(a)), (a[:1] + b, run_data(a[:1] + b))])
        assert r.lookup(b) == 0 and int(server.store.regions.pins.sum()) == 0


@pytest.mark.parametrize("answer", [{"verdict": "maybe"}, {"verdict": None}, {}, "ok"])
def test_an_admit_answer_with_no_known_verdict_is_refused(served, monkeypatch, answer):
    """admit's verdict is "ok", "duplicate" or "rejected": another one (a
    server of another release) was taken as "ok" and the run written; one
    without a verdict or clear ticket failed as a KeyError.  ServerError,
    before anything is allocated or written."""
    path, sock, server = served
    real = server._op_admit

    def admit(s, keys, **kw):
        out = real(s, keys, **kw)
        return {**out, **answer} if isinstance(answer, dict) and answer else answer
    monkeypatch.setattr(server, "_op_admit", admit)
    with RemoteStore(sock) as r:
        for put in ("put_run", "put_runs"):
            keys = run_keys(1 if put == "put_run" else 2, 2)
            with pytest.raises(ServerError, match="admit"):
                if put == "put_run":
                    r.put_run(keys, run_data(keys))
                else:
                    r.put_runs([(keys, run_data(keys)), (run_keys(3, 1), run_data(run_keys(3, 1)))])
            assert r.lookup(keys) == 0
        assert int(server.store.regions.pins.sum()) == 0


@pytest.mark.parametrize("field", ["region_count", "alignment", "devices"])
def test_a_reconnect_to_a_server_of_another_layout_is_refused(served, monkeypatch, field):
    """A new session (reconnect) must serve the layout the rank checked at
    its first hello: the rank checks every place the server answers against
    that one (region count, alignment) and does its I/O on those devices.
    A hello with more regions or another alignment was taken."""
    from kvblock.errors import GeometryMismatchError

    path, sock, server = served
    real = server._op_hello

    def hello(s, protocol, pid=None):
        h = real(s, protocol, pid)
        if field == "region_count":
            h["region_count"] += 64
        elif field == "alignment":
            h["alignment"] = 512
        else:
            h["devices"] = h["devices"] * 2
        return h
    with RemoteStore(sock) as r:
        monkeypatch.setattr(server, "_op_hello", hello)
        with pytest.raises(GeometryMismatchError, match="another store|layout"):
            r._new_session().close()


@pytest.mark.parametrize("answer", ["past_keys", -1, True, "2", None, 1.5])
def test_a_lookup_or_touch_answer_not_a_count_of_the_keys_is_refused(served, monkeypatch,
                                                                    answer):
    """lookup and touch answer how many of the keys asked are stored: a
    count past the keys asked (an engine connector then claims blocks that
    do not exist) or below 0 was taken as it came, True as 1, "2" as 2,
    and None or a float failed as a bare TypeError or passed as an int.
    Refused with ServerError naming the server and the answer, for
    contains_nowait and touch_nowait too."""
    from kvblock.errors import ServerError as Typed
    from kvblock.store.protocol import decode_keys

    path, sock, server = served
    for op in ("_op_lookup", "_op_touch"):
        real = getattr(server, op)

        def bad(s, keys, real=real):
            real(s, keys)
            return len(decode_keys(keys)) + 1 if answer == "past_keys" else answer
        monkeypatch.setattr(server, op, bad)
    with RemoteStore(sock) as r:
        keys = run_keys(1, 2)
        assert r.put_run(keys, run_data(keys)) == 2
        for call in (lambda: r.lookup(keys), lambda: r.touch(keys),
                     lambda: r.contains(keys[0]),
                     lambda: r.contains_nowait(keys[0], 5.0),
                     lambda: r.touch_nowait(keys, 5.0)):
            with pytest.raises(Typed, match=f"store server at {sock}.* answered (lookup|touch)"):
                call()
        assert r.counters["lookup_hit_blocks"] == 0


@pytest.mark.parametrize("answer", [-1, None, "3", True, 1.5])
def test_a_delete_evict_or_clear_answer_not_a_count_is_refused(served, monkeypatch, answer):
    """delete, delete_prefix, evict, evict_older_than and clear answer a
    count (blocks removed, regions reclaimed): int() took "3" and True as
    counts and -1 as one, and failed on None as a bare TypeError.
    Refused with ServerError naming the server and the answer."""
    from kvblock.errors import ServerError as Typed

    path, sock, server = served
    for op in ("_op_delete", "_op_delete_prefix", "_op_evict", "_op_clear"):
        real = getattr(server, op)

        def bad(s, *args, real=real, **kw):
            real(s, *args, **kw)
            return answer
        monkeypatch.setattr(server, op, bad)
    with RemoteStore(sock) as r:
        keys = run_keys(1, 2)
        for call, op in ((lambda: r.delete(keys), "delete"),
                         (lambda: r.delete_prefix(keys[0][:4]), "delete_prefix"),
                         (lambda: r.evict(all=True), "evict"),
                         (lambda: r.evict_older_than(0.0), "evict"),
                         (lambda: r.clear(), "clear")):
            with pytest.raises(Typed, match=f"store server at {sock} answered {op} "):
                call()


@pytest.mark.parametrize("answer", ["0:1", {"cursor": "x:1"}, {"keys": []},
                                    {"cursor": 5, "keys": []}, {"cursor": "x:1", "keys": [1]},
                                    {"cursor": "x:1", "keys": "not base64!"}])
def test_a_removed_answer_not_a_cursor_and_keys_is_refused(served, monkeypatch, answer):
    """removed answers {"cursor": text, "keys": base64 keys or null}: an
    answer of another shape failed as a bare TypeError or KeyError (a
    removal watch such as the vLLM tier's catches KVBlockError only), a
    cursor of another type was handed back to be sent again, and keys
    that are not base64 were a ConfigError blaming the caller's keys.
    Refused with ServerError naming the server and the answer."""
    from kvblock.errors import ServerError as Typed

    path, sock, server = served
    monkeypatch.setattr(server, "_op_removed", lambda s, cursor=None: answer)
    with RemoteStore(sock) as r:
        with pytest.raises(Typed, match=f"store server at {sock} answered removed "):
            r.removed_since("x:0")


@pytest.mark.parametrize("answer", [None, [1, 2], "stats"])
def test_a_stats_answer_not_a_dict_is_refused(served, monkeypatch, answer):
    """stats answers the server's numbers as an object: another answer
    failed as a bare TypeError (s["client"] = ... on it), not the
    ServerError a server's wrong answer raises.  ServerError naming the
    server and the answer."""
    from kvblock.errors import ServerError as Typed

    path, sock, server = served
    monkeypatch.setattr(server, "_op_stats", lambda s: answer)
    with RemoteStore(sock) as r:
        with pytest.raises(Typed, match=f"store server at {sock} answered stats "):
            r.stats()


@pytest.mark.parametrize("answer", [None, 7, ["t"], ""])
def test_a_clear_ticket_answer_not_a_ticket_is_refused(served, monkeypatch, answer):
    """clear_ticket answers text naming the clears so far: another answer
    was made text by str() ("None", "7"), a ticket no clear ever had, so a
    put given it (an engine's clears=) was refused as overtaken by a clear
    and silently stored nothing.  Refused with ServerError."""
    path, sock, server = served
    monkeypatch.setattr(server, "_op_clear_ticket", lambda s: answer)
    with RemoteStore(sock) as r:
        with pytest.raises(ServerError, match="answered clear_ticket"):
            r.clear_ticket()


def test_a_lookup_decodes_its_keys_outside_the_store_lock(tmp_path, monkeypatch):
    """_op_lookup took the store's lock around KVStore.lookup, which takes
    it itself for the index probe (a server's store has no DRAM tier, so
    that probe is the whole answer): the decoding and normalizing of every
    key, and the counting, held up every other rank's reads and puts for
    nothing.  The answer is the same."""
    from kvblock.store import server as server_mod
    from tests.serve.test_serve import _store_file

    path = _store_file(tmp_path)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock) as server:
        held = []
        real = server_mod.decode_keys

        def decode(keys):
            held.append(server.store._lock._is_owned())
            return real(keys)
        monkeypatch.setattr(server_mod, "decode_keys", decode)
        with RemoteStore(sock) as r:
            keys = run_keys(3, 4)
            r.put_run(keys[:3], run_data(keys[:3]))
            held.clear()
            assert r.lookup(keys) == 3 and r.lookup(keys[3:]) == 0
        assert held == [False, False], held
