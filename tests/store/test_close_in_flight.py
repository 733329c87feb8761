"""close() while another thread reads, writes or loads: it waits for the call
in flight to finish with the devices and buffers before it frees them, and
calls that start later raise StoreClosedError (never an AttributeError from
a freed engine, never a read through an unmapped device)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.errors import StoreClosedError
from kvblock.index import normalize_keys
from kvblock.store.client import RemoteStore
from kvblock.store.server import serve_in_background
from tests.serve.test_shared_clear import _wait_in
from tests.store.workload import GEOM, run_data, run_keys, small_store


def _close_while(store, reached, go, call, meanwhile=None):
    """Run ``call`` in a thread until it reaches its stall, close the store
    in another, check that close waits for it (``meanwhile()``, if given,
    runs before the call goes on); returns what call returned."""
    result = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as e:    # reported below
            result["error"] = e
    t = threading.Thread(target=run)
    t.start()
    assert reached.wait(20)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() returned while a call was using the devices"
    with pytest.raises(StoreClosedError):            # the door is shut meanwhile
        store.lookup(run_keys(1, 1)) if isinstance(store, RemoteStore) else \
            store.get_run(run_keys(1, 1), np.zeros(GEOM.block_bytes, np.uint8))
    if meanwhile is not None:
        meanwhile()
    go.set()
    t.join(20)
    closer.join(20)
    assert not closer.is_alive() and store.io is None
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.fixture
def store_file(tmp_path):
    return small_store(tmp_path / "kv.img")


def test_close_waits_for_a_read_in_another_thread(store_file):
    store = KVStore.open([store_file])
    keys = run_keys(1, 3)
    store.put_run(keys, run_data(keys))
    out = np.zeros(3 * GEOM.block_bytes, np.uint8)
    reached, go = _wait_in(store, "_segments")
    assert _close_while(store, reached, go, lambda: store.get_run(keys, out)) == 3
    assert np.array_equal(out, run_data(keys))
    with pytest.raises(StoreClosedError, match="reopen"):
        store.get_run(keys, out)


def test_close_waits_for_a_put_in_another_thread(store_file):
    store = KVStore.open([store_file])
    keys = run_keys(2, 3)
    reached, go = _wait_in(store, "_stage_run")
    assert _close_while(store, reached, go, lambda: store.put_run(keys, run_data(keys))) == 3
    with KVStore.open([store_file]) as again:      # published before the close
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert again.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))


def test_close_waits_for_a_layer_load_in_another_thread(store_file):
    from kvblock.tensors import VLLMLayout, load_blocks
    from kvblock.tensors import transfer

    store = KVStore.open([store_file])
    keys = run_keys(3, 4)
    store.put_run(keys, run_data(keys))
    shape = (2, 8, GEOM.block_tokens, GEOM.num_kv_heads, GEOM.head_dim)
    dst = [np.zeros(shape, np.float16) for _ in range(GEOM.num_layers)]
    reached, go = threading.Event(), threading.Event()
    real = transfer._LoadJob._read_batch

    def read_batch(job, batch):
        reached.set()
        assert go.wait(30)
        return real(job, batch)
    transfer._LoadJob._read_batch = read_batch
    try:
        h = _close_while(store, reached, go,
                         lambda: load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3]))
    finally:
        transfer._LoadJob._read_batch = real
    assert h.wait(20) == 4
    with KVStore.open([store_file]) as again:
        want = [np.zeros(shape, np.float16) for _ in range(GEOM.num_layers)]
        assert load_blocks(again, keys, VLLMLayout(want), [0, 1, 2, 3]).wait(20) == 4
    for a, b in zip(dst, want):
        assert np.array_equal(a.view(np.int16), b.view(np.int16))


def test_a_rank_closed_during_a_read_turns_it_into_a_miss(store_file, tmp_path):
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock):
        rank = RemoteStore(sock)
        keys = run_keys(4, 3)
        rank.put_run(keys, run_data(keys))
        reached, go = _wait_in(rank, "_segments")
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        # its connection is closed under it: the pins lapse, so the bytes are
        # not trusted (a miss), but the read itself finishes on open devices
        assert _close_while(rank, reached, go, lambda: rank.get_run(keys, out)) == 0
        with pytest.raises(StoreClosedError, match="remote store is closed"):
            rank.get_run(keys, out)


def test_failed_and_refused_loads_leave_nothing_in_flight_or_pinned(store_file, monkeypatch):
    """A load that fails while loading inline (EIO), and loads refused once
    their runs were pinned (their job could not be made), leave no call in
    flight (close() does not wait for them) and no pin (the runs can go)."""
    from kvblock.errors import ConfigError, IOFailedError
    from kvblock.tensors import VLLMLayout, load_blocks
    from kvblock.tensors import transfer
    from tests.support.faults import BadSectors

    store = KVStore.open([store_file])
    keys = run_keys(5, 4)
    store.put_run(keys, run_data(keys))
    run = next(iter(store.index.runs.values()))
    shape = (2, 8, GEOM.block_tokens, GEOM.num_kv_heads, GEOM.head_dim)
    dst = [np.zeros(shape, np.float16) for _ in range(GEOM.num_layers)]
    bad = BadSectors()
    dev, off = store.regions.address(run.region, run.offset)
    bad.add(dev, off + store.layout(4).range_offset(1, 0), 4096)
    bad.install(store)
    with pytest.raises(IOFailedError):
        load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3], background=False)
    assert store._inflight.calls == 0
    keys = run_keys(6, 4)
    store.put_run(keys, run_data(keys))

    def refuse(*args):
        raise ConfigError("no job for this cache")
    for where, name in ((transfer, "_job_class"), (transfer._LoadJob, "__init__")):
        with monkeypatch.context() as m:
            m.setattr(where, name, refuse)
            with pytest.raises(ConfigError, match="no job"):
                load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3])
        assert store._inflight.calls == 0
        with store._lock:
            assert int(store.regions.pins.sum()) == 0
    assert store.evict(all=True) >= 1 and store.lookup(keys) == 0
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(5)
    assert not closer.is_alive() and store.io is None


def test_an_unpin_racing_close_frees_nothing_through_a_closed_engine(store_file):
    """unpin() of the last pin on a region whose runs were deleted reclaims
    the region (a journal commit, a TRIM).  unpin is no call in flight: a
    close() in another thread meanwhile freed the engine under it, and the
    unpin raised AttributeError ('NoneType' has no 'flush') from the freed
    I/O.  The reclaim runs inside the store's calls in flight (close waits
    for it) or not at all once the store is closing."""
    store = KVStore.open([store_file])
    n = store.max_run_blocks
    keys = run_keys(1, n)
    assert store.put_run(keys, run_data(keys)) == n
    assert store.put_run(run_keys(2, 1), run_data(run_keys(2, 1))) == 1   # seals run 1's region
    region = store.index.locate(normalize_keys(keys)[0])[0].region
    assert store.regions.state[region] == 2                # SEALED
    pins = store.pin(keys)
    assert store.delete(keys) == n        # pinned: the region is freed at the unpin
    closed = threading.Event()
    release = store._release_empty_regions

    def slow_release(regions):            # the race: close() runs while the unpin frees
        closed.wait(3)
        return release(regions)
    store._release_empty_regions = slow_release
    errors = []

    def unpin():
        try:
            store.unpin(pins)
        except BaseException as e:      # reported below
            errors.append(e)
    t = threading.Thread(target=unpin)
    t.start()
    store.close()
    closed.set()
    t.join(20)
    assert not errors, errors
    with KVStore.open([store_file]) as again:
        assert again.lookup(keys) == 0 and again.lookup(run_keys(2, 1)) == 1
        assert again.regions.state[region] == 0          # FREE


@pytest.mark.parametrize("remote", [False, True], ids=["store", "remote"])
def test_close_frees_the_staging_buffers_of_every_thread(store_file, tmp_path, remote):
    """Puts and reads from a long-lived thread (an engine's worker pool)
    stage in that thread's aligned buffer; close() frees it (and takes it off
    the io_uring registry), not only the closing thread's, so a closed store
    still referenced does not keep every worker's buffer mapped and
    registered for good."""
    from concurrent.futures import ThreadPoolExecutor

    from kvblock.memory import registry

    server = serve_in_background([store_file], tmp_path / "s.sock") if remote else None
    try:
        with ThreadPoolExecutor(2) as pool:
            before = {a for a, _ in registry.snapshot()[1]}
            store = RemoteStore(tmp_path / "s.sock") if remote else KVStore.open([store_file])
            keys = run_keys(1, 3)
            out = np.zeros(3 * GEOM.block_bytes, np.uint8)

            def use():
                store.put_run(keys, run_data(keys))
                assert store.get_run(keys, out) == 3
            pool.submit(use).result()
            use()
            assert len({a for a, _ in registry.snapshot()[1]} - before) == 2
            store.close()
            assert {a for a, _ in registry.snapshot()[1]} - before == set()
            assert (out == run_data(keys)).all()
    finally:
        if server is not None:
            server.stop()


def test_a_child_forked_while_a_thread_reads_closes_the_store(store_file):
    """A process forks while another of its threads is inside a store call
    (a DataLoader worker started beside a load).  That call is the parent's:
    the child's close() waited CLOSE_WAIT_S for it and then left the devices
    and buffers unreleased; it now releases them at once.  Nor does it write
    a checkpoint (it hung on the store lock that thread held; without one,
    it hid the parent's later journal records from a crash recovery)."""
    import kvblock.store.store as store_mod
    from tests.support.servers import exit_code_in_child

    store = KVStore.open([store_file])
    keys = run_keys(1, 3)
    store.put_run(keys, run_data(keys))
    out = np.zeros(3 * GEOM.block_bytes, np.uint8)
    reached, go = _wait_in(store, "_segments")
    t = threading.Thread(target=store.get_run, args=(keys, out))
    t.start()
    try:
        assert reached.wait(20)

        def child():
            store_mod.CLOSE_WAIT_S = 0.2      # an old count would show as a failed drain
            store.close()
            return 0 if store.io is None else 1
        assert exit_code_in_child(child) == 0
    finally:
        go.set()
        t.join(20)
    assert np.array_equal(out, run_data(keys))
    later = run_keys(2, 2)
    assert store.put_run(later, run_data(later)) == 2
    store.closed = True                   # a crash: no checkpoint at close
    store._release_devices()
    with KVStore.open([store_file]) as again:
        assert again.lookup(keys) == 3 and again.lookup(later) == 2


def test_a_forked_childs_copy_refuses_reads_and_writes(store_file):
    """A child's copy of a store went on writing journal records at its
    stale journal position (over the parent's later ones) and reading
    through an index the parent's reclaims make stale (verify="never":
    another run's bytes under its keys).  It refuses every call, naming
    the fix; its close() still releases it, and the parent's store is
    untouched."""
    from tests.support.servers import exit_code_in_child

    store = KVStore.open([store_file])
    keys = run_keys(1, 3)
    store.put_run(keys, run_data(keys))

    def child():
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        refused = 0
        for call in (lambda: store.put_run(run_keys(5, 2), run_data(run_keys(5, 2))),
                     lambda: store.get_run(keys, out), lambda: store.delete(keys)):
            try:
                call()
            except StoreClosedError as e:
                refused += "forked" in str(e) and "KVStore.open" in str(e)
        store.close()
        return 0 if refused == 3 and store.io is None else 1

    assert exit_code_in_child(child) == 0
    later = run_keys(2, 2)
    assert store.put_run(later, run_data(later)) == 2
    out = np.zeros(3 * GEOM.block_bytes, np.uint8)
    assert store.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))
    store.close()
    with KVStore.open([store_file]) as again:
        assert again.lookup(keys) == 3 and again.lookup(later) == 2
        assert again.lookup(run_keys(5, 2)) == 0


