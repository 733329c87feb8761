"""Checkpoints: pinned header layout, round trip, corruption handling."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvblock.format import FORMAT_VERSION
from kvblock.format.checkpoint import (HEADER_BYTES, MAGIC, REGION_DTYPE, RUN_DTYPE, Checkpoint,
                                       CheckpointHeader, decode_header, decode_payload)

RANGES = 3

# xxh64 hex digest of sample_checkpoint().encode() (header + payload).
# If this changes, bump FORMAT_VERSION (tests/format/test_format_version.py enforces it).
GOLDEN_DIGEST = "889d7e6259f7e685"   # format version 2


def sample_checkpoint(ranges=RANGES, nblocks=(2, 1, 4), nregions=5) -> Checkpoint:
    regions = np.zeros(nregions, dtype=REGION_DTYPE)
    regions["generation"] = [10 + i for i in range(nregions)]
    regions["seal_seq"] = [0 if i % 2 else 100 + i for i in range(nregions)]
    runs = np.zeros(len(nblocks), dtype=RUN_DTYPE)
    for i, n in enumerate(nblocks):
        runs[i] = (1000 + i, i % max(nregions, 1), 10 + i, 4096 * 64 * i, n, 0)
    total = sum(nblocks)
    keys = np.arange(total * 16, dtype=np.uint64).astype(np.uint8).reshape(total, 16)
    sums = (np.arange(len(nblocks) * ranges, dtype=np.uint64).reshape(len(nblocks), ranges)
            * np.uint64(0x9E3779B97F4A7C15))
    return Checkpoint(generation=7, journal_seq=0x1234_5678_9A, next_run_id=1003,
                      ranges=ranges, regions=regions, runs=runs, keys=keys, checksums=sums)


def assert_same(a: Checkpoint, b: Checkpoint):
    assert (a.generation, a.journal_seq, a.next_run_id, a.ranges) == \
        (b.generation, b.journal_seq, b.next_run_id, b.ranges)
    np.testing.assert_array_equal(a.regions["generation"], b.regions["generation"])
    np.testing.assert_array_equal(a.regions["seal_seq"], b.regions["seal_seq"])
    np.testing.assert_array_equal(a.regions["sealed_at"], b.regions["sealed_at"])
    for f in ("run_id", "region", "generation", "offset", "nblocks"):
        np.testing.assert_array_equal(a.runs[f], b.runs[f])
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.checksums, b.checksums)
    assert b.keys.shape == (len(a.keys), 16) and b.keys.dtype == np.uint8
    assert b.checksums.shape == (len(a.runs), a.ranges) and b.checksums.dtype == np.uint64


def rechecksum_header(buf: bytearray) -> bytes:
    struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
    return bytes(buf)


# ------------------------------------------------------------------ golden layout
def test_golden_header_layout():
    cp = sample_checkpoint()
    b = cp.encode()
    payload = b[HEADER_BYTES:]
    assert b[0:8] == MAGIC == b"KVBLKCP\0"
    assert struct.unpack_from("<I", b, 8)[0] == FORMAT_VERSION
    assert struct.unpack_from("<I", b, 12)[0] == RANGES
    assert struct.unpack_from("<Q", b, 16)[0] == 7
    assert struct.unpack_from("<Q", b, 24)[0] == 0x1234_5678_9A
    assert struct.unpack_from("<Q", b, 32)[0] == 1003
    assert struct.unpack_from("<Q", b, 40)[0] == 3           # runs
    assert struct.unpack_from("<Q", b, 48)[0] == 7           # keys
    assert struct.unpack_from("<II", b, 56) == (5, 0)        # regions, 0
    assert struct.unpack_from("<Q", b, 64)[0] == len(payload)
    assert struct.unpack_from("<Q", b, 72)[0] == xxhash.xxh64_intdigest(payload)
    assert b[80:4088] == bytes(4088 - 80)
    assert struct.unpack_from("<Q", b, 4088)[0] == xxhash.xxh64_intdigest(b[:4088])
    # payload: regions (16 B each), runs (32 B each), keys (16 B each), sums (8 B each)
    assert len(payload) == 5 * 16 + 3 * 32 + 7 * 16 + 3 * RANGES * 8
    assert struct.unpack_from("<IIQ", payload, 0) == (10, 0, 100)
    assert struct.unpack_from("<IIQ", payload, 16) == (11, 0, 0)
    runs_at = 5 * 16
    assert struct.unpack_from("<QIIQII", payload, runs_at) == (1000, 0, 10, 0, 2, 0)
    assert struct.unpack_from("<QIIQII", payload, runs_at + 32) == (1001, 1, 11, 4096 * 64, 1, 0)
    keys_at = runs_at + 3 * 32
    assert payload[keys_at:keys_at + 16] == bytes(range(16))
    sums_at = keys_at + 7 * 16
    assert struct.unpack_from("<Q", payload, sums_at + 8)[0] == 0x9E3779B97F4A7C15
    assert sums_at + 9 * 8 == len(payload)
    assert xxhash.xxh64_hexdigest(b) == GOLDEN_DIGEST


def test_golden_region_entry_pins_the_seal_time():
    """The golden sample's regions all have sealed_at 0, so its digest and
    field checks pinned neither the width nor the byte order of the u32 at
    4 in each region entry (a big-endian sealed_at passed every format
    test).  A nonzero seal time, spelled out byte by byte."""
    cp = sample_checkpoint()
    cp.regions["sealed_at"] = [0x01020304 + i for i in range(len(cp.regions))]
    payload = cp.encode()[HEADER_BYTES:]
    assert payload[0:16] == (struct.pack("<I", 10) + bytes([4, 3, 2, 1])
                             + struct.pack("<Q", 100))
    assert struct.unpack_from("<IIQ", payload, 16) == (11, 0x01020305, 0)
    assert payload[:5 * 16] == b"".join(
        struct.pack("<IIQ", 10 + i, 0x01020304 + i, 0 if i % 2 else 100 + i) for i in range(5))
    assert_same(cp, round_trip(cp))


def test_dtypes_are_pinned():
    assert REGION_DTYPE.itemsize == 16 and RUN_DTYPE.itemsize == 32
    assert [REGION_DTYPE.fields[n][1] for n in REGION_DTYPE.names] == [0, 4, 8]
    assert [RUN_DTYPE.fields[n][1] for n in RUN_DTYPE.names] == [0, 8, 12, 16, 24, 28]


# ------------------------------------------------------------------ round trip
def round_trip(cp: Checkpoint) -> Checkpoint:
    b = cp.encode()
    h = decode_header(b[:HEADER_BYTES])
    assert isinstance(h, CheckpointHeader)
    assert h.payload_bytes == len(b) - HEADER_BYTES
    back = decode_payload(h, b[HEADER_BYTES:])
    assert back is not None
    return back


def test_round_trip():
    cp = sample_checkpoint()
    back = round_trip(cp)
    assert_same(cp, back)
    h = decode_header(cp.encode())
    assert h == CheckpointHeader(generation=7, journal_seq=0x1234_5678_9A, next_run_id=1003,
                                 ranges=3, run_count=3, key_count=7, region_count=5,
                                 payload_bytes=h.payload_bytes,
                                 payload_checksum=h.payload_checksum)


@pytest.mark.parametrize("ranges,nblocks,nregions", [
    (1, (1,), 1), (3, (), 4), (3, (), 0), (124, (5, 7), 2), (2, tuple(range(1, 40)), 64)])
def test_round_trip_shapes(ranges, nblocks, nregions):
    cp = sample_checkpoint(ranges=ranges, nblocks=nblocks, nregions=nregions)
    assert_same(cp, round_trip(cp))


def test_decode_payload_accepts_memoryview_and_longer_buffer():
    cp = sample_checkpoint()
    b = cp.encode()
    h = decode_header(memoryview(b))
    assert_same(cp, decode_payload(h, memoryview(b)[HEADER_BYTES:]))
    assert_same(cp, decode_payload(h, b[HEADER_BYTES:] + b"\xff" * 4096))


def test_decoded_arrays_are_writable_copies():
    cp = sample_checkpoint()
    back = round_trip(cp)
    back.checksums[0, 0] = 1
    back.keys[0, 0] = 1
    back.regions["generation"][0] = 99


# ------------------------------------------------------------------ corruption
def test_corrupt_header_returns_none():
    b = sample_checkpoint().encode()
    for pos in [*range(0, 80), *range(80, 4088, 131), *range(4088, 4096)]:
        bad = bytearray(b[:HEADER_BYTES])
        bad[pos] ^= 0x08
        assert decode_header(bytes(bad)) is None, pos


@pytest.mark.parametrize("data", [b"", bytes(4096), b"\xff" * 4096, MAGIC + bytes(4088)])
def test_empty_or_foreign_slot_returns_none(data):
    assert decode_header(data) is None


def test_short_header_returns_none():
    b = sample_checkpoint().encode()
    for n in (0, 8, 80, 4095):
        assert decode_header(b[:n]) is None


def test_wrong_version_returns_none():
    buf = bytearray(sample_checkpoint().encode()[:HEADER_BYTES])
    struct.pack_into("<I", buf, 8, FORMAT_VERSION + 1)
    assert decode_header(rechecksum_header(buf)) is None


def test_corrupt_payload_returns_none():
    b = sample_checkpoint().encode()
    h = decode_header(b)
    payload = b[HEADER_BYTES:]
    for pos in range(0, len(payload), 7):
        bad = bytearray(payload)
        bad[pos] ^= 0x40
        assert decode_payload(h, bytes(bad)) is None, pos
    assert decode_payload(h, payload[:-1]) is None
    assert decode_payload(h, b"") is None


@pytest.mark.parametrize("field_at,fmt,delta", [
    (12, "<I", 1),    # ranges
    (40, "<Q", 1),    # run count
    (48, "<Q", 1),    # key count
    (56, "<I", 1),    # region count
    (64, "<Q", 8),    # payload bytes
    (64, "<Q", -8),
    (40, "<Q", 1 << 40),
])
def test_header_counts_disagreeing_with_payload_bytes_return_none(field_at, fmt, delta):
    buf = bytearray(sample_checkpoint().encode()[:HEADER_BYTES])
    value = struct.unpack_from(fmt, buf, field_at)[0]
    struct.pack_into(fmt, buf, field_at, value + delta)
    assert decode_header(rechecksum_header(buf)) is None


def test_payload_whose_run_blocks_disagree_with_key_count_returns_none():
    cp = sample_checkpoint()
    cp.runs["nblocks"][0] += 1   # 8 blocks claimed, 7 keys stored
    b = cp.encode()
    h = decode_header(b)
    assert h is not None  # sizes agree: the header alone cannot tell
    assert decode_payload(h, b[HEADER_BYTES:]) is None


def test_header_bytes_constant():
    assert HEADER_BYTES == 4096


def test_a_header_whose_reserved_word_is_not_zero_returns_none():
    """The u32 after the region count (offset 60) is 0 in every checkpoint
    this format writes (the golden layout); a header with another value there
    is not one of them, and was decoded."""
    buf = bytearray(sample_checkpoint().encode()[:HEADER_BYTES])
    assert decode_header(bytes(buf)) is not None
    struct.pack_into("<I", buf, 60, 1)
    assert decode_header(rechecksum_header(buf)) is None
