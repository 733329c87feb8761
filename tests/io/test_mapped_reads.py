"""Reads through shared mappings of store files on tmpfs (kvblock/io/mapped.py):
which devices qualify, bytes and digests equal to what a kernel read gives,
coherence with writes, errors, a close that waits for readers, prefaulting,
and a store that never punches holes in a mapped device."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import threading
import time

import numpy as np
import pytest

from kvblock import KVStore, create_file
from kvblock.devices import Device
from kvblock.errors import ConfigError, IOFailedError
from kvblock.format.checksum import data_checksum
from kvblock.io import IOBatch, native, open_engine
from kvblock.io.mapped import TMPFS_MAGIC, MappedDevices, loop_over_tmpfs, mappable
from kvblock.memory import HostBuffer
from tests.store.workload import GEOM, REGION, run_data, run_keys
from tests.support import loopdev

MIB = 1 << 20
BLOCK = 4096


def _fs_type(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return native.lib().kvb_fs_type(fd)
    finally:
        os.close(fd)


def _filled(path, size, seed=0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    with open(path, "r+b") as f:
        f.write(data.tobytes())
    return data


@pytest.fixture
def mapped_copies(monkeypatch):
    """The ops (OP_READ / OP_WRITE) of every batch copied through a mapping."""
    import kvblock.io.engine as engine_mod

    ops = []
    copy_mapped = engine_mod.IOEngine._copy_mapped
    monkeypatch.setattr(engine_mod.IOEngine, "_copy_mapped",
                        lambda self, op, *a: ops.append(op) or copy_mapped(self, op, *a))
    return ops


def test_dev_shm_is_tmpfs():
    """The suite's tmpfs targets live in /dev/shm: it must be tmpfs for the
    mapped-read tests to mean anything."""
    assert _fs_type("/dev/shm") == TMPFS_MAGIC


def test_which_devices_are_mapped(shm_target, file_target, loop_device, tmp_path, monkeypatch,
                                  caplog):
    shm = shm_target(8 * MIB)
    sparse = os.path.join(os.path.dirname(shm), "sparse.img")
    with open(sparse, "wb") as f:
        f.truncate(8 * MIB)
    on_disk = str(create_file(tmp_path / "disk.img", 8 * MIB))
    assert _fs_type(on_disk) != TMPFS_MAGIC
    loop = loop_device(8 * MIB)     # a block device, even when its file is on tmpfs
    over = loopdev.backing_of(loop)
    assert _fs_type(over) == TMPFS_MAGIC
    with contextlib.ExitStack() as stack:
        disk_loop = stack.enter_context(loopdev.loop_device(8 * MIB, tmp_path))
        devs = [stack.enter_context(Device(p)) for p in (shm, sparse, on_disk, loop, disk_loop)]
        reasons = [mappable(d) for d in devs]
        assert reasons[:3] == [None, "not fully allocated (sparse)", "not on tmpfs"]
        # a loop device over a tmpfs file names the file to give kvblock instead
        assert reasons[3].startswith(f"a loop device over {over} on tmpfs: give kvblock that "
                                     "file instead")
        assert reasons[4] == "not a file"
        assert [loop_over_tmpfs(d) for d in devs] == [None, None, None, over, None]
        caplog.clear()
        with caplog.at_level("INFO", logger="kvblock"), open_engine(devs) as eng:
            assert [eng.mapped(i) for i in range(5)] == [True, False, False, False, False]
        assert [r.getMessage() for r in caplog.records] == [f"kvblock: {loop} is {reasons[3]}"]
        caplog.clear()
        with caplog.at_level("INFO", logger="kvblock"), open_engine(devs[3:4]):
            pass
        assert not caplog.records          # said once per process
        with open_engine(devs, mapped_reads=False) as eng:
            assert not eng.mapped(0)
        monkeypatch.setenv("KVBLOCK_MAPPED_READS", "never")
        with open_engine(devs[:1]) as eng:
            assert not eng.mapped(0)
        monkeypatch.setenv("KVBLOCK_MAPPED_READS", "sometimes")
        with pytest.raises(ConfigError, match="KVBLOCK_MAPPED_READS"):
            open_engine(devs[:1])


def test_reads_equal_the_bytes_and_see_later_writes(engine_name, shm_target):
    path = shm_target(16 * MIB)
    data = _filled(path, 16 * MIB)
    with Device(path) as dev, open_engine([dev], engine_name) as eng:
        assert eng.mapped(0)
        rng = np.random.default_rng(3)
        offsets = rng.permutation(16 * MIB // BLOCK)[:200].astype(np.uint64) * BLOCK
        lens = rng.integers(1, 8, 200).astype(np.uint64) * BLOCK
        lens = np.minimum(lens, np.uint64(16 * MIB) - offsets)
        out = np.zeros(int(lens.sum()) + 1, np.uint8)   # +1: unaligned addresses below
        homes = np.cumsum(lens) - lens + np.uint64(out.ctypes.data + 1)
        res = eng.read(IOBatch(homes, 0, offsets, lens), latency=True)
        assert res.nbytes == int(lens.sum()) and (res.latency_ns >= 0).all()
        at = 1
        for o, n in zip(offsets.tolist(), lens.tolist()):
            assert np.array_equal(out[at:at + n], data[o:o + n])
            at += n
        # a write through the engine is what the next mapped read returns
        with HostBuffer(MIB) as src, HostBuffer(MIB) as dst:
            src.array[:] = 0xA5
            eng.write(IOBatch.single(src.address, 0, 5 * MIB, MIB))
            eng.read(IOBatch.single(dst.address, 0, 5 * MIB, MIB))
            assert (dst.array == 0xA5).all()


def _pread(path, offset, n) -> np.ndarray:
    """The file's bytes as the kernel's read path sees them (no mapping)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return np.frombuffer(os.pread(fd, n, offset), np.uint8)
    finally:
        os.close(fd)


