"""A large run is hashed on a helper thread while its data is written: the
range checksums (where the write does not compute them) and the block
digests of its trailer, which is written after the data.  What is stored
must read back verified, whole and in part, and pass fsck --deep; a failed
write publishes nothing and returns only once the hashing is over."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvblock import KVStore, aligned_empty, create_file
from kvblock.errors import IOFailedError
from kvblock.index import normalize_keys
from kvblock.store import writes as writes_mod
from kvblock.store.client import RemoteStore
from kvblock.store.fsck import fsck
from kvblock.store.server import serve_in_background
from tests.store.workload import GEOM, run_data, run_keys

MIB = 1 << 20
N = 64                                   # blocks per run: 512 KiB of data


def _spy(monkeypatch, store):
    """Record (thread name, what) for each digest pass (block digests, with
    or without the range checksums) and each write."""
    events = []
    # block digests alone (a write that hashes its ranges), or with the ranges
    for name in ("block_digests", "block_and_range_digests"):
        def hashing(*a, _real=getattr(writes_mod, name)):
            out = _real(*a)
            events.append((threading.current_thread().name, "digests"))
            return out
        monkeypatch.setattr(writes_mod, name, hashing)
    for name in ("write", "write_hashed"):
        real = getattr(store.io, name)

        def write(batch, *a, _real=real):
            events.append((threading.current_thread().name, int(batch.nbytes),
                           int(batch.offsets.min())))
            return _real(batch, *a)
        monkeypatch.setattr(store.io, name, write)
    return events


def _run_io(store, keys, events):
    """The digest passes and the writes of the run of ``keys`` (not the
    journal's), as (thread, "digests") and (thread, bytes)."""
    first = normalize_keys(keys[:1])[0]
    (run,) = [r for r in store.index.runs.values() if r.keys.startswith(first)]
    _, base = store.regions.address(run.region, run.offset)
    end = base + store.layout(len(keys)).run_bytes
    return [e if e[1] == "digests" else e[:2] for e in events
            if e[1] == "digests" or base <= e[2] < end]


def _check_stored(path, runs):
    """Reopened: every run reads back whole and in part (verified by the
    trailer), and fsck --deep finds nothing."""
    with KVStore.open([path]) as store:
        for keys, data in runs:
            out = np.zeros(len(keys) * GEOM.block_bytes, np.uint8)
            assert store.get_run(keys, out) == len(keys)
            assert np.array_equal(out, data)
            part = np.zeros(2 * GEOM.block_bytes, np.uint8)
            assert store.get_run(keys[30:32], part) == 2
            want = data.reshape(GEOM.ranges, len(keys), -1)[:, 30:32]
            assert np.array_equal(part, want.reshape(-1))
        assert store.stats()["partial_verified_reads"] == len(runs)
        assert fsck(store, deep=True).problems == []


def test_large_runs_are_hashed_on_a_helper_while_their_data_is_written(target, monkeypatch):
    """Staged (an unaligned array), the caller's aligned array as the image,
    blocks in separate buffers: on a loop device and a file.  A mapped tmpfs
    file's writes are copies on this process's cores: there the run is
    hashed first and written in one I/O (the copy hashing the ranges)."""
    monkeypatch.setattr(writes_mod, "OVERLAP_HASH_BYTES", 256 << 10)
    path = target(16 * MIB)
    runs = []
    with KVStore.format([path], GEOM, region_size=2 * MIB) as store:
        events = _spy(monkeypatch, store)
        trailer = store.layout(N).trailer_bytes
        data_bytes = store.layout(N).data_bytes
        for i, how in enumerate(("staged", "image", "blocks")):
            keys = run_keys(i, N)
            data = run_data(keys)
            events.clear()
            if how == "staged":
                raw = np.empty(data.size + 1, np.uint8)
                raw[1:] = data
                assert store.put_run(keys, raw[1:]) == N       # not aligned: staged
            elif how == "image":
                image = aligned_empty(data.size)
                image[:] = data
                assert store.put_run(keys, image) == N
            else:
                blocks = data.reshape(GEOM.ranges, N, -1)
                assert store.put_blocks(keys, [np.ascontiguousarray(blocks[:, k])
                                               for k in range(N)]) == N
            io = _run_io(store, keys, events)
            (hasher, _), = [e for e in io if e[1] == "digests"]
            writes = [e for e in io if e[1] != "digests"]
            me = threading.current_thread().name
            if store.io.engine.mapped_for_writes(0):
                assert io == [(me, "digests"), (me, data_bytes + trailer)], how
            else:
                assert hasher.startswith("kvblock-hash"), how
                assert writes[-1] == (me, trailer), how
                assert sum(n for _, n in writes[:-1]) == data_bytes, how
            runs.append((keys, data))
    _check_stored(path, runs)


def test_small_runs_hash_first_and_write_data_and_trailer_together(file_target, monkeypatch):
    path = file_target(16 * MIB)
    with KVStore.format([path], GEOM, region_size=2 * MIB) as store:
        assert store.layout(N).data_bytes < writes_mod.OVERLAP_HASH_BYTES
        events = _spy(monkeypatch, store)
        keys = run_keys(1, N)
        assert store.put_run(keys, run_data(keys)) == N
        me = threading.current_thread().name
        assert _run_io(store, keys, events) == [(me, "digests"),
                                                (me, store.layout(N).run_bytes)]
    _check_stored(path, [(keys, run_data(keys))])


def test_a_failed_data_write_publishes_nothing_after_the_hashing_ended(file_target,
                                                                       monkeypatch):
    monkeypatch.setattr(writes_mod, "OVERLAP_HASH_BYTES", 256 << 10)
    path = file_target(16 * MIB)
    with KVStore.format([path], GEOM, region_size=2 * MIB) as store:
        hashing_done = threading.Event()
        digests = writes_mod.block_and_range_digests

        def slow_hashing(*a):
            out = digests(*a)
            threading.Event().wait(0.2)          # still hashing when the write fails
            hashing_done.set()
            return out
        monkeypatch.setattr(writes_mod, "block_and_range_digests", slow_hashing)
        real = store.io.write

        def failing(batch):
            raise IOFailedError(f"write of {batch.nbytes} bytes failed: EIO", path, 5, 0,
                                int(batch.nbytes))
        monkeypatch.setattr(store.io, "write", failing)
        keys = run_keys(1, N)
        with pytest.raises(IOFailedError, match="EIO"):
            store.put_run(keys, run_data(keys))
        assert hashing_done.is_set()             # its memory was not let go before
        assert store.lookup(keys) == 0
        monkeypatch.setattr(store.io, "write", real)
        assert store.put_run(keys, run_data(keys)) == N
    _check_stored(path, [(keys, run_data(keys))])


def test_a_rank_of_a_shared_store_hashes_while_it_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(writes_mod, "OVERLAP_HASH_BYTES", 256 << 10)
    path = str(tmp_path / "kv.img")
    create_file(path, 16 * MIB)
    KVStore.format([path], GEOM, region_size=2 * MIB).close()
    sock = str(tmp_path / "kv.sock")
    keys = run_keys(1, N)
    with serve_in_background([path], sock):
        rank = RemoteStore(sock)
        try:
            events = _spy(monkeypatch, rank)
            assert rank.put_run(keys, run_data(keys)) == N
            io = [e[:2] for e in events]     # the commit's journal write is the server's
            assert [e[0] for e in io if e[1] == "digests"][0].startswith("kvblock-hash")
            assert io[-1][1] == rank.layout(N).trailer_bytes
        finally:
            rank.close()
    _check_stored(path, [(keys, run_data(keys))])


def test_a_writer_that_finds_every_helper_busy_hashes_itself(target, monkeypatch):
    """Many writer threads: no queueing behind the helpers; the writer
    hashes, then writes data and trailer in one I/O."""
    monkeypatch.setattr(writes_mod, "OVERLAP_HASH_BYTES", 256 << 10)
    monkeypatch.setattr(writes_mod, "_hash_slots", threading.BoundedSemaphore(1))
    assert writes_mod._hash_slots.acquire(blocking=False)        # the one helper is taken
    path = target(16 * MIB)
    with KVStore.format([path], GEOM, region_size=2 * MIB) as store:
        events = _spy(monkeypatch, store)
        keys = run_keys(1, N)
        image = aligned_empty(N * GEOM.block_bytes)
        image[:] = run_data(keys)
        assert store.put_run(keys, image) == N
        me = threading.current_thread().name
        assert _run_io(store, keys, events) == [(me, "digests"),
                                                (me, store.layout(N).run_bytes)]
    _check_stored(path, [(keys, run_data(keys))])


@pytest.mark.parametrize("together_from, overlapped", [(1 * MIB, True), (2 * MIB, False)],
                         ids=["group-large-enough", "group-too-small"])
def test_runs_put_together_are_hashed_while_their_data_is_written(target, monkeypatch,
                                                                 together_from, overlapped):
    """put_runs of runs that are their own images (LMCache's puts): one
    write of all their data while helpers hash them, one of all their
    trailers after, when their data together (1.5 MiB here) reaches the
    threshold, however small each run (512 KiB); else hashed first and
    written in one call.  One journal commit publishes them."""
    monkeypatch.setattr(writes_mod, "OVERLAP_HASH_BYTES", together_from)
    monkeypatch.setattr(writes_mod, "_hash_slots", threading.BoundedSemaphore(8))  # none busy
    path = target(16 * MIB)
    runs = []
    for i in range(3):
        keys = run_keys(20 + i, N)
        image = aligned_empty(N * GEOM.block_bytes)
        image[:] = run_data(keys)
        runs.append((keys, image))
    with KVStore.format([path], GEOM, region_size=2 * MIB) as store:
        events = _spy(monkeypatch, store)
        assert store.put_runs(runs) == [N] * 3
        me = threading.current_thread().name
        lay = store.layout(N)
        hashers = [e[0] for e in events if e[1] == "digests"]
        writes = [e[:2] for e in events if e[1] != "digests"]
        if store.io.engine.mapped_for_writes(0) or not overlapped:   # hashed first
            assert hashers == [me] * 3 and writes[0] == (me, 3 * lay.run_bytes)
        else:
            assert len(hashers) == 3 and all(h.startswith("kvblock-hash") for h in hashers)
            assert writes[:2] == [(me, 3 * lay.data_bytes), (me, 3 * lay.trailer_bytes)]
    _check_stored(path, runs)


def test_an_interrupted_put_returns_only_once_the_hashing_ended(file_target, monkeypatch):
    """Ctrl-C while the writer waits for its hashing helper (the data written,
    the hashing slower): the put raises KeyboardInterrupt only once the
    helper stopped reading the run's memory (the staging buffer, which
    close() unmaps, or the caller's array), and publishes nothing."""
    monkeypatch.setattr(writes_mod, "OVERLAP_HASH_BYTES", 256 << 10)
    monkeypatch.setattr(writes_mod, "_hash_slots", threading.BoundedSemaphore(8))  # none busy
    path = file_target(16 * MIB)
    with KVStore.format([path], GEOM, region_size=2 * MIB) as store:
        go, hashed = threading.Event(), threading.Event()
        digests, real_wait = writes_mod.block_and_range_digests, writes_mod.wait

        def slow_hashing(*a):
            assert go.wait(20)                   # still hashing when Ctrl-C comes
            out = digests(*a)
            hashed.set()
            return out
        waits = []

        def interrupted(futures):
            waits.append(len(futures))
            if len(waits) == 1:
                raise KeyboardInterrupt
            go.set()
            return real_wait(futures)
        monkeypatch.setattr(writes_mod, "block_and_range_digests", slow_hashing)
        monkeypatch.setattr(writes_mod, "wait", interrupted)
        keys = run_keys(1, N)
        try:
            with pytest.raises(KeyboardInterrupt):
                store.put_run(keys, run_data(keys))
            assert hashed.is_set()               # the helper was done with the memory
        finally:
            go.set()
        assert store.lookup(keys) == 0
        monkeypatch.setattr(writes_mod, "block_and_range_digests", digests)
        monkeypatch.setattr(writes_mod, "wait", real_wait)
        assert store.put_run(keys, run_data(keys)) == N
    _check_stored(path, [(keys, run_data(keys))])


def test_a_forked_child_hashes_its_large_runs(file_target, monkeypatch):
    """README: a forked child opens the store again.  Its large puts hash on
    the helper threads, whose pool (and free-slot count) the child copied
    from a parent that had used them: the pool's threads are the parent's,
    so a run handed to it was never hashed and the child's put waited for
    good.  The child's helpers are its own; the parent's go on working."""
    from tests.support.servers import exit_code_in_child_while_held

    monkeypatch.setattr(writes_mod, "OVERLAP_HASH_BYTES", 256 << 10)
    path = file_target(16 * MIB)
    runs = [(run_keys(i, N), run_data(run_keys(i, N))) for i in range(3)]
    with KVStore.format([path], GEOM, region_size=2 * MIB) as store:
        assert store.put_run(*runs[0]) == N          # the helpers run in the parent
        assert writes_mod._hashers is not None

    def child():
        with KVStore.open([path]) as store:
            return 0 if store.put_run(*runs[1]) == N else 1
    # a helper busy at the fork: its slot is the parent's
    assert exit_code_in_child_while_held(writes_mod._hash_slots, child, timeout=20) == 0
    with KVStore.open([path]) as store:              # the parent's helpers still work
        assert store.put_run(*runs[2]) == N
    _check_stored(path, runs)