def test_a_forked_childs_copy_refuses_lookups_too(store_file):
    """README: a forked process's copy of a store is shut, "its calls raise
    StoreClosedError".  Only the calls that use the devices did: lookup,
    present, contains, pin, touch, stats, clear_ticket and removed_since
    answered from the copy's index, which goes stale as the parent deletes
    and evicts (a lookup in the child named blocks the parent had deleted,
    then the get refused).  Every one now refuses, naming the fix."""
    from tests.support.servers import exit_code_in_child

    store = KVStore.open([store_file])
    keys = run_keys(1, 3)
    store.put_run(keys, run_data(keys))

    def child():
        calls = (lambda: store.lookup(keys), lambda: store.present(keys),
                 lambda: store.contains(keys[0]), lambda: store.pin(keys),
                 lambda: store.touch(keys), store.stats, store.clear_ticket,
                 store.removed_since)
        refused = 0
        for call in calls:
            try:
                call()
            except StoreClosedError as e:
                refused += "forked" in str(e) and "KVStore.open" in str(e)
        store.close()
        return 0 if refused == len(calls) else 1

    assert exit_code_in_child(child) == 0
    assert store.lookup(keys) == 3                 # the parent's copy is untouched
    store.close()


def test_close_waits_for_a_save_gathering_into_its_staging(store_file):
    """save_blocks gathers the cache pages into staging memory that close()
    frees: close() waits for the gather, and the save is then refused (a
    StoreClosedError, nothing stored), never copying into freed memory."""
    from kvblock.tensors import VLLMLayout, save_blocks

    store = KVStore.open([store_file])
    keys = run_keys(5, 4)
    shape = (2, 8, GEOM.block_tokens, GEOM.num_kv_heads, GEOM.head_dim)
    src = [np.ones(shape, np.float16) for _ in range(GEOM.num_layers)]
    reached, go = _wait_in(store, "_staging")       # the gather buffer handed out

    def save():
        try:
            return save_blocks(store, keys, VLLMLayout(src), [0, 1, 2, 3])
        except StoreClosedError:
            return "refused"
    assert _close_while(store, reached, go, save) == "refused"
    with KVStore.open([store_file]) as again:
        assert again.lookup(keys) == 0