def test_writes_copy_into_the_mapping(engine_name, shm_target, mapped_copies):
    """Writes to a writable mapped device are copies into the mapping, from
    any source alignment; the kernel's read path sees exactly those bytes."""
    import kvblock.io.engine as engine_mod

    copies = mapped_copies
    path = shm_target(16 * MIB)
    before = _filled(path, 16 * MIB, seed=6)
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 3 * MIB + 1, dtype=np.uint8)
    offsets = np.array([0, 5 * MIB, 16 * MIB - 4 * BLOCK, 9 * MIB + BLOCK], np.uint64)
    lens = np.array([MIB, MIB + 8 * BLOCK, 4 * BLOCK, MIB - 12 * BLOCK], np.uint64)
    homes = np.cumsum(lens) - lens + np.uint64(src.ctypes.data + 1)   # unaligned sources
    with Device(path) as dev, open_engine([dev], engine_name) as eng:
        assert eng.mapped(0) and eng.mapped_for_writes(0)
        res = eng.write(IOBatch(homes, 0, offsets, lens), latency=True)
        assert res.nbytes == int(lens.sum()) and (res.latency_ns >= 0).all()
        assert copies == [engine_mod.OP_WRITE]
    want, at = before.copy(), 1
    for o, n in zip(offsets.tolist(), lens.tolist()):
        want[o:o + n] = src[at:at + n]
        at += n
    assert np.array_equal(_pread(path, 0, 16 * MIB), want)


def test_writes_take_the_engine_path_when_asked_or_read_only(shm_target, mapped_copies):
    """mapped_writes=False (store-server clients) and read-only devices map
    for reads only; their writes, if any, go through the kernel."""
    import kvblock.io.engine as engine_mod

    copies = mapped_copies
    path = shm_target(8 * MIB)
    _filled(path, 8 * MIB, seed=8)
    with Device(path) as dev, open_engine([dev], mapped_writes=False) as eng, \
            HostBuffer(MIB) as buf:
        assert eng.mapped(0) and not eng.mapped_for_writes(0)
        buf.array[:] = 0x3C
        eng.write(IOBatch.single(buf.address, 0, 2 * MIB, MIB))
        assert copies == []
        buf.array[:] = 0
        eng.read(IOBatch.single(buf.address, 0, 2 * MIB, MIB))     # mapped read
        assert copies == [engine_mod.OP_READ] and (buf.array == 0x3C).all()
    assert (_pread(path, 2 * MIB, MIB) == 0x3C).all()
    with Device(path, writable=False) as dev, open_engine([dev]) as eng:
        assert eng.mapped(0) and not eng.mapped_for_writes(0)


@pytest.mark.parametrize("where", ["shm", "disk"])
def test_hashed_writes_return_the_sources_checksums(engine_name, shm_target, file_target,
                                                    where, mapped_copies):
    """write_hashed: each stream's digest equals data_checksum of its source
    bytes, and the bytes land; into a mapping the copy hashes as it goes
    (one native call), elsewhere the sources are hashed, then written."""
    import kvblock.io.engine as engine_mod

    copies = mapped_copies
    path = shm_target(16 * MIB) if where == "shm" else file_target(16 * MIB)
    rng = np.random.default_rng(11)
    lens = [3 * MIB + 8 * BLOCK, BLOCK, 2 * BLOCK, 2 * MIB, 7 * BLOCK]
    offsets = [8 * MIB, 0, 4 * MIB, MIB, 15 * MIB]
    streams = [0, 1, 1, 2, 2]
    seeds = [7, 2**64 - 1, 12345]
    with Device(path) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(sum(lens)) as src:
        src.array[:] = rng.integers(0, 256, src.array.size, dtype=np.uint8)
        addrs = np.cumsum([0] + lens[:-1]).astype(np.uint64) + np.uint64(src.address)
        got = eng.write_hashed(IOBatch(addrs, 0, offsets, lens), streams, seeds)
        pieces = np.split(src.array, np.cumsum(lens)[:-1])
        want = [data_checksum(np.concatenate([x for x, t in zip(pieces, streams) if t == s]),
                              seed) for s, seed in enumerate(seeds)]
        assert [int(x) for x in got] == want
        assert copies == ([engine_mod.OP_WRITE] if where == "shm" else [])
        for o, x in zip(offsets, pieces):
            assert np.array_equal(_pread(path, o, x.size), x)
        with pytest.raises(ConfigError, match="write_hashed: streams must count"):
            eng.write_hashed(IOBatch(addrs, 0, offsets, lens), [0, 2, 2, 2, 2], seeds)


def test_a_mapping_that_fails_names_the_device_and_unmaps_the_others(engine_name, shm_target,
                                                                     monkeypatch):
    """mmap failing for one device (ENOMEM: address space or map count
    exhausted) was a bare OSError naming no device, and the mappings already
    made of the devices before it stayed mapped (the engine never opened, so
    nothing closed them).  Now: a DeviceError naming the device and the way
    out, and no mapping left behind."""
    import mmap as mmap_mod

    from kvblock.errors import DeviceError

    paths = [shm_target(4 * MIB), shm_target(4 * MIB)]
    made, real = [], mmap_mod.mmap

    def failing_mmap(fd, length, *args, **kwargs):
        if fd != -1 and made:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        m = real(fd, length, *args, **kwargs)
        if fd != -1:
            made.append(m)
        return m

    with Device(paths[0]) as d0, Device(paths[1]) as d1:
        monkeypatch.setattr(mmap_mod, "mmap", failing_mmap)
        with pytest.raises(DeviceError, match=rf"{paths[1]}: .*ENOMEM.*KVBLOCK_MAPPED_READS=never"):
            open_engine([d0, d1], engine_name)
        monkeypatch.undo()
        assert len(made) == 1 and made[0].closed


