"""The block digest trailer: pinned byte layout, round trip, its checksum."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvblock.format import trailer


def test_golden_byte_layout():
    digests = np.array([[0x0102030405060708, 2, 3], [4, 5, 0xFFFFFFFFFFFFFFFF]], np.uint64)
    b = trailer.encode(digests, 4096).tobytes()
    assert len(b) == 4096
    # range by range, block by block, little-endian u64, then zeros
    assert b[:8] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert struct.unpack_from("<6Q", b, 0) == (0x0102030405060708, 2, 3, 4, 5, 2**64 - 1)
    assert b[48:] == bytes(4096 - 48)
    # if this changes, bump FORMAT_VERSION (tests/format/test_format_version.py enforces it)
    assert xxhash.xxh64_hexdigest(b) == "ae2842f12e9d0407"


def test_round_trip_and_checksum():
    rng = np.random.default_rng(3)
    digests = rng.integers(0, 2**63, (5, 7), dtype=np.uint64)
    b = trailer.encode(digests, 512)
    assert np.array_equal(trailer.decode(b, 5, 7), digests)
    # seeded with the run id, over every byte (padding included)
    assert trailer.checksum(b, 99) == xxhash.xxh3_64_intdigest(b.tobytes(), seed=99)
    assert trailer.checksum(b, 99) != trailer.checksum(b, 100)


def test_too_many_digests_for_the_room_is_refused():
    with pytest.raises(ValueError, match="trailer"):
        trailer.encode(np.zeros((4, 200), np.uint64), 4096)
