"""I/Os a broken io_uring could not wait for (IOFailedError.in_flight): a
write may still land on the space it was going to, a read in its buffer,
while this process lives.  The store must not hand that space (or a buffer
of its own) to anything else meanwhile."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.errors import IOFailedError
from kvblock.io import native
from kvblock.io.engine import OP_WRITE
from tests.store.workload import run_data, run_keys, small_store


class _LeftInFlight:
    """kvb_ring_run on a ring that broke under the first batch of ``op``
    once armed, its drain unable to wait for I/O 0 (taken by the kernel,
    its slot never written); the rest ECANCELED.  ``left``: (device,
    offset, length, address) of each I/O so left."""

    def __init__(self, real, op):
        self.real, self.op, self.left, self.armed = real, op, [], True

    def __getattr__(self, name):
        return getattr(self.real, name)

    def kvb_ring_run(self, handle, op, n, addrs, devs, offsets, lens, qd, results, lat, h):
        if op != self.op or not self.armed:
            return self.real.kvb_ring_run(handle, op, n, addrs, devs, offsets, lens, qd,
                                          results, lat, h)
        self.armed = False
        self.left.append((int(devs[0]), int(offsets[0]), int(lens[0]), int(addrs[0])))
        for i in range(1, n):
            results[i] = -errno.ECANCELED
        return -errno.ENXIO


def _overlaps(a, b) -> bool:
    return a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]


@pytest.mark.parametrize("how", ["put_run", "put_runs"])
def test_a_put_whose_write_a_broken_ring_left_in_flight_never_gets_its_space_reused(
        tmp_path, monkeypatch, caplog, how):
    """A put's write that a broken io_uring could not wait for may still
    land: the put failed (IOFailedError, in_flight 1), its region was
    unpinned, and once eviction came round to it the region was freed and
    written again: the late write landed on a run put there later (read
    back damaged, or another's bytes).  The region stays pinned while the
    process lives (logged once): later puts go round the store and never
    get that space; what they stored reads back whole after the late
    write lands."""
    path = small_store(tmp_path / "store.img")
    with KVStore.open([path], engine="uring") as store:
        assert store.io.engine.name == "uring"
        ring = _LeftInFlight(native.lib(), OP_WRITE)
        monkeypatch.setattr(native, "lib", lambda: ring)
        keys = run_keys(0, 4)
        with caplog.at_level(logging.WARNING, logger="kvblock.store.store"):
            with pytest.raises(IOFailedError) as e:
                if how == "put_run":
                    store.put_run(keys, run_data(keys))
                else:
                    store.put_runs([(keys, run_data(keys)), (run_keys(-1, 2),
                                                             run_data(run_keys(-1, 2)))])
        assert e.value.in_flight == 1, str(e.value)
        (dev, off, length, _), = ring.left
        regions = store.regions
        region = (off - regions.data_offsets[dev]) // regions.size * regions.device_count + dev
        # Runs of a region each, going round the store three times.
        n = store.max_run_blocks
        for i in range(1, 3 * regions.count):
            keys = run_keys(i, n)
            assert store.put_run(keys, run_data(keys)) == n
            for run in store.index.runs.values():
                at = store.regions.address(run.region, run.offset)
                mine = (at[0], at[1], store.layout(run.nblocks).run_bytes)
                assert not _overlaps(mine, (dev, off, length)), \
                    f"run {run.run_id} was given the space a write in flight may land on"
        # said once, naming the region, the device and why
        said = [r.getMessage() for r in caplog.records if "in flight" in r.getMessage()]
        assert len(said) == 1 and f"region {region}" in said[0] and path in said[0], said
        # The late write lands now; every run stored reads back whole.
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xa5" * length, off)
            os.fsync(fd)
        finally:
            os.close(fd)
        found = 0
        for i in range(1, 3 * regions.count):
            keys = run_keys(i, n)
            if store.lookup(keys) == n:
                out = np.zeros_like(run_data(keys))
                assert store.get_run(keys, out) == n and np.array_equal(out, run_data(keys))
                found += 1
        assert found