def test_out_of_range_write_is_a_typed_error(shm_target):
    path = shm_target(4 * MIB)
    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(2 * BLOCK) as buf:
        assert eng.mapped_for_writes(0)
        with pytest.raises(IOFailedError, match="past the device"):
            eng.write(IOBatch.single(buf.address, 0, 4 * MIB - BLOCK, 2 * BLOCK))


def test_hashed_reads_equal_data_checksum(engine_name, shm_target):
    path = shm_target(32 * MIB)
    data = _filled(path, 32 * MIB, seed=5)
    lens = [3 * MIB + 8 * BLOCK, BLOCK, 2 * BLOCK, 5 * MIB, 7 * BLOCK, MIB]
    offsets = [20 * MIB, 0, 9 * MIB, 4 * MIB, 31 * MIB, 12 * MIB]
    streams = [0, 1, 1, 2, 2, 3]
    seeds = [1, 2**64 - 1, 0, 12345678901234567]
    with Device(path) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(sum(lens)) as buf:
        addrs = np.cumsum([0] + lens[:-1]).astype(np.uint64) + np.uint64(buf.address)
        got = eng.read_hashed(IOBatch(addrs, 0, offsets, lens), streams, seeds)
        want = [data_checksum(np.concatenate([data[o:o + n] for o, n, t in
                                              zip(offsets, lens, streams) if t == s]), seed)
                for s, seed in enumerate(seeds)]
        assert [int(x) for x in got] == want


@pytest.mark.parametrize("fused", [False, True], ids=["with-hasher", "copy-hashed"])
@pytest.mark.parametrize("op", ["read", "write"])
def test_native_mem_copies_refuse_unmapped_devices_and_ranges(shm_target, op, fused):
    """kvb_mem_read/kvb_mem_write's own checks (the engine validates before
    it gets there), with a hasher and in kvb_mem_copy_hashed: an unmapped
    device or a range past the mapping is -EINVAL, and a hashed stream with
    such a piece gets digest 0; the good entry copies, and its digest is
    that of the source's bytes."""
    path = shm_target(4 * MIB)
    data = _filled(path, 4 * MIB, seed=9)
    host = np.full(3 * BLOCK, 0x5A, np.uint8) if op == "write" else np.zeros(3 * BLOCK, np.uint8)
    with Device(path) as dev:
        maps = MappedDevices([dev])
        try:
            bases = np.array([maps.bases[0], 0], np.uint64)
            sizes = np.array([maps.sizes[0], 0], np.uint64)
            addrs = np.arange(3, dtype=np.uint64) * BLOCK + np.uint64(host.ctypes.data)
            devs = np.array([0, 1, 0], np.uint32)
            offs = np.array([BLOCK, 0, 4 * MIB], np.uint64)
            lens = np.full(3, BLOCK, np.uint64)
            results = np.empty(3, np.int64)
            streams = np.array([0, 1, 2], np.uint32)
            seeds = np.array([1, 2, 3], np.uint64)
            digests = np.ones(3, np.uint64)
            p = native.ptr
            args = (3, p("uint64_t *", addrs), p("uint32_t *", devs), p("uint64_t *", bases),
                    p("uint64_t *", sizes), 2, p("uint64_t *", offs), p("uint64_t *", lens),
                    p("int64_t *", results), native.ffi.NULL)
            if fused:
                failed = native.lib().kvb_mem_copy_hashed(
                    int(op == "write"), *args, p("uint32_t *", streams), 3,
                    p("uint64_t *", seeds), p("uint64_t *", digests))
            else:
                hasher = native.Hasher(addrs, lens, streams, seeds, results, digests)
                failed = getattr(native.lib(), f"kvb_mem_{op}")(*args, hasher.handle)
                assert hasher.finish() == 2
            assert failed == 2
            assert results.tolist() == [BLOCK, -22, -22]
            assert digests[1:].tolist() == [0, 0]
        finally:
            maps.close()
    want = data.copy()
    if op == "write":
        want[BLOCK:2 * BLOCK] = 0x5A
    assert np.array_equal(host[:BLOCK], want[BLOCK:2 * BLOCK])
    assert int(digests[0]) == data_checksum(want[BLOCK:2 * BLOCK], 1)
    assert np.array_equal(_pread(path, 0, 4 * MIB), want)


def test_copy_hashed_refuses_bad_stream_numbering(shm_target):
    """kvb_mem_copy_hashed checks the streams as kvb_hasher_create does, and
    then copies nothing."""
    path = shm_target(4 * MIB)
    _filled(path, 4 * MIB, seed=3)
    host = np.zeros(2 * BLOCK, np.uint8)
    with Device(path) as dev:
        maps = MappedDevices([dev])
        try:
            p = native.ptr
            results = np.zeros(2, np.int64)
            got = native.lib().kvb_mem_copy_hashed(
                0, 2, p("uint64_t *", np.arange(2, dtype=np.uint64) * BLOCK
                        + np.uint64(host.ctypes.data)),
                p("uint32_t *", np.zeros(2, np.uint32)), p("uint64_t *", maps.bases),
                p("uint64_t *", maps.sizes), 1, p("uint64_t *", np.zeros(2, np.uint64)),
                p("uint64_t *", np.full(2, BLOCK, np.uint64)), p("int64_t *", results),
                native.ffi.NULL, p("uint32_t *", np.array([1, 1], np.uint32)), 2,
                p("uint64_t *", np.zeros(2, np.uint64)), p("uint64_t *", np.zeros(2, np.uint64)))
        finally:
            maps.close()
    assert got == -22
    assert not host.any() and not results.any()


def test_out_of_range_read_is_a_typed_error(shm_target):
    path = shm_target(4 * MIB)
    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(2 * BLOCK) as buf:
        with pytest.raises(IOFailedError, match="past the device"):
            eng.read(IOBatch.single(buf.address, 0, 4 * MIB - BLOCK, 2 * BLOCK))


