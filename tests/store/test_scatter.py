"""put_blocks / get_blocks: runs whose blocks lie in separate buffers.

Aligned blocks take direct I/O where they are (checked by watching the
I/O batches); others go through staging; both store exactly what put_run
would, and the streaming checksums catch corruption like the contiguous ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvblock import Geometry, KVStore, aligned_empty
from kvblock.errors import ConfigError
from kvblock.format.checksum import data_checksum, data_checksum_pieces
from kvblock.index import normalize_keys
from kvblock.io import IOBatch
from kvblock.store.scatter import BlockList, coalesce
from tests.store.workload import GEOM, REGION, run_data, run_keys

MIB = 1 << 20
# 4 KiB per (layer, group) piece: aligned pieces, so blocks can take direct I/O.
ALIGNED = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                   block_tokens=16, head_groups=2)


def _blocks(data: np.ndarray, geom: Geometry, aligned: bool = True) -> list[np.ndarray]:
    """The run image ``data`` (layers, groups, n, bytes) cut into per-block
    buffers in block order, each in a buffer of its own."""
    n = data.nbytes // geom.block_bytes
    img = data.reshape(geom.num_layers, geom.head_groups, n, geom.group_block_bytes)
    out = []
    for k in range(n):
        buf = aligned_empty(geom.block_bytes + 64)
        at = 0 if aligned else 64    # unaligned: still contiguous, off by 64 bytes
        b = buf[at:at + geom.block_bytes]
        b[...] = img[:, :, k].reshape(-1)
        out.append(b)
    return out


def _watch(store):
    """Record every (read|write, batch) the store issues."""
    seen = []
    read, write, hashed = store.io.read, store.io.write, store.io.read_hashed
    write_hashed = store.io.write_hashed        # writes into a mapped tmpfs file
    store.io.read = lambda b: (seen.append(("read", b)), read(b))[1]
    store.io.read_hashed = lambda b, s, d: (seen.append(("read", b)), hashed(b, s, d))[1]
    store.io.write = lambda b: (seen.append(("write", b)), write(b))[1]
    store.io.write_hashed = lambda b, s, d: (seen.append(("write", b)), write_hashed(b, s, d))[1]
    return seen


def _format(target, geom, **kw):
    kw.setdefault("region_size", REGION)
    return KVStore.format([str(target)], geom, **kw)


def test_streaming_checksum_equals_the_contiguous_one():
    data = np.random.default_rng(1).integers(0, 256, 3 * 4096 + 17, dtype=np.uint8)
    pieces = [data[:4096], data[4096:4097], data[4097:9000], data[9000:]]
    assert data_checksum_pieces(pieces, 77) == data_checksum(data, 77)
    assert data_checksum_pieces(pieces, 77) != data_checksum(data, 78)
    assert data_checksum_pieces([], 5) == xxhash.xxh3_64_intdigest(b"", seed=5)


def test_coalesce_merges_pieces_that_touch_in_memory_and_on_device():
    addrs = np.array([0, 4096, 8192, 20480, 24576], dtype=np.uint64)
    offs = np.array([100, 4196, 9999, 12000, 16096], dtype=np.uint64)
    b = coalesce(addrs, 0, offs, 4096)
    assert b.addrs.tolist() == [0, 8192, 20480]
    assert b.offsets.tolist() == [100, 9999, 12000]
    assert b.lens.tolist() == [8192, 4096, 8192]
    # pieces of any length; a device change breaks a run
    b = coalesce(np.array([0, 100, 300, 400], dtype=np.uint64), np.array([0, 0, 0, 1]),
                 np.array([0, 100, 300, 400], dtype=np.uint64), np.array([100, 200, 100, 50]))
    assert b.addrs.tolist() == [0, 400] and b.lens.tolist() == [400, 50]
    assert b.devs.tolist() == [0, 1]


def test_aligned_blocks_are_written_and_read_in_place(target):
    keys = run_keys(1, 6)
    data = run_data(keys, ALIGNED)
    with _format(target(16 * MIB), ALIGNED) as store:
        src = _blocks(data, ALIGNED)
        seen = _watch(store)
        assert store.put_blocks(keys, src) == 6
        lay = store.layout(6)
        wb, = [b for k, b in seen if k == "write" and b.nbytes == lay.run_bytes]
        # every data piece comes from one of the caller's blocks: no staging
        # copy; the last piece is the run's block digest trailer
        spans = [(int(b.ctypes.data), int(b.ctypes.data) + ALIGNED.block_bytes) for b in src]
        for a, n in zip(wb.addrs[:-1].tolist(), wb.lens[:-1].tolist()):
            assert any(lo <= a and a + n <= hi for lo, hi in spans)
        assert int(wb.lens[-1]) == lay.trailer_bytes
        assert int(wb.offsets[-1]) == int(wb.offsets.min()) + lay.data_bytes
        # contiguous read of what put_blocks wrote
        out = np.zeros_like(data)
        assert store.get_run(keys, out) == 6 and np.array_equal(out, data)
        # and back into separate blocks, in place
        dst = _blocks(np.zeros_like(data), ALIGNED)
        seen.clear()
        assert store.get_blocks(keys, dst) == 6
        reads = [b for k, b in seen if k == "read"]
        assert len(reads) == 1 and reads[0].nbytes == 6 * ALIGNED.block_bytes
        spans = [(int(b.ctypes.data), int(b.ctypes.data) + ALIGNED.block_bytes) for b in dst]
        for a, n in zip(reads[0].addrs.tolist(), reads[0].lens.tolist()):
            assert any(lo <= a and a + n <= hi for lo, hi in spans)   # straight into dst
        for k, b in enumerate(dst):
            assert np.array_equal(b, src[k])


def test_put_run_data_reads_into_blocks_and_partial_runs(target):
    keys = run_keys(2, 5)
    data = run_data(keys, ALIGNED)
    with _format(target(16 * MIB), ALIGNED) as store:
        assert store.put_run(keys, data) == 5
        want = _blocks(data, ALIGNED)
        dst = _blocks(np.zeros_like(data), ALIGNED)
        assert store.get_blocks(keys, dst) == 5
        assert all(np.array_equal(a, b) for a, b in zip(dst, want))
        # a lookup that starts inside the run: whole-range read, then per-block copies
        dst = _blocks(np.zeros_like(data), ALIGNED)[:3]
        assert store.get_blocks(keys[2:], dst) == 3
        assert all(np.array_equal(a, b) for a, b in zip(dst, want[2:]))
        # missing keys end the prefix
        assert store.get_blocks(keys[:2] + [b"nope"], dst) == 2


@pytest.mark.parametrize("geom,aligned", [(GEOM, True), (ALIGNED, False)],
                         ids=["unaligned-pieces", "unaligned-buffers"])
def test_blocks_that_cannot_take_direct_io_go_through_staging(tmp_path, geom, aligned):
    from kvblock import create_file

    path = tmp_path / "s.img"
    create_file(path, 16 * MIB)
    keys = run_keys(3, 7)
    data = run_data(keys, geom)
    with _format(path, geom) as store:
        src = _blocks(data, geom, aligned)
        assert store.put_blocks(keys, src) == 7
        out = np.zeros_like(data)
        assert store.get_run(keys, out) == 7 and np.array_equal(out, data)
        dst = _blocks(np.zeros_like(data), geom, aligned)
        assert store.get_blocks(keys, dst) == 7
        assert all(np.array_equal(a, b) for a, b in zip(dst, src))
    with KVStore.open([str(path)]) as store:   # durable like any put
        dst = _blocks(np.zeros_like(data), geom, aligned)
        assert store.get_blocks(keys, dst) == 7
        assert all(np.array_equal(a, b) for a, b in zip(dst, src))


def test_corrupt_piece_is_a_miss_and_drops_the_run(tmp_path):
    from kvblock import create_file

    path = tmp_path / "s.img"
    create_file(path, 16 * MIB)
    keys = run_keys(4, 4)
    data = run_data(keys, ALIGNED)
    with _format(path, ALIGNED) as store:
        store.put_blocks(keys, _blocks(data, ALIGNED))
        run = next(iter(store.index.runs.values()))
        _, off = store.regions.address(run.region, run.offset)
        range_bytes = store.layout(4).range_bytes
    with open(path, "r+b") as f:   # one byte of block 2 in the last range
        at = off + 3 * range_bytes + 2 * ALIGNED.group_block_bytes + 5
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    with KVStore.open([str(path)]) as store:
        dst = _blocks(np.zeros_like(data), ALIGNED)
        assert store.get_blocks(keys, dst) == 0
        assert store.stats()["checksum_failures"] == 1
        assert store.last_checksum_failure[3] == 3      # the range that failed
        assert store.lookup(keys) == 0


def test_host_tier_serves_blocks(tmp_path):
    from kvblock import create_file

    path = tmp_path / "s.img"
    create_file(path, 16 * MIB)
    keys = run_keys(5, 3)
    data = run_data(keys, ALIGNED)
    with _format(path, ALIGNED, host_cache_bytes=MIB) as store:
        src = _blocks(data, ALIGNED)
        store.put_blocks(keys, src)
        for _ in range(2):
            dst = _blocks(np.zeros_like(data), ALIGNED)
            assert store.get_blocks(keys, dst) == 3
            assert all(np.array_equal(a, b) for a, b in zip(dst, src))
        assert store.stats()["host_hit_blocks"] >= 3


@pytest.fixture
def small_store(tmp_path):
    from kvblock import create_file

    path = tmp_path / "s.img"
    create_file(path, 16 * MIB)
    with _format(path, ALIGNED) as store:
        yield store


def test_bad_block_lists(small_store):
    store = small_store
    keys = run_keys(6, 2)
    good = _blocks(run_data(keys, ALIGNED), ALIGNED)
    with pytest.raises(ConfigError, match="2 keys but 1 block buffers"):
        store.put_blocks(keys, good[:1])
    with pytest.raises(ConfigError, match=f"block 1 holds 100 bytes; a block is "
                                          f"{ALIGNED.block_bytes}"):
        store.put_blocks(keys, [good[0], np.zeros(100, np.uint8)])
    assert store.lookup(keys) == 0                      # nothing half-written
    store.put_blocks(keys, good)
    ro = good[1].copy()
    ro.flags.writeable = False
    with pytest.raises(ConfigError, match="block 1 is read-only"):
        store.get_blocks(keys, [good[0].copy(), ro])
    strided = np.zeros(2 * ALIGNED.block_bytes, np.uint8)[::2]
    with pytest.raises(ConfigError, match="block 0 is not C-contiguous"):
        store.get_blocks(keys, [strided, good[1].copy()])
    # a non-contiguous *source* is fine: it is copied
    keys2 = run_keys(7, 1)
    src = np.zeros(2 * ALIGNED.block_bytes, np.uint8)
    src[::2] = 9
    assert store.put_blocks(keys2, [src[::2]]) == 1
    out = aligned_empty(ALIGNED.block_bytes)
    assert store.get_run(keys2, out) == 1 and (out == 9).all()


@pytest.mark.parametrize("overlap", [0, 64])
def test_block_buffers_to_read_into_that_overlap_are_refused(tmp_path, overlap):
    """get_blocks into one buffer given for two keys (or two that overlap)
    read both blocks there, and with a DRAM tier then put that buffer into
    the tier as each key's block: key 0's entry held key 1's bytes, and every
    later read of key 0 returned them.  Overlapping buffers to read into are
    a ConfigError up front, before any read."""
    from kvblock import create_file

    path = tmp_path / "s.img"
    create_file(path, 16 * MIB)
    bb = ALIGNED.block_bytes
    a, b = np.full(bb, 1, np.uint8), np.full(bb, 2, np.uint8)
    with _format(path, ALIGNED, host_cache_bytes=MIB) as store:
        store.put_blocks([b"a"], [a])
        store.put_blocks([b"b"], [b])
        store.host.clear()                   # both read from the device, then tiered
        buf = aligned_empty(2 * bb)
        outs = [buf[:bb], buf[overlap:overlap + bb]]
        with pytest.raises(ConfigError, match="get_blocks: block buffers 0 and 1 overlap"):
            store.get_blocks([b"a", b"b"], outs)
        out = aligned_empty(bb)
        assert store.get_blocks([b"a"], [out]) == 1 and (out == 1).all()
        assert store.get_blocks([b"b"], [out]) == 1 and (out == 2).all()
        # buffers side by side (touching, not overlapping) are fine
        assert store.get_blocks([b"a", b"b"], [buf[:bb], buf[bb:]]) == 2
        assert (buf[:bb] == 1).all() and (buf[bb:] == 2).all()


def test_present_is_per_key_and_not_a_lookup(tmp_path):
    from kvblock import create_file

    path = tmp_path / "s.img"
    create_file(path, 16 * MIB)
    keys = run_keys(8, 3)
    with _format(path, ALIGNED, host_cache_bytes=MIB) as store:
        store.put_run(keys[1:], run_data(keys[1:], ALIGNED))
        assert store.present(keys).tolist() == [False, True, True]
        assert store.present([]).tolist() == []
        assert store.stats()["lookups"] == 0
        store.delete(keys[1:2])                 # deletes whole runs
        assert store.present(keys).tolist() == [False, False, False]


def _runs(store, geom, sizes, first=10):
    """One put_blocks per size (each its own run); (keys, block buffers)."""
    keys, blocks = [], []
    for i, n in enumerate(sizes):
        k = run_keys(first + i, n)
        b = _blocks(run_data(k, geom), geom)
        assert store.put_blocks(k, b) == n
        keys += k
        blocks += b
    return keys, blocks


@pytest.mark.parametrize("verify", ["always", "never"])
def test_a_get_across_whole_runs_is_one_engine_call(target, verify):
    """Whole runs that go straight into the caller's buffers are read with one
    engine call (their I/O in flight together); a get that starts inside a
    run stages that run, then reads the rest together."""
    with _format(target(16 * MIB), ALIGNED, verify=verify) as store:
        keys, want = _runs(store, ALIGNED, [3, 1, 2, 2, 1])
        assert len(store.index.runs) == 5
        seen = _watch(store)
        dst = _blocks(np.zeros(9 * ALIGNED.block_bytes, np.uint8), ALIGNED)
        assert store.get_blocks(keys, dst) == 9
        assert all(np.array_equal(a, b) for a, b in zip(dst, want))
        reads = [b for k, b in seen if k == "read"]
        assert len(reads) == 1 and reads[0].nbytes == 9 * ALIGNED.block_bytes
        seen.clear()
        dst = _blocks(np.zeros(8 * ALIGNED.block_bytes, np.uint8), ALIGNED)
        assert store.get_blocks(keys[1:], dst) == 8
        assert all(np.array_equal(a, b) for a, b in zip(dst, want[1:]))
        reads = [b for k, b in seen if k == "read"]
        assert len(reads) == 2 and reads[1].nbytes == 6 * ALIGNED.block_bytes


def test_a_get_across_runs_into_one_buffer_is_one_engine_call(target):
    """get_run into an aligned buffer with one range per block: each whole
    run's part of the buffer is its on-device image, read in place, all runs
    in one call."""
    geom = Geometry(num_layers=1, num_kv_heads=1, head_dim=2048, dtype="float16",
                    block_tokens=1, kv_parts=1)          # 4 KiB blocks, one range
    with _format(target(16 * MIB), geom) as store:
        keys, want = _runs(store, geom, [2, 1, 3])
        seen = _watch(store)
        out = aligned_empty(6 * geom.block_bytes)
        out[:] = 0
        assert store.get_run(keys, out) == 6
        assert np.array_equal(out, np.concatenate(want))
        reads = [b for k, b in seen if k == "read"]
        assert len(reads) == 1 and reads[0].addrs.min() == out.ctypes.data


def _flip_byte(path, at: int) -> None:
    """Damage one byte of a store file (the store is closed)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x80]))


