"""I/Os a broken io_uring could not wait for (IOFailedError.in_flight): a
write may still land on the space it was going to, a read in its buffer,
while this process lives.  The store must not hand that space (or a buffer
of its own) to anything else meanwhile."""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import os

import numpy as np
import pytest

from kvblock import KVStore
from kvblock.errors import DeviceBusyError, IOFailedError, KVBlockError
from kvblock.io import native
from kvblock.devices import Device
from kvblock.io import IOBatch, open_engine
from kvblock.io.engine import OP_READ, OP_WRITE
from kvblock.memory import HostBuffer, aligned
from kvblock.memory.spares import STEP, SpareBuffers
from kvblock.store import storeio
from tests.store.workload import GEOM, REGION, run_data, run_keys, small_store


class _LeftInFlight:
    """kvb_ring_run on a ring that broke under the first batch of ``op``
    once armed, its drain unable to wait for I/O 0 (taken by the kernel,
    its slot never written); the rest ECANCELED.  ``left``: (device,
    offset, length, address) of each I/O so left; ``seen``: (address,
    length) of every I/O of ``op`` run."""

    def __init__(self, real, op, at=None):
        self.real, self.op, self.left, self.armed, self.seen = real, op, [], True, []
        self.at = at       # (lo, hi): only a batch whose first I/O starts there

    def __getattr__(self, name):
        return getattr(self.real, name)

    def kvb_ring_run(self, handle, op, n, addrs, devs, offsets, lens, qd, results, lat, h):
        if op == self.op:
            self.seen += [(int(addrs[i]), int(lens[i])) for i in range(n)]
        if op != self.op or not self.armed or \
                (self.at is not None and not self.at[0] <= offsets[0] < self.at[1]):
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
    monkeypatch.setattr(storeio, "_LATE_DATA_WRITES", {}, raising=False)
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
    # Closed, the store's pin is gone: another open in this process would
    # hand the region out again while the write may still land; refused,
    # naming the device, the write and the fix.  Read-only opens still work.
    monkeypatch.setattr(native, "lib", lambda: ring.real)
    with pytest.raises(DeviceBusyError) as e:
        KVStore.open([path]).close()
    said = str(e.value)
    assert e.value.path == path and f"a data write in region {region}" in said and \
        "restart the process" in said, said
    with KVStore.open([path], readonly=True) as store:
        assert store.lookup(run_keys(3 * regions.count - 1, n)) == n


# --- reads left in flight into buffers kvblock owns ---------------------------------------

@pytest.fixture
def late_reads(monkeypatch):
    """The memory kept for reads left in flight, this test's only (the
    mappings it keeps go at its end, not the process's)."""
    monkeypatch.setattr(aligned, "_LATE", [], raising=False)
    monkeypatch.setattr(aligned, "_KEPT", [], raising=False)