def test_close_waits_for_readers_then_refuses(shm_target):
    path = shm_target(64 * MIB)
    _filled(path, 64 * MIB)
    errors, reads, done = [], [], threading.Event()
    buf = HostBuffer(64 * MIB)
    with Device(path) as dev:
        eng = open_engine([dev])

        def reader():
            try:
                while not done.is_set():
                    eng.read(IOBatch.contiguous(buf.address, 0, 0, 64 * MIB, 8 * MIB))
                    reads.append(1)
            except ConfigError as e:      # the engine closed between two reads
                errors.append(e)
            finally:
                done.set()

        t = threading.Thread(target=reader)
        t.start()
        while not reads and t.is_alive():
            time.sleep(0.001)
        eng.close()      # reads run back to back: one is copying now; unmapping under it crashes
        t.join(60)
        assert not t.is_alive(), "the reader never saw the engine close"
        assert all("closed" in str(e) for e in errors)
        with pytest.raises(ConfigError, match="closed"):
            eng.read(IOBatch.single(buf.address, 0, 0, BLOCK))
    if not t.is_alive():     # never free memory a stuck reader might still copy into
        buf.close()


def test_prefaulted_mapping_copies_without_page_faults(shm_target):
    """Pages mapped in once serve reads and writes: no fault per page (the
    pages of a tmpfs mapping are mapped writable on the read prefault)."""
    path = shm_target(64 * MIB)
    data = _filled(path, 64 * MIB, seed=2)
    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(64 * MIB) as buf:
        buf.array[:] = 0                       # the destination's pages exist already
        assert eng._maps.wait_prefaulted(30)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        eng.read(IOBatch.contiguous(buf.address, 0, 0, 64 * MIB, 8 * MIB))
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert np.array_equal(buf.array, data)
        assert faults < 64 * MIB // BLOCK // 16, faults   # 16384 pages unmapped
        buf.array[:] = 0x77
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        eng.write(IOBatch.contiguous(buf.address, 0, 0, 64 * MIB, 8 * MIB))
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert faults < 64 * MIB // BLOCK // 16, faults
    assert (_pread(path, 0, 64 * MIB) == 0x77).all()


def test_store_on_tmpfs_keeps_evicted_space_allocated(shm_target):
    """Evicting from a store whose device is mapped does not punch holes (a
    read of a hole on a full tmpfs would be SIGBUS); the space is reused."""
    path = shm_target(8 * MIB, "store.img")
    allocated = os.stat(path).st_blocks
    with KVStore.format([path], GEOM, region_size=REGION) as store:
        assert store.io.engine.mapped(0)
        assert store.stats()["mapped_reads"] == store.stats()["mapped_writes"] == [path]
        keys = run_keys(1, 2)
        store.put_run(keys, run_data(keys))
        store.evict(all=True)
        assert store.stats()["discards"] == 0
        assert os.stat(path).st_blocks == allocated
        keys = run_keys(2, 3)
        store.put_run(keys, run_data(keys))
        out = np.zeros(3 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 3 and np.array_equal(out, run_data(keys))


def test_large_mapping_is_used_once_mapped_in(shm_target, monkeypatch, mapped_copies):
    """Above PREFAULT_INLINE a thread maps the pages in; reads take the
    engine's own path until it is done, then the mapping."""
    import kvblock.io.engine as engine_mod
    import kvblock.io.mapped as mapped_mod

    go = threading.Event()
    prefault = mapped_mod.MappedDevices._prefault

    def held(self, spans, background=False):
        assert background
        go.wait(30)
        prefault(self, spans, background)

    monkeypatch.setattr(mapped_mod, "PREFAULT_INLINE", MIB)
    monkeypatch.setattr(mapped_mod.MappedDevices, "_prefault", held)
    mapped_calls = mapped_copies
    path = shm_target(8 * MIB)
    data = _filled(path, 8 * MIB, seed=4)
    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(8 * MIB) as buf:
        assert eng.mapped(0)
        eng.read(IOBatch.contiguous(buf.address, 0, 0, 8 * MIB, MIB))
        assert np.array_equal(buf.array, data) and not mapped_calls
        eng.write(IOBatch.single(buf.address, 0, 0, MIB))       # the engine's path too
        assert not mapped_calls
        go.set()
        assert eng._maps.wait_prefaulted(30)
        buf.array[:] = 0
        eng.read(IOBatch.contiguous(buf.address, 0, 0, 8 * MIB, MIB))
        assert np.array_equal(buf.array, data) and mapped_calls == [engine_mod.OP_READ]
        eng.write(IOBatch.single(buf.address, 0, 0, MIB))
        assert mapped_calls == [engine_mod.OP_READ, engine_mod.OP_WRITE]


def test_a_child_forked_while_the_pages_map_in_reads_through_the_mapping(shm_target,
                                                                         monkeypatch,
                                                                         mapped_copies):
    """A fork while the background prefault runs: that thread is the
    parent's, so the child's mappings never became ready and all its reads
    took the engine's path.  The child maps the pages in afresh, then reads
    through the mapping."""
    import kvblock.io.mapped as mapped_mod
    from tests.support.servers import exit_code_in_child

    go = threading.Event()
    prefault = mapped_mod.MappedDevices._prefault

    def held(self, spans, background=False):
        if os.getpid() == parent:
            go.wait(30)
        prefault(self, spans, background)

    parent = os.getpid()
    monkeypatch.setattr(mapped_mod, "PREFAULT_INLINE", MIB)
    monkeypatch.setattr(mapped_mod.MappedDevices, "_prefault", held)
    path = shm_target(8 * MIB)
    data = _filled(path, 8 * MIB, seed=5)
    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(8 * MIB) as buf:
        def child():
            eng.read(IOBatch.contiguous(buf.address, 0, 0, 8 * MIB, MIB))
            if not eng._maps.wait_prefaulted(8):
                return 2
            buf.array[:] = 0
            eng.read(IOBatch.contiguous(buf.address, 0, 0, 8 * MIB, MIB))
            return 0 if np.array_equal(buf.array, data) and mapped_copies else 1
        try:
            assert exit_code_in_child(child) == 0
        finally:
            go.set()
        assert eng._maps.wait_prefaulted(30)


def test_store_maps_its_pages_in_only_after_recovery(shm_target, monkeypatch):
    """Recovery reads go through the engine, and the pages are mapped in
    after it (a prefault beside the recovery slowed reopening)."""
    path = shm_target(8 * MIB, "store.img")
    keys = run_keys(3, 2)
    with KVStore.format([path], GEOM, region_size=REGION) as store:
        store.put_run(keys, run_data(keys))
    seen = []
    recover = KVStore._recover

    def spy(self):
        seen.append((self.io.engine.mapped(0), self.io.engine._maps._started))
        recover(self)

    monkeypatch.setattr(KVStore, "_recover", spy)
    with KVStore.open([path]) as store:
        assert seen == [(True, False)]
        assert store.io.engine._maps.wait_prefaulted(30)
        assert store.io.engine._maps.covers(np.zeros(1, np.uint32))
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))


