"""Blocks that live in separate buffers: ``put_blocks`` / ``get_blocks``.

An engine's host pool hands kvblock the slots of a run wherever its allocator
put them (vLLM's CPU primary pool after some churn, SGLang's page-first
pools).  Gathering them into one staging buffer costs a memcpy per block,
which on a fast device halves the throughput.  When every block is aligned
and its per-range pieces are whole multiples of the store's alignment, the
run is instead written from / read into the blocks themselves: one I/O per
(range, block) piece, pieces that touch in memory and on the device merged
back into one, and the range checksums computed piece by piece (xxh3's
streaming form gives the same value as over the contiguous range).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvblock.errors import ConfigError
from kvblock.format.checksum import data_checksum_pieces
from kvblock.io import IOBatch
from kvblock.layout.geometry import Geometry


class BlockList:
    """One uint8 ``(ranges, group_block_bytes)`` view per block (no copies)."""

    __slots__ = ("arrays", "geometry", "_addrs")

    def __init__(self, arrays: list[np.ndarray], geometry: Geometry, addrs=None):
        self.arrays = arrays
        self.geometry = geometry
        self._addrs = addrs          # uint64 host addresses, computed once

    @classmethod
    def of(cls, blocks: Sequence, geometry: Geometry, n: int, what: str,
           writable: bool) -> "BlockList":
        """Check and view the caller's per-block arrays (``what`` names the call)."""
        if len(blocks) != n:
            raise ConfigError(f"{what}: {n} keys but {len(blocks)} block buffers")
        g = geometry
        arrays = []
        shape = (g.ranges, g.group_block_bytes)
        for k, b in enumerate(blocks):
            if type(b) is np.ndarray and b.dtype == np.uint8 and b.ndim == 1 and \
                    b.size == g.block_bytes and b.flags.c_contiguous and \
                    (b.flags.writeable or not writable):
                arrays.append(b.reshape(shape))          # a pool slot as it is: no checks left
                continue
            a = np.asarray(b)
            if a.nbytes != g.block_bytes:
                raise ConfigError(f"{what}: block {k} holds {a.nbytes} bytes; a block is "
                                  f"{g.block_bytes} bytes ({g.describe()})")
            if not a.flags.c_contiguous:
                if writable:
                    raise ConfigError(f"{what}: block {k} is not C-contiguous; pass "
                                      "contiguous block buffers")
                a = np.ascontiguousarray(a)
            if writable and not a.flags.writeable:
                raise ConfigError(f"{what}: block {k} is read-only")
            arrays.append(a.reshape(-1).view(np.uint8).reshape(g.ranges, g.group_block_bytes))
        return cls(arrays, g)

    def __len__(self) -> int:
        return len(self.arrays)

    def sub(self, start: int, stop: int) -> "BlockList":
        addrs = None if self._addrs is None else self._addrs[start:stop]
        return BlockList(self.arrays[start:stop], self.geometry, addrs)

    def block(self, k: int) -> np.ndarray:
        """Block k as ``(layers, groups, group_block_bytes)`` (the host tier's form)."""
        g = self.geometry
        return self.arrays[k].reshape(g.num_layers, g.head_groups, g.group_block_bytes)

    def addresses(self) -> np.ndarray:
        if self._addrs is None:
            self._addrs = np.fromiter((a.__array_interface__["data"][0] for a in self.arrays),
                                      dtype=np.uint64, count=len(self.arrays))
        return self._addrs

    def direct(self, alignment: int) -> bool:
        """Can the blocks take direct I/O as they are?"""
        if self.geometry.group_block_bytes % alignment:
            return False
        return not bool((self.addresses() % np.uint64(alignment)).any())

    def gather_into(self, ranges: np.ndarray, pos: int = 0) -> None:
        """Copy the blocks into ``ranges`` (a run image, one row per range)."""
        gbb = self.geometry.group_block_bytes
        for k, a in enumerate(self.arrays):
            ranges[:, (pos + k) * gbb:(pos + k + 1) * gbb] = a

    def scatter_from(self, ranges: np.ndarray, pos: int = 0) -> None:
        """Copy blocks ``pos``.. of a run image into the blocks."""
        gbb = self.geometry.group_block_bytes
        for k, a in enumerate(self.arrays):
            a[...] = ranges[:, (pos + k) * gbb:(pos + k + 1) * gbb]

    def batch(self, dev: int, base: int, range_bytes: int) -> IOBatch:
        """The run's I/O: piece (range r, block k) at device offset
        ``base + r * range_bytes + k * gbb``; touching pieces merged."""
        return self._batch(dev, base, range_bytes, by_range=False)

    def hashed_batch(self, dev: int, base: int, range_bytes: int) -> tuple[IOBatch, np.ndarray]:
        """:meth:`batch` with pieces merged only within a range, and each
        I/O's range index: the streams whose checksums
        ``IOEngine.read_hashed`` / ``write_hashed`` compute."""
        b = self._batch(dev, base, range_bytes, by_range=True)
        return b, (b.offsets - np.uint64(base)) // np.uint64(range_bytes)

    def _batch(self, dev: int, base: int, range_bytes: int, by_range: bool) -> IOBatch:
        g = self.geometry
        gbb, n = g.group_block_bytes, len(self.arrays)
        r = np.arange(g.ranges, dtype=np.uint64)[:, None]
        k = np.arange(n, dtype=np.uint64)[None, :]
        addrs = (self.addresses()[None, :] + r * np.uint64(gbb)).reshape(-1)
        offs = (np.uint64(base) + r * np.uint64(range_bytes) + k * np.uint64(gbb)).reshape(-1)
        ranges = np.broadcast_to(r, (g.ranges, n)).reshape(-1)
        return coalesce(addrs, dev, offs, gbb, ranges if by_range else None)

    def checksums(self, seed: int) -> np.ndarray:
        """Per-range checksums of the run these blocks make (no padding)."""
        return np.array([data_checksum_pieces([a[r] for a in self.arrays], seed)
                         for r in range(self.geometry.ranges)], dtype=np.uint64)


def coalesce(addrs: np.ndarray, devs, offsets: np.ndarray, lens,
             groups: np.ndarray | None = None) -> IOBatch:
    """An IOBatch of the pieces, with runs of pieces that follow each other
    both in memory and on one device (and share their ``groups`` entry, when
    given) merged into one I/O."""
    b = IOBatch(addrs, devs, offsets, lens)
    if len(b) <= 1:
        return b
    ends = b.addrs[:-1] + b.lens[:-1]
    joins = (b.addrs[1:] == ends) & (b.offsets[1:] == b.offsets[:-1] + b.lens[:-1]) & \
        (b.devs[1:] == b.devs[:-1])
    if groups is not None:
        joins &= groups[1:] == groups[:-1]
    starts = np.concatenate(([0], np.nonzero(~joins)[0] + 1))
    return IOBatch(b.addrs[starts], b.devs[starts], b.offsets[starts],
                   np.add.reduceat(b.lens, starts))
