"""A key stored again by a newer run, clear() with reads and puts in flight,
a put larger than the store, and regions emptied while pinned.

Each case survives a restart: a clean one (close writes a checkpoint) and a
crash (the journal is replayed), so what the store forgot stays forgotten.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import xxhash

from kvblock import KVStore
from kvblock.alloc.regions import SEALED
from kvblock.errors import ConfigError, StoreClosedError, StoreFullError
from kvblock.index import normalize_keys
from tests.store.workload import GEOM, run_data, run_keys, small_store
from tests.support.faults import CrashPlan, SimulatedCrash

MIB = 1 << 20


def _store(tmp_path, size=4 * MIB) -> str:
    return small_store(tmp_path / "store.img", size)


def _crash(store: KVStore) -> None:
    """The process dies: no checkpoint, the next open replays the journal."""
    store._release_devices()
    store.closed = True


def _close(store, how):
    """A clean close (it writes a checkpoint) or a crash (the journal is replayed)."""
    store.close() if how == "clean" else _crash(store)


def _clear_during(store, method: str, work):
    """Run ``work()`` in a thread that stops right after ``store.<method>``
    ran, clear() the store meanwhile, let it go on; what ``work()`` returned."""
    reached, go = threading.Event(), threading.Event()
    real = getattr(store, method)

    def stalled(*args, **kw):
        out = real(*args, **kw)
        reached.set()
        assert go.wait(20)
        return out
    setattr(store, method, stalled)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=work()))
    t.start()
    assert reached.wait(20)
    store.clear()
    go.set()
    t.join(20)
    delattr(store, method)
    return result["out"]


def _read(store, keys) -> np.ndarray | None:
    out = np.zeros(len(keys) * GEOM.block_bytes, np.uint8)
    return out if store.get_run(keys, out) == len(keys) else None


@pytest.mark.parametrize("how", ["clean", "crash"])
def test_a_deleted_key_stays_deleted_when_an_older_run_also_held_it(tmp_path, how):
    """K[:3] stored, then the grown prefix K[:4]: the older run's three keys
    now name positions of the newer run.  Deleting the newer run must not
    let the older copy come back after a restart."""
    path = _store(tmp_path)
    keys = run_keys(1, 4)
    store = KVStore.open([path])
    store.put_run(keys[:3], run_data(keys[:3]))
    store.put_run(keys, run_data(keys))
    assert store.stats()["runs"] == 1                  # the older run is of no use: dropped
    assert store.counters["superseded_runs"] == 1
    assert store.delete(keys[:1]) == 4 and store.lookup(keys) == 0
    _close(store, how)
    with KVStore.open([path]) as store:
        assert store.lookup(keys) == 0 and store.lookup(keys[:3]) == 0
        assert store.stats()["runs"] == 0


@pytest.mark.parametrize("how", ["clean", "crash"])
def test_a_partly_superseded_run_keeps_its_other_keys_only(tmp_path, how):
    """Runs A = [x, k1, k2] and B = [k1, k2, k3]: A keeps x; deleting B takes
    k1..k3 away for good, also from A, also across a checkpoint."""
    path = _store(tmp_path)
    x, k1, k2, k3 = run_keys(2, 4)
    a_data, b_data = run_data([x, k1, k2]), run_data([k1, k2, k3])
    store = KVStore.open([path])
    store.put_run([x, k1, k2], a_data)
    store.put_run([k1, k2, k3], b_data)
    assert store.stats()["runs"] == 2
    b_view = b_data.reshape(GEOM.num_layers, GEOM.head_groups, 3, -1)
    got = _read(store, [k1, k2, k3])                   # the newer copy
    assert got is not None and np.array_equal(
        got.reshape(GEOM.num_layers, GEOM.head_groups, 3, -1), b_view)
    store.checkpoint()                                 # A is written with k1, k2 superseded
    assert store.delete([k3]) == 3
    store.checkpoint()
    _close(store, how)
    with KVStore.open([path]) as store:
        assert store.lookup([x]) == 1
        assert store.lookup([k1]) == 0 and store.lookup([k2]) == 0 and store.lookup([k3]) == 0
        got = _read(store, [x])
        a_view = a_data.reshape(GEOM.num_layers, GEOM.head_groups, 3, -1)
        assert got is not None and np.array_equal(
            got.reshape(GEOM.num_layers, GEOM.head_groups, 1, -1), a_view[:, :, :1])


def test_runs_stored_twice_do_not_keep_their_space(tmp_path):
    """Two writers racing on the same runs (as two ranks may): the losing
    copies are dropped, and their regions come back once empty."""
    path = _store(tmp_path)
    with KVStore.open([path]) as store:
        for i in range(8):
            keys = run_keys(10 + i, 4)
            store.put_run(keys, run_data(keys))
        for i in range(8):   # as the second rank's put would land (present() was false)
            keys = run_keys(10 + i, 4)
            store._put_one(normalize_keys(keys), store._blocks_view(normalize_keys(keys),
                                                                    run_data(keys)),
                           store._clears)
        assert store.stats()["runs"] == 8 and store.counters["superseded_runs"] == 8
        store.regions.seal(store.regions.open)
        for i in range(8):
            store.delete(run_keys(10 + i, 1))
        assert store.stats()["runs"] == 0
        assert int(store.regions.live.sum()) == 0
        assert len(store.regions.free) == store.regions.count   # nothing held
    with KVStore.open([path]) as store:
        assert store.stats()["runs"] == 0


@pytest.mark.parametrize("how", ["clean", "crash"])
def test_clear_forgets_runs_that_a_read_pins(tmp_path, how):
    """clear() with a read in flight (its pin) forgets that read's run at
    once; the region is freed when the read lets go, not left for later."""
    path = _store(tmp_path)
    store = KVStore.open([path])
    keys = run_keys(3, 4)
    store.put_run(keys, run_data(keys))
    other = run_keys(4, 2)
    store.put_run(other, run_data(other))
    pin = store.pin(keys)
    store.clear()
    assert store.lookup(keys) == 0 and store.lookup(other) == 0
    assert store.stats()["runs"] == 0
    region = pin[0][0].region
    assert store.regions.pins[region] == 1 and region not in store.regions.free
    store.unpin(pin)
    assert region in store.regions.free
    _close(store, how)
    with KVStore.open([path]) as store:
        assert store.lookup(keys) == 0 and store.lookup(other) == 0


@pytest.mark.parametrize("how", ["clean", "crash"])
def test_clear_refuses_a_put_allocated_before_it(tmp_path, how):
    """A put whose space was allocated before clear() holds what was stored
    before it (old weights' KV): it returns 0 and nothing of it is found."""
    path = _store(tmp_path)
    store = KVStore.open([path])
    keys = run_keys(5, 3)
    # stopped once its space is allocated and its data staged, before the write
    n = _clear_during(store, "_stage_run", lambda: store.put_run(keys, run_data(keys)))
    assert n == 0 and store.lookup(keys) == 0
    assert store.counters["cleared_puts"] == 1
    later = run_keys(6, 3)                            # puts after the clear are stored
    assert store.put_run(later, run_data(later)) == 3
    assert np.array_equal(_read(store, later), run_data(later))
    _close(store, how)
    with KVStore.open([path]) as store:
        assert store.lookup(keys) == 0 and store.lookup(later) == 3



@pytest.mark.parametrize("how", ["clean", "crash"])
def test_a_clear_refusing_a_put_runs_call_refuses_its_repeated_runs_too(tmp_path, how):
    """put_runs counts a run that an earlier run of the call writes whole as
    stored (a duplicate); when a clear() refused that earlier run, the
    repeat still said all its blocks were stored, and none was."""
    path = _store(tmp_path)
    store = KVStore.open([path])
    keys = run_keys(9, 3)
    out = _clear_during(store, "_stage_run", lambda: store.put_runs(
        [(keys, run_data(keys)), (keys[:2], run_data(keys[:2]))]))
    assert out == [0, 0] and store.lookup(keys) == 0
    _close(store, how)
    with KVStore.open([path]) as store:
        assert store.lookup(keys) == 0

def test_a_run_larger_than_the_store_is_refused_before_anything_is_evicted(tmp_path):
    path = _store(tmp_path, 2 * MIB)
    with KVStore.open([path]) as store:
        kept = run_keys(7, 2)
        store.put_run(kept, run_data(kept))
        room = (store.regions.count - 1) * store.regions.size
        n = room // GEOM.block_bytes + store.max_run_blocks
        big = run_keys(8, n)
        with pytest.raises(StoreFullError, match=f"a run of {n} blocks .* does not fit"):
            store.put_run(big, np.zeros(n * GEOM.block_bytes, np.uint8))
        with pytest.raises(StoreFullError, match="does not fit"):
            store.put_runs([(kept, run_data(kept)), (big, np.zeros(n * GEOM.block_bytes,
                                                                   np.uint8))])
        assert store.lookup(kept) == 2 and store.counters["evicted_regions"] == 0
        fits = run_keys(9, room // store.layout(1).run_bytes // 2)
        assert store.put_run(fits, np.zeros(len(fits) * GEOM.block_bytes, np.uint8)) \
            == len(fits)
        assert store.lookup(fits) == len(fits)


def test_a_run_that_fits_the_bytes_but_not_the_regions_is_refused(tmp_path):
    # A run is cut into pieces of max_run_blocks, each a little smaller than
    # a region (its padding and trailer); pieces never straddle regions, so
    # that slack adds up: a run whose bytes fit the store's regions but whose
    # pieces need one region more would have its tail evict its head.
    path = _store(tmp_path, 12 * MIB)
    with KVStore.open([path]) as store:
        count, step = store.regions.count, store.max_run_blocks
        piece = store.layout(step).run_bytes
        assert store.regions.size // piece == 1 and count * piece <= (count - 1) * \
            store.regions.size
        n = count * step + 1                 # one piece per region, and one more
        big = run_keys(10, n)
        with pytest.raises(StoreFullError, match=f"a run of {n} blocks .* does not fit"):
            store.put_run(big, np.zeros(n * GEOM.block_bytes, np.uint8))
        assert store.lookup(big) == 0 and store.counters["evicted_regions"] == 0
        fits = run_keys(11, (count - 1) * step)
        assert store.put_run(fits, np.zeros(len(fits) * GEOM.block_bytes, np.uint8)) \
            == len(fits)
        assert store.lookup(fits) == len(fits)


@pytest.mark.parametrize("call", ["evict", "clear"])
def test_evict_all_and_clear_end_while_puts_keep_sealing_regions(tmp_path, call):
    """Puts from other threads keep filling regions while evict(all=True)
    or clear() runs: it reclaims the regions sealed when it began, not
    every region those puts seal meanwhile, which kept it going as long
    as they did.  (Here one put of a region's worth lands after each
    region it frees: puts as fast as the reclaims.)"""
    path = _store(tmp_path)
    with KVStore.open([path]) as store:
        step = store.max_run_blocks
        count = store.regions.count
        for i in range(count):
            keys = run_keys(300 + i, step)
            store.put_run(keys, run_data(keys))
        real, n, busy = store._finish_reclaim, [0], [False]

        def finish_then_put(region, *args, **kw):
            real(region, *args, **kw)
            if busy[0]:
                return                    # the put's own reclaims
            n[0] += 1
            if n[0] > 3 * count:
                raise RuntimeError(f"{call} reclaimed {n[0]} regions of {count}: no end")
            busy[0] = True
            try:
                keys = run_keys(1000 + n[0], step)
                store.put_run(keys, run_data(keys))
            finally:
                busy[0] = False
        store._finish_reclaim = finish_then_put
        store.evict(all=True) if call == "evict" else store.clear()
        assert n[0] <= count + 1
        del store._finish_reclaim
        late = run_keys(1000 + n[0], step)
        assert store.lookup(late) == step       # put after it began: kept
        assert all(store.lookup(run_keys(300 + i, step)) == 0 for i in range(count))


def test_evict_counts_a_region_another_call_is_freeing(tmp_path):
    """A full store: a delete empties a region, its RECLAIM record in
    flight, when evict(nbytes) asks for a region's worth: the region being
    freed is that room.  evict waits for it rather than evicting a region
    of live runs too."""
    path = _store(tmp_path)
    with KVStore.open([path]) as store:
        step = store.max_run_blocks
        runs = [run_keys(400 + i, step) for i in range(store.regions.count)]
        for keys in runs:
            store.put_run(keys, run_data(keys))
        assert store.stats()["regions_free"] == 0
        real_finish, real_free = store._finish_reclaim, store._free_regions
        looked, result = threading.Event(), []
        evictor = threading.Thread(target=lambda: result.append(
            store.evict(store.regions.size)))

        def free_regions():
            if threading.current_thread() is evictor:
                looked.set()              # it saw the store's free space
            return real_free()

        def finish_once_looked(*args, **kw):
            # the delete's region is RECLAIMING: evict asks now
            if threading.current_thread() is threading.main_thread() and not looked.is_set():
                evictor.start()
                assert looked.wait(20)
            return real_finish(*args, **kw)
        store._finish_reclaim, store._free_regions = finish_once_looked, free_regions
        try:
            assert store.delete(runs[0][:1]) == step
            evictor.join(20)
        finally:
            del store._finish_reclaim, store._free_regions
        assert result == [0]
        assert store.counters["evicted_regions"] == 0
        assert all(store.lookup(keys) == step for keys in runs[1:])


def test_a_region_emptied_while_pinned_is_freed_when_unpinned(tmp_path):
    path = _store(tmp_path)
    with KVStore.open([path]) as store:
        runs = [run_keys(20 + i, 2) for i in range(4)]
        for keys in runs:
            store.put_run(keys, run_data(keys))
        region = store.regions.open
        store.regions.seal(region)
        free_before = len(store.regions.free)
        pin = store.pin(runs[0])
        for keys in runs:
            store.delete(keys)
        assert region not in store.regions.free        # a read still holds it
        store.unpin(pin)
        assert region in store.regions.free and len(store.regions.free) == free_before + 1


@pytest.mark.parametrize("how", ["put_run", "put_runs"])
def test_a_clear_between_the_pieces_of_one_put_refuses_the_whole_put(tmp_path, how):
    """A run longer than a region goes in pieces; a clear() after the first
    piece took that piece away: the tail must not be published either (an
    engine storing the head again after a weight update would read the new
    head followed by the old tail), and the put returns 0."""
    path = _store(tmp_path, 8 * MIB)
    with KVStore.open([path]) as store:
        big, small = run_keys(30, store.max_run_blocks + 5), run_keys(31, 2)
        real, calls = store._begin_put, []

        def begin_put(nbytes, held=None):
            calls.append(nbytes)
            if len(calls) == 2:            # another thread clears between the pieces
                t = threading.Thread(target=store.clear)
                t.start()
                t.join(20)
            return real(nbytes, held)
        store._begin_put = begin_put
        if how == "put_run":
            got = [store.put_run(big, run_data(big))]
        else:
            got = store.put_runs([(big, run_data(big)), (small, run_data(small))])
        del store._begin_put
        assert got[0] == 0 and store.lookup(big) == 0
        assert store.lookup(big[store.max_run_blocks:]) == 0      # no tail either
        if how == "put_runs":                   # allocated after the clear, but the call
            assert got[1] == 0 and store.lookup(small) == 0    # began before it
        assert store.put_run(big, run_data(big)) == len(big)  # the next put is stored
        assert np.array_equal(_read(store, big), run_data(big))


def test_a_dram_tier_keeps_nothing_that_a_clear_overtook(tmp_path):
    """With host_cache_bytes, a read in flight during clear() (it copies its
    blocks into DRAM when done) and a put published just before it (the
    same after its publish) must not put cleared blocks back."""
    path = _store(tmp_path)
    with KVStore.open([path], host_cache_bytes=MIB) as store:
        keys, fresh = run_keys(40, 4), run_keys(41, 3)
        store.put_run(keys, run_data(keys))
        store.host.clear()                      # on the device only: a read fetches it
        got = _clear_during(store, "_read", lambda: _read(store, keys))
        assert got is not None and store.lookup(keys) == 0 and len(store.host) == 0
        _clear_during(store, "_publish_put", lambda: store.put_run(fresh, run_data(fresh)))
        assert store.lookup(fresh) == 0 and len(store.host) == 0


def test_a_put_during_a_clear_leaves_no_older_copy_in_the_dram_tier(tmp_path):
    """A put that begins while clear() is still dropping the device's runs
    (the store's clear count moved, the DRAM tier's epoch not yet) is
    published, but does not enter the tier: the key's pre-clear copy stayed
    there, and a get_run after the put returned served the old bytes."""
    path = _store(tmp_path)
    keys = run_keys(45, 2)
    old, new = run_data(keys), run_data(keys) ^ 0x5A
    with KVStore.open([path], host_cache_bytes=MIB) as store:
        store.put_run(keys, old)
        assert all(k in store.host for k in normalize_keys(keys))
        reached, go = threading.Event(), threading.Event()
        real = store.host.clear

        def held_clear(*args, **kw):
            reached.set()
            assert go.wait(30)
            return real(*args, **kw)
        store.host.clear = held_clear
        t = threading.Thread(target=store.clear)
        t.start()
        try:
            assert reached.wait(30)
            assert store.put_run(keys, new) == 2
            got = _read(store, keys)
            assert got is not None and np.array_equal(got, new)
        finally:
            go.set()
            t.join(30)
        assert np.array_equal(_read(store, keys), new)


def test_a_dram_tier_serves_the_newest_copy_of_a_key(tmp_path):
    """A key stored again with other bytes (not content-addressed): the DRAM
    tier must hand out the new copy, as the device index does."""
    path = _store(tmp_path)
    keys = run_keys(50, 2)
    old, new = run_data(keys), run_data(keys) ^ 0x5A
    with KVStore.open([path], host_cache_bytes=MIB) as store:
        store.put_run(keys, old)
        store.put_run(keys[:1] + run_keys(51, 1), np.concatenate([
            new.reshape(GEOM.num_layers, GEOM.head_groups, 2, -1)[:, :, :1],
            run_data(run_keys(51, 1)).reshape(GEOM.num_layers, GEOM.head_groups, 1, -1)],
            axis=2))
        got = _read(store, keys[:1])
        want = new.reshape(GEOM.num_layers, GEOM.head_groups, 2, -1)[:, :, :1]
        assert np.array_equal(got.reshape(want.shape), want)


def test_a_region_reclaimed_after_the_checkpoint_is_not_old_after_a_replay(tmp_path):
    """A region sealed before the checkpoint, then reclaimed and filled with
    new runs (its RECLAIM and PUTs in the journal): after a crash the replay
    must not give it back its old seal time (and seal order), or
    evict_older_than(a time before the new runs) evicts them, and fifo/lru
    take it first as if it held the oldest data."""
    import time

    path = _store(tmp_path)
    store = KVStore.open([path])
    n = store.max_run_blocks                   # one run fills a region
    old = [run_keys(0, n), run_keys(1, n)]     # region 0 (sealed), region 1 (open)
    for keys in old:
        store.put_run(keys, run_data(keys))
    store.checkpoint()                         # region 0 sealed, with its seal time
    time.sleep(1.1)                            # seal times are whole seconds
    cutoff = time.time()
    assert store.evict_older_than(cutoff) == 1 and store.lookup(old[0]) == 0
    time.sleep(1.1)                            # what is sealed from here on is newer
    late = [run_keys(10 + i, n) for i in range(store.regions.count - 1)]
    for keys in late:                          # the last one lands in region 0 again
        assert store.put_run(keys, run_data(keys)) == n
    assert store.lookup(old[1]) == n
    _crash(store)
    with KVStore.open([path]) as store:
        assert all(store.lookup(keys) == n for keys in late)
        store.evict_older_than(cutoff)
        assert [store.lookup(keys) for keys in late] == [n] * len(late)


def test_a_region_reclaimed_as_a_checkpoint_is_taken_is_not_old_after_a_replay(tmp_path):
    """The RECLAIM commit that fills half the journal writes a checkpoint at
    once, while the region is still being reclaimed (its new generation
    applied, its seal time not yet cleared).  Runs put in it afterwards
    (journal) must not get that old seal time back after a crash, or
    evict_older_than(a time before them) evicts them."""
    import time

    path = _store(tmp_path)
    store = KVStore.open([path])
    n = store.max_run_blocks                   # one run fills a region
    store.put_run(run_keys(0, n), run_data(run_keys(0, n)))       # region 0
    small = 0
    while store._jhead < store.sb.journal_bytes // 2:             # one journal block a put
        small += 1
        store.put_run(run_keys(100 + small, 1), run_data(run_keys(100 + small, 1)))
    assert store._jhead == store.sb.journal_bytes // 2
    time.sleep(1.1)                            # seal times are whole seconds
    cutoff = time.time()
    time.sleep(1.1)
    checkpoints = store.counters["checkpoints"]
    assert store.evict_older_than(cutoff) >= 1 and store.lookup(run_keys(0, n)) == 0
    assert store.counters["checkpoints"] == checkpoints + 1        # at region 0's RECLAIM
    late = [run_keys(10 + i, n) for i in range(len(store.regions.free))]
    for keys in late:                          # one of them lands in region 0 again
        assert store.put_run(keys, run_data(keys)) == n
    _crash(store)
    with KVStore.open([path]) as store:
        assert all(store.lookup(keys) == n for keys in late)
        store.evict_older_than(cutoff)
        assert [store.lookup(keys) for keys in late] == [n] * len(late)


def test_used_bytes_after_a_crash_count_a_reclaimed_region_anew(tmp_path):
    # A region filled, reclaimed and reused with a smaller run before a crash:
    # replay must not keep the old runs' fill (used_bytes, the gauge).
    path = _store(tmp_path, 2 * MIB)
    store = KVStore.open([path])
    for i in range(3):
        store.put_run(run_keys(i, 8), run_data(run_keys(i, 8)))
    first = store.regions.open
    store.evict(all=True)
    i = 10
    while store.regions.open != first:
        store.put_run(run_keys(i, 8), run_data(run_keys(i, 8)))
        i += 1
    used = store.stats()["used_bytes"]
    _crash(store)
    with KVStore.open([path]) as store:
        assert store.counters["replayed_records"] > 0
        assert store.stats()["used_bytes"] == used


def test_a_dram_tier_serves_the_newest_copy_when_two_puts_race(tmp_path):
    """Two writers store a key with other bytes: the second publishes (and
    fills the DRAM tier) before the first got to fill it.  The tier must
    hand out the copy the device index names, not the one filled last."""
    path = _store(tmp_path)
    keys = run_keys(52, 2)
    old, new = run_data(keys), run_data(keys) ^ 0x5A
    other = keys[:1] + run_keys(53, 1)
    newer = np.concatenate([
        new.reshape(GEOM.num_layers, GEOM.head_groups, 2, -1)[:, :, :1],
        run_data(run_keys(53, 1)).reshape(GEOM.num_layers, GEOM.head_groups, 1, -1)], axis=2)
    with KVStore.open([path], host_cache_bytes=MIB) as store:
        real = store._count_put
        calls = []

        def overtaken(*args):
            calls.append(1)
            if len(calls) == 1:                 # the first put, published: the second overtakes
                assert store.put_run(other, newer) == 2
            return real(*args)
        store._count_put = overtaken
        assert store.put_run(keys, old) == 2
        got = _read(store, keys[:1])
        want = new.reshape(GEOM.num_layers, GEOM.head_groups, 2, -1)[:, :, :1]
        assert np.array_equal(got.reshape(want.shape), want)


def test_a_dram_tier_copy_overtaken_while_it_is_made_is_not_served(tmp_path):
    """The tier copies a put's blocks outside the store's lock: a second put
    holding one of its keys (other bytes) that publishes and fills the tier
    while the first is copying (the first's older copy then lands over it)
    must not leave the older copy served: the first put looks again and
    drops it."""
    path = _store(tmp_path)
    keys = run_keys(54, 2)
    old = run_data(keys)
    other = keys[:1] + run_keys(55, 1)
    newer = run_data(other)
    with KVStore.open([path], host_cache_bytes=MIB) as store:
        real = store.host.put
        calls = []

        def overtaken(key, block, **kw):
            calls.append(key)
            if len(calls) == 1:      # the first put's first copy: the second overtakes it
                assert store.put_run(other, newer) == 2
            return real(key, block, **kw)
        store.host.put = overtaken
        assert store.put_run(keys, old) == 2
        store.host.put = real
        assert store.host.stats()["host_blocks"] >= 1
        got = _read(store, keys[:1])
        want = newer.reshape(GEOM.num_layers, GEOM.head_groups, 2, -1)[:, :, :1]
        assert np.array_equal(got.reshape(want.shape), want)


def test_a_dram_tier_put_runs_whose_later_run_takes_a_prefix(tmp_path):
    """put_runs([K0 K1 K2], [K0 K1 X]) with a DRAM tier: the second run takes
    the first's first two keys; the first's tier fill looks again at the
    keys it copied (one left) and must drop only those the second took
    (found by the store's model test: an IndexError there)."""
    path = _store(tmp_path)
    first = run_keys(56, 3)
    second = first[:2] + run_keys(57, 1)
    with KVStore.open([path], host_cache_bytes=MIB) as store:
        assert store.put_runs([(first, run_data(first)), (second, run_data(second))]) == [3, 3]
        got = _read(store, first[:2])
        want = run_data(second).reshape(GEOM.num_layers, GEOM.head_groups, 3, -1)[:, :, :2]
        assert np.array_equal(got.reshape(want.shape), want)
        got = _read(store, first)
        assert got is not None


def _owned(owner: bytes, i: int, n: int) -> list[bytes]:
    """``n`` 16-byte keys (stored as given) that begin with ``owner``."""
    return [owner + xxhash.xxh3_128_digest(f"{i}-{j}".encode())[len(owner):]
            for j in range(n)]


@pytest.mark.parametrize("how", ["clean", "crash"])
def test_delete_prefix_removes_one_owners_runs_and_no_others(tmp_path, how):
    """Owners whose tags differ in the last byte only; a run whose second
    key is the owner's goes whole (as delete() takes a run); a superseded
    position of the owner's in another owner's run does not count."""
    path = _store(tmp_path)
    me, them = b"\x01\x02\x03\x04", b"\x01\x02\x03\x05"
    mine = [_owned(me, i, 3) for i in range(3)]
    theirs = [_owned(them, i, 3) for i in range(2)]
    mixed = [_owned(them, 9, 1)[0], _owned(me, 9, 1)[0]]
    store = KVStore.open([path])
    for keys in mine + theirs + [mixed]:
        assert store.put_run(keys, run_data(keys)) == len(keys)
    assert store.delete_prefix(me) == 3 * 3 + 2
    assert store.delete_prefix(me) == 0
    assert [store.lookup(k) for k in mine + [mixed]] == [0, 0, 0, 0]
    assert [_read(store, k) is not None and np.array_equal(_read(store, k), run_data(k))
            for k in theirs] == [True, True]
    _close(store, how)
    with KVStore.open([path]) as store:
        assert [store.lookup(k) for k in mine + [mixed]] == [0, 0, 0, 0]
        assert [store.lookup(k) for k in theirs] == [3, 3]
        assert np.array_equal(_read(store, theirs[1]), run_data(theirs[1]))
        assert store.stats()["runs"] == 2


@pytest.mark.parametrize("dram", [False, True])
def test_delete_prefix_matches_the_key_zero_as_given_not_its_stand_in(tmp_path, dram):
    """The key 0 (16 zero bytes) is held under a stand-in (a hash: zero
    marks a superseded position, kvblock/index/keys.py).  delete_prefix()
    matched the stand-in's bytes: a prefix of zeros left the key 0 stored,
    and a prefix of the stand-in's first byte (0xe5) deleted it.  Alike
    in the DRAM tier, the key there too and only there."""
    from kvblock.index.keys import _ZERO_STANDIN

    path = _store(tmp_path)
    zero, other = [bytes(16)], _owned(b"\x00\x07", 0, 1)
    with KVStore.open([path], host_cache_bytes=8 * GEOM.block_bytes if dram else 0) as store:
        for keys in (zero, other):
            assert store.put_run(keys, run_data(keys)) == 1
        if dram:
            store.evict(all=True)                  # held only in DRAM now
        assert store.lookup(zero) == 1 and store.lookup(other) == 1
        assert store.delete_prefix(_ZERO_STANDIN[:1]) == 0
        assert store.lookup(zero) == 1
        assert store.delete_prefix(b"\x00\x00") == 1
        assert store.lookup(zero) == 0 and store.lookup(other) == 1
        assert store.put_run(zero, run_data(zero)) == 1
        if dram:
            store.evict(all=True)
        assert store.delete_prefix(bytes(8)) == 1
        assert store.lookup(zero) == 0 and store.lookup(other) == 1


@pytest.mark.parametrize("prefix", [b"", b"123456789", "0102", None])
def test_delete_prefix_refuses_a_prefix_it_cannot_match(tmp_path, prefix):
    path = _store(tmp_path)
    with KVStore.open([path]) as store:
        keys = _owned(b"1", 0, 2)
        store.put_run(keys, run_data(keys))
        with pytest.raises(ConfigError, match="a key prefix is 1 to 8 bytes"):
            store.delete_prefix(prefix)
        assert store.lookup(keys) == 2


def test_clear_ticket_changes_with_every_clear(tmp_path):
    with KVStore.open([_store(tmp_path)]) as store:
        first = store.clear_ticket()
        assert store.clear_ticket() == first
        store.clear()
        second = store.clear_ticket()
        assert second != first
        store.delete(run_keys(1, 1))
        assert store.clear_ticket() == second


@pytest.mark.parametrize("how", ["prefix", "keys"])
def test_delete_counts_the_blocks_it_removed_not_positions_a_newer_run_holds(tmp_path, how):
    """A run whose second key a newer (another owner's) run stored again:
    deleting it removes one block, the other is still stored and read from
    the newer run.  The count said 2 (the run's length), so LMCache's
    clear() reported tokens it had not removed."""
    me, them = b"\x01\x02\x03\x04", b"\x01\x02\x03\x05"
    mine, theirs = _owned(me, 0, 1), _owned(them, 1, 2)
    with KVStore.open([_store(tmp_path)]) as store:
        store.put_run(mine + theirs[:1], run_data(mine + theirs[:1]))
        store.put_run(theirs, run_data(theirs))          # supersedes theirs[0]
        assert store.stats()["blocks"] == 3
        removed = store.delete_prefix(me) if how == "prefix" else store.delete(mine)
        assert store.stats()["blocks"] == 2 and store.lookup(theirs) == 2
        assert removed == 1


def test_delete_does_not_count_a_run_dropped_meanwhile(tmp_path):
    """The runs are found under the lock and dropped after it: one another
    call dropped in between (a delete, an eviction) is not this call's."""
    keys = _owned(b"\x09", 0, 3)
    with KVStore.open([_store(tmp_path)]) as store:
        store.put_run(keys, run_data(keys))
        found = store.index.runs_with_prefix(b"\x09")
        assert store.delete(keys) == 3                   # the other call
        store.index.runs_with_prefix = lambda prefix: found
        assert store.delete_prefix(b"\x09") == 0


def test_deleted_runs_does_not_count_a_run_dropped_meanwhile(tmp_path):
    """stats()["deleted_runs"] counted the runs a delete found, so a run
    another call dropped between the lookup and the drop was counted twice."""
    keys = _owned(b"\x0a", 0, 3)
    with KVStore.open([_store(tmp_path)]) as store:
        store.put_run(keys, run_data(keys))
        found = store.index.runs_with_prefix(b"\x0a")
        assert store.delete(keys) == 3                   # the other call
        store.index.runs_with_prefix = lambda prefix: found
        assert store.delete_prefix(b"\x0a") == 0
        assert store.stats()["deleted_runs"] == 1


def _removal_in_flight(store, plan, start, other):
    """``start()`` in a thread that stops where its removal from the index
    is made and its journal record not yet written; ``other()`` meanwhile;
    then the process dies (the record never reaches the medium).  Returns
    whether ``other()`` returned (a successful call) before the store
    failed."""
    stopped, go = threading.Event(), threading.Event()
    real = store._commit

    def commit(records, apply=None):
        if threading.current_thread().name == "remover" and not stopped.is_set():
            stopped.set()
            assert go.wait(20)
        return real(records, apply)
    store._commit = commit
    remover = threading.Thread(target=lambda: _swallow(start), name="remover")
    remover.start()
    assert stopped.wait(20)
    done = {}
    caller = threading.Thread(target=lambda: done.update(ok=_swallow(other)))
    caller.start()
    caller.join(2)               # done by now, unless it waits for the record
    plan.crashed = True          # the process dies: no more I/O reaches the medium
    go.set()
    remover.join(20)
    caller.join(20)
    assert not caller.is_alive() and not remover.is_alive()
    _crash(store)
    return done["ok"]


def _swallow(call) -> bool:
    try:
        call()
    except (SimulatedCrash, StoreClosedError):
        return False
    return True


@pytest.mark.parametrize("first", ["delete", "evict"])
def test_a_delete_returns_only_once_a_removal_it_relied_on_is_durable(tmp_path, first):
    """A run is taken out of the index before its DROP (or RECLAIM) record
    is durable.  A delete() of its key meanwhile found nothing left to drop
    and returned at once: a crash before the other call's record then
    brought back the key that delete() had returned for."""
    path = _store(tmp_path)
    plan = CrashPlan()
    store = KVStore.open([path], storeio_factory=plan.factory())
    keys = run_keys(7, 3)
    store.put_run(keys, run_data(keys))
    start = (lambda: store.delete(keys[:1])) if first == "delete" else \
        (lambda: store.evict(all=True))
    returned = _removal_in_flight(store, plan, start, lambda: store.delete(keys[:1]))
    with KVStore.open([path]) as store:
        if returned:
            assert store.lookup(keys) == 0, "delete() returned, yet its key came back"


@pytest.mark.parametrize("evict", ["evict", "evict_older_than"])
def test_clear_returns_only_once_an_eviction_in_flight_is_durable(tmp_path, evict):
    """clear() passed over a region another call was reclaiming (its runs
    already out of the index, its RECLAIM record not yet written) and
    returned: a crash then brought the region's runs back after the clear
    (KV of the old weights, served for the new ones).  evict_older_than
    takes several regions at once: those after a failed RECLAIM never
    become durable, and the clear must not wait for them forever."""
    path = _store(tmp_path)
    plan = CrashPlan()
    store = KVStore.open([path], storeio_factory=plan.factory())
    stored, i = [], 0
    while (store.regions.state == SEALED).sum() < 2:
        keys = run_keys(100 + i, 3)
        store.put_run(keys, run_data(keys))
        stored.append(keys)
        i += 1
    start = (lambda: store.evict(all=True)) if evict == "evict" else \
        (lambda: store.evict_older_than(time.time() + 60))
    returned = _removal_in_flight(store, plan, start, store.clear)
    with KVStore.open([path]) as store:
        if returned:
            assert all(store.lookup(keys) == 0 for keys in stored), \
                "clear() returned, yet a run came back"


@pytest.mark.parametrize("call", ["put_run", "put_blocks", "put_runs"])
def test_a_clear_during_a_puts_argument_checks_refuses_the_put(tmp_path, call):
    """A put that began before clear() (here: clear() runs while the put
    checks its data) publishes nothing: its data are from before the clear.
    The put noted the clear count only after its checks, so it was stored
    and served after the clear returned."""
    from kvblock.store.scatter import BlockList

    path = _store(tmp_path)
    keys = run_keys(60, 3)
    data = run_data(keys)
    with KVStore.open([path]) as store:
        real_view, real_of = store._blocks_view, BlockList.of

        def clearing_view(*args, **kw):
            store.clear()
            return real_view(*args, **kw)

        def clearing_of(*args, **kw):
            store.clear()
            return real_of(*args, **kw)
        store._blocks_view = clearing_view
        per_block = data.reshape(GEOM.num_layers, GEOM.head_groups, 3, -1)
        try:
            if call == "put_run":
                got = store.put_run(keys, data)
            elif call == "put_runs":
                got = store.put_runs([(keys, data)])[0]
            else:
                BlockList.of = clearing_of
                got = store.put_blocks(keys, [np.ascontiguousarray(per_block[:, :, k])
                                              for k in range(3)])
        finally:
            BlockList.of = real_of
        assert got == 0 and store.lookup(keys) == 0


def test_delete_finds_the_runs_of_its_keys_in_one_lookup(tmp_path):
    """delete() found the runs of its keys with a Python call of
    index.locate per key under the store's lock (half a second for 100k
    keys: every read and put waited); one vectorised lookup finds the same
    runs: each run holding a key asked for (its newest copy: not an older
    run a newer one took the key from), the key 0 (stored under a stand-in),
    keys asked twice, keys stored nowhere."""
    with KVStore.open([_store(tmp_path)]) as store:
        runs = [run_keys(i, 3) for i in range(6)]
        runs[5] = [bytes(16)] + runs[5][1:]               # the key 0
        for keys in runs:
            store.put_run(keys, run_data(keys))
        newer = run_keys(90, 1) + runs[1][1:2]           # takes runs[1]'s second key
        store.put_run(newer, run_data(newer))
        asked = (runs[0][2:] + runs[1][1:2] + [0] + runs[3] + runs[3][:1]
                 + run_keys(99, 2))
        with store._lock:
            want = {hit[0].run_id for k in normalize_keys(asked)
                    if (hit := store.index.locate(k)) is not None}
        assert len(want) == 4                            # runs 0, 3, 5 and the newer one
        before = set(store.index.runs)
        looked_up = []
        real = store.index.locate
        store.index.locate = lambda key: (looked_up.append(key), real(key))[1]
        try:
            removed = store.delete(asked)
        finally:
            del store.index.locate
        assert set(store.index.runs) == before - want
        assert removed == 3 + 3 + 3 + 2                  # runs[1] keeps its other keys
        assert store.lookup(runs[1][:1]) == 1 and store.lookup(runs[2]) == 3
        assert store.lookup(runs[1][1:2]) == 0
        assert looked_up == [], "delete() called index.locate once per key"


def test_a_long_put_that_fails_part_way_keeps_its_earlier_pieces(tmp_path):
    """A run longer than a region is put as several runs (pieces), each
    published as it is written: a device error in a later piece raises, and
    the pieces before it stay stored and readable (put_run's docstring and
    README say so); putting the run again stores it whole."""
    from kvblock.errors import IOFailedError

    with KVStore.open([_store(tmp_path)]) as store:
        m = store.max_run_blocks
        keys = run_keys(7, 2 * m + 1)
        real, calls = store._write_piece, []

        def second_fails(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise IOFailedError("injected EIO", path=store.io.devices[0].path,
                                    errno=5, offset=0)
            return real(*args, **kwargs)
        store._write_piece = second_fails
        try:
            with pytest.raises(IOFailedError):
                store.put_run(keys, run_data(keys))
        finally:
            del store._write_piece
        assert store.lookup(keys) == m
        whole = run_data(keys).reshape(GEOM.num_layers, GEOM.head_groups, len(keys), -1)
        assert np.array_equal(_read(store, keys[:m]), whole[:, :, :m].reshape(-1))
        assert store.put_run(keys, run_data(keys)) == 2 * m + 1    # the retry
        assert store.lookup(keys) == 2 * m + 1