def test_fresh_store_maps_in_at_once_reopened_one_in_the_background(shm_target, monkeypatch):
    import kvblock.io.mapped as mapped_mod

    monkeypatch.setattr(mapped_mod, "PREFAULT_INLINE", MIB)   # the 8 MiB file is "large"
    path = shm_target(8 * MIB, "store.img")
    with KVStore.format([path], GEOM, region_size=REGION) as store:
        maps = store.io.engine._maps
        assert maps._ready.is_set() and maps._prefaulter is None
    with KVStore.open([path]) as store:
        maps = store.io.engine._maps
        assert maps._prefaulter is not None
        assert maps.wait_prefaulted(30) and maps._ready.is_set()


@contextlib.contextmanager
def _prefaulting_while_written(shm_target):
    """An engine on an 8 MiB tmpfs file that has just written, its
    background prefault started: (engine, its mappings, a 1 MiB buffer)."""
    with Device(shm_target(8 * MIB)) as dev, \
            open_engine([dev], defer_mapped_reads=True) as eng, HostBuffer(MIB) as buf:
        eng.write(IOBatch.single(buf.address, 0, 0, MIB))
        eng._maps.start(background=True)
        yield eng, eng._maps, buf


def test_background_prefault_waits_for_a_gap_in_writes(shm_target, monkeypatch):
    """The populate steps hold the process's mmap_lock; they run only once
    the engine has not written for PREFAULT_PAUSE."""
    import kvblock.io.mapped as mapped_mod

    monkeypatch.setattr(mapped_mod, "PREFAULT_PAUSE", 0.2)
    monkeypatch.setattr(mapped_mod, "PREFAULT_MAX_WAIT", 30.0)
    with _prefaulting_while_written(shm_target) as (eng, maps, buf):
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:     # keep writing: the prefault must wait
            eng.write(IOBatch.single(buf.address, 0, 0, MIB))
            assert not maps._ready.is_set()
            time.sleep(0.01)
        assert maps.wait_prefaulted(30) and maps._ready.is_set()


def test_background_prefault_waits_for_a_gap_no_longer_than_its_limit(shm_target,
                                                                      monkeypatch):
    """Writes every few ms never leave a PREFAULT_PAUSE gap: each step
    waits at most PREFAULT_MAX_WAIT, so the mapping comes on anyway."""
    import kvblock.io.mapped as mapped_mod

    monkeypatch.setattr(mapped_mod, "PREFAULT_PAUSE", 0.2)
    monkeypatch.setattr(mapped_mod, "PREFAULT_MAX_WAIT", 0.1)
    monkeypatch.setattr(mapped_mod, "PREFAULT_STEP", 2 * MIB)   # 4 steps of 8 MiB
    with _prefaulting_while_written(shm_target) as (eng, maps, buf):
        deadline = time.monotonic() + 10
        while not maps._ready.is_set():        # never a 0.2 s gap in the writes
            assert time.monotonic() < deadline, "the prefault waited for a gap for good"
            eng.write(IOBatch.single(buf.address, 0, 0, MIB))
            time.sleep(0.005)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("hashed", [False, True], ids=["plain", "hashed"])