def _mapped(address: int, nbytes: int) -> bool:
    """Whether [address, address + nbytes) lies in one mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address and address + nbytes <= hi:
                return True
    return False


def _land(address: int, nbytes: int) -> None:
    """The late read lands (only where it is still mapped: else the test
    would crash, as the kernel would write into whatever is mapped there)."""
    assert _mapped(address, nbytes), f"0x{address:x} was unmapped under a read in flight"
    ctypes.memset(address, 0xA5, nbytes)


def _left_of(ring, op=OP_READ):
    (_, _, length, address), = ring.left
    return address, length


def _reused(ring, address: int, length: int) -> list:
    return [s for s in ring.seen if s[0] < address + length and address < s[0] + s[1]]


def test_a_read_left_in_flight_keeps_the_engines_staging_buffer(
        file_target, monkeypatch, caplog, late_reads):
    """A read into an unaligned address goes through the engine's staging
    buffer (one per thread): a read there that a broken io_uring could not
    wait for may still land in it, but the thread's next read was staged
    in the same memory (and the engine's close() unmapped it): the late
    read's bytes were copied out to the caller as the next read's.  The
    buffer is kept mapped and out of use while the process lives (logged)."""
    MIB = 1 << 20
    path = file_target(8 * MIB)
    data = np.random.default_rng(1).integers(0, 256, MIB, dtype=np.uint8)
    with open(path, "r+b") as f:
        f.write(data.tobytes())
    ring = _LeftInFlight(native.lib(), OP_READ)
    with Device(path) as dev, HostBuffer(2 * MIB) as raw:
        eng = open_engine([dev], "uring")
        try:
            view = raw.array[1:1 + MIB]           # not block-aligned: staged
            monkeypatch.setattr(native, "lib", lambda: ring)
            with caplog.at_level(logging.WARNING, logger="kvblock.memory"):
                with pytest.raises(IOFailedError) as e:
                    eng.read_into(0, 0, view)
            assert e.value.in_flight == 1, str(e.value)
            address, length = _left_of(ring)
            assert not (raw.address <= address < raw.address + raw.nbytes)   # the staging
            said = [r.getMessage() for r in caplog.records if "kept mapped" in r.getMessage()]
            assert len(said) == 1 and path in said[0] and "offset 0" in said[0], said
            ring.seen.clear()
            eng.read_into(0, 0, view)
            assert np.array_equal(view, data)
            assert not _reused(ring, address, length), "the next read was staged there"
            _land(address, length)                # lands now: the bytes read stay
            assert np.array_equal(view, data)
        finally:
            eng.close()
        gc.collect()
        _land(address, length)                    # and after the engine's close


def test_a_read_left_in_flight_keeps_the_stores_staging_buffer(tmp_path, monkeypatch,
                                                               late_reads):
    """A get into memory that is not the run's image reads into the
    thread's staging buffer (StagingBuffers): one a broken ring left a
    read in flight in was handed to the next get (the late read landing
    before its copy out gave the caller wrong bytes wherever no checksum
    is checked), and the store's close() unmapped it."""
    path = small_store(tmp_path / "store.img")
    keys = run_keys(0, 4)
    with KVStore.open([path], engine="uring", verify="never") as store:
        assert store.put_run(keys, run_data(keys)) == 4
        ring = _LeftInFlight(native.lib(), OP_READ)
        monkeypatch.setattr(native, "lib", lambda: ring)
        out = np.zeros(run_data(keys).size + 1, np.uint8)[1:]     # not aligned: staged
        with pytest.raises(IOFailedError) as e:
            store.get_run(keys, out)
        assert e.value.in_flight == 1, str(e.value)
        address, length = _left_of(ring)
        ring.seen.clear()
        assert store.get_run(keys, out) == 4 and np.array_equal(out, run_data(keys))
        assert not _reused(ring, address, length), "the next get was staged there"
        _land(address, length)
        assert store.get_run(keys, out) == 4 and np.array_equal(out, run_data(keys))
    gc.collect()
    _land(address, length)


def test_a_spare_buffer_a_read_was_left_in_flight_in_is_not_taken_again(
        file_target, monkeypatch, late_reads):
    """A load's unit buffers go back to the store's SpareBuffers when it
    ends, failed or not: one a read was left in flight in was handed to
    the next load (its late bytes landing among that load's), and freed
    when the spares were closed.  Not kept now, nor unmapped; a buffer
    dropped without close() (a load without spares) stays mapped too."""
    path = file_target(8 * STEP)
    ring = _LeftInFlight(native.lib(), OP_READ)
    spares = SpareBuffers(64 * STEP)
    with Device(path) as dev, open_engine([dev], "uring") as eng:
        monkeypatch.setattr(native, "lib", lambda: ring)
        buf, loose = spares.take(STEP), HostBuffer(STEP, register=False)
        batch = IOBatch([buf.address, loose.address], 0, [0, STEP], STEP)
        ring.armed = True
        with pytest.raises(IOFailedError) as e:
            eng.read(batch)
        assert e.value.in_flight == 1
        loose_at = loose.address
        ring.left.clear()
        ring.armed = True
        with pytest.raises(IOFailedError) as e:
            eng.read(IOBatch.single(loose.address, 0, 0, STEP))
        spares.give(buf)
        assert spares.take(STEP) is not buf
        del loose
        gc.collect()
        spares.close()
    assert buf.closed
    _land(buf.address, STEP)
    _land(loose_at, STEP)


# --- metadata writes left in flight ----------------------------------------------------

@pytest.mark.parametrize("what", ["journal", "checkpoint"])
def test_a_metadata_write_left_in_flight_closes_the_store_and_refuses_writing_it_again(
        tmp_path, monkeypatch, what):
    """A journal (or checkpoint) write a broken io_uring could not wait for
    may still land.  The store closed (a failed metadata write), but it
    could be opened again at once in the same process: the open's recovery
    writes a checkpoint into a slot and restarts the journal, and its
    later records go where the late write may land (a newer record after
    the journal wraps, a newer checkpoint in the same slot, overwritten by
    the old bytes: acknowledged puts lost, or replayed onto the wrong
    snapshot).  Now no store writes that device again in this process
    (open and format refuse it, naming the device and the fix: restart
    the process); a read-only open, which never writes, still works."""
    monkeypatch.setattr(storeio, "_LATE_WRITES", {}, raising=False)
    path = small_store(tmp_path / "store.img")
    keys = run_keys(0, 4)
    with KVStore.open([path], engine="uring") as store:
        assert store.put_run(keys, run_data(keys)) == 4
        sb = store.sb
        area = ((sb.journal_offset, sb.journal_offset + sb.journal_bytes) if what == "journal"
                else (sb.checkpoint_offset, sb.checkpoint_offset + 2 * sb.checkpoint_bytes))
        ring = _LeftInFlight(native.lib(), OP_WRITE, at=area)
        monkeypatch.setattr(native, "lib", lambda: ring)
        with pytest.raises(KVBlockError) as e:
            if what == "journal":
                store.put_run(run_keys(1, 4), run_data(run_keys(1, 4)))
            else:
                store.checkpoint()
        assert ring.left, "no metadata write was left in flight"
        cause = e.value if isinstance(e.value, IOFailedError) else e.value.__cause__
        assert isinstance(cause, IOFailedError) and cause.in_flight == 1, repr(e.value)
        assert store.closed
    monkeypatch.setattr(native, "lib", lambda: ring.real)
    for again in (lambda: KVStore.open([path]),
                  lambda: KVStore.format([path], GEOM, region_size=REGION,
                                         journal_bytes=256 << 10)):
        with pytest.raises(DeviceBusyError) as e:
            again().close()
        said = str(e.value)
        assert e.value.path == path and path in said and "restart the process" in said, said
        assert f"offset {ring.left[0][1]}" in said, said
    with KVStore.open([path], readonly=True) as store:
        out = np.zeros_like(run_data(keys))
        assert store.get_run(keys, out) == 4 and np.array_equal(out, run_data(keys))


@pytest.mark.parametrize("left_on", ["loop device", "its backing file"])
def test_a_write_left_in_flight_refuses_the_loop_device_and_its_backing_file_alike(
        loop_device, monkeypatch, left_on):
    """A loop device and the file under it are one medium: a write left in
    flight through either lands on the other, so an open through the other
    is refused too (they were told apart by st_rdev vs inode: an open of
    the backing file went ahead after a late write through /dev/loopN)."""
    from types import SimpleNamespace
    from tests.support import loopdev

    monkeypatch.setattr(storeio, "_LATE_WRITES", {}, raising=False)
    monkeypatch.setattr(storeio, "_LATE_DATA_WRITES", {}, raising=False)
    loop = loop_device(4 << 20)
    backing = loopdev.backing_of(loop)
    fds = [os.open(loop, os.O_RDONLY), os.open(backing, os.O_RDONLY)]
    try:
        on_loop, on_file = (SimpleNamespace(fd=fd, path=p) for fd, p in zip(fds, (loop, backing)))
        left, other = (on_loop, on_file) if left_on == "loop device" else (on_file, on_loop)
        storeio.note_late_data_write(left, "a data write in region 3")
        storeio.refuse_late_writes([other])           # (data writes: only when opening)
        with pytest.raises(DeviceBusyError) as e:
            storeio.refuse_late_writes([other], opening=True)
        assert e.value.path == other.path and "a data write in region 3" in str(e.value)
    finally:
        for fd in fds:
            os.close(fd)