def test_a_bad_run_in_a_combined_read_ends_the_prefix_there(tmp_path):
    """Runs read together are verified in order: a get returns the blocks
    before the bad run, drops that run, and leaves the runs after it whole."""
    from kvblock import create_file

    path = tmp_path / "s.img"
    create_file(path, 16 * MIB)
    with _format(path, ALIGNED) as store:
        keys, want = _runs(store, ALIGNED, [2, 1, 2, 3])
        bad = store.index.segments(normalize_keys(keys[3:5]))[0][0]   # the third run
        _, off = store.regions.address(bad.region, bad.offset)
    _flip_byte(path, off + 100)
    with KVStore.open([str(path)]) as store:
        dst = _blocks(np.zeros(8 * ALIGNED.block_bytes, np.uint8), ALIGNED)
        assert store.get_blocks(keys, dst) == 3
        assert all(np.array_equal(a, b) for a, b in zip(dst[:3], want[:3]))
        assert store.stats()["checksum_failures"] == 1
        assert store.last_checksum_failure[2] == bad.run_id
        assert store.lookup(keys) == 3
        dst = _blocks(np.zeros(3 * ALIGNED.block_bytes, np.uint8), ALIGNED)
        assert store.get_blocks(keys[5:], dst) == 3
        assert all(np.array_equal(a, b) for a, b in zip(dst, want[5:]))


