"""read_hashed: a read that returns each stream's data checksum, computed in C
as the pieces land.  The digests must equal format.checksum.data_checksum of
the bytes read, for every engine, batch shape and staging path; bad stream
numbering and failed reads raise typed errors."""

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblock.devices import Device
from kvblock.errors import ConfigError, IOFailedError
from kvblock.format.checksum import data_checksum
from kvblock.io import IOBatch, native, open_engine
from kvblock.io import engine as engine_mod
from kvblock.io.uring import probe
from kvblock.memory import HostBuffer

MIB = 1 << 20
BLOCK = 4096


def _fill(path, data: np.ndarray) -> None:
    with open(path, "r+b") as f:
        f.write(data.tobytes())


def _expected(data, offsets, lens, streams, seeds):
    """data_checksum of each stream's bytes, gathered in batch order."""
    out = []
    for s, seed in enumerate(seeds):
        parts = [data[o:o + n] for o, n, t in zip(offsets, lens, streams) if t == s]
        out.append(data_checksum(np.concatenate(parts), seed))
    return out


def test_digests_equal_data_checksum_across_pieces_and_streams(engine_name, target):
    """Streams longer than a hash piece, shorter than a block-aligned piece,
    several I/Os per stream, reads in an order unlike the device's."""
    path = target(32 * MIB)
    data = np.random.default_rng(7).integers(0, 256, 32 * MIB, dtype=np.uint8)
    _fill(path, data)
    lens = [3 * MIB + 8 * BLOCK, BLOCK, 2 * BLOCK, 5 * MIB, 7 * BLOCK, MIB]
    offsets = [20 * MIB, 0, 9 * MIB, 4 * MIB, 31 * MIB, 12 * MIB]
    streams = [0, 1, 1, 2, 2, 3]
    seeds = [1, 2**64 - 1, 0, 12345678901234567]
    with Device(path) as dev, open_engine([dev], engine_name, queue_depth=8) as eng, \
            HostBuffer(sum(lens)) as buf:
        addrs = np.cumsum([0] + lens[:-1]).astype(np.uint64) + np.uint64(buf.address)
        got = eng.read_hashed(IOBatch(addrs, 0, offsets, lens), streams, seeds)
        assert got.dtype == np.uint64
        assert [int(x) for x in got] == _expected(data, offsets, lens, streams, seeds)
        at = 0
        for o, n in zip(offsets, lens):    # and the bytes are where the batch put them
            assert np.array_equal(buf.array[at:at + n], data[o:o + n])
            at += n


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 200), st.booleans()), min_size=1, max_size=12),
       st.integers(0, 2**64 - 1))
