"""Checksums: xxHash (xxh64 for metadata, xxh3-64 for data), via the xxhash package."""

from __future__ import annotations

import xxhash


def meta_checksum(data) -> int:
    return xxhash.xxh64_intdigest(data)


def data_seed(seed: int) -> int:
    """The 64-bit seed data checksums use for ``seed`` (a run id)."""
    return seed & 0xFFFFFFFFFFFFFFFF


def data_checksum(data, seed: int) -> int:
    """Checksum of a data range; seeded with the run id so that a range read
    back from reused space never verifies as another run's data.  Reads
    compute the same value as their bytes land (IOEngine.read_hashed)."""
    return xxhash.xxh3_64_intdigest(data, seed=data_seed(seed))


def data_hasher(seed: int):
    """A streaming data_checksum: ``update()`` it with the range's bytes in
    order, piece by piece; ``intdigest()`` equals data_checksum of them all."""
    return xxhash.xxh3_64(seed=data_seed(seed))


def data_checksum_pieces(pieces, seed: int) -> int:
    """data_checksum of the concatenation of ``pieces`` (without joining them)."""
    h = data_hasher(seed)
    for p in pieces:
        h.update(p)
    return h.intdigest()
