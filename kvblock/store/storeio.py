"""The store's only path to its devices.

Everything the store reads, writes, flushes or discards goes through one
:class:`StoreIO`, so tests can substitute a fault-injecting one
(tests/support/faults.py) and crash the store at any I/O.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading

from kvblock.devices import medium_key
from kvblock.errors import DeviceBusyError, IOFailedError
from kvblock.io import IOBatch, IOEngine
from kvblock.io.mapped import mappable
from kvblock.memory import HostBuffer
from kvblock.memory.aligned import round_up


# write_bytes copies a record into a per-thread aligned buffer of this size
# (larger writes, checkpoints, get their own).  A fresh mapping per record
# cost ~15 us, more than the 12 us write of a 4 KiB record through a tmpfs
# mapping; heap memory (store._small_aligned) measured 22.5 us per record
# against 17.3 reused, and 386-390 us against 364-375 per put of 2 x 256 KiB
# into a /dev/shm store file (2-core VM).
META_BUFFER_BYTES = 256 << 10

# Devices a metadata write was left in flight on (a broken io_uring could
# not wait for it: IOFailedError.in_flight), by identity (_identity), with
# where it goes: it may still land, over whatever is written there later (a
# newer journal record once the journal wraps, a newer checkpoint in its
# slot), so no store writes them again while this process lives.
_LATE_WRITES: dict[tuple, str] = {}
# Likewise data writes (a put's): the store that failed keeps their regions
# pinned (KVStore._keep_pinned) and goes on, but another open of the device
# in this process would know nothing of them and could hand the space out.
_LATE_DATA_WRITES: dict[tuple, str] = {}


def _identity(dev) -> tuple:
    # A loop device and the file under it are one: a write left in flight
    # through either lands on the other.
    return medium_key(os.fstat(dev.fd))


def note_late_data_write(dev, what: str) -> None:
    """A data write to ``dev`` (a Device) was left in flight: no other open
    of it in this process (see _LATE_DATA_WRITES)."""
    with contextlib.suppress(OSError):
        _LATE_DATA_WRITES.setdefault(_identity(dev), what)


def refuse_late_writes(devices, opening: bool = False) -> None:
    """DeviceBusyError for the first of ``devices`` a metadata write (and,
    ``opening`` a store on them, a data write) was left in flight on in
    this process (see _LATE_WRITES)."""
    tables = [t for t in ((_LATE_WRITES, _LATE_DATA_WRITES) if opening else (_LATE_WRITES,))
              if t]
    if not tables:
        return
    for d in devices:
        try:
            ident = _identity(d)
        except OSError:       # (closed: nothing writes it)
            continue
        said = next((t[ident] for t in tables if ident in t), None)
        if said is not None:
            raise DeviceBusyError(
                f"{d.path}: {said}, which a broken io_uring could not wait for, may still "
                "land on it (over what a store would write there now), so no store writes "
                "this device again in this process; restart the process to open or format "
                "it (open it with readonly=True to read it meanwhile)", d.path, errno.EBUSY)


class StoreIO:
    def __init__(self, devices, engine: IOEngine):
        self.devices = list(devices)
        self.engine = engine
        self.served = False     # a store server's: its ranks read the devices too
        self._meta = threading.local()

    def read(self, batch: IOBatch) -> None:
        self.engine.read(batch)

    def read_hashed(self, batch: IOBatch, streams, seeds):
        """Read, and return each stream's data checksum (IOEngine.read_hashed)."""
        return self.engine.read_hashed(batch, streams, seeds)

    def write(self, batch: IOBatch) -> None:
        self.engine.write(batch)

    def write_hashed(self, batch: IOBatch, streams, seeds):
        """Write, and return each stream's data checksum (IOEngine.write_hashed)."""
        return self.engine.write_hashed(batch, streams, seeds)

    def flush(self, devs=None) -> None:
        for i in (range(len(self.devices)) if devs is None else devs):
            self.devices[i].flush()

    def discard(self, dev: int, offset: int, length: int) -> bool:
        # A device read through a shared mapping keeps every byte allocated:
        # a read of a punched hole would have to allocate on tmpfs, and fail
        # with SIGBUS when it is full (kvblock/io/mapped.py).  A store
        # server's ranks map the devices that qualify whatever the server's
        # own KVBLOCK_MAPPED_READS says: it keeps those allocated too.
        if self.engine.mapped(dev) or (self.served and mappable(self.devices[dev]) is None):
            return False
        return self.devices[dev].discard(offset, length)

    # --- small metadata transfers ---------------------------------------------------------
    def write_bytes(self, dev: int, offset: int, data: bytes) -> None:
        refuse_late_writes([self.devices[dev]])
        try:
            size = round_up(len(data), self.devices[dev].block_size)
            if size > META_BUFFER_BYTES:
                with HostBuffer(size, register=False) as buf:
                    self._write_padded(buf, dev, offset, data, size)
                return
            buf = getattr(self._meta, "buffer", None)
            if buf is None:
                buf = self._meta.buffer = HostBuffer(META_BUFFER_BYTES, register=False)
            self._write_padded(buf, dev, offset, data, size)
        except IOFailedError as e:
            if e.in_flight:     # (the store closes itself: a failed metadata write)
                with contextlib.suppress(OSError):
                    _LATE_WRITES.setdefault(_identity(self.devices[dev]),
                                            f"a metadata write at offset {offset}")
            raise

    def _write_padded(self, buf: HostBuffer, dev: int, offset: int, data: bytes,
                      size: int) -> None:
        """``data`` and zeros up to ``size`` bytes, from ``buf``, at ``offset``."""
        buf.array[:len(data)] = memoryview(data).cast("B")
        buf.array[len(data):size] = 0
        self.write(IOBatch.single(buf.address, dev, offset, size))

    def read_bytes(self, dev: int, offset: int, length: int) -> bytes:
        size = round_up(length, self.devices[dev].block_size)
        with HostBuffer(size, register=False) as buf:
            self.read(IOBatch.single(buf.address, dev, offset, size))
            return buf.array[:length].tobytes()

    def read_array(self, dev: int, offset: int, length: int):
        """Like read_bytes, without the copy: a uint8 array over aligned memory
        (freed when the array is)."""
        size = round_up(length, self.devices[dev].block_size)
        buf = HostBuffer(size, register=False)
        self.read(IOBatch.single(buf.address, dev, offset, size))
        return buf.array[:length]

    def close(self) -> None:
        # Each device is closed past an engine, or another device, whose
        # close raises (the error is raised after, chained to any before
        # it, as _release_devices does): left open, its
        # descriptor and lock stayed while the process lived (the store's
        # release runs once), and no store could open the device again.
        with contextlib.ExitStack() as stack:      # closes in the reverse order
            for d in reversed(self.devices):
                stack.callback(d.close)
            stack.callback(self.engine.close)       # first: its rings hold the devices
