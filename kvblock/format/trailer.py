"""The block digest trailer: what lets a read of some of a run's blocks
verify just those instead of reading whole ranges.

A run of N blocks is ``ranges`` ranges (see kvblock/layout/geometry.py),
then this trailer, aligned, at ``RunLayout.data_bytes`` from the run's
start.  Layout (little-endian; bump FORMAT_VERSION when changing it)::

    ranges x N x Q   xxh3-64 of block k's bytes in range r (seeded with
                     the run id, as data_checksum), range by range
    zeros            to the alignment

The index keeps ``data_checksum`` of the whole trailer (padding included)
as the run's last checksum, after its per-range ones: a partial read
verifies the trailer against it, then each block it hands out against the
trailer.  A whole-range read needs neither (its range checksums cover it).
"""

from __future__ import annotations

import numpy as np

from kvblock.format.checksum import data_checksum

DIGEST = np.dtype("<u8")


def encode(digests: np.ndarray, nbytes: int) -> np.ndarray:
    """The trailer's bytes (``nbytes``: RunLayout.trailer_bytes) for the
    (ranges, blocks) digests."""
    out = np.zeros(nbytes, dtype=np.uint8)
    raw = np.ascontiguousarray(digests, dtype=DIGEST).view(np.uint8).reshape(-1)
    if raw.size > nbytes:
        raise ValueError(f"trailer: {digests.size} digests need {raw.size} bytes, "
                         f"room for {nbytes}")
    out[:raw.size] = raw
    return out


def decode(data, ranges: int, nblocks: int) -> np.ndarray:
    """The (ranges, blocks) digests in a trailer's bytes."""
    return np.frombuffer(data, dtype=DIGEST, count=ranges * nblocks).reshape(ranges, nblocks)


def checksum(data, run_id: int) -> int:
    """The index's checksum of a trailer (all its bytes, padding included)."""
    return data_checksum(data, run_id)
