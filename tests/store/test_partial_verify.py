"""Reading some blocks of a long run with verification: only those blocks'
windows and the run's block digest trailer are read, and every byte handed
out is still checked (kvblock/format/trailer.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.layout.geometry import Geometry
from kvblock.store.fsck import fsck
from tests.store.workload import GEOM, run_data, run_keys

MIB = 1 << 20
N = 64                       # blocks in the run: 128 KiB per range
# 4 KiB per (layer, group) block: windows start on a block boundary.
WHOLE_PAGES = Geometry(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float16",
                       block_tokens=16, head_groups=1)


def _store(target, geom=GEOM):
    return KVStore.format([target(32 * MIB)], geom, region_size=4 * MIB)


def _path(store) -> str:
    return str(store.io.devices[0].path)


def _flip(store, run, at: int) -> None:
    """Flip a byte ``at`` bytes into ``run`` on its device."""
    dev, base = store.regions.address(run.region, run.offset)
    with open(store.io.devices[dev].path, "r+b") as f:
        f.seek(base + at)
        byte = f.read(1)
        f.seek(base + at)
        f.write(bytes([byte[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


def _blocks(data, geom, first, count):
    """Blocks first..first+count of a put_run array, as get_run returns them."""
    a = data.reshape(geom.num_layers, geom.head_groups, -1, geom.group_block_bytes)
    return np.ascontiguousarray(a[:, :, first:first + count]).reshape(-1)


@pytest.mark.parametrize("geom", [GEOM, WHOLE_PAGES], ids=["2k-blocks", "4k-blocks"])
def test_a_few_blocks_of_a_long_run_read_their_windows_and_the_trailer(target, geom):
    keys = run_keys(1, N)
    data = run_data(keys, geom)
    with _store(target, geom) as store:
        assert store.put_run(keys, data) == N
        lay = store.layout(N)
        for first, count in [(41, 2), (0, 1), (N - 3, 3), (17, 5)]:
            out = np.zeros(count * geom.block_bytes, np.uint8)
            before = store.stats()["bytes_read"]
            assert store.get_run(keys[first:first + count], out) == count
            assert np.array_equal(out, _blocks(data, geom, first, count))
            read = store.stats()["bytes_read"] - before
            # each range's aligned window and the trailer: a small part of the run
            window = -(-(first + count) * geom.group_block_bytes // 4096) * 4096 \
                - first * geom.group_block_bytes // 4096 * 4096
            assert read == geom.ranges * window + lay.trailer_bytes
            assert read < lay.data_bytes // 4
        assert store.stats()["partial_verified_reads"] == 4
        # into separate blocks too
        dst = [np.zeros(geom.block_bytes, np.uint8) for _ in range(2)]
        assert store.get_blocks(keys[30:32], dst) == 2
        for j, b in enumerate(dst):
            assert np.array_equal(b, _blocks(data, geom, 30 + j, 1)), j
        # a read of most of the run reads whole ranges, as before
        out = np.zeros((N - 4) * geom.block_bytes, np.uint8)
        before = store.stats()["bytes_read"]
        assert store.get_run(keys[4:], out) == N - 4
        assert np.array_equal(out, _blocks(data, geom, 4, N - 4))
        assert store.stats()["bytes_read"] - before == lay.data_bytes
        assert store.stats()["checksum_failures"] == 0


def test_damage_outside_the_blocks_read_is_not_theirs_but_a_whole_read_finds_it(target):
    keys = run_keys(2, N)
    data = run_data(keys)
    with _store(target) as store:
        store.put_run(keys, data)
        (run,) = store.index.runs.values()
        lay = store.layout(N)
        _flip(store, run, 3 * lay.range_bytes + 5 * GEOM.group_block_bytes + 7)  # block 5
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys[50:52], out) == 2
        assert np.array_equal(out, _blocks(data, GEOM, 50, 2))
        out = np.zeros(N * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 0          # the whole run: range 3 is bad
        assert store.stats()["checksum_failures"] == 1
        assert store.last_checksum_failure[3] == 3
        assert store.lookup(keys) == 0                # dropped, not served again


@pytest.mark.parametrize("geom", [GEOM, WHOLE_PAGES], ids=["2k-blocks", "4k-blocks"])
@pytest.mark.parametrize("where", ["block", "trailer", "trailer padding"])
def test_damage_in_what_a_partial_read_reads_fails_it(target, where, geom):
    """Through a staging window (2 KiB blocks) and straight into place (4 KiB
    blocks; out of a tmpfs mapping each block is hashed as it is copied)."""
    from kvblock.memory import aligned_empty

    keys = run_keys(3, N)
    data = run_data(keys, geom)
    with _store(target, geom) as store:
        path = _path(store)
        store.put_run(keys, data)
        (run,) = store.index.runs.values()
        lay = store.layout(N)
        at = {"block": 2 * lay.range_bytes + 42 * geom.group_block_bytes + 100,
              "trailer": lay.data_bytes + (2 * N + 42) * 8 + 3,   # block 42's digest
              "trailer padding": lay.run_bytes - 1}[where]
        out = aligned_empty(2 * geom.block_bytes)
        assert store.get_run(keys[41:43], out) == 2               # intact: read, verified
        assert np.array_equal(out, _blocks(data, geom, 41, 2))
        _flip(store, run, at)
        out[:] = 7
        assert store.get_run(keys[41:43], out) == 0
        assert store.stats()["checksum_failures"] == 1
        # the failure names the range (the trailer counts as range `ranges`)
        assert store.last_checksum_failure[3] == (2 if where == "block" else geom.ranges)
        assert store.lookup(keys) == 0
    with KVStore.open([path]) as store:
        assert store.lookup(keys) == 0                # the drop was journaled


def test_fsck_deep_checks_the_trailer_and_each_block_against_it(target):
    keys = run_keys(4, 8)
    with _store(target) as store:
        store.put_run(keys, run_data(keys))
        (run,) = store.index.runs.values()
        assert fsck(store, deep=True).problems == []
        lay = store.layout(8)
        _flip(store, run, lay.data_bytes + 8)         # block 1's digest of range 0
        report = fsck(store, deep=True)
        assert len(report.problems) == 1
        assert "block digest trailer" in report.problems[0]
        assert str(store.io.devices[0].path) in report.problems[0]


def test_an_unverified_read_of_a_few_blocks_reads_just_their_windows(target):
    """verify="never": the aligned window of each range, not the range from
    its start up to the blocks (nor a trailer)."""
    keys = run_keys(5, N)
    data = run_data(keys)
    store = _store(target)
    path = _path(store)
    with store:
        store.put_run(keys, data)
    with KVStore.open([path], verify="never") as store:
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys[50:53], out) == 3
        assert np.array_equal(out, _blocks(data, GEOM, 50, 3))
        # blocks 50..52 of 2 KiB: bytes [100K, 106K) of each range -> [100K, 108K)
        assert store.stats()["bytes_read"] == GEOM.ranges * 8192
        assert store.stats()["partial_verified_reads"] == 0


def test_windows_that_are_exactly_the_blocks_go_straight_into_an_aligned_destination(target):
    """8 KiB blocks, an aligned contiguous destination: the windows are read
    into it (no staging copy) and still verified there."""
    from kvblock.memory import aligned_empty

    keys = run_keys(6, N)
    data = run_data(keys, WHOLE_PAGES)
    with _store(target, WHOLE_PAGES) as store:
        store.put_run(keys, data)
        reads, hashed = [], []
        read, read_hashed = store.io.read, store.io.read_hashed
        store.io.read = lambda b: (reads.append(b), read(b))[1]
        store.io.read_hashed = lambda b, *a: (hashed.append(b), read_hashed(b, *a))[1]
        out = aligned_empty(2 * WHOLE_PAGES.block_bytes)
        assert store.get_run(keys[20:22], out) == 2
        assert np.array_equal(out, _blocks(data, WHOLE_PAGES, 20, 2))
        mapped = store.io.engine.mapped(0)
        (batch,) = hashed if mapped else reads
        assert not (reads if mapped else hashed)
        lo, hi = out.ctypes.data, out.ctypes.data + out.nbytes
        assert all(lo <= a < hi for a in batch.addrs[:-1].tolist())   # the ranges' windows
        assert not lo <= int(batch.addrs[-1]) < hi                     # the trailer: staging
        if mapped:
            # copied out of a mapping: each block its own entry (hashed as it
            # is copied), then the trailer
            gbb = WHOLE_PAGES.group_block_bytes
            assert len(batch) == WHOLE_PAGES.ranges * 2 + 1
            assert batch.lens[:-1].tolist() == [gbb] * (len(batch) - 1)
            assert batch.addrs[:-1].tolist() == [lo + k * gbb for k in range(len(batch) - 1)]
        (run,) = store.index.runs.values()
        lay = store.layout(N)
        _flip(store, run, 2 * lay.range_bytes + 21 * WHOLE_PAGES.group_block_bytes + 9)
        assert store.get_run(keys[20:22], out) == 0
        assert store.stats()["checksum_failures"] == 1


@pytest.mark.parametrize("shape", ["get_run", "get_runs", "host_tier"])
def test_a_partial_read_whose_pins_lapse_counts_no_partial_verified_read(target, monkeypatch,
                                                                         shape):
    """The pins of a read of a few blocks lapse while it reads (a store
    server gone: its client's _unpin says False, the read returns 0 blocks
    and counts lapsed_pin_gets): partial_verified_reads counts reads that
    handed out their blocks, not this one.  Before: counted as the trailer
    check passed, before the pins were looked at.  A read whose pins held
    counts one."""
    keys = run_keys(1, N)
    data = run_data(keys)
    kwargs = {"host_cache_bytes": 4 * MIB} if shape == "host_tier" else {}
    with KVStore.format([target(32 * MIB)], GEOM, region_size=4 * MIB, **kwargs) as store:
        assert store.put_run(keys, data) == N
        if store.host is not None:
            store.host.clear()          # (the put's copies: read from the device)
        real = type(store)._unpin
        lapse = [True]

        def unpin(self, segs):
            held = real(self, segs)
            return held and not lapse[0]

        monkeypatch.setattr(type(store), "_unpin", unpin)
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)

        def read():
            if shape == "get_runs":
                return store.get_runs([(keys[41:43], out)])[0]
            return store.get_run(keys[41:43], out)

        before = store.stats()
        assert read() == 0
        after = store.stats()
        assert after["lapsed_pin_gets"] == before["lapsed_pin_gets"] + 1
        assert after["partial_verified_reads"] == before["partial_verified_reads"]
        assert after["bytes_read"] == before["bytes_read"]
        lapse[0] = False
        assert read() == 2
        assert np.array_equal(out, _blocks(data, GEOM, 41, 2))
        assert store.stats()["partial_verified_reads"] == before["partial_verified_reads"] + 1