@pytest.mark.parametrize("remote", [False, True], ids=["store", "remote"])
@pytest.mark.parametrize("stage,background", [("_reader", True), ("_scatter", True),
                                              ("_reader", False)],
                         ids=["reader", "scatter", "inline-reader"])
def test_a_load_whose_thread_cannot_start_leaves_nothing_held(store_file, tmp_path,
                                                              monkeypatch, remote, stage,
                                                              background):
    """threading.Thread.start raising ("can't start new thread": a process
    at its thread limit) for a load's reader or scatter thread: the caller
    hears that error, and the load leaves no call in flight (close() would
    wait for it) and no pin (its runs could never be evicted); the next load
    reads the right bytes."""
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    server = serve_in_background([store_file], tmp_path / "s.sock") if remote else None
    owner = server.store if remote else None
    try:
        store = RemoteStore(tmp_path / "s.sock") if remote else KVStore.open([store_file])
        owner = owner or store
        keys = run_keys(7, 4)
        shape = (2, 8, GEOM.block_tokens, GEOM.num_kv_heads, GEOM.head_dim)
        rng = np.random.default_rng(7)
        src = [rng.integers(-30000, 30000, shape, dtype=np.int16).view(np.float16)
               for _ in range(GEOM.num_layers)]
        assert save_blocks(store, keys, VLLMLayout(src), [0, 1, 2, 3]) == 4
        dst = [np.zeros(shape, np.float16) for _ in range(GEOM.num_layers)]
        start = threading.Thread.start

        def refuse(thread):
            if getattr(getattr(thread, "_target", None), "__name__", None) == stage:
                raise RuntimeError("can't start new thread")
            return start(thread)
        with monkeypatch.context() as m:
            m.setattr(threading.Thread, "start", refuse)
            with pytest.raises(RuntimeError, match="can't start new thread"):
                load_blocks(store, keys, VLLMLayout(dst), [0, 1, 2, 3],
                            background=background).wait(20)
        assert store._inflight.calls == 0
        with owner._lock:
            assert int(owner.regions.pins.sum()) == 0
        h = load_blocks(store, keys, VLLMLayout(dst), [4, 5, 6, 7], background=background)
        assert h.wait(20) == 4
        for a, b in zip(src, dst):
            assert np.array_equal(a.view(np.int16)[:, :4], b.view(np.int16)[:, 4:])
        closer = threading.Thread(target=store.close)
        closer.start()
        closer.join(5)
        assert not closer.is_alive() and store.io is None
    finally:
        if server is not None:
            server.stop()