def test_a_combined_read_spans_devices(tmp_path):
    from kvblock import create_file

    paths = [create_file(tmp_path / f"d{i}.img", 8 * MIB) for i in range(2)]
    with KVStore.format([str(p) for p in paths], ALIGNED, region_size=REGION) as store:
        keys, want = _runs(store, ALIGNED, [8] * 12)
        devs = {store.regions.address(r.region, r.offset)[0] for r in store.index.runs.values()}
        assert devs == {0, 1}
        seen = _watch(store)
        dst = _blocks(np.zeros(len(keys) * ALIGNED.block_bytes, np.uint8), ALIGNED)
        assert store.get_blocks(keys, dst) == len(keys)
        assert all(np.array_equal(a, b) for a, b in zip(dst, want))
        reads = [b for k, b in seen if k == "read"]
        assert len(reads) == 1 and set(reads[0].devs.tolist()) == {0, 1}


def test_unreadable_runs_on_one_device_drop_only_themselves(tmp_path):
    """get_blocks over whole runs striped across three devices, two of the
    runs on device 1 unreadable (EIO): the read fails, and those two runs
    are dropped.  The engine's error names the first failed I/O and counts
    two; taken for 'cannot tell which', every run of the batch was dropped,
    the runs on devices 0 and 2 that read fine too (the whole cache)."""
    from kvblock import create_file
    from kvblock.errors import IOFailedError
    from tests.support.faults import BadSectors

    paths = [create_file(tmp_path / f"d{i}.img", 8 * MIB) for i in range(3)]
    with KVStore.format([str(p) for p in paths], ALIGNED, region_size=REGION) as store:
        keys, want = _runs(store, ALIGNED, [8] * 12)
        runs = sorted(store.index.runs.values(), key=lambda r: r.run_id)
        on = {r.run_id: store.regions.address(r.region, r.offset) for r in runs}
        assert {dev for dev, _ in on.values()} == {0, 1, 2}
        unreadable = [r for r in runs if on[r.run_id][0] == 1][:2]
        bad = BadSectors()
        for r in unreadable:
            bad.add(*on[r.run_id], 4096)
        bad.install(store)
        dst = [aligned_empty(ALIGNED.block_bytes) for _ in keys]
        with pytest.raises(IOFailedError):
            store.get_blocks(keys, dst)
        gone = {r.run_id for r in unreadable}
        assert {r.run_id for r in runs} - set(store.index.runs) == gone
        for k, r in enumerate(runs):
            held = store.lookup(keys[8 * k:8 * k + 8])
            assert held == (0 if r.run_id in gone else 8), (r.run_id, on[r.run_id])
            if held:
                dst = [aligned_empty(ALIGNED.block_bytes) for _ in range(8)]
                assert store.get_blocks(keys[8 * k:8 * k + 8], dst) == 8
                assert all(np.array_equal(a, b) for a, b in zip(dst, want[8 * k:8 * k + 8]))


