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
from kvblock.io import IOBatch
from kvblock.layout.geometry import Geometry


def as_array(x, what: str, writable: bool = False, arg: str = "data") -> np.ndarray:
    """A caller's buffer as a numpy array: numpy arrays, array-likes and
    bytes-like objects, and CPU torch tensors of any dtype (bfloat16, which
    numpy has not, as bytes), contiguous ones without a copy.  A buffer to
    read into (``writable``) must be contiguous: a copy would take the bytes.
    ``arg`` names the argument in errors."""
    if type(x).__module__.startswith("torch"):
        import torch

        if x.device.type != "cpu":
            raise ConfigError(f"{what}: a {x.device.type} tensor; the byte API takes host "
                              "memory (kvblock.tensors loads into GPU tensors)")
        x = x.detach()
        if not x.is_contiguous():
            if writable:
                raise ConfigError(f"{what}: the tensor is not contiguous; pass a contiguous "
                                  "one (a copy would receive the bytes)")
            x = x.contiguous()
        return x.reshape(-1).view(torch.uint8).numpy()
    if writable and not isinstance(x, np.ndarray):
        # np.asarray would copy some buffers (bytes: a 0-d copy that takes
        # the bytes read and drops them): read into the caller's memory only
        try:
            view = memoryview(x)
        except TypeError:
            raise ConfigError(f"{what}: cannot read into a {type(x).__name__}; pass a writable "
                              "numpy array, CPU tensor, bytearray or memoryview") from None
        if view.readonly:
            raise ConfigError(f"{what}: the {type(x).__name__} to read into is read-only; pass "
                              "a writable one (a bytearray, numpy array or tensor)")
        return _bytes_held(np.asarray(view), what)
    if not isinstance(x, np.ndarray) and not _array_like(x):
        # numpy makes an array of anything: a str becomes a unicode array (4
        # bytes a character), a list of ints an int64 one; neither is KV
        raise ConfigError(f"{what}: {arg} is a {type(x).__name__}; pass the KV bytes as a "
                          "numeric numpy array, CPU tensor or bytes-like object (bytes, "
                          "bytearray, memoryview)")
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:     # an array interface numpy cannot read
        raise ConfigError(f"{what}: a {type(x).__name__} numpy cannot take as one array of "
                          f"bytes ({e})") from None
    return _bytes_held(arr, what)


def _array_like(x) -> bool:
    """Does ``x`` hold its bytes as an array (the buffer protocol or numpy's
    array interfaces), not values numpy would make an array of?"""
    if hasattr(x, "__array_interface__") or hasattr(x, "__array_struct__"):
        return True
    try:
        memoryview(x)
    except TypeError:
        return False
    return True