def _two_runs_second_corrupt(rank, save_blocks, layout, keys):
    """Save ``keys`` as two runs through ``rank`` and corrupt the second on
    the device: a load of ``keys`` verifies the first and fails the second."""
    assert save_blocks(rank, keys[:2], layout, [0, 1]) == 2
    assert save_blocks(rank, keys[2:], layout, [2, 3]) == 2
    with rank._lock:
        segs = rank._segments(keys[2:])
    run = segs[0][0]
    rank._unpin(segs)
    dev, off = rank.regions.address(run.region, run.offset)
    rank.io.write_bytes(dev, off, b"\xa5" * 4096)


def _vllm_caches(seed: int):
    """(shape, per-layer vLLM caches of random float16 bits) of 8 pages."""
    shape = (2, 8, GEOM.block_tokens, GEOM.num_kv_heads, GEOM.head_dim)
    rng = np.random.default_rng(seed)
    return shape, [rng.integers(-30000, 30000, shape, dtype=np.int16).view(np.float16)
                   for _ in range(GEOM.num_layers)]


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_a_rank_closed_while_its_load_drops_a_corrupt_run(store_file, tmp_path, background):
    """A rank's load meets a run that fails its checksum while another
    thread closes the rank, its connection still open (close() waits for a
    put in flight).  The load had unpinned its runs with the pins held, so
    its verified prefix stands: it returns that count, and the server drops
    the bad run, as the load's drop asks.  The drop was refused
    (StoreClosedError: the store was closing), and the whole load failed
    with it, though a get_run meeting the same run returns its count."""
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    sock = str(tmp_path / "kv.sock")
    shape, src = _vllm_caches(3)
    keys = run_keys(8, 4)
    with serve_in_background([store_file], sock) as server:
        rank = RemoteStore(sock)
        _two_runs_second_corrupt(rank, save_blocks, VLLMLayout(src), keys)
        # a put in flight: close() keeps the connection open until it is done
        reached, go = _wait_in(rank, "_write_run")
        later = run_keys(9, 2)
        put = threading.Thread(target=rank.put_run, args=(later, run_data(later)))
        put.start()
        assert reached.wait(20)
        closer = threading.Thread(target=rank.close)
        drop = rank._drop_runs

        def close_then_drop(runs, why="checksum"):
            closer.start()                    # close() begins as the load drops the run
            while not rank.closed:
                closer.join(0.001)
            return drop(runs, why)
        rank._drop_runs = close_then_drop
        dst = [np.zeros(shape, np.float16) for _ in range(GEOM.num_layers)]
        try:
            h = load_blocks(rank, keys, VLLMLayout(dst), [4, 5, 6, 7], background=background)
            assert h.wait(20) == 2
        finally:
            go.set()
            put.join(20)
            if closer.ident is not None:          # started
                closer.join(20)
            else:
                rank.close()
        assert not closer.is_alive() and rank.io is None
        for a, b in zip(src, dst):
            assert np.array_equal(a.view(np.int16)[:, :2], b.view(np.int16)[:, 4:6])
        assert server.store.lookup(keys) == 2              # the bad run is gone
        assert server.store.lookup(later) == 2             # the put finished meanwhile


def test_a_load_keeps_its_verified_prefix_when_dropping_a_corrupt_run_fails(store_file,
                                                                           tmp_path):
    """The server goes away after a rank's load has unpinned its runs (the
    pins held: what it read stands) and before its drop of the run that
    failed its checksum.  The load returns its verified prefix, as get_run
    does when its drop fails ("the read is a miss whatever became of the
    drop"); the failed drop failed the whole load (ServerGoneError, 0 blocks)."""
    from kvblock.tensors import VLLMLayout, load_blocks, save_blocks

    sock = str(tmp_path / "kv.sock")
    shape, src = _vllm_caches(4)
    keys = run_keys(10, 4)
    server = serve_in_background([store_file], sock)
    rank = RemoteStore(sock)
    try:
        _two_runs_second_corrupt(rank, save_blocks, VLLMLayout(src), keys)
        drop = rank._drop_runs

        def server_gone_then_drop(runs, why="checksum"):
            server.stop()
            return drop(runs, why)
        rank._drop_runs = server_gone_then_drop
        dst = [np.zeros(shape, np.float16) for _ in range(GEOM.num_layers)]
        assert load_blocks(rank, keys, VLLMLayout(dst), [4, 5, 6, 7]).wait(20) == 2
        for a, b in zip(src, dst):
            assert np.array_equal(a.view(np.int16)[:, :2], b.view(np.int16)[:, 4:6])
    finally:
        rank.close()
        server.stop()


