"""Fault injection for the store: crash at the N-th write/flush, or sectors
that fail every read (:class:`BadSectors`).

:class:`CrashPlan` counts every write batch, flush and discard the store
issues (through :class:`kvblock.store.storeio.StoreIO`, the store's only path
to its devices).  At the planned I/O the "machine dies":

- ``torn=True``: the dying write lands only partly (first half of its entries,
  or first half of a single entry's bytes: on 4 KiB boundaries);
- ``torn="sectors"``: the dying write keeps a prefix of its 512-byte sectors
  (over its entries in order; how many is seeded), ``torn="sector-subset"``:
  each of its sectors lands or not (seeded) -- a device writes each sector
  whole, not a write as a whole: tears inside a 4 KiB journal block;
- ``lose_unflushed=True``: every write since the device's last flush is
  rolled back (the drive's volatile cache was lost);
- ``lose_unflushed="random"``: each unflushed write is independently kept or
  lost (seeded): a drive that reorders writes in its cache, which is what
  catches a metadata record made durable before the data it publishes;
- every later I/O raises :class:`SimulatedCrash`, so nothing more reaches the
  medium.
"""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass, field

import numpy as np

from kvblock.errors import IOFailedError
from kvblock.io import IOBatch
from kvblock.memory import HostBuffer
from kvblock.store.storeio import StoreIO


SECTOR = 512     # what a device writes whole (torn="sectors", "sector-subset")


class SimulatedCrash(Exception):
    """The fault plan's crash point was reached (not a kvblock error on purpose)."""


@dataclass
class CrashPlan:
    crash_at: int | None = None       # 1-based index of the I/O that dies; None = never
    torn: bool = False
    lose_unflushed: bool | str = False
    seed: int = 0
    ops: int = 0
    crashed: bool = False
    undo: list = field(default_factory=list)   # (dev, offset, old bytes) since last flush
    writes: list = field(default_factory=list)  # (I/O index, [(dev, offset, length)]) per write

    def factory(self):
        plan = self

        def make(devices, engine):
            return CrashingIO(devices, engine, plan)

        return make