def test_runs_batch_is_the_runs_batches_end_to_end():
    """BlockList.runs_batch over several runs equals each run's hashed_batch,
    concatenated, streams numbered on (run j's range r: j * ranges + r); and
    merges nothing across runs or ranges when hashing."""
    buf = aligned_empty(12 * ALIGNED.block_bytes)
    blocks = BlockList.of([buf[i * ALIGNED.block_bytes:(i + 1) * ALIGNED.block_bytes]
                           for i in (0, 1, 2, 5, 6, 9, 10, 11, 3)], ALIGNED, 9, "t", True)
    counts, devs = [3, 2, 4], [0, 1, 0]
    bases, rbs = [1 << 20, 0, 4 << 20], [3 * 4096, 2 * 4096, 4 * 4096]
    got, streams = blocks.runs_batch(counts, devs, bases, rbs)
    want, want_streams, first = [], [], 0
    for j, n in enumerate(counts):
        b, s = blocks.sub(first, first + n).hashed_batch(devs[j], bases[j], rbs[j])
        want.append(b)
        want_streams.append(s.astype(np.int64) + j * ALIGNED.ranges)
        first += n
    cat = IOBatch.concat(want)
    for field in ("addrs", "devs", "offsets", "lens"):
        assert np.array_equal(getattr(got, field), getattr(cat, field)), field
    assert np.array_equal(streams, np.concatenate(want_streams))
    assert got.nbytes == 9 * ALIGNED.block_bytes