def test_any_stream_layout_hashes_like_xxhash(file_target, pieces, seed):
    """Random piece lengths (in blocks), each piece continuing its stream or
    starting the next one."""
    path = file_target(8 * MIB, name="hashed.img")
    data = np.random.default_rng(seed % 1000).integers(0, 256, 8 * MIB, dtype=np.uint8)
    _fill(path, data)
    lens = [n * BLOCK for n, _ in pieces]
    streams, s = [], 0
    for k, (_, new) in enumerate(pieces):
        s += 1 if (new and k) else 0
        streams.append(s)
    seeds = [(seed + i) % 2**64 for i in range(s + 1)]
    offsets = [(k * 997 * BLOCK) % (8 * MIB - n) // BLOCK * BLOCK for k, n in enumerate(lens)]
    with Device(path, exclusive=False) as dev, open_engine([dev]) as eng, \
            HostBuffer(sum(lens)) as buf:
        addrs = np.cumsum([0] + lens[:-1]).astype(np.uint64) + np.uint64(buf.address)
        got = eng.read_hashed(IOBatch(addrs, 0, offsets, lens), streams, seeds)
    assert [int(x) for x in got] == _expected(data, offsets, lens, streams, seeds)


def test_unaligned_host_buffer_is_staged_and_still_hashed(engine_name, file_target):
    path = file_target(4 * MIB)
    data = np.random.default_rng(9).integers(0, 256, 4 * MIB, dtype=np.uint8)
    _fill(path, data)
    with Device(path) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(2 * MIB + BLOCK) as buf:
        addr = buf.address + 512             # not block aligned: goes through staging
        got = eng.read_hashed(IOBatch.single(addr, 0, MIB, MIB), [0], [99])
        assert int(got[0]) == data_checksum(data[MIB:2 * MIB], 99)
        assert np.array_equal(buf.array[512:512 + MIB], data[MIB:2 * MIB])


def test_pieces_are_hashed_as_they_land_on_the_ring(monkeypatch, file_target):
    """On io_uring the read is cut into HASH_PIECE pieces and the digests come
    from the native hasher handed to the run (not from a pass afterwards)."""
    if not probe()[0]:
        pytest.skip(f"io_uring unavailable here: {probe()[1]}")
    path = file_target(8 * MIB)
    data = np.random.default_rng(5).integers(0, 256, 8 * MIB, dtype=np.uint8)
    _fill(path, data)
    seen = []
    monkeypatch.setattr(native, "hash_pieces", lambda *a: pytest.fail("hashed afterwards"))
    with Device(path) as dev, open_engine([dev], "uring") as eng, HostBuffer(6 * MIB) as buf:
        run = type(eng)._run

        def spy(self, op, batch, qd, results, latency, hasher):
            seen.append((len(batch), int(batch.lens.max()), hasher is not None))
            return run(self, op, batch, qd, results, latency, hasher)

        monkeypatch.setattr(type(eng), "_run", spy)
        got = eng.read_hashed(IOBatch.single(buf.address, 0, MIB, 6 * MIB), [0], [4])
    assert int(got[0]) == data_checksum(data[MIB:7 * MIB], 4)
    assert seen == [(6 * MIB // engine_mod.HASH_PIECE, engine_mod.HASH_PIECE, True)]


def test_worker_threads_can_hash_as_pieces_land(file_target):
    """The threads engine hashes after the read by default; with hashing as
    pieces land its C workers take turns at the in-order cursor (and finish
    picks up what none of them got to): the digests are the same."""
    path = file_target(16 * MIB)
    data = np.random.default_rng(11).integers(0, 256, 16 * MIB, dtype=np.uint8)
    _fill(path, data)
    lens = [5 * MIB, 3 * MIB + BLOCK, 7 * MIB]
    offsets = [8 * MIB, 0, 4 * BLOCK]
    streams, seeds = [0, 0, 1], [21, 22]
    with Device(path) as dev, open_engine([dev], "threads", queue_depth=8) as eng, \
            HostBuffer(sum(lens)) as buf:
        assert eng.hashes_as_reads_land is False
        eng.hashes_as_reads_land = True
        addrs = np.cumsum([0] + lens[:-1]).astype(np.uint64) + np.uint64(buf.address)
        for _ in range(5):                     # the workers race differently each time
            got = eng.read_hashed(IOBatch(addrs, 0, offsets, lens), streams, seeds)
            assert [int(x) for x in got] == _expected(data, offsets, lens, streams, seeds)


def test_a_read_of_one_piece_or_less_is_hashed_after_it(monkeypatch, engine_name, file_target):
    """Nothing to overlap in a read of at most HASH_PIECE bytes: no native
    hasher (it cost small gets ~25 us each), the same digests."""
    path = file_target(MIB)
    data = np.random.default_rng(13).integers(0, 256, MIB, dtype=np.uint8)
    _fill(path, data)
    monkeypatch.setattr(native, "Hasher", lambda *a: pytest.fail("native hasher for a small read"))
    with Device(path) as dev, open_engine([dev], engine_name) as eng, HostBuffer(MIB) as buf:
        got = eng.read_hashed(IOBatch.single(buf.address, 0, 8 * BLOCK, BLOCK), [0], [3])
        assert int(got[0]) == data_checksum(data[8 * BLOCK:9 * BLOCK], 3)
        at = np.array([0, BLOCK], np.uint64)
        got = eng.read_hashed(IOBatch(at + np.uint64(buf.address), 0, at + np.uint64(BLOCK),
                                      BLOCK), [0, 1], [4, 5])
        assert [int(x) for x in got] == [data_checksum(data[BLOCK:2 * BLOCK], 4),
                                         data_checksum(data[2 * BLOCK:3 * BLOCK], 5)]


@pytest.mark.parametrize("mapped", [True, False], ids=["shm-file", "disk-file"])
def test_a_copy_out_of_a_mapping_hashes_as_it_copies(monkeypatch, shm_target, file_target,
                                                     mapped):
    """Out of a mapped tmpfs file, every hashed read is hashed by the copy,
    chunk by chunk, in the copy's native call; a small read through the
    kernel (at most HASH_PIECE) is hashed after it.  The digests are the
    same either way."""
    path = (shm_target if mapped else file_target)(MIB)
    data = np.random.default_rng(17).integers(0, 256, MIB, dtype=np.uint8)
    _fill(path, data)
    after = []
    real = native.hash_pieces
    monkeypatch.setattr(native, "hash_pieces", lambda *a: (after.append(1), real(*a))[1])
    with Device(path) as dev, open_engine([dev]) as eng, HostBuffer(MIB) as buf:
        assert eng.mapped(0) == mapped
        for length in (BLOCK, 64 << 10, engine_mod.HASH_PIECE):
            after.clear()
            got = eng.read_hashed(IOBatch.single(buf.address, 0, 2 * BLOCK, length), [0], [9])
            assert int(got[0]) == data_checksum(data[2 * BLOCK:2 * BLOCK + length], 9)
            assert np.array_equal(buf.array[:length], data[2 * BLOCK:2 * BLOCK + length])
            assert bool(after) != mapped, length


@pytest.mark.parametrize("n, streams, seeds, why", [
    (2, [1, 1], [0, 0], "must count 0, 1"),
    (2, [0, 2], [0, 0, 0], "must count 0, 1"),
    (3, [0, 1, 0], [0, 0], "must count 0, 1"),
    (2, [0, 0], [0, 0], "one seed each"),
    (2, [0], [0], "1 stream indices for 2 I/Os"),
    # more than FEW_IOS entries: numpy's checks instead of Python's
    (40, [*range(38), 39, 39], [0] * 40, "must count 0, 1"),
    (40, [*range(39), 37], [0] * 39, "must count 0, 1"),
    (40, [0] * 40, [0, 0], "one seed each"),
    # not stream numbers or seeds at all: a ConfigError too, not numpy's
    # OverflowError or int()'s ValueError (nor a float cut to an int)
    (1, [-1], [0], "read_hashed: stream"),
    (2, [0, 0.5], [0], "stream indices must be integers"),
    (1, ["a"], [0], "stream indices must be integers"),
    (1, [0], ["x"], "seeds must be integers"),
    (1, [0], [None], "seeds must be integers"),
    (1, [0], [1.5], "seeds must be integers"),
    (1, [0], np.array([1.5]), "seeds must be integers"),
])
def test_bad_stream_numbering_is_a_config_error(file_target, n, streams, seeds, why):
    from kvblock.io.engine import FEW_IOS

    assert n <= FEW_IOS or n == 40 > FEW_IOS
    with Device(file_target(MIB)) as dev, open_engine([dev]) as eng, HostBuffer(MIB) as buf:
        at = np.arange(n, dtype=np.uint64) * np.uint64(BLOCK)
        with pytest.raises(ConfigError, match=why):
            eng.read_hashed(IOBatch(at + np.uint64(buf.address), 0, at, BLOCK), streams, seeds)


def test_failed_read_raises_and_frees_the_hasher(engine_name, file_target):
    """A piece past the end of the device fails the batch with the usual
    typed error; the engine stays usable (the native hasher was finished)."""
    path = file_target(2 * MIB)
    with Device(path) as dev, open_engine([dev], engine_name) as eng, \
            HostBuffer(2 * MIB) as buf:
        batch = IOBatch(np.array([0, MIB], np.uint64) + np.uint64(buf.address), 0,
                        [0, 2 * MIB], MIB)
        with pytest.raises(IOFailedError, match="ends past the device"):
            eng.read_hashed(batch, [0, 1], [0, 0])
        ok = eng.read_hashed(IOBatch.single(buf.address, 0, 0, MIB), [0], [0])
        assert int(ok[0]) == data_checksum(np.zeros(MIB, np.uint8), 0)


def test_a_close_racing_read_hashed_leaves_no_hasher_unfreed(monkeypatch, file_target):
    """close() from another thread can land right after read_hashed made its
    native hasher: either the read is refused (engine closed) or close waits
    for it, but the hasher, native memory, is freed either way."""
    if not probe()[0]:
        pytest.skip(f"io_uring unavailable here: {probe()[1]}")
    path = file_target(8 * MIB)
    made, closers = [], []

    class CloseMeanwhile(native.Hasher):
        __slots__ = ()

        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)
            closer = threading.Thread(target=eng.close)
            closers.append(closer)
            closer.start()
            closer.join(0.5)              # done, unless it waits for this read

    monkeypatch.setattr(native, "Hasher", CloseMeanwhile)
    with Device(path) as dev, HostBuffer(2 * MIB) as buf:
        eng = open_engine([dev], "uring")
        try:
            got = eng.read_hashed(IOBatch.single(buf.address, 0, 0, 2 * MIB), [0], [3])
        except ConfigError as e:
            assert "engine is closed" in str(e)
        else:
            assert int(got[0]) == data_checksum(np.zeros(2 * MIB, np.uint8), 3)
        closers[0].join(20)
    assert not closers[0].is_alive() and eng.closed
    assert len(made) == 1 and made[0].handle == native.ffi.NULL


def test_native_hasher_rejects_bad_streams_and_reports_unfinished_pieces():
    buf = np.arange(3 * BLOCK, dtype=np.uint64).view(np.uint8)[:3 * BLOCK].copy()
    addrs = np.array([buf.ctypes.data + i * BLOCK for i in range(3)], np.uint64)
    lens = np.full(3, BLOCK, np.uint64)
    seeds = np.array([5, 6], np.uint64)
    digests = np.zeros(2, np.uint64)
    native.hash_pieces(addrs, lens, np.array([0, 0, 1], np.uint32), seeds, digests)
    assert int(digests[0]) == data_checksum(buf[:2 * BLOCK], 5)
    assert int(digests[1]) == data_checksum(buf[2 * BLOCK:], 6)
    with pytest.raises(ValueError, match="Invalid argument"):
        native.hash_pieces(addrs, lens, np.array([0, 2, 2], np.uint32), seeds, digests)
    # a run that never completed piece 1: finish says so instead of a digest
    results = np.zeros(3, np.int64)
    h = native.Hasher(addrs, lens, np.array([0, 0, 1], np.uint32), seeds, results, digests)
    assert (results == np.iinfo(np.int64).min).all()      # every piece pending
    results[0] = BLOCK
    assert h.finish() == -11                                # -EAGAIN
    # pieces that came back short mark their stream failed (digest 0)
    results = np.zeros(3, np.int64)
    h = native.Hasher(addrs, lens, np.array([0, 0, 1], np.uint32), seeds, results, digests)
    results[:] = [BLOCK, 100, BLOCK]
    assert h.finish() == 1
    assert int(digests[0]) == 0 and int(digests[1]) == data_checksum(buf[2 * BLOCK:], 6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 200_000), st.integers(0, 9000),
       st.integers(0, 2**64 - 1), st.booleans())
def test_block_digests_and_range_checksums_in_one_pass(nranges, nblocks, block_len, pad, seed,
                                                       shuffled):
    """native.hash_blocks_ranges (what a put hashes its blocks and ranges
    with): each block's digest and each range's checksum (its blocks in
    order, then ``pad`` zero bytes) equal xxhash's, for blocks anywhere in
    memory and blocks that cross the native code's 64 KiB chunks."""
    import xxhash

    n = nranges * nblocks
    data = np.random.default_rng(seed % 997).integers(0, 256, n * block_len, dtype=np.uint8)
    order = np.random.default_rng(seed % 991).permutation(n) if shuffled else np.arange(n)
    # block i (range-major) lies at slot order[i] of the buffer
    at = [data.ctypes.data + int(order[i]) * block_len for i in range(n)]
    block = [data[int(order[i]) * block_len:(int(order[i]) + 1) * block_len] for i in range(n)]
    got_blocks, got_ranges = native.hash_blocks_ranges(at, nranges, nblocks, block_len, pad,
                                                       seed)
    assert got_blocks.shape == (nranges, nblocks)
    assert got_blocks.reshape(-1).tolist() == [xxhash.xxh3_64_intdigest(b, seed=seed)
                                               for b in block]
    assert got_ranges.tolist() == [
        xxhash.xxh3_64_intdigest(b"".join(b.tobytes() for b in block[r * nblocks:
                                                                     (r + 1) * nblocks])
                                 + bytes(pad), seed=seed)
        for r in range(nranges)]
    with pytest.raises(ValueError, match="addresses for"):
        native.hash_blocks_ranges(at[:-1], nranges, nblocks, block_len, pad, seed)


def test_a_native_hasher_that_cannot_be_made_is_a_typed_error(monkeypatch, file_target):
    """kvb_hasher_create failing (ENOMEM) raised a plain ValueError out of a
    hashed read: not a KVBlockError, so callers that handle kvblock's errors
    (a store read, an engine integration) did not.  It is a DeviceError
    (errno ENOMEM) naming the read; the engine stays usable."""
    import errno

    from kvblock.errors import DeviceError

    path = file_target(16 * MIB)
    data = np.random.default_rng(17).integers(0, 256, 16 * MIB, dtype=np.uint8)
    _fill(path, data)
    real = native.lib()

    class NoMemory:
        def __getattr__(self, name):
            return getattr(real, name)

        def kvb_hasher_create(self, *args):
            args[-1][0] = -errno.ENOMEM
            return native.ffi.NULL

    with Device(path) as dev, open_engine([dev], "threads", queue_depth=4) as eng, \
            HostBuffer(8 * MIB) as buf:
        eng.hashes_as_reads_land = True
        batch = IOBatch.single(buf.address, 0, 0, 8 * MIB)
        monkeypatch.setattr(native, "lib", lambda: NoMemory())
        with pytest.raises(DeviceError, match="hashed read of .* Cannot allocate memory") as e:
            eng.read_hashed(batch, [0], [7])
        assert e.value.errno == errno.ENOMEM
        monkeypatch.setattr(native, "lib", lambda: real)
        got = eng.read_hashed(batch, [0], [7])
        assert int(got[0]) == data_checksum(data[:8 * MIB], 7)


@pytest.mark.parametrize("case", ["digests short", "results short", "lens short",
                                  "streams int64", "digests read-only"])
def test_native_hasher_arrays_that_do_not_fit_the_pieces_are_refused(case):
    """The native hasher indexes every array up to the piece count (and
    the digests up to the stream count) and writes the results and digests:
    one shorter than that was read or written past its end (here into the
    rest of the array it is a view of; in general the heap), a wrong dtype
    read as another (a uint32 view of int64 stream numbers), a read-only
    array written.  Each is refused before the native call."""
    buf = np.arange(3 * BLOCK, dtype=np.uint64).view(np.uint8)[:3 * BLOCK].copy()
    addrs = np.array([buf.ctypes.data + i * BLOCK for i in range(3)], np.uint64)
    lens = np.full(3, BLOCK, np.uint64)
    streams = np.array([0, 0, 1], np.uint32)
    seeds = np.array([5, 6], np.uint64)
    around = np.zeros(4, np.uint64)
    digests = np.zeros(2, np.uint64)
    results = np.zeros(3, np.int64)
    if case == "digests short":
        digests = around[:1]
    elif case == "results short":
        results = around.view(np.int64)[:2]
    elif case == "lens short":
        around[:] = BLOCK
        lens = around[:2]
    elif case == "streams int64":
        streams = streams.astype(np.int64)
    else:
        digests.flags.writeable = False
    before = around.copy()
    with pytest.raises(ConfigError):
        if case == "results short":
            native.Hasher(addrs, lens, streams, seeds, results, digests).finish()
        else:
            native.hash_pieces(addrs, lens, streams, seeds, digests)
    with pytest.raises(ConfigError):
        native.Hasher(addrs, lens, streams, seeds, results, digests).finish()
    assert np.array_equal(around, before) and not digests.any()


@pytest.mark.parametrize("case", ["lens strided", "addresses strided", "digests strided",
                                  "seeds an int", "seeds a generator", "addresses a list"])
def test_native_hasher_arrays_not_contiguous_or_unsized_are_config_errors(case):
    """A strided (non-contiguous) array was cffi's bare ValueError ('ndarray
    is not C-contiguous') out of ffi.from_buffer, and seeds without a
    length (an int, a generator) a bare TypeError out of len(): each is a
    ConfigError naming the argument and the fix, before any native call."""
    buf = np.zeros(2 * BLOCK, np.uint8)
    addrs = np.array([buf.ctypes.data, buf.ctypes.data + BLOCK], np.uint64)
    lens = np.full(2, BLOCK, np.uint64)
    streams = np.array([0, 1], np.uint32)
    seeds = np.array([5, 6], np.uint64)
    digests = np.zeros(2, np.uint64)
    results = np.zeros(2, np.int64)
    name = {"lens": "lengths"}.get(case.split()[0], case.split()[0])
    if case == "lens strided":
        lens = np.full(4, BLOCK, np.uint64)[::2]
    elif case == "addresses strided":
        addrs = np.repeat(addrs, 2)[::2]
    elif case == "digests strided":
        digests = np.zeros(4, np.uint64)[::2]
    elif case == "seeds an int":
        seeds = 5
    elif case == "seeds a generator":
        seeds = (s for s in (5, 6))
    else:
        addrs = addrs.tolist()
    with pytest.raises(ConfigError, match=name):
        native.hash_pieces(addrs, lens, streams, seeds, digests)
    with pytest.raises(ConfigError, match=name):
        native.Hasher(addrs, lens, streams, seeds, results, digests).finish()
    assert not digests.any()


def test_submit_refuses_hashing_arrays_that_do_not_fit_the_batch(shm_target):
    """submit(hashing=...) hands its arrays to the native copy or hasher
    as they are: stream numbers fewer than the batch's entries were read
    past their end, digests fewer than the streams written past theirs."""
    path = shm_target(4 * MIB)
    with Device(path) as dev, open_engine([dev], mapped_reads=True) as eng, \
            HostBuffer(2 * BLOCK) as buf:
        assert eng.mapped(0)
        batch = IOBatch([buf.address, buf.address + BLOCK], 0, [0, BLOCK], BLOCK)
        around = np.zeros(3, np.uint64)
        for streams, seeds, digests in (
                (np.array([0], np.uint32), np.array([1, 2], np.uint64), np.zeros(2, np.uint64)),
                (np.array([0, 1], np.uint32), np.array([1, 2], np.uint64), around[:1])):
            with pytest.raises(ConfigError):
                eng.submit(engine_mod.OP_READ, batch, hashing=(streams, seeds, digests))
        assert not around.any()


def test_submit_refuses_stream_numbers_past_the_seeds_on_the_mapped_copy(shm_target):
    """The mapped copy hashes each helper's part with its own streams
    (renumbered from the part's first) and the seeds and digests sliced
    to them: stream numbers past the seeds made those slices short (numpy
    cuts a slice at the end), and the native copy read seeds and wrote
    digests past the arrays (found in the final read: a digest beside
    the array overwritten).  Refused now, nothing written."""
    path = shm_target(4 * MIB)
    with Device(path) as dev, open_engine([dev], mapped_reads=True) as eng, \
            HostBuffer(2 * BLOCK) as buf:
        assert eng.mapped(0)
        batch = IOBatch([buf.address, buf.address + BLOCK], 0, [0, BLOCK], BLOCK)
        seeds, digests = np.array([1, 2, 3], np.uint64), np.full(3, 12345, np.uint64)
        with pytest.raises(ConfigError, match="stream"):
            eng.submit(engine_mod.OP_READ, batch,
                       hashing=(np.array([1, 2], np.uint32), seeds[:2], digests[:2]))
        assert digests[2] == 12345