class CrashingIO(StoreIO):
    def __init__(self, devices, engine, plan: CrashPlan):
        super().__init__(devices, engine)
        self.plan = plan

    def _dead(self):
        if self.plan.crashed:
            raise SimulatedCrash("I/O after the crash point")

    def _tick(self) -> bool:
        """Count one I/O; True when this one is the crash point."""
        self._dead()
        self.plan.ops += 1
        return self.plan.crash_at is not None and self.plan.ops >= self.plan.crash_at

    def _save_undo(self, batch: IOBatch):
        if not self.plan.lose_unflushed:
            return
        for dev, off, length in zip(batch.devs.tolist(), batch.offsets.tolist(),
                                    batch.lens.tolist()):
            with HostBuffer(length, register=False) as old:
                super().read(IOBatch.single(old.address, dev, off, length))
                self.plan.undo.append((dev, off, old.array.tobytes()))

    def _crash(self):
        plan = self.plan
        plan.crashed = True
        undo = plan.undo
        if plan.lose_unflushed == "random":
            keep = np.random.default_rng(plan.seed).random(len(undo)) < 0.5
            undo = [u for u, k in zip(undo, keep) if not k]
        for dev, off, old in reversed(undo):
            with HostBuffer(len(old), register=False) as buf:
                buf.array[:] = np.frombuffer(old, np.uint8)
                super().write(IOBatch.single(buf.address, dev, off, len(old)))
        plan.undo.clear()
        raise SimulatedCrash(f"crash at I/O #{plan.ops}")

    def read(self, batch):
        self._dead()
        super().read(batch)

    def read_hashed(self, batch, streams, seeds):
        self._dead()
        return super().read_hashed(batch, streams, seeds)

    def write(self, batch):
        dying = self._tick()
        self.plan.writes.append((self.plan.ops, list(zip(
            batch.devs.tolist(), batch.offsets.tolist(), batch.lens.tolist()))))
        self._save_undo(batch)
        if dying:
            if self.plan.torn in ("sectors", "sector-subset"):
                self._write_sectors(batch)
            elif self.plan.torn:
                super().write(_torn(batch))
            self._crash()
        super().write(batch)

    def _write_sectors(self, batch: IOBatch):
        """The dying write at sector granularity: each of its 512-byte
        sectors holds the new bytes or the old ones (a prefix of them new,
        or any subset: ``plan.torn``, seeded by ``plan.seed``).  Drawn over
        the sectors whose bytes change (the others read the same either
        way: a journal commit's zero padding over a journal never written)."""
        rng = np.random.default_rng([self.plan.seed, 0x5EC7])
        images = []
        for dev, off, length, addr in zip(batch.devs.tolist(), batch.offsets.tolist(),
                                          batch.lens.tolist(), batch.addrs.tolist()):
            with HostBuffer(length, register=False) as buf:
                super().read(IOBatch.single(buf.address, dev, off, length))
                old = buf.array[:length].copy()
            new = np.frombuffer(ctypes.string_at(addr, length), np.uint8)
            images.append((dev, off, old, new))
        changing = [(i, s) for i, (_, _, old, new) in enumerate(images)
                    for s in range(len(old) // SECTOR)
                    if not np.array_equal(old[s * SECTOR:(s + 1) * SECTOR],
                                          new[s * SECTOR:(s + 1) * SECTOR])]
        if self.plan.torn == "sectors":
            keep = np.arange(len(changing)) < rng.integers(0, max(len(changing), 1))
        else:
            keep = rng.random(len(changing)) < 0.5
        for (i, s), kept in zip(changing, keep):
            if kept:
                images[i][2][s * SECTOR:(s + 1) * SECTOR] = images[i][3][s * SECTOR:(s + 1) * SECTOR]
        for dev, off, image, _ in images:
            with HostBuffer(len(image), register=False) as buf:
                buf.array[:len(image)] = image
                super().write(IOBatch.single(buf.address, dev, off, len(image)))

    def write_hashed(self, batch, streams, seeds):
        """Hash the sources, then :meth:`write` (one counted, crashable I/O)."""
        from kvblock.io.engine import _hash_streams
        from kvblock.io import native

        streams, seeds, digests = _hash_streams("write_hashed", batch, streams, seeds)
        native.hash_pieces(batch.addrs, batch.lens, streams, seeds, digests)
        self.write(batch)
        return digests

    def flush(self, devs=None):
        # No real fdatasync: the host never crashes, and what a crash keeps
        # is decided by ``undo`` (the simulated drive cache) alone.  The real
        # flushes made these tests spend a third of their time in fdatasync.
        if self._tick():
            self._crash()
        flushed = set(range(len(self.devices)) if devs is None else devs)
        self.plan.undo = [u for u in self.plan.undo if u[0] not in flushed]

    def discard(self, dev, offset, length):
        dying = self._tick()
        if dying:
            self._crash()
        return super().discard(dev, offset, length)


def _torn(batch: IOBatch) -> IOBatch:
    """The part of a write that reached the medium before power went."""
    if len(batch) > 1:
        keep = len(batch) // 2
        return IOBatch(batch.addrs[:keep], batch.devs[:keep], batch.offsets[:keep],
                       batch.lens[:keep])
    half = int(batch.lens[0]) // 2 // 4096 * 4096
    if half == 0:
        return IOBatch(batch.addrs[:0], batch.devs[:0], batch.offsets[:0], batch.lens[:0])
    return IOBatch(batch.addrs, batch.devs, batch.offsets, np.array([half], np.uint64))


class BadSectors:
    """Device ranges that fail every read with EIO, as a drive's unreadable
    sectors do.  A read batch that touches one raises what the engine raises
    then: :class:`IOFailedError` naming the path, errno, offset and length
    of the first failed I/O and how many failed.  Writes are untouched (a
    drive remaps a sector it can write)."""

    def __init__(self):
        self.ranges: list[tuple[int, int, int]] = []   # (device index, start, end)
        self.reads_failed = 0

    def add(self, dev: int, offset: int, length: int) -> None:
        self.ranges.append((dev, offset, offset + length))

    def factory(self):
        return lambda devices, engine: BadSectorIO(devices, engine, self)

    def install(self, store) -> None:
        """Put the bad sectors under an open store (its I/O path is swapped)."""
        store.io = BadSectorIO(store.io.devices, store.io.engine, self)


class BadSectorIO(StoreIO):
    def __init__(self, devices, engine, bad: BadSectors):
        super().__init__(devices, engine)
        self.bad = bad

    def _check(self, batch: IOBatch) -> None:
        ends = batch.offsets + batch.lens
        failed = np.zeros(len(batch), dtype=bool)
        for dev, start, end in self.bad.ranges:
            failed |= (batch.devs == dev) & (batch.offsets < end) & (ends > start)
        if failed.any():
            i = int(np.argmax(failed))
            path = self.devices[int(batch.devs[i])].path
            off, length = int(batch.offsets[i]), int(batch.lens[i])
            self.bad.reads_failed += 1
            raise IOFailedError(f"read of {length} bytes at offset {off} on {path} failed: "
                                "EIO (Input/output error)", path, errno.EIO, off, length,
                                int(failed.sum()))

    def read(self, batch):
        self._check(batch)
        super().read(batch)

    def read_hashed(self, batch, streams, seeds):
        self._check(batch)
        return super().read_hashed(batch, streams, seeds)