@pytest.mark.parametrize("nruns", [3, 40], ids=["few-ios", "numpy"])
def test_a_bad_run_among_images_read_together_ends_the_prefix_there(tmp_path, nruns):
    """get_run across whole runs straight into an aligned buffer (one range
    per run): up to FEW_IOS ranges are batched with Python ints, more with
    numpy; either way the blocks before a bad run come back verified, the
    bad run is dropped and named, and the runs after it stay whole."""
    from kvblock import create_file
    from kvblock.io.engine import FEW_IOS

    assert (nruns <= FEW_IOS) == (nruns == 3)
    geom = Geometry(num_layers=1, num_kv_heads=1, head_dim=2048, dtype="float16",
                    block_tokens=1, kv_parts=1)          # 4 KiB blocks, one range
    path = tmp_path / "s.img"
    create_file(path, 16 * MIB)
    with _format(path, geom) as store:
        keys, want = _runs(store, geom, [1] * nruns)
        out = aligned_empty(nruns * geom.block_bytes)
        assert store.get_run(keys, out) == nruns            # intact: all of them
        assert np.array_equal(out, np.concatenate(want))
        bad = store.index.segments(normalize_keys(keys[1:2]))[0][0]   # the second run
        _, off = store.regions.address(bad.region, bad.offset)
    _flip_byte(path, off + 100)
    with KVStore.open([str(path)]) as store:
        out[:] = 0
        assert store.get_run(keys, out) == 1
        assert np.array_equal(out[:geom.block_bytes], want[0])
        assert store.stats()["checksum_failures"] == 1
        assert store.last_checksum_failure[2:] == (bad.run_id, 0)
        assert store.lookup(keys[1:2]) == 0                 # dropped
        rest = aligned_empty((nruns - 2) * geom.block_bytes)
        assert store.get_run(keys[2:], rest) == nruns - 2
        assert np.array_equal(rest, np.concatenate(want[2:]))
    with KVStore.open([str(path)], verify="never") as store:   # one I/O per run, unhashed
        seen = _watch(store)
        rest[:] = 0
        assert store.get_run(keys[2:], rest) == nruns - 2
        assert np.array_equal(rest, np.concatenate(want[2:]))
        (batch,) = [b for k, b in seen if k == "read"]
        assert len(batch) == nruns - 2
