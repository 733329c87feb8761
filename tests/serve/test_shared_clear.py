"""A shared store's clear() while other ranks read and write, a run stored
by two ranks at once, a put larger than the store, and a read whose pins
lapse with a killed server."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.errors import ConfigError, ServerGoneError, StoreClosedError, StoreFullError
from kvblock.store.client import RemoteStore
from kvblock.store.server import serve_in_background, spawn_server
from tests.store.workload import GEOM, run_data, run_keys, small_store
from tests.support.servers import stop_server


@pytest.fixture
def store_file(tmp_path):
    return small_store(tmp_path / "kv.img")


def _read(store, keys):
    out = np.zeros(len(keys) * GEOM.block_bytes, np.uint8)
    return out if store.get_run(keys, out) == len(keys) else None


def _wait_in(store, method: str, before: bool = False):
    """Make ``store.<method>`` stop (after it ran; ``before``: before it
    runs) until released: (reached, go)."""
    reached, go = threading.Event(), threading.Event()
    real = getattr(store, method)

    def stalled(*args, **kw):
        if before:
            reached.set()
            assert go.wait(30)
        out = real(*args, **kw)
        if not before:
            reached.set()
            assert go.wait(30)
        return out
    setattr(store, method, stalled)
    return reached, go


def test_clear_on_one_rank_forgets_what_other_ranks_read_and_write(store_file, tmp_path):
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock) as server:
        reader, writer, admin = (RemoteStore(sock) for _ in range(3))
        try:
            keys, fresh = run_keys(1, 4), run_keys(2, 3)
            admin.put_run(keys, run_data(keys))
            pinned, unpin_go = _wait_in(reader, "_segments")   # a read in flight
            allocated, write_go = _wait_in(writer, "_stage_run")  # a put allocated
            result = {}
            threads = [
                threading.Thread(target=lambda: result.update(
                    read=_read(reader, keys))),
                threading.Thread(target=lambda: result.update(
                    put=writer.put_run(fresh, run_data(fresh)))),
            ]
            for t in threads:
                t.start()
            assert pinned.wait(20) and allocated.wait(20)
            admin.clear()
            assert admin.lookup(keys) == 0 and server.store.stats()["runs"] == 0
            unpin_go.set()
            write_go.set()
            for t in threads:
                t.join(20)
            # the read under its pin still got the right bytes; the put that
            # was allocated before the clear is refused, not published
            assert np.array_equal(result["read"], run_data(keys))
            assert result["put"] == 0 and writer.counters["cleared_puts"] == 1
            assert admin.lookup(fresh) == 0 and admin.lookup(keys) == 0
            assert server.store.regions.pins.sum() == 0
            assert admin.put_run(fresh, run_data(fresh)) == 3
            assert np.array_equal(_read(reader, fresh), run_data(fresh))
        finally:
            for s in (reader, writer, admin):
                s.close()
    with KVStore.open([store_file]) as store:
        assert store.lookup(keys) == 0 and store.lookup(fresh) == 3


def test_two_ranks_storing_the_same_run_leave_one_copy(store_file, tmp_path):
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock) as server:
        a, b = RemoteStore(sock), RemoteStore(sock)
        try:
            keys = run_keys(3, 4)
            # both ranks were told "ok" by admit before either committed
            admitted, go = _wait_in(b, "_put_one")
            real_call = b._call

            def admit_ok(op, **kw):
                if op == "admit":
                    return dict(real_call(op, **kw), verdict="ok")
                return real_call(op, **kw)
            b._call = admit_ok
            t = threading.Thread(target=lambda: b.put_run(keys, run_data(keys)))
            t.start()
            assert a.put_run(keys, run_data(keys)) == 4
            assert admitted.wait(20)
            go.set()
            t.join(20)
            assert server.store.stats()["runs"] == 1
            assert a.delete(keys[:1]) == 4 and server.store.stats()["runs"] == 0
        finally:
            a.close()
            b.close()
    with KVStore.open([store_file]) as store:
        assert store.lookup(keys) == 0


def test_a_put_larger_than_the_shared_store_is_refused(store_file, tmp_path):
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock):
        with RemoteStore(sock) as rank:
            kept = run_keys(4, 2)
            rank.put_run(kept, run_data(kept))
            n = rank.regions.count * rank.regions.size // GEOM.block_bytes
            with pytest.raises(StoreFullError, match=f"a run of {n} blocks"):
                rank.put_run(run_keys(5, n), np.zeros(n * GEOM.block_bytes, np.uint8))
            assert rank.lookup(kept) == 2


def test_put_runs_with_a_run_too_large_writes_none_of_them(store_file, tmp_path):
    """put_runs checks every run before it writes any, on a shared store as
    in one process: a later run too large for the store leaves the earlier
    ones unwritten."""
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock):
        with RemoteStore(sock) as rank:
            first = run_keys(7, 2)
            n = rank.regions.count * rank.regions.size // GEOM.block_bytes
            with pytest.raises(StoreFullError, match=f"a run of {n} blocks"):
                rank.put_runs([(first, run_data(first)),
                               (run_keys(8, n), np.zeros(n * GEOM.block_bytes, np.uint8))])
            assert rank.lookup(first) == 0 and rank.stats()["runs"] == 0


@pytest.mark.parametrize("verify", ["never", "always"])
def test_a_read_whose_pins_lapse_with_the_server_is_a_miss(store_file, tmp_path, verify):
    """A rank pins a run and stalls; the server is killed, restarted, and
    another rank clears the store and fills it again.  Unverified, the
    stalled read would hand over the new runs' bytes: it must be a miss.
    Verified, the new bytes fail the old run's checksums: also a miss (not
    an error, not a checksum failure: nothing on the device is corrupt)."""
    sock = str(tmp_path / "kv.sock")
    server = spawn_server([store_file], sock)
    stalled = None
    try:
        keys = run_keys(6, 4)
        with RemoteStore(sock) as rank:
            rank.put_run(keys, run_data(keys))
        stalled = RemoteStore(sock, verify=verify)
        pinned, go = _wait_in(stalled, "_segments")
        result = {}
        t = threading.Thread(target=lambda: result.update(n=stalled.get_run(
            keys, np.zeros(4 * GEOM.block_bytes, np.uint8))))
        t.start()
        assert pinned.wait(20)
        server.send_signal(signal.SIGKILL)
        server.wait(20)
        server = spawn_server([store_file], sock)
        with RemoteStore(sock) as other:
            other.clear()
            for i in range(100, 100 + other.regions.count * 6):
                k = run_keys(i, 4)
                other.put_run(k, run_data(k))
        go.set()
        t.join(20)
        assert result["n"] == 0
        assert stalled.counters["lapsed_pin_gets"] == 1
        assert stalled.counters["checksum_failures"] == 0
        with RemoteStore(sock) as other:      # the new runs were not dropped
            k = run_keys(100 + other.regions.count * 6 - 1, 4)
            assert other.lookup(k) == 4
    finally:
        if stalled is not None:
            stalled.close()
        stop_server(server.pid)
        server.wait(20)


def test_a_clear_between_the_pieces_of_a_ranks_put_refuses_the_whole_put(store_file,
                                                                         tmp_path):
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock):
        rank, admin = RemoteStore(sock), RemoteStore(sock)
        try:
            big = run_keys(7, rank.max_run_blocks + 3)
            real, pieces = rank._put_one, []

            def put_one(*args):
                pieces.append(1)
                if len(pieces) == 2:           # another rank clears between the pieces
                    admin.clear()
                return real(*args)
            rank._put_one = put_one
            assert rank.put_run(big, run_data(big)) == 0
            del rank._put_one
            assert rank.lookup(big) == 0 and rank.lookup(big[rank.max_run_blocks:]) == 0
            assert rank.put_run(big, run_data(big)) == len(big)
        finally:
            rank.close()
            admin.close()


@pytest.mark.parametrize("verify", ["never", "always"])
def test_a_layer_read_after_the_pins_lapsed_is_never_handed_over(tmp_path, verify):
    """A layer-by-layer load (what a model streaming its prefix waits on,
    layer by layer) stalls after layer 0; the server is killed, restarted,
    and another rank clears the store and fills it again.  Unverified,
    layers 1.. would hold the new runs' bytes: ``wait_layer`` must raise for
    each of them, not only the final ``wait()``.  Verified, they fail their
    checksums: the same lapse, not corruption (nothing counted or dropped)."""
    from kvblock import Geometry, create_file
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks
    from kvblock.tensors import transfer

    g = Geometry(num_layers=6, num_kv_heads=2, head_dim=32, dtype="float16",
                 block_tokens=16, head_groups=2)
    path = str(tmp_path / "kv.img")
    create_file(path, 8 << 20)
    KVStore.format([path], g, region_size=512 << 10, journal_bytes=256 << 10).close()
    sock = str(tmp_path / "kv.sock")
    rng = np.random.default_rng(3)

    def cache(fill):
        shape = (2, 8, g.block_tokens, g.num_kv_heads, g.head_dim)
        return [(rng.integers(1, 1 << 15, shape, dtype=np.int16) if fill
                 else np.zeros(shape, np.int16)).view(np.float16) for _ in range(g.num_layers)]

    server = spawn_server([path], sock)
    reader = None
    try:
        keys, pages = run_keys(1, 4), [0, 1, 2, 3]
        src = cache(True)
        with RemoteStore(sock) as saver:
            assert save_blocks(saver, keys, VLLMLayout(src), pages) == 4
        reader = RemoteStore(sock, verify=verify)
        stalled, go = threading.Event(), threading.Event()
        real = transfer._LoadJob._read_batch

        def read_batch(job, batch):
            if any(layer == 1 for layer, _, _ in batch):
                stalled.set()
                assert go.wait(30)
            return real(job, batch)
        dst = cache(False)
        seen, layer0 = {}, threading.Event()

        def model(h):
            for layer in range(g.num_layers):
                try:
                    h.wait_layer(layer, timeout=30)
                    seen[layer] = np.array_equal(dst[layer].view(np.int16)[:, pages],
                                                 src[layer].view(np.int16)[:, pages])
                except StoreClosedError:
                    seen[layer] = "lapsed"
                if layer == 0:
                    layer0.set()
        transfer._LoadJob._read_batch = read_batch
        try:
            h = load_blocks(reader, keys, VLLMLayout(dst), pages)
            t = threading.Thread(target=model, args=(h,))
            t.start()
            assert stalled.wait(20) and layer0.wait(20)   # layer 0 was read under the pins
            server.send_signal(signal.SIGKILL)
            server.wait(20)
            server = spawn_server([path], sock)
            with RemoteStore(sock) as other:      # the new server hands the space out again
                other.clear()
                for i in range(100, 100 + other.regions.count * 6):
                    k = run_keys(i, 4)
                    other.put_run(k, rng.integers(0, 256, 4 * g.block_bytes, dtype=np.uint8))
            go.set()
            t.join(30)
        finally:
            transfer._LoadJob._read_batch = real
        assert seen == {0: True, **{layer: "lapsed" for layer in range(1, g.num_layers)}}
        with pytest.raises(ServerGoneError, match="pins lapsed"):
            h.wait(10)
        assert reader.counters["checksum_failures"] == 0
    finally:
        if reader is not None:
            reader.close()
        stop_server(server.pid)
        server.wait(20)


def test_a_put_admitted_before_a_clear_and_a_server_restart_publishes_nothing(store_file,
                                                                             tmp_path):
    """A rank's put is admitted, then stalls; another rank clears the store;
    the server is killed and restarted, the rank reconnects and the put goes
    on.  The new server's clear count starts over at 0 like the old one's
    did at admit: the put must still be refused (it holds what was stored
    before the clear, e.g. KV of the old weights).  A put's calls go to
    the server that admitted it (as put_runs'): that one gone, it raises
    ServerGoneError and publishes nothing."""
    from kvblock.errors import ServerGoneError

    sock = str(tmp_path / "kv.sock")
    server = spawn_server([store_file], sock)
    rank = RemoteStore(sock, reconnect=True)
    try:
        keys = run_keys(1, 4)
        admitted, go = _wait_in(rank, "_put_one", before=True)
        result = {}
        def put():
            try:
                result["n"] = rank.put_run(keys, run_data(keys))
            except ServerGoneError as e:
                result["error"] = e
        t = threading.Thread(target=put)
        t.start()
        assert admitted.wait(20)
        with RemoteStore(sock) as admin:
            admin.clear()
        server.send_signal(signal.SIGKILL)
        server.wait(20)
        server = spawn_server([store_file], sock)
        with pytest.raises(ServerGoneError):   # the rank notices, and reconnects
            rank.lookup(keys)
        for _ in range(400):
            if rank.server_alive:
                break
            time.sleep(0.05)
        assert rank.server_alive
        go.set()
        t.join(30)
        assert "error" in result, result
        assert rank.lookup(keys) == 0
        del rank._put_one
        assert rank.put_run(keys, run_data(keys)) == 4      # a put begun now is stored
        assert np.array_equal(_read(rank, keys), run_data(keys))
    finally:
        rank.close()
        stop_server(server.pid)
        server.wait(20)


def test_a_rank_deleting_more_runs_than_one_journal_write_holds_keeps_the_server(tmp_path):
    """delete() of many runs from one rank: their DROP records exceed the
    journal, which once failed the commit and closed the shared store (the
    server stopped for every rank); they are committed in parts."""
    from kvblock import create_file
    from tests.store.workload import REGION

    path, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    create_file(path, 32 << 20)
    KVStore.format([path], GEOM, region_size=REGION, journal_bytes=32 << 10).close()
    runs = [run_keys(i, 1) for i in range(1500)]
    with KVStore.open([path]) as st:
        st.put_runs([(k, run_data(k)) for k in runs])
        stored = st.stats()["runs"]
    assert stored * 48 > 32 << 10, "the test needs more DROP records than the journal holds"
    server = serve_in_background([path], sock)
    try:
        with RemoteStore(sock) as r:
            assert r.delete([k for keys in runs for k in keys]) == stored
            assert not server.store.closed
            assert r.lookup(runs[-1]) == 0
            r.put_run(runs[0], run_data(runs[0]))       # the store still serves
            assert _read(r, runs[0]) is not None
    finally:
        server.stop()
    with KVStore.open([path]) as st:                    # and the deletes are durable
        assert st.stats()["runs"] == 1


def test_delete_prefix_and_clear_ticket_through_the_server(store_file, tmp_path):
    """A rank removes the runs of its own key prefix, the other rank's stay
    and read back; a clear on one rank changes the ticket every rank sees
    (SGLang's backup stops on it); a prefix that is not 1-8 bytes is a
    ConfigError on the client, and one the server cannot decode there."""
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock):
        a, b = RemoteStore(sock), RemoteStore(sock)
        try:
            mine = [b"\x07" + bytes([i]) * 15 for i in (1, 2, 3)]
            theirs = [b"\x08" + bytes([i]) * 15 for i in (1, 2)]
            a.put_run(mine, run_data(mine))
            b.put_run(theirs, run_data(theirs))
            assert a.delete_prefix(b"\x07") == 3
            assert b.lookup(mine) == 0
            got = _read(a, theirs)
            assert got is not None and np.array_equal(got, run_data(theirs))
            ticket = a.clear_ticket()
            assert b.clear_ticket() == ticket
            b.clear()
            assert a.clear_ticket() != ticket and a.lookup(theirs) == 0
            with pytest.raises(ConfigError, match="1 to 8 bytes"):
                a.delete_prefix(b"")
            with pytest.raises(ConfigError, match="not hex"):
                a._call("delete_prefix", prefix="zz")
            with pytest.raises(ConfigError, match="1 to 8 bytes"):
                a._call("delete_prefix", prefix="00" * 9)
        finally:
            a.close()
            b.close()


def test_put_runs_whose_third_run_fails_publishes_none_of_them(store_file, tmp_path):
    """A shared store's put_runs publishes its runs together, as KVStore's
    does (one commit): an error while the third run is written leaves the
    first two unpublished too, and every allocation given back."""
    from kvblock.errors import IOFailedError

    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock) as server:
        with RemoteStore(sock) as rank:
            runs = [run_keys(20 + i, 2) for i in range(3)]
            real, staged = rank._stage_run, []

            def failing(*args, **kw):
                staged.append(1)
                if len(staged) == 3:
                    raise IOFailedError("injected write error on run 3")
                return real(*args, **kw)
            rank._stage_run = failing
            with pytest.raises(IOFailedError, match="injected"):
                rank.put_runs([(k, run_data(k)) for k in runs])
            assert len(staged) == 3
            assert [rank.lookup(k) for k in runs] == [0, 0, 0]
            assert server.store.stats()["runs"] == 0 and rank.counters["put_runs"] == 0
            assert server.store.regions.pins.sum() == 0
            rank._stage_run = real
            assert rank.put_runs([(k, run_data(k)) for k in runs]) == [2, 2, 2]
            assert [_read(rank, k) is not None for k in runs] == [True] * 3
            assert server.store.counters["put_runs"] == 3


@pytest.mark.parametrize("served", [False, True], ids=["one process", "served"])
def test_put_runs_skips_a_run_held_by_the_store_and_its_earlier_runs(store_file, tmp_path,
                                                                     served):
    """A run whose keys the store holds in part and an earlier run of the
    same put_runs holds the rest is a duplicate, as put one call after
    another: nothing of it is written, the stored bytes stay.  Through a
    server, whose admit sees none of the call's runs before they are
    published together, this was written over them."""
    old, fresh = run_keys(1, 2), run_keys(2, 1)
    both = [old[0], fresh[0]]
    mixed = np.random.default_rng(5).integers(0, 256, 2 * GEOM.block_bytes, dtype=np.uint8)
    sock = str(tmp_path / "kv.sock")

    def check(store):
        assert store.put_run(old, run_data(old)) == 2
        assert store.put_runs([(fresh, run_data(fresh)), (both, mixed)]) == [1, 2]
        assert store.counters["put_duplicate_runs"] == 1
        got = _read(store, both)
        assert got is not None
        per_block = (GEOM.num_layers, GEOM.head_groups, -1, GEOM.group_block_bytes)
        want = np.concatenate([run_data(old).reshape(per_block)[:, :, :1],
                               run_data(fresh).reshape(per_block)], axis=2)
        assert np.array_equal(got, want.reshape(-1))

    if not served:
        with KVStore.open([store_file]) as store:
            check(store)
        return
    with serve_in_background([store_file], sock) as server:
        with RemoteStore(sock) as rank:
            check(rank)
        assert server.store.counters["put_runs"] == 2


def test_a_rank_counts_a_long_run_its_earlier_put_runs_runs_hold_a_duplicate(tmp_path):
    """A run too long to put, whose blocks the call's earlier runs all hold,
    is a duplicate through a server too, as put one call after another (a
    rank raised StoreFullError for it, storing none of the runs)."""
    path = small_store(tmp_path / "kv.img", 12 << 20)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock) as server, RemoteStore(sock) as rank:
        step = rank.max_run_blocks
        assert rank.regions.size // rank.layout(step).run_bytes == 1
        whole = run_keys(54, rank.regions.count * step)     # one piece per region
        half = rank.regions.count // 2 * step
        runs = [whole[:half], whole[half:], whole]
        assert rank.put_runs([(k, np.zeros(len(k) * GEOM.block_bytes, np.uint8))
                              for k in runs]) == [len(k) for k in runs]
        assert rank.lookup(whole) == len(whole)
        assert rank.counters["put_duplicate_runs"] == 1
        assert server.store.counters["evicted_regions"] == 0


def test_a_clear_before_put_runs_first_admit_refuses_every_run(store_file, tmp_path):
    """put_runs through a server asks which keys are stored (present) before
    it admits its runs: a clear() by another rank right after that answer
    came before the call's first admit, whose clear ticket is then the
    cleared store's.  The call began before the clear, so it stores
    nothing (as KVStore's put_runs, which notes the clear count first);
    it published its first run and said its second, a duplicate of the
    store's (cleared) key and of the first run, was stored whole."""
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock):
        rank, admin = RemoteStore(sock), RemoteStore(sock)
        try:
            old, fresh = run_keys(30, 1), run_keys(31, 1)
            both = [old[0], fresh[0]]
            assert rank.put_run(old, run_data(old)) == 1
            real = rank.present

            def present(keys):
                found = real(keys)
                admin.clear()             # another rank clears after the answer
                return found
            rank.present = present
            got = rank.put_runs([(fresh, run_data(fresh)), (both, run_data(both))])
            del rank.present
            assert got == [0, 0]
            assert rank.lookup(fresh) == 0 and rank.lookup(both) == 0
        finally:
            rank.close()
            admin.close()