def _bytes_held(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr``, unless its elements are Python object references (dtype
    object, or a record holding one): those are no KV bytes to read into or
    write from, and numpy refuses their byte view with a bare TypeError."""
    if arr.dtype.hasobject:
        raise ConfigError(f"{what}: an array of Python object references (dtype "
                          f"{arr.dtype}) holds no KV bytes; pass a numeric numpy array, "
                          "CPU tensor, bytearray or memoryview")
    return arr


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
        try:
            len(blocks)
        except TypeError:
            # a generator (put_runs takes one for its runs) as its list; None
            # or a number is no list of blocks, nor a 0-dim array (it has
            # __len__, and len() of it is numpy's TypeError)
            try:
                blocks = list(blocks)
            except TypeError:
                raise ConfigError(f"{what}: blocks must be a sequence of block buffers, got "
                                  f"{type(blocks).__name__}") from None
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
            a = as_array(b, what, writable, arg=f"block {k}")
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
        out = cls(arrays, g)
        if writable and len(arrays) > 1:
            out._check_apart(what)
        return out

    def _check_apart(self, what: str) -> None:
        """Buffers to read into must not overlap: two blocks read into one
        place leave one of them there, which a DRAM tier then took for
        both keys' blocks (wrong bytes for every later read of the other)."""
        addrs = self.addresses()
        order = np.argsort(addrs, kind="stable")
        sorted_addrs = addrs[order]
        hit = np.flatnonzero(sorted_addrs[1:] < sorted_addrs[:-1]
                             + np.uint64(self.geometry.block_bytes))
        if hit.size:
            j, k = sorted(int(x) for x in order[hit[0]:hit[0] + 2])
            raise ConfigError(f"{what}: block buffers {j} and {k} overlap in memory; each key "
                              "needs a buffer of its own to read its block into")

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

    @classmethod
    def joined(cls, parts: Sequence["BlockList"]) -> "BlockList":
        """The blocks of ``parts`` in order, as one list."""
        return cls([a for p in parts for a in p.arrays], parts[0].geometry,
                   np.concatenate([p.addresses() for p in parts]))

    def batch(self, dev: int, base: int, range_bytes: int) -> IOBatch:
        """The run's I/O: piece (range r, block k) at device offset
        ``base + r * range_bytes + k * gbb``; touching pieces merged."""
        return self.runs_batch([len(self)], [dev], [base], [range_bytes], by_range=False)[0]

    def hashed_batch(self, dev: int, base: int, range_bytes: int) -> tuple[IOBatch, np.ndarray]:
        """:meth:`batch` with pieces merged only within a range, and each
        I/O's range index: the streams whose checksums
        ``IOEngine.read_hashed`` / ``write_hashed`` compute."""
        return self.runs_batch([len(self)], [dev], [base], [range_bytes])

    def runs_batch(self, counts, devs, bases, range_bytes,
                   by_range: bool = True) -> tuple[IOBatch, np.ndarray]:
        """The I/O of consecutive whole runs whose blocks these are, in order:
        run j has ``counts[j]`` blocks and its range r starts at device offset
        ``bases[j] + r * range_bytes[j]`` on device ``devs[j]``.  Entries go
        run by run, range by range, block by block, with pieces that touch in
        memory and on the device merged (within a range when ``by_range``).
        Returns the batch and each entry's stream, ``j * ranges + r``.
        Vectorised: the cost does not grow with a Python step per run."""
        g = self.geometry
        nr, gbb = g.ranges, np.uint64(g.group_block_bytes)
        counts = np.asarray(counts, dtype=np.int64)
        per_run = counts * nr
        run = np.repeat(np.arange(counts.size), per_run)
        t = np.arange(run.size) - np.repeat(np.cumsum(per_run) - per_run, per_run)
        c = counts[run]
        r, k = t // c, t % c
        first = np.cumsum(counts) - counts               # run j's first block
        addrs = self.addresses()[first[run] + k] + r.astype(np.uint64) * gbb
        offs = (np.asarray(bases, dtype=np.uint64)[run]
                + r.astype(np.uint64) * np.asarray(range_bytes, dtype=np.uint64)[run]
                + k.astype(np.uint64) * gbb)
        streams = run * nr + r
        batch, kept = merge(addrs, np.asarray(devs, dtype=np.uint32)[run], offs, gbb,
                            streams if by_range else None)
        return batch, streams[kept]


def coalesce(addrs: np.ndarray, devs, offsets: np.ndarray, lens,
             groups: np.ndarray | None = None) -> IOBatch:
    """An IOBatch of the pieces, with runs of pieces that follow each other
    both in memory and on one device (and share their ``groups`` entry, when
    given) merged into one I/O."""
    return merge(addrs, devs, offsets, lens, groups)[0]


def merge(addrs: np.ndarray, devs, offsets: np.ndarray, lens,
          groups: np.ndarray | None = None) -> tuple[IOBatch, np.ndarray]:
    """:func:`coalesce`, and the index of the first piece of each I/O."""
    b = IOBatch(addrs, devs, offsets, lens)
    if len(b) <= 1:
        return b, np.zeros(len(b), dtype=np.int64)
    ends = b.addrs[:-1] + b.lens[:-1]
    joins = (b.addrs[1:] == ends) & (b.offsets[1:] == b.offsets[:-1] + b.lens[:-1]) & \
        (b.devs[1:] == b.devs[:-1])
    if groups is not None:
        joins &= groups[1:] == groups[:-1]
    starts = np.concatenate(([0], np.nonzero(~joins)[0] + 1))
    return IOBatch(b.addrs[starts], b.devs[starts], b.offsets[starts],
                   np.add.reduceat(b.lens, starts)), starts


def span(blocks, start: int, stop: int):
    """Blocks start..stop of a (layers, groups, n, bytes) array or a BlockList."""
    return blocks.sub(start, stop) if isinstance(blocks, BlockList) else blocks[:, :, start:stop]


def block_at(blocks, k: int) -> np.ndarray:
    """Block k as (layers, groups, bytes)."""
    return blocks.block(k) if isinstance(blocks, BlockList) else blocks[:, :, k]