def test_large_mapped_copies_are_shared_between_threads(shm_target, monkeypatch, threads,
                                                       hashed):
    """A mapped copy of at least COPY_SPLIT_BYTES is cut between entries
    (between streams when hashing) and copied by the caller and idle helper
    threads: the bytes and every stream's digest are those of one thread;
    a batch of one stream is not cut."""
    import kvblock.io.engine as engine_mod

    monkeypatch.setattr(engine_mod, "COPY_THREADS", threads)
    monkeypatch.setattr(engine_mod, "COPY_SPLIT_BYTES", MIB)
    path = shm_target(32 * MIB)
    data = _filled(path, 32 * MIB, seed=8)
    lens = [3 * MIB, BLOCK, 2 * BLOCK, 5 * MIB, 7 * BLOCK, MIB, 2 * MIB, BLOCK]
    offsets = [20 * MIB, 0, 9 * MIB, 4 * MIB, 31 * MIB, 12 * MIB, 14 * MIB, 30 * MIB]
    streams = [0, 1, 1, 2, 2, 3, 4, 4]
    seeds = [1, 2**64 - 1, 0, 12345678901234567, 99]
    parts = []
    copy_part = engine_mod.IOEngine._copy_part
    monkeypatch.setattr(engine_mod.IOEngine, "_copy_part",
                        lambda self, op, batch, a, b, *rest: (
                            parts.append((a, b, threading.current_thread().name)),
                            copy_part(self, op, batch, a, b, *rest))[1])
    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(sum(lens)) as buf:
        addrs = np.cumsum([0] + lens[:-1]).astype(np.uint64) + np.uint64(buf.address)
        batch = IOBatch(addrs, 0, offsets, lens)
        if hashed:
            got = eng.read_hashed(batch, streams, seeds)
            want = [data_checksum(np.concatenate([data[o:o + n] for o, n, t in
                                                  zip(offsets, lens, streams) if t == s]), seed)
                    for s, seed in enumerate(seeds)]
            assert [int(x) for x in got] == want
        else:
            eng.read(batch)
        at = 0
        for o, n in zip(offsets, lens):
            assert np.array_equal(buf.array[at:at + n], data[o:o + n])
            at += n
        assert len(parts) == threads
        assert sorted((a, b) for a, b, _ in parts)[0][0] == 0          # the parts tile the batch
        assert sum(b - a for a, b, _ in parts) == len(lens)
        assert [name for a, _, name in parts if a == 0] == ["MainThread"]
        assert any(name != "MainThread" for *_, name in parts)
        cuts = sorted(a for a, _, _ in parts)
        if hashed:      # never inside a stream
            assert all(streams[c] != streams[c - 1] for c in cuts[1:])
        # writes: the same bytes back into other places, shared the same way
        parts.clear()
        back = [int(o) for o in np.cumsum([16 * MIB] + lens[:-1])]     # one after another
        eng.write(IOBatch(addrs, 0, back, lens))
        assert len(parts) == threads
        at = 0
        for o, n in zip(back, lens):
            assert np.array_equal(_pread(path, o, n), buf.array[at:at + n])
            at += n
        # one stream: one thread
        parts.clear()
        eng.read_hashed(batch, [0] * len(lens), [5])
        assert len(parts) == 1


def test_busy_copy_helpers_are_not_waited_for(shm_target, monkeypatch):
    """With every helper slot taken by another caller, a large copy runs
    whole on the calling thread."""
    import kvblock.io.engine as engine_mod

    monkeypatch.setattr(engine_mod, "COPY_THREADS", 2)
    monkeypatch.setattr(engine_mod, "COPY_SPLIT_BYTES", MIB)
    path = shm_target(16 * MIB)
    data = _filled(path, 16 * MIB, seed=9)
    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(8 * MIB) as buf:
        _, slots = eng._copiers_pool()
        assert slots.acquire(blocking=False)            # another caller holds the helper
        try:
            parts = []
            copy_part = engine_mod.IOEngine._copy_part
            monkeypatch.setattr(engine_mod.IOEngine, "_copy_part",
                                lambda self, op, batch, a, b, *rest: (
                                    parts.append((a, b)),
                                    copy_part(self, op, batch, a, b, *rest))[1])
            addrs = np.array([buf.address, buf.address + 4 * MIB], dtype=np.uint64)
            eng.read(IOBatch(addrs, 0, [0, 8 * MIB], 4 * MIB))
            assert parts == [(0, 2)]
            assert np.array_equal(buf.array[:4 * MIB], data[:4 * MIB])
            assert np.array_equal(buf.array[4 * MIB:], data[8 * MIB:12 * MIB])
        finally:
            slots.release()


def test_a_tmpfs_file_with_a_hole_or_no_bytes_is_not_mapped(tmp_path):
    """A hole inside the capacity (counted blocks can still add up: the
    page past the capacity counts too) is not mapped: on a full tmpfs a
    write into it through the mapping would be a SIGBUS, not ENOSPC.  An
    empty file is not mapped either (mmap refuses length 0)."""
    path = f"/dev/shm/kvblock-hole-{os.getpid()}-{tmp_path.name}.img"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4 * 4096 + 100)                 # capacity: 4 pages
        for page in (1, 2, 3, 4):                        # page 0 stays a hole
            os.pwrite(fd, b"\1" * (4096 if page < 4 else 100), page * 4096)
        os.close(fd)
        assert os.stat(path).st_blocks * 512 >= 4 * 4096
        dev = Device(path)
        try:
            assert dev.capacity == 4 * 4096
            assert mappable(dev) == "not fully allocated (sparse)"
        finally:
            dev.close()
        with open(path, "wb"):
            pass
        dev = Device(path)
        try:
            assert mappable(dev) == "empty"
            eng = open_engine([dev], "threads")
            assert not eng.mapped(0)
            eng.close()
        finally:
            dev.close()
    finally:
        os.unlink(path)