@pytest.mark.parametrize("call", ["lookup", "present", "pin", "stats"])
def test_a_call_racing_close_with_a_dram_tier_raises_store_closed(store_file, monkeypatch,
                                                                  call):
    """lookup, present, pin and stats (no calls close() waits for) read the
    DRAM tier (and stats the engine) after their open check: a close() in
    another thread meanwhile set store.host (and store.io) to None, and they
    raised TypeError / AttributeError ("argument of type 'NoneType' is not
    iterable", "'NoneType' object has no attribute 'pin'") instead of
    answering or raising StoreClosedError."""
    from kvblock.tiers import HostTier

    store = KVStore.open([store_file], host_cache_bytes=8 * GEOM.block_bytes)
    closed = []
    method = {"lookup": "__contains__", "present": "__contains__", "pin": "pin",
              "stats": "stats"}[call]
    original = getattr(HostTier, method)

    def racing(self, *args):
        answer = original(self, *args)
        if not closed:             # another thread's close() lands right here
            t = threading.Thread(target=store.close)
            t.start()
            t.join(20)
            closed.append(True)
            return True if method != "stats" else answer
        return answer
    monkeypatch.setattr(HostTier, method, racing)
    keys = run_keys(7, 3)          # on no device: the tier is asked for each
    try:
        got = {"lookup": lambda: store.lookup(keys), "present": lambda: store.present(keys),
               "pin": lambda: store.pin(keys), "stats": store.stats}[call]()
    except StoreClosedError:
        got = None
    assert closed and store.closed and store.io is None
    if call == "lookup":
        assert got in (None, 0, 1, 2, 3)
    monkeypatch.undo()
    with KVStore.open([store_file]) as again:        # closed cleanly
        assert again.lookup(keys) == 0


def test_two_closes_at_once_write_one_checkpoint_and_raise_nothing(store_file):
    """Two threads closing one store (an engine's shutdown and a with block,
    say): the second passed close()'s "already closed?" check while the
    first wrote its checkpoint, waited for the commit lock, and then wrote
    a checkpoint of its own through the engine the first had released:
    AttributeError ('NoneType' object has no attribute 'flush')."""
    store = KVStore.open([store_file])
    keys = run_keys(3, 2)
    assert store.put_run(keys, run_data(keys)) == 2
    lock = store._commit_lock
    waiting = threading.Event()

    class Watched:
        """The commit lock, saying when a second thread waits for it."""

        def __enter__(self):
            if not lock.acquire(blocking=False):
                waiting.set()
                lock.acquire()
            return self

        def __exit__(self, *exc):
            lock.release()
    store._commit_lock = Watched()
    write = store._write_checkpoint
    errors = []

    def first_checkpoint():
        store._write_checkpoint = write          # the second close's is the plain one
        other = threading.Thread(target=lambda: _closing(store, errors))
        other.start()
        assert waiting.wait(20)                  # it waits for the commit lock now
        write()
        first_checkpoint.other = other
    store._write_checkpoint = first_checkpoint
    before = store.counters["checkpoints"]
    store.close()
    first_checkpoint.other.join(20)
    assert not errors, errors
    assert store.closed and store.io is None
    assert store.counters["checkpoints"] == before + 1
    with KVStore.open([store_file]) as again:
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert again.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))


def _closing(store, errors):
    try:
        store.close()
    except BaseException as e:      # noqa: BLE001  (reported by the test)
        errors.append(e)


