"""KVStore.get_runs: several get_run requests in one call.  Requests for part
of a stored run are read in one engine batch and checked against their
runs' trailers together; every answer equals get_run's, and a damaged
block or a device error fails only its own request."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.errors import ConfigError, IOFailedError
from kvblock.index import normalize_keys
from kvblock.layout.geometry import Geometry
from tests.store.test_partial_verify import _flip
from tests.store.workload import GEOM, run_data, run_keys
from tests.support.faults import BadSectors

MIB = 1 << 20
N = 32
# One 16 KiB block per (layer, group), as the vLLM tier stores slots: a
# window of whole blocks is exactly the blocks, read straight into place.
SLOTS = Geometry(num_layers=1, num_kv_heads=1, head_dim=16 << 10, dtype="uint8",
                 block_tokens=1, kv_parts=1, head_groups=1)


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + 4096, np.uint8)
    shift = (-raw.ctypes.data) % 4096
    return raw[shift:shift + nbytes]


def _blocks(data, geom, first, count):
    a = data.reshape(geom.num_layers, geom.head_groups, -1, geom.group_block_bytes)
    return np.ascontiguousarray(a[:, :, first:first + count]).reshape(-1)


@pytest.fixture
def filled(target):
    """A store holding runs 0..3 of N blocks (SLOTS geometry), and their data."""
    def make(geom=SLOTS, **options):
        store = KVStore.format([target(64 * MIB)], geom, region_size=4 * MIB, **options)
        keys = [run_keys(i, N) for i in range(4)]
        data = [run_data(k, geom) for k in keys]
        for k, d in zip(keys, data):
            assert store.put_run(k, d) == N
        return store, keys, data
    return make


def _run(store, key):
    """The stored run that holds ``key``."""
    return store.index.segments(normalize_keys([key]))[0][0]


def _bad_sectors(store, key, blocks=N):
    """EIO from now on under the first ``blocks`` blocks (default: all N)
    of the stored run that holds ``key``: (that run, the BadSectors)."""
    run = _run(store, key)
    bad = BadSectors()
    bad.add(*store.regions.address(run.region, run.offset), store.geometry.block_bytes * blocks)
    bad.install(store)
    return run, bad


def _requests(keys):
    """(keys, [(run, first, count), ...] they hold) per request."""
    return [
        (keys[0][10:12], [(0, 10, 2)]),                    # part of a run
        (keys[1][0:3], [(1, 0, 3)]),                       # its first blocks
        (keys[2], [(2, 0, N)]),                            # a whole run
        ([b"nobody-stored-this"], []),                     # a miss
        (keys[3][30:] + keys[0][:2], [(3, 30, 2), (0, 0, 2)]),   # two runs
        (keys[1][5:7] + [b"missing"] + keys[1][7:8], [(1, 5, 2)]),   # a gap ends it
    ]


def test_answers_as_get_run_and_reads_parts_of_runs_together(filled, monkeypatch):
    store, keys, data = filled()
    geom = store.geometry
    together = []
    real = KVStore._read_blocks_together
    monkeypatch.setattr(KVStore, "_read_blocks_together",
                        lambda self, reads, *a: (together.append([r[0].run_id for r in reads]),
                                                 real(self, reads, *a))[1])
    with store:
        reqs = _requests(keys)
        outs = [_aligned(len(k) * geom.block_bytes) for k, _ in reqs]
        before = store.stats()
        counts = store.get_runs([(k, o) for (k, _), o in zip(reqs, outs)])
        after = store.stats()
        assert counts == [sum(c for _, _, c in held) for _, held in reqs]
        for out, (_, held) in zip(outs, reqs):
            want = [_blocks(data[r], geom, first, c) for r, first, c in held]
            got = out[:sum(c for _, _, c in held) * geom.block_bytes]
            assert np.array_equal(got, np.concatenate(want) if want else got)
        # the three single-run parts in one batch, whatever else read on its own
        run_of = {r: _run(store, keys[r][0]).run_id for r in range(4)}
        assert [run_of[0], run_of[1], run_of[1]] in together
        assert after["miss_gets"] - before["miss_gets"] == 1
        assert after["get_blocks"] - before["get_blocks"] == sum(counts)
        assert after["checksum_failures"] == 0
        # the same answers, one get_run at a time
        for (k, _), out, count in zip(reqs, outs, counts):
            alone = _aligned(out.nbytes)
            assert store.get_run(k, alone) == count
            n = count * geom.block_bytes
            assert np.array_equal(alone[:n], out[:n])


@pytest.mark.parametrize("geom, verify", [(GEOM, "always"), (SLOTS, "never")],
                         ids=["2k-blocks", "unverified"])
def test_requests_that_cannot_go_together_read_as_get_run(filled, monkeypatch, geom, verify):
    """Windows wider than their blocks (2 KiB blocks in 4 KiB windows), or
    reads without verification, are read one request at a time."""
    store, keys, data = filled(geom, verify=verify)
    monkeypatch.setattr(KVStore, "_read_blocks_together",
                        lambda self, reads, *a: pytest.fail("read together"))
    with store:
        reqs = _requests(keys)
        outs = [np.zeros(len(k) * geom.block_bytes, np.uint8) for k, _ in reqs]
        counts = store.get_runs([(k, o) for (k, _), o in zip(reqs, outs)])
        assert counts == [sum(c for _, _, c in held) for _, held in reqs]
        for out, (k, held) in zip(outs, reqs):
            got = out.reshape(geom.num_layers, geom.head_groups, len(k), geom.group_block_bytes)
            at = 0
            for r, first, c in held:
                assert np.array_equal(np.ascontiguousarray(got[:, :, at:at + c]).reshape(-1),
                                      _blocks(data[r], geom, first, c))
                at += c


@pytest.mark.parametrize("where", ["block", "trailer"])
def test_a_damaged_block_or_trailer_fails_only_its_request(filled, where):
    store, keys, data = filled()
    geom = store.geometry
    with store:
        run = _run(store, keys[0][0])
        lay = store.layout(N)
        _flip(store, run, 11 * geom.group_block_bytes + 5 if where == "block"
              else lay.data_bytes + 11 * 8)
        outs = [_aligned(2 * geom.block_bytes) for _ in range(2)]
        assert store.get_runs([(keys[0][10:12], outs[0]), (keys[1][3:5], outs[1])]) == [0, 2]
        assert np.array_equal(outs[1], _blocks(data[1], geom, 3, 2))
        assert store.stats()["checksum_failures"] == 1
        assert store.get_run(keys[0][:1], _aligned(geom.block_bytes)) == 0   # dropped


def test_a_device_error_fails_its_request_and_drops_the_run_it_hit(filled):
    """EIO under one request's blocks: that request gets 0 and its run is
    dropped (it would stay a hit that no read returns); the request read in
    the same batch gets its blocks."""
    store, keys, data = filled()
    geom = store.geometry
    with store:
        _, bad = _bad_sectors(store, keys[2][0])
        outs = [_aligned(2 * geom.block_bytes) for _ in range(3)]
        assert store.get_runs([(keys[0][4:6], outs[0]), (keys[2][4:6], outs[1]),
                               (keys[1][8:10], outs[2])]) == [2, 0, 2]
        assert bad.reads_failed >= 1 and store.stats()["read_errors"] >= 1
        assert np.array_equal(outs[0], _blocks(data[0], geom, 4, 2))
        assert np.array_equal(outs[2], _blocks(data[1], geom, 8, 2))
        assert [store.lookup(k) for k in keys] == [N, N, 0, N]
        # a whole run read on its own path meets it the same way
        run = _run(store, keys[3][0])
        bad.add(*store.regions.address(run.region, run.offset), geom.block_bytes)
        assert store.get_runs([(keys[3], _aligned(N * geom.block_bytes))]) == [0]
        assert store.lookup(keys[3]) == 0
        assert int(store.regions.pins.sum()) == 0     # nothing stays pinned


@pytest.mark.parametrize("fault", [None, "checksum", "eio"])
def test_whole_runs_are_read_in_one_engine_call_and_fail_alone(filled, monkeypatch, fault):
    """Requests that are a whole run each go to the devices in one batch;
    a run that fails its checksums or meets EIO fails its request only."""
    store, keys, data = filled()
    geom = store.geometry
    calls = []
    real = KVStore._read_whole_runs
    monkeypatch.setattr(KVStore, "_read_whole_runs",
                        lambda self, parts, *a: (calls.append(len(parts)), real(self, parts, *a))[1])
    with store:
        if fault == "checksum":
            _flip(store, _run(store, keys[1][0]), 7 * geom.group_block_bytes)
        elif fault == "eio":
            _bad_sectors(store, keys[1][0], 1)
        outs = [_aligned(N * geom.block_bytes) for _ in range(3)]
        counts = store.get_runs([(keys[r], outs[r]) for r in range(3)])
        assert calls[0] == 3
        assert counts == ([N, N, N] if fault is None else [N, 0, N])
        for r in range(3):
            if counts[r]:
                assert np.array_equal(outs[r], data[r]), r
        assert store.lookup(keys[1]) == (N if fault is None else 0)
        assert int(store.regions.pins.sum()) == 0


def test_a_bad_destination_is_refused_before_anything_is_read(filled):
    store, keys, _ = filled()
    with store:
        good = _aligned(2 * store.geometry.block_bytes)
        with pytest.raises(ConfigError, match="get_runs: out must be .* 2 blocks"):
            store.get_runs([(keys[0][:2], good), (keys[1][:2], good[:-1])])
        assert int(store.regions.pins.sum()) == 0
        assert store.get_runs([]) == []


def test_a_request_that_is_not_a_keys_and_out_pair_is_a_config_error(filled):
    """As put_runs says of its runs: a request must be a (keys, out) pair;
    one that is not (a third item, a bare array) is a ConfigError naming
    it, nothing pinned, not a bare unpacking error."""
    store, keys, _ = filled()
    with store:
        good = _aligned(2 * store.geometry.block_bytes)
        for bad in ([(keys[0][:2], good), (keys[1][:2], good, 0)],
                    [(keys[0][:2], good), good]):
            with pytest.raises(ConfigError, match=r"get_runs: request 1 must be a \(keys, out\)"):
                store.get_runs(bad)
        assert int(store.regions.pins.sum()) == 0


def test_sub_sector_blocks_whose_windows_are_exactly_them_read_back(filled):
    """2 KiB blocks whose 4 KiB windows hold exactly them (an even first
    block and count) into aligned memory: the windows go straight into
    place, never a 2 KiB I/O per block, not even on a store file on /dev/shm
    (whose engine checks alignment like any other, and which reads through
    the engine until its mapping is ready).  Found by the model test
    (tests/store/test_store_model.py): this raised AlignmentError there."""
    store, keys, data = filled(GEOM)
    with store:
        for first, count in [(2, 2), (4, 8), (0, 4)]:
            want = _blocks(data[0], GEOM, first, count)
            out = _aligned(count * GEOM.block_bytes)
            assert store.get_run(keys[0][first:first + count], out) == count
            assert np.array_equal(out, want)
            outs = [_aligned(count * GEOM.block_bytes) for _ in range(2)]
            assert store.get_runs([(keys[0][first:first + count], outs[0]),
                                   (keys[1][first:first + count], outs[1])]) == [count, count]
            assert np.array_equal(outs[0], want)
            assert np.array_equal(outs[1], _blocks(data[1], GEOM, first, count))


def test_with_a_host_tier_a_device_error_fails_only_its_request(filled):
    """A store with a DRAM tier reads each request as get_run does; an EIO
    under one request still fails only that request (count 0, its run
    dropped), never the whole call."""
    store, keys, data = filled(host_cache_bytes=4 * MIB)
    geom = store.geometry
    with store:
        store.host.clear()                 # every block read from the device
        _bad_sectors(store, keys[2][0])
        outs = [_aligned(2 * geom.block_bytes) for _ in range(3)]
        assert store.get_runs([(keys[0][4:6], outs[0]), (keys[2][4:6], outs[1]),
                               (keys[1][8:10], outs[2])]) == [2, 0, 2]
        assert np.array_equal(outs[0], _blocks(data[0], geom, 4, 2))
        assert np.array_equal(outs[2], _blocks(data[1], geom, 8, 2))
        assert store.stats()["read_errors"] >= 1
        assert [store.lookup(k) for k in keys] == [N, N, 0, N]
        assert int(store.regions.pins.sum()) == 0


def test_requests_sharing_a_damaged_run_count_one_failure(filled):
    """Two requests of one get_runs call read the same damaged run: both
    fail, the run is dropped once and counted once (it counted once per
    request: two failures for one damaged range)."""
    store, keys, data = filled()
    geom = store.geometry
    with store:
        run = _run(store, keys[0][0])
        _flip(store, run, 11 * geom.group_block_bytes + 5)
        outs = [_aligned(2 * geom.block_bytes) for _ in range(3)]
        assert store.get_runs([(keys[0][10:12], outs[0]), (keys[0][11:13], outs[1]),
                               (keys[1][3:5], outs[2])]) == [0, 0, 2]
        assert store.stats()["checksum_failures"] == 1
        assert store.counters["deleted_runs"] == 0 and store.lookup(keys[0]) == 0


def test_a_damaged_run_past_a_requests_first_run_ends_its_count_there(filled):
    """A request over two runs whose second run is damaged: its count is the
    first run's blocks, read and verified, as get_run's (not 0: README and
    the docstring said a damaged block fails its request with count 0); an
    EIO there fails the whole request (count 0).  Either way the other
    request gets its blocks and only the run hit is dropped."""
    store, keys, data = filled()
    geom = store.geometry
    with store:
        _flip(store, _run(store, keys[0][0]), 1 * geom.group_block_bytes + 5)
        spanning = keys[3][30:] + keys[0][:2]
        out, other = _aligned(4 * geom.block_bytes), _aligned(2 * geom.block_bytes)
        assert store.get_runs([(spanning, out), (keys[1][3:5], other)]) == [2, 2]
        assert np.array_equal(out[:2 * geom.block_bytes], _blocks(data[3], geom, 30, 2))
        assert np.array_equal(other, _blocks(data[1], geom, 3, 2))
        assert store.stats()["checksum_failures"] == 1
        assert [store.lookup(k) for k in keys] == [0, N, N, N]
        _bad_sectors(store, keys[2][0])
        spanning = keys[1][30:] + keys[2][:2]
        assert store.get_runs([(spanning, out), (keys[3][3:5], other)]) == [0, 2]
        assert np.array_equal(other, _blocks(data[3], geom, 3, 2))
        assert [store.lookup(k) for k in keys] == [0, N, 0, N]
        assert int(store.regions.pins.sum()) == 0


def test_a_damaged_run_whose_drop_failed_is_dropped_by_the_next_read(filled):
    """The read that met a damaged run could not drop it (a served store's
    server gone at that moment: the drop is logged and the read is a miss).
    The reader had still recorded the run as counted *and dropped*, so every
    later read met it, skipped it as handled, and left it indexed: a hit no
    read could return, for good.  The next read that meets it drops it (and
    counts the failure no second time)."""
    from kvblock.errors import StoreClosedError

    store, keys, data = filled()
    geom = store.geometry
    with store:
        run = _run(store, keys[0][0])
        _flip(store, run, 11 * geom.group_block_bytes + 5)
        real, calls = store._drop_runs, []

        def gone_once(runs, *args, **kwargs):
            calls.append([r.run_id for r in runs])
            if len(calls) == 1:
                raise StoreClosedError("the store server went away")
            return real(runs, *args, **kwargs)
        store._drop_runs = gone_once
        out = _aligned(N * geom.block_bytes)
        assert store.get_run(keys[0], out) == 0
        assert store.lookup(keys[0]) == N                  # its drop failed: still indexed
        assert store.get_run(keys[0], out) == 0
        assert store.lookup(keys[0]) == 0, "the run stayed indexed, a hit no read returns"
        assert store.stats()["checksum_failures"] == 1


def test_requests_sharing_a_whole_run_that_meets_eio_count_one_read_error(filled):
    """Two requests of one get_runs call read the same whole run, and it
    meets EIO: each request was read again alone, each met the error, and
    each ran the read-error handling: read_errors counted 2 for one
    unreadable run, and the run dropped twice (as a checksum failure is
    deduplicated, it is counted and dropped once).  Both requests fail; the
    other request gets its run."""
    store, keys, data = filled()
    geom = store.geometry
    with store:
        run, _ = _bad_sectors(store, keys[1][0], 1)
        real, drops = store._drop_runs, []
        store._drop_runs = lambda runs, *a, **k: (drops.append([r.run_id for r in runs]),
                                                  real(runs, *a, **k))[1]
        outs = [_aligned(N * geom.block_bytes) for _ in range(3)]
        counts = store.get_runs([(keys[1], outs[0]), (keys[0], outs[1]), (keys[1], outs[2])])
        assert counts == [0, N, 0]
        assert np.array_equal(outs[1], data[0])
        assert store.stats()["read_errors"] == 1
        assert drops == [[run.run_id]]
        assert [store.lookup(k) for k in keys] == [N, 0, N, N]
        assert int(store.regions.pins.sum()) == 0


def test_requests_for_parts_of_one_run_that_meets_eio_count_one_read_error(filled):
    """As for whole runs: two requests for blocks of one run, read together,
    meet EIO there; each was read again alone and each ran the read-error
    handling (read_errors 2, the run dropped twice).  Counted and dropped
    once; the other request gets its blocks."""
    store, keys, data = filled()
    geom = store.geometry
    with store:
        run, _ = _bad_sectors(store, keys[2][0])
        real, drops = store._drop_runs, []
        store._drop_runs = lambda runs, *a, **k: (drops.append([r.run_id for r in runs]),
                                                  real(runs, *a, **k))[1]
        outs = [_aligned(2 * geom.block_bytes) for _ in range(3)]
        assert store.get_runs([(keys[2][4:6], outs[0]), (keys[0][4:6], outs[1]),
                               (keys[2][8:10], outs[2])]) == [0, 2, 0]
        assert np.array_equal(outs[1], _blocks(data[0], geom, 4, 2))
        assert store.stats()["read_errors"] == 1
        assert drops == [[run.run_id]]
        assert [store.lookup(k) for k in keys] == [N, N, 0, N]
        assert int(store.regions.pins.sum()) == 0


def test_two_threads_meeting_one_unreadable_run_count_one_read_error(filled):
    """Two get_run calls in two threads read the same run, and it meets
    EIO: the read-error handling was deduplicated within one get_runs
    call only, so each thread counted it (read_errors 2 for one unreadable
    run) and each dropped it (as racing reads meeting one damaged run count
    and drop it once).  Both reads raise the device's error; the run is
    counted and dropped once."""
    store, keys, data = filled()
    geom = store.geometry
    with store:
        run, _ = _bad_sectors(store, keys[1][0], 1)
        real_failed, both = store._read_failed, threading.Barrier(2, timeout=10)

        def after_both_failed(error, runs):
            both.wait()             # each thread met the device error
            real_failed(error, runs)
        store._read_failed = after_both_failed
        real, drops = store._drop_runs, []
        store._drop_runs = lambda runs, *a, **k: (drops.append([r.run_id for r in runs]),
                                                  real(runs, *a, **k))[1]
        raised = []

        def read():
            try:
                store.get_run(keys[1], _aligned(N * geom.block_bytes))
            except IOFailedError as e:
                raised.append(e)
        threads = [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(raised) == 2
        assert store.stats()["read_errors"] == 1
        assert drops == [[run.run_id]]
        assert [store.lookup(k) for k in keys] == [N, 0, N, N]
        assert int(store.regions.pins.sum()) == 0