def test_an_interrupted_large_copy_leaves_no_helper_copying(shm_target, monkeypatch):
    """KeyboardInterrupt (Ctrl-C) while a large mapped read waits for its
    helper threads: read() raised with the helpers still copying into the
    caller's buffer (freed or reused by the caller from then on), and the
    engine counted the call as done, so close() could unmap the store file
    under them.  read() now raises only once its helpers are done."""
    from concurrent.futures import Future

    import kvblock.io.engine as engine_mod

    monkeypatch.setattr(engine_mod, "COPY_THREADS", 2)
    monkeypatch.setattr(engine_mod, "COPY_SPLIT_BYTES", MIB)
    path = shm_target(8 * MIB)
    data = _filled(path, 8 * MIB, seed=10)
    go, helped = threading.Event(), threading.Event()
    copy_part = engine_mod.IOEngine._copy_part

    def slow_helper(self, *args):
        if threading.current_thread() is threading.main_thread():
            return copy_part(self, *args)
        go.wait(10)              # still copying when the interrupt comes
        try:
            return copy_part(self, *args)
        finally:
            helped.set()

    real_result = Future.result

    def interrupted(self, timeout=None):
        threading.Timer(0.3, go.set).start()
        raise KeyboardInterrupt

    with Device(path) as dev, HostBuffer(8 * MIB) as buf:
        eng = open_engine([dev], mapped_reads=True)
        buf.array[:] = 0xAA
        monkeypatch.setattr(engine_mod.IOEngine, "_copy_part", slow_helper)
        monkeypatch.setattr(Future, "result", interrupted)
        with pytest.raises(KeyboardInterrupt):
            eng.read(IOBatch.contiguous(buf.address, 0, 0, 8 * MIB, MIB))
        at_raise = buf.array.copy()
        monkeypatch.setattr(Future, "result", real_result)
        go.set()
        assert helped.wait(10)
        eng.close()
        assert np.array_equal(buf.array, at_raise), "a helper copied after read() raised"
        assert np.array_equal(buf.array[:MIB], data[:MIB])


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_mapped_copy_that_fails_as_a_whole_names_the_device_and_offset(shm_target,
                                                                         monkeypatch, op):
    """kvb_mem_copy_hashed failing before it copies (ENOMEM for its hasher)
    was a ConfigError 'kvb_mem_read: Cannot allocate memory': a settings
    error, naming no device or offset.  Now a DeviceError with the errno,
    the device and the offset."""
    from kvblock.errors import DeviceError

    path = shm_target(4 * MIB)
    real_lib = native.lib()

    class NoMemory:
        def __getattr__(self, name):
            return getattr(real_lib, name)

        @staticmethod
        def kvb_mem_copy_hashed(*args):
            return -errno.ENOMEM

    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(2 * BLOCK) as buf:
        assert eng.mapped_for_writes(0)
        monkeypatch.setattr(native, "lib", lambda: NoMemory())
        batch = IOBatch(np.array([buf.address, buf.address + BLOCK], np.uint64), 0,
                        [3 * BLOCK, 9 * BLOCK], [BLOCK, BLOCK])
        call = eng.read_hashed if op == "read" else eng.write_hashed
        with pytest.raises(DeviceError) as e:
            call(batch, [0, 1], [0, 0])
    assert not isinstance(e.value, ConfigError) and e.value.errno == errno.ENOMEM
    assert path in str(e.value) and f"offset {3 * BLOCK}" in str(e.value)
    assert os.strerror(errno.ENOMEM) in str(e.value)


@pytest.mark.parametrize("ask", ["mapped", "mapped_for_writes", "start_mapped_reads"])
def test_asking_whether_mapped_while_another_thread_closes_the_engine(engine_name, shm_target,
                                                                     ask):
    """engine.mapped() read ``_maps`` twice (``is not None``, then its
    answer): a close() in another thread between the two, which drops it,
    made it raise AttributeError ('NoneType' object has no attribute
    'mapped') instead of answering."""
    path = shm_target(4 * MIB)
    with Device(path) as dev:
        eng = open_engine([dev], engine_name)
        assert eng.mapped(0)
        state = {"maps": eng.__dict__.pop("_maps"), "armed": False}

        class Racing(type(eng)):
            @property
            def _maps(self):
                maps = state["maps"]
                if state["armed"]:        # first look: another thread closes now
                    state["armed"] = False
                    t = threading.Thread(target=self.close)
                    t.start()
                    t.join(30)
                return maps

            @_maps.setter
            def _maps(self, value):
                state["maps"] = value

        eng.__class__ = Racing
        try:
            state["armed"] = True
            answer = getattr(eng, ask)(0) if ask != "start_mapped_reads" \
                else eng.start_mapped_reads()
            assert eng.closed and state["maps"] is None
            assert answer in (True, False, None)
        finally:
            eng.close()


def test_a_prefault_that_fails_leaves_reads_on_the_engine_path(engine_name, shm_target,
                                                               caplog):
    """MADV_POPULATE_READ failing for any reason was taken as 'an old kernel:
    pages fault in on first read', and the mappings were used.  A store
    file cut shorter after it was mapped makes it fail with EFAULT (so does
    a page a full tmpfs cannot back): the reads then copied past the file's
    end, a SIGBUS that killed the process, where the engine's pread gives a
    short read, a typed error.  Only EINVAL (a kernel without the advice)
    means that now; any other failure keeps reads and writes on the engine's
    path, and says so."""
    path = shm_target(8 * MIB)
    with Device(path) as dev, open_engine([dev], engine_name, defer_mapped_reads=True) as eng, \
            HostBuffer(MIB) as buf:
        assert eng.mapped(0)
        os.truncate(path, 4 * MIB)        # what nothing may do to an open store file
        with caplog.at_level("WARNING", logger="kvblock"):
            eng.start_mapped_reads(background=False)
        assert not eng._maps.covers(np.zeros(1, np.uint32))
        assert any(path in r.getMessage() and "EFAULT" in r.getMessage()
                   for r in caplog.records)
        eng.read(IOBatch.single(buf.address, 0, 2 * MIB, MIB))       # still there
        with pytest.raises(IOFailedError):
            eng.read(IOBatch.single(buf.address, 0, 6 * MIB, MIB))   # past the new end


def _prefaults_fail(monkeypatch) -> None:
    """Every prefault (MADV_POPULATE_READ) of the mappings fails with EFAULT
    (a page the file cannot back); the native core's other calls are real."""
    import kvblock.io.mapped as mapped_mod

    real = native.lib()

    class FailingPrefault:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def kvb_mem_prefault(addr, length):
            return -errno.EFAULT

    monkeypatch.setattr(mapped_mod.native, "lib", lambda: FailingPrefault())


def test_a_failed_prefault_leaves_the_device_unmapped(shm_target, monkeypatch, caplog):
    """A prefault that fails (EFAULT: a page the file cannot back) leaves the
    mappings unused: reads and writes take the engine's path.  The device
    was still reported mapped (stats, ``engine.mapped``, `kvblock info`) and
    its evictions were not trimmed, as if reads went through the mapping."""
    _prefaults_fail(monkeypatch)
    path = shm_target(8 * MIB, "store.img")
    allocated = os.stat(path).st_blocks
    with KVStore.format([path], GEOM, region_size=REGION) as store:
        assert "mapping its pages in failed" in caplog.text
        assert not store.io.engine.mapped(0) and not store.io.engine.mapped_for_writes(0)
        assert store.stats()["mapped_reads"] == store.stats()["mapped_writes"] == []
        keys = run_keys(1, 2)
        store.put_run(keys, run_data(keys))
        out = np.zeros(2 * GEOM.block_bytes, np.uint8)
        assert store.get_run(keys, out) == 2 and np.array_equal(out, run_data(keys))
        store.evict(all=True)
        assert store.stats()["discards"] >= 1
        assert os.stat(path).st_blocks < allocated