def test_two_first_kvikio_loads_at_once_open_one_reader_closed_with_the_store(store_file,
                                                                               monkeypatch):
    """Two loads into CUDA memory through kvikio (KVBLOCK_GPU_PATH=kvikio:
    gpu_path opens no reader) start at once on a fresh store: both found
    no reader and each opened one (a kvikio.CuFile per device); the store
    kept the last, and the other's files stayed open for good, close()
    never reaching them."""
    import sys
    import types

    opened, closed = [], []
    both = threading.Barrier(2, timeout=2)

    class CuFile:
        def __init__(self, path, flags):
            opened.append(self)
            try:
                both.wait()       # the two loads open their readers side by side
            except threading.BrokenBarrierError:
                pass

        def close(self):
            closed.append(self)

    monkeypatch.setitem(sys.modules, "kvikio", types.SimpleNamespace(CuFile=CuFile))
    store = KVStore.open([store_file])
    got = []
    try:
        threads = [threading.Thread(target=lambda: got.append(store._kvikio_reader()))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(got) == 2 and got[0] is got[1], "two loads read through two readers"
    finally:
        store.close()
    assert len(closed) == len(opened), "a kvikio reader's files were left open"
    with pytest.raises(StoreClosedError):
        store._kvikio_reader()
    assert len(closed) == len(opened)


@pytest.mark.parametrize("remote", [False, True])
def test_a_child_forked_while_another_store_closes_closes_its_copy(store_file, tmp_path,
                                                                   remote):
    """README: a forked child's close() "only lets go of the copy ...
    waiting for none of the parent's calls".  _release_devices takes a
    module-wide lock (one for every store, RemoteStore's too) that another
    thread of the parent holds while it closes any store; a fork meanwhile
    left it held in the child for good, and the child's close() of its
    copy hung forever on it.  The child's copy of that lock is a fresh one."""
    import kvblock.store.store as store_mod
    from tests.support.servers import exit_code_in_child

    server = None
    if remote:
        sock = str(tmp_path / "kv.sock")
        server = serve_in_background([store_file], sock)
        store = RemoteStore(sock)
    else:
        store = KVStore.open([store_file])
    try:
        with store_mod._RELEASE_LOCK:      # another store's close() in a parent's thread

            def child():
                store.close()
                return 0 if store.io is None else 1
            assert exit_code_in_child(child, timeout=10) == 0
        assert store.lookup(run_keys(1, 1)) == 0       # the parent's copy is untouched
    finally:
        store.close()
        if server is not None:
            server.stop()


@pytest.mark.parametrize("remote", [False, True])
def test_a_second_close_returns_once_the_devices_are_released(store_file, tmp_path, remote):
    """Two close() calls at once (an engine's shutdown thread and a with
    block): whichever took the devices to release closed them, and the
    other returned at once, the devices (their locks) still open: a reopen
    right after its close() returned was refused as busy.  The second now
    returns once the first has let them go."""
    server = None
    if remote:
        server = serve_in_background([store_file], tmp_path / "s.sock")
        store = RemoteStore(tmp_path / "s.sock")
    else:
        store = KVStore.open([store_file])
    io_close = store.io.close
    closing, go, order = threading.Event(), threading.Event(), []

    def slow_close():
        closing.set()
        assert go.wait(20)
        io_close()
        order.append("devices closed")
    store.io.close = slow_close
    try:
        first = threading.Thread(target=store.close)
        first.start()
        assert closing.wait(20)             # the first close() is closing the devices

        def second_close():
            store.close()
            order.append("second close returned")
        second = threading.Thread(target=second_close)
        second.start()
        second.join(0.5)
        go.set()
        first.join(20)
        second.join(20)
        assert order == ["devices closed", "second close returned"]
        if not remote:
            with KVStore.open([store_file]):        # not busy
                pass
    finally:
        go.set()
        if server is not None:
            server.stop()


@pytest.mark.parametrize("lock", ["spares", "stagings", "host arena"])
def test_a_child_forked_while_a_thread_holds_a_buffer_lock_closes_its_copy(store_file, lock):
    """A forked child's close() lets go of its copy's buffers: the spare
    load buffers, every thread's staging buffers, the DRAM tier's arena.
    Each has a lock of its own, which a thread of the parent held at the
    fork when it was taking or giving a spare (a layer-wise load), making
    a staging buffer (a read) or closing the buffer; held it stays in the
    child (that thread is not the child's), and the child's close() of its
    copy hung on it for good."""
    from tests.support.servers import exit_code_in_child_while_held

    store = KVStore.open([store_file], host_cache_bytes=4 * GEOM.block_bytes)
    store.spares.give(store.spares.take(1))     # one idle spare to free
    store._staging(4096)                        # and one staging buffer
    target = {"spares": lambda: store.spares._lock,
              "stagings": lambda: store._stagings._lock,
              "host arena": lambda: store.host.arena._lock}[lock]()

    def child():
        store.close()
        return 0 if store.io is None else 1
    assert exit_code_in_child_while_held(target, child) == 0
    keys = run_keys(1, 1)                       # the parent's store is unaffected
    store.put_run(keys, run_data(keys))
    out = np.zeros(GEOM.block_bytes, np.uint8)
    assert store.get_run(keys, out) and (out == run_data(keys)).all()
    store.close()


def _open_fds(fds) -> list[int]:
    """Those of ``fds`` open in this process."""
    import os

    left = []
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        left.append(fd)
    return left


@pytest.mark.parametrize("remote", [False, True])
def test_a_child_forked_while_the_parent_releases_the_devices_lets_go_of_its_copy(
        store_file, tmp_path, remote):
    """README: a forked child's close() "only lets go of the copy".  A child
    forked while a thread of the parent was inside _release_devices (the
    devices, buffers and DRAM arena taken off the store, the release
    marked the parent's) found the release another's, and returned: the
    child kept its copies of the device descriptors (on a block device the
    O_EXCL claim: the parent's reopen refused as busy while the child
    lives), of the staging buffers and of the DRAM tier's arena (memory
    the parent freed stays the child's).  The child now lets go of them."""
    import os

    from tests.support.servers import exit_code_in_child

    server = None
    if remote:
        server = serve_in_background([store_file], tmp_path / "s.sock")
        store = RemoteStore(tmp_path / "s.sock")
    else:
        store = KVStore.open([store_file], host_cache_bytes=4 * GEOM.block_bytes)
    store._staging(4096)                             # a staging buffer to free
    staging = list(store._stagings._all)
    # the copy's descriptors (an in-process server holds the store file too)
    fds = [d.fd for d in store.io.devices] + (store._fence._fds() if remote else [])
    arena = store.host.arena if store.host is not None else None
    parent = os.getpid()
    spares_close = store.spares.close
    releasing, go = threading.Event(), threading.Event()

    def slow_close():               # the parent's release, caught in the middle
        if os.getpid() == parent:
            releasing.set()
            assert go.wait(20)
        spares_close()
    store.spares.close = slow_close
    closer = threading.Thread(target=store.close)
    closer.start()
    try:
        assert releasing.wait(20)

        def child():
            store.close()
            left = []
            if _open_fds(fds):
                left.append(f"descriptors {_open_fds(fds)}")
            if any(not b.closed for b in staging):
                left.append("staging buffers")
            if arena is not None and not arena.closed:
                left.append("the DRAM arena")
            print("left open in the child:", left, flush=True)
            return 1 if left else 0
        assert exit_code_in_child(child, timeout=10) == 0
    finally:
        go.set()
        closer.join(20)
        if server is not None:
            server.stop()
    assert store.io is None and not _open_fds(fds)
    with KVStore.open([store_file]):                  # the parent let go as well
        pass


def _uring_fds() -> set[int]:
    """This process's io_uring descriptors."""
    import os

    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "io_uring" in os.readlink(f"/proc/self/fd/{name}"):
                fds.add(int(name))
        except OSError:
            pass
    return fds


def test_a_child_forked_while_the_parent_closes_the_engine_destroys_its_rings(store_file):
    """The release a forked child finishes (the test above) reached the
    engine, but UringEngine.close marked the engine closed and took its
    rings off it into the closing thread's frame before destroying them: a
    child forked in between found its copy closed and with no rings, so its
    close() kept its copies of the rings' descriptors.  An io_uring keeps the
    device files it registered (the store's fixed files) open while any
    descriptor of it lives: on a block device the parent's O_EXCL claim, so
    the store could not be opened again while the child lived."""
    import os

    from kvblock.io.uring import UringEngine
    from tests.support.servers import exit_code_in_child

    before = _uring_fds()
    store = KVStore.open([store_file], engine="uring")
    engine = store.io.engine
    assert isinstance(engine, UringEngine)
    mine = _uring_fds() - before
    assert mine and engine._rings                     # the open's ring
    parent = os.getpid()
    first = engine._rings[0]
    destroy = first.destroy
    destroying, go = threading.Event(), threading.Event()

    def slow_destroy():             # the parent's engine close, caught in the middle
        if os.getpid() == parent and not destroying.is_set():
            destroying.set()
            assert go.wait(20)
        destroy()
    first.destroy = slow_destroy
    closer = threading.Thread(target=store.close)
    closer.start()
    try:
        assert destroying.wait(20)

        def child():
            store.close()
            left = sorted(mine & _uring_fds())
            print("io_uring descriptors left open in the child:", left, flush=True)
            return 1 if left else 0
        assert exit_code_in_child(child, timeout=10) == 0
    finally:
        go.set()
        closer.join(20)
    assert store.io is None and not (mine & _uring_fds())


def test_a_close_that_gave_up_waiting_lets_go_of_the_devices_once_the_call_is_done(
        store_file, monkeypatch):
    """close() waits CLOSE_WAIT_S for a call in flight, then returns leaving
    the devices to that call.  Nothing let go of them afterwards (a Device's
    descriptor and flock are not closed by the garbage collector): once the
    call was done the store still could not be opened again in this
    process (device busy) for as long as it lived.  The last call to leave
    releases them; what it published is there at the reopen."""
    from kvblock.store import store as store_mod

    monkeypatch.setattr(store_mod, "CLOSE_WAIT_S", 0.2)
    store = KVStore.open([store_file])
    keys = run_keys(2, 3)
    reached, go = _wait_in(store, "_stage_run")
    result = {}
    t = threading.Thread(target=lambda: result.update(n=store.put_run(keys, run_data(keys))))
    t.start()
    try:
        assert reached.wait(20)
        store.close()                       # gives up on the put after 0.2 s
        assert store.closed and store.io is not None
    finally:
        go.set()
        t.join(20)
    assert result == {"n": 3}
    assert store.io is None, "the devices stayed open after the last call left"
    with KVStore.open([store_file]) as again:
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert again.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))