def test_a_failed_prefault_at_an_engines_open_fails_nothing(engine_name, shm_target,
                                                            monkeypatch, caplog):
    """An engine opened with mapped reads started at once (the default;
    store files up to PREFAULT_INLINE are mapped in on the spot, inside the
    mappings' constructor) whose prefault fails: the failing prefault drops
    the mappings, but the constructor still held an array over the last
    one, so closing it raised BufferError ("cannot close exported pointers
    exist") out of the engine's open, where the device should just be read
    through the engine."""
    _prefaults_fail(monkeypatch)
    path = shm_target(8 * MIB)
    with Device(path) as dev, open_engine([dev], engine_name) as eng, HostBuffer(MIB) as buf:
        assert "mapping its pages in failed" in caplog.text
        assert not eng.mapped(0)
        eng.read(IOBatch.single(buf.address, 0, 2 * MIB, MIB))


def test_a_copy_helper_that_cannot_start_leaves_no_helper_copying(shm_target, monkeypatch):
    """A large mapped read whose second helper cannot start (the pool's
    submit raising RuntimeError "can't start new thread"): read() raised at
    once with the first helper still copying into the caller's buffer, and
    the engine counted the call as done (close() could unmap the file under
    it).  The part no helper took is copied on the calling thread (once, even
    when the failed submit queued it), and read() returns with no helper
    copying."""
    import kvblock.io.engine as engine_mod

    monkeypatch.setattr(engine_mod, "COPY_THREADS", 3)
    monkeypatch.setattr(engine_mod, "COPY_SPLIT_BYTES", MIB)
    path = shm_target(8 * MIB)
    data = _filled(path, 8 * MIB, seed=11)
    go = threading.Event()
    copying, parts = [], []
    copy_part = engine_mod.IOEngine._copy_part

    def slow_helper(self, op, batch, a, b, *rest):
        parts.append((a, b))
        copying.append(1)
        try:
            if threading.current_thread() is not threading.main_thread():
                go.wait(10)          # still copying when the second submit fails
            return copy_part(self, op, batch, a, b, *rest)
        finally:
            copying.pop()

    with Device(path) as dev, HostBuffer(8 * MIB) as buf, \
            open_engine([dev], mapped_reads=True) as eng:
        buf.array[:] = 0xAA
        pool, slots = eng._copiers_pool()
        calls = []

        class Pool:
            def submit(self, *args):
                calls.append(1)
                if len(calls) > 1:
                    threading.Timer(0.3, go.set).start()
                    raise RuntimeError("can't start new thread")
                return pool.submit(*args)

        monkeypatch.setattr(eng, "_copiers_pool", lambda: (Pool(), slots))
        monkeypatch.setattr(engine_mod.IOEngine, "_copy_part", slow_helper)
        try:
            eng.read(IOBatch.contiguous(buf.address, 0, 0, 8 * MIB, MIB))
        finally:
            left = len(copying)
            go.set()
        assert left == 0, "read() returned with a helper still copying"
        assert np.array_equal(buf.array, data)
        assert sorted(parts)[0][0] == 0 and sum(b - a for a, b in parts) == 8


CUT_UNDER_THE_ENGINE = """
import os, sys
import numpy as np
from kvblock.devices import Device
from kvblock.errors import IOFailedError
from kvblock.io import IOBatch, open_engine
from kvblock.memory import HostBuffer
path, engine = sys.argv[1], sys.argv[2]
MIB = 1 << 20
data = np.fromfile(path, np.uint8)
with Device(path) as dev, open_engine([dev], engine) as eng, HostBuffer(MIB) as buf:
    assert eng.mapped(0) and eng._maps.covers(np.zeros(1, np.uint32))
    os.truncate(path, 4 * MIB)        # what nothing may do to an open store file
    eng.read(IOBatch.single(buf.address, 0, 2 * MIB, MIB))       # still there
    assert np.array_equal(buf.array, data[2 * MIB:3 * MIB])
    try:
        eng.read(IOBatch.single(buf.address, 0, 6 * MIB, MIB))   # past the new end
    except IOFailedError as e:
        print("read:", e.offset, e)
    buf.array[:] = 7
    eng.write(IOBatch.single(buf.address, 0, 6 * MIB, MIB))      # as pwrite: grows it
    print("write:", os.path.getsize(path))
"""


def test_a_store_file_cut_shorter_under_the_engine_is_a_typed_error(engine_name, shm_target):
    """A store file on tmpfs cut shorter (truncate) while an engine had it
    mapped: a copy past the new end through the mapping was a SIGBUS that
    killed the process, where pread gives a short read.  Each mapped copy
    now checks the file still covers the mapping, and takes the engine's
    path when it does not: a read still in the file returns its bytes, one
    past the end is an IOFailedError naming the offset, a write lands as a
    pwrite.  In a child process, where a SIGBUS cannot kill the test run."""
    import subprocess
    import sys

    path = shm_target(8 * MIB)
    _filled(path, 8 * MIB, seed=5)
    res = subprocess.run([sys.executable, "-c", CUT_UNDER_THE_ENGINE, path, engine_name],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"read: {6 * MIB} ") and path in lines[0], lines
    assert lines[1] == f"write: {7 * MIB}", lines
    assert "cut shorter" in res.stderr and path in res.stderr, res.stderr[-2000:]