@pytest.mark.parametrize("many", [False, True], ids=["put_run", "put_runs"])
def test_a_ranks_close_waits_for_a_put_written_and_not_yet_committed(store_file, tmp_path,
                                                                     many):
    """A rank's put has written its run and is about to publish it (commit)
    when another thread closes the rank.  close() waited for the write only:
    it then ended the connection under the commit, so the put raised
    ServerGoneError ("remote store is closed") and its run was lost, where
    a local store's close lets a put in flight finish."""
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock) as server:
        rank = RemoteStore(sock)
        items = [(run_keys(20 + i, 2), run_data(run_keys(20 + i, 2))) for i in range(2)]
        reached, go = _wait_in(rank, "_write_allocated")     # written, commit next
        put = (lambda: rank.put_runs(items)) if many else (lambda: rank.put_run(*items[0]))
        assert _close_while(rank, reached, go, put) == ([2, 2] if many else 2)
        for keys, _ in items[:2 if many else 1]:
            assert server.store.lookup(keys) == 2


@pytest.mark.parametrize("many", [False, True], ids=["put_run", "put_runs"])
def test_a_ranks_close_lets_a_put_of_several_pieces_finish(store_file, tmp_path, many):
    """A rank's put of a run longer than a region (several pieces, each
    committed on its own) had committed its first piece when another
    thread closed the rank: close() waited for that piece only, so the next
    one was refused and the put raised StoreClosedError with part of the
    run published, where a local store's close lets the whole put finish."""
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock) as server:
        rank = RemoteStore(sock)
        n = rank.max_run_blocks + 3                     # two pieces
        keys = run_keys(30, n)
        data = run_data(keys)
        reached, go = _wait_in(rank, "_count_committed")   # first piece committed
        put = (lambda: rank.put_runs([(keys, data)])) if many else \
            (lambda: rank.put_run(keys, data))
        assert _close_while(rank, reached, go, put) == ([n] if many else n)
        out = np.zeros(n * GEOM.block_bytes, np.uint8)
        assert server.store.get_run(keys, out) == n and np.array_equal(out, data)


@pytest.mark.parametrize("many", [False, True], ids=["put_run", "put_runs"])
def test_a_ranks_put_interrupted_at_any_line_of_its_count_lets_close_return(
        store_file, tmp_path, monkeypatch, many):
    """A KeyboardInterrupt landing at any line of a rank's put count (the
    put under way from its allocation to its commit's answer, which close()
    waits for): cut after the count went up and before its try, or as its
    finally began, the put stayed counted for good, so every later close()
    of the rank waited CLOSE_WAIT_S (30 s) for a put that no longer ran."""
    import time

    from kvblock.store import client
    from tests.store.test_store import _LineInterrupt

    # (what close() must not wait for: a bound of half of it holds under
    # any load, and a close() that waits for a put no longer running fails)
    monkeypatch.setattr(client, "CLOSE_WAIT_S", 20.0)
    sock = str(tmp_path / "kv.sock")
    functions = [RemoteStore._put_under_way, RemoteStore._put_over]
    fired = []
    with serve_in_background([store_file], sock):
        n = 0
        while True:
            n += 1
            rank = RemoteStore(sock)
            items = [(run_keys(100 * n + i, 2), run_data(run_keys(100 * n + i, 2)))
                     for i in range(2)]
            try:
                with _LineInterrupt(functions, n) as cut:
                    try:
                        if many:
                            rank.put_runs(items)
                        else:
                            rank.put_run(*items[0])
                    except KeyboardInterrupt:
                        pass
                keys = run_keys(100 * n + 50, 1)       # the rank still puts
                assert rank.put_run(keys, run_data(keys)) == 1, cut.fired
            finally:
                began = time.monotonic()
                rank.close()
                took = time.monotonic() - began
            assert took < client.CLOSE_WAIT_S / 2, \
                f"close() waited {took:.1f} s after a cut at {cut.fired}"
            if cut.fired is None:
                break
            fired.append(cut.fired)
    assert len(fired) >= 6, fired


class _CutAsTaken(list):
    """A token (or a list of writer pins) whose element is taken off, then
    a KeyboardInterrupt raised before the caller's next bytecode: what
    CPython does to a Ctrl-C pending as the call taking it (list.pop)
    returns (it checks for signals at the end of every call)."""
    cut = False

    def _cut(self):
        if not self.cut:
            self.cut = True
            raise KeyboardInterrupt

    def pop(self, *at):
        value = super().pop(*at)
        self._cut()
        return value

    def __delitem__(self, at):
        super().__delitem__(at)
        self._cut()

    def __setitem__(self, at, value):
        before = len(self)
        super().__setitem__(at, value)
        if len(self) < before:
            self._cut()


def test_a_leave_cut_as_it_took_its_token_counts_the_call_out():
    """InFlight.leave(token) counted the call out as ``_calls -=
    token.pop()``: a Ctrl-C as pop returned (where CPython raises it) left
    the token taken and the count up, and the leave again counted nothing:
    close() then waited CLOSE_WAIT_S and left the devices locked."""
    from kvblock.store.inflight import InFlight

    gate, token = InFlight("closed"), _CutAsTaken([1])
    gate.enter()
    with pytest.raises(KeyboardInterrupt):
        gate.leave(token)
    gate.leave(token)                 # what in_flight does when its leave is cut
    assert gate.calls == 0
    gate.leave(token)                 # and once more: nothing counted twice
    assert gate.calls == 0


def test_a_call_cut_as_it_entered_is_not_left_counted(store_file, monkeypatch):
    """in_flight entered the store's InFlight before its try: a Ctrl-C as
    enter() returned (where CPython raises it, counted already) left the
    call counted for good: close() waited CLOSE_WAIT_S (30 s), then left
    the devices open and locked (a reopen in the process: DeviceBusyError)."""
    import kvblock.store.store as store_module
    from kvblock.store.inflight import InFlight

    monkeypatch.setattr(store_module, "CLOSE_WAIT_S", 0.5)   # a failure fails fast
    store = KVStore.open([store_file])
    real, cut = InFlight.enter, []

    def enter(gate, *args):
        real(gate, *args)
        if not cut:
            cut.append(1)
            raise KeyboardInterrupt
    monkeypatch.setattr(InFlight, "enter", enter)
    with pytest.raises(KeyboardInterrupt):
        store.checkpoint()
    monkeypatch.setattr(InFlight, "enter", real)
    assert store._inflight.calls == 0
    store.close()
    with KVStore.open([store_file]) as again:      # the devices were let go
        assert again.lookup(run_keys(1, 1)) == 0
