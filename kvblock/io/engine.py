"""What every I/O engine does around its native call: validate a batch
(vectorised), route unaligned host buffers through aligned staging memory,
split oversized requests, and turn per-I/O results into one clear exception.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import math
import operator
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvblock.devices import Device
from kvblock.errors import AlignmentError, ConfigError, DeviceError, IOFailedError, strerror
from kvblock.format.checksum import data_seed
from kvblock.io import native
from kvblock.io.batch import DEFAULT_MAX_IO, IOBatch
from kvblock.io.mapped import MappedDevices
from kvblock.memory import aligned
from kvblock.memory.aligned import HostBuffer
from kvblock.units import is_whole

OP_READ, OP_WRITE = 0, 1
# read_hashed cuts reads into pieces this long and hashes each as it lands.
# perf/verified_reads.py --target loop --pieces 256K,512K,1M,2M (2 MiB vLLM
# slots, /dev/shm loop device, 2-core VM): 256 KiB to 2 MiB within noise of
# each other (1 thread 3.06-3.42 GiB/s, 8 threads 5.75-6.15), all above
# hashing after the read (2.79 / 5.77); 512 KiB was best with 8 threads.
HASH_PIECE = 512 << 10
_OP_NAME = {OP_READ: "read", OP_WRITE: "write"}
# A copy into or out of a mapped store file (kvblock/io/mapped.py) of at least
# COPY_SPLIT_BYTES is shared by up to COPY_THREADS threads (the caller and
# helpers that are idle at the time): one thread copies and hashes at about
# 10 GiB/s, two at 18-20 on the 2-core VM (native/kvblock_io.c, mem_copy).
COPY_THREADS = max(1, min(os.cpu_count() or 1, 4))
COPY_SPLIT_BYTES = 8 << 20
# Batches of up to FEW_IOS entries are checked with Python ints instead of
# numpy (a partial promotion reads a few blocks and a trailer; a whole run of
# 16 layers is 16 entries).  Timed on the 2-core VM: _validate 3.0 against
# 12.8 us at 8 entries, 8.4 against 12.4 at 32, 15.7 against 12.3 at 64.
FEW_IOS = 32


class _Staging:
    """A thread's aligned staging buffer (IOEngine._stage), in a box the
    engine can empty at close() for every thread (a thread's locals are not
    reachable from another)."""

    __slots__ = ("buffer", "__weakref__")

    def __init__(self):
        self.buffer = None


@dataclass
class IOResult:
    """Outcome of a batch: bytes per I/O and, when asked for, latency per I/O."""

    nbytes: int
    latency_ns: np.ndarray | None = None


def _hash_streams(what: str, batch: IOBatch, streams, seeds):
    """read_hashed/write_hashed's stream indices and seeds as the native
    hasher takes them, checked, and zeroed digests: (streams, seeds, digests)."""
    try:
        raw = np.asarray(streams)
        if raw.size and raw.dtype.kind not in "iu":   # (a float would be cut to an int)
            raise TypeError
        streams = np.ascontiguousarray(raw, dtype=np.uint32).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{what}: stream indices must be integers from 0 (one per I/O), "
                          f"got {streams!r}") from None
    try:
        if not isinstance(seeds, np.ndarray):
            seeds = [data_seed(operator.index(s)) for s in seeds]
        elif seeds.size and seeds.dtype.kind not in "iu":
            raise TypeError
        seeds = np.ascontiguousarray(seeds, dtype=np.uint64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{what}: seeds must be integers (one per stream), "
                          f"got {seeds!r}") from None
    n = len(batch)
    if streams.size != n:
        raise ConfigError(f"{what}: {streams.size} stream indices for {n} I/Os")
    if n == 0:
        numbered = seeds.size == 0
    elif n <= FEW_IOS:
        st = streams.tolist()
        numbered = (st[0] == 0 and st[-1] + 1 == seeds.size
                    and all(0 <= b - a <= 1 for a, b in zip(st, st[1:])))
    else:
        steps = np.diff(streams.astype(np.int64))
        numbered = (streams[0] == 0 and int(streams[-1]) + 1 == seeds.size
                    and not (steps < 0).any() and not (steps > 1).any())
    if not numbered:
        raise ConfigError(f"{what}: streams must count 0, 1, ... in batch order "
                          f"with one seed each ({seeds.size} seeds)")
    return streams, seeds, np.zeros(seeds.size, dtype=np.uint64)


class RingBroken(Exception):
    """Raised by an engine's _run when the engine itself failed the batch
    (a broken io_uring: errno ``code``) leaving I/Os unfinished; submit()
    turns it into an IOFailedError that counts the caller's I/Os."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


_LIVE: "weakref.WeakSet[IOEngine]" = weakref.WeakSet()
# The same, listed from any thread (a buffer's close): {key: weakref}, not a
# WeakSet, which is iterated in Python (an engine opened in another thread
# meanwhile raised "Set changed size during iteration"; see uring._ENGINES).
_BY_KEY: "dict[int, weakref.ref[IOEngine]]" = {}
_BY_KEY_KEYS = itertools.count()


def _after_fork_in_child() -> None:
    for engine in list(_LIVE):
        engine._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait_for_batches_into(address: int, nbytes: int) -> None:
    """(HostBuffer.close, before it unmaps) Wait until no batch in flight
    in any engine reads into or writes from [address, address + nbytes)."""
    for ref in list(_BY_KEY.values()):   # (one copy in C: no thread runs meanwhile)
        engine = ref()
        if engine is not None:
            engine._wait_for_batches_into(address, address + nbytes)


aligned.before_unmap(_wait_for_batches_into)


def _targets(batch: IOBatch, lo: int, hi: int) -> bool:
    """Whether an entry of ``batch`` lies (in part) in host memory [lo, hi)."""
    addrs, lens = batch.addrs, batch.lens
    return bool(((addrs < np.uint64(hi)) & (addrs + lens > np.uint64(lo))).any())


# The longest a wait for calls in flight to end sleeps before it looks
# again (a call's wake-up may have been cut short by a KeyboardInterrupt)
IDLE_POLL_S = 0.05

# An I/O the kernel answered with part of its bytes (io_uring hands a partial
# transfer back as it is; the threads engine's pread loop goes on by itself)
# or with -EAGAIN / -EINTR (kernels before 6.x let a block device's
# BLK_STS_AGAIN through to the CQE, liburing #766 and #1269) is issued again
# for what is left, up to this many times, before it is reported.
RETRY_ROUNDS = 4
_RETRY_ERRNOS = (-errno.EAGAIN, -errno.EINTR)
# What a result slot starts as: one still holding it (or the native hasher's
# INT64_MIN) after a broken ring's drain stopped is an I/O the kernel took
# and nobody waited for, still in flight.  No read or write answers it.
UNANSWERED = -errno.EINPROGRESS
_PENDING = np.iinfo(np.int64).min

MAX_IO_LIMIT = 1 << 30     # one I/O's length travels as 32 bits in io_uring
MAX_QUEUE_DEPTH = 32768    # the most entries an io_uring holds (IORING_MAX_ENTRIES)


def _check_max_io(max_io, devices) -> int:
    """``max_io`` (the largest single I/O; larger ones are split there) as
    an int: whole logical blocks of every device, at most MAX_IO_LIMIT."""
    block = math.lcm(*(int(d.block_size) for d in devices)) if devices else 512
    if not is_whole(max_io) or not block <= max_io <= MAX_IO_LIMIT or max_io % block:
        raise ConfigError(f"max_io must be a multiple of the devices' {block}-byte logical "
                          f"blocks from {block} to {MAX_IO_LIMIT} bytes, got {max_io!r} "
                          f"(default {DEFAULT_MAX_IO})")
    return int(max_io)


class IOEngine:
    """Base class; subclasses implement :meth:`_run`.

    An engine serves a fixed device table: device index ``i`` in a batch means
    ``devices[i]``.  Methods may be called from several threads at once.
    """

    name = "base"
    # read_hashed hashes pieces as they complete (True) or the whole batch
    # after it (False: engines whose completions do not arrive in one thread).
    hashes_as_reads_land = True

    def __init__(self, devices: Sequence[Device], *, queue_depth: int = 32,
                 max_io: int = DEFAULT_MAX_IO, mapped_reads: bool | None = None,
                 defer_mapped_reads: bool = False, mapped_writes: bool = True):
        if not is_whole(queue_depth) or not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
            raise ConfigError(f"queue_depth must be an integer from 1 to {MAX_QUEUE_DEPTH} "
                              f"(I/Os in flight per batch), got {queue_depth!r} (default 32)")
        self.devices = list(devices)
        for d in self.devices:
            if d.fd < 0:   # (its -1 in the table: every I/O an EBADF 'device fault')
                raise ConfigError(f"{d.path}: the device is closed; open it again "
                                  "(Device(path)) for the engine")
        self.queue_depth = int(queue_depth)
        self.max_io = _check_max_io(max_io, self.devices)
        self.fds = np.array([d.fd for d in self.devices], dtype=np.int32)
        self._block = np.array([d.block_size for d in self.devices], dtype=np.uint64)
        self._capacity = np.array([d.capacity for d in self.devices], dtype=np.uint64)
        # The same as plain ints: one-I/O batches (small gets, metadata) are
        # checked without numpy, whose per-call cost dominated them.
        self._block_int = [int(d.block_size) for d in self.devices]
        self._capacity_int = [int(d.capacity) for d in self.devices]
        self._local = threading.local()
        self.closed = False
        # Store files on tmpfs are read (and, with mapped_writes, written) through
        # shared mappings (kvblock/io/mapped.py), from now or from
        # start_mapped_reads() on.
        self._maps = MappedDevices.open(self.devices, mapped_reads,
                                        start=not defer_mapped_reads, writes=mapped_writes)
        # The batches of the calls in flight (copying, running I/O, hashing
        # or staging their bytes), by a key each: close() waits for them (it
        # frees what they use), and so does HostBuffer.close() for those in
        # its memory.  Entered and left without a lock (a dict's item set
        # and del are atomic; _enter checks ``closed`` after its item is in,
        # close() the items after setting it); who waits counts in
        # _waiters under _map_idle, and a call leaving wakes them.
        self._inflight: dict[int, IOBatch] = {}
        self._keys = itertools.count()
        self._waiters = 0
        self._map_idle = threading.Condition()
        self._copiers = None         # helper threads of large mapped copies, made on first use
        # Every thread's staging box (_stage), emptied by close(); a thread
        # that ends drops its box with its locals.
        self._stagings: "weakref.WeakSet[_Staging]" = weakref.WeakSet()
        # Held for the whole of close(): a second close() returns once the
        # first is done (its caller then closes the devices' fds).
        self._closing = threading.RLock()
        _LIVE.add(self)
        key = next(_BY_KEY_KEYS)
        _BY_KEY[key] = weakref.ref(self, lambda _, key=key: _BY_KEY.pop(key, None))
        # Closing one of the devices closes this engine first (Device.close):
        # its I/O would go to whatever file took the descriptor's number.
        for d in self.devices:
            engines = getattr(d, "_engines", None)
            if engines is not None:
                engines.add(self)

    # --- public ------------------------------------------------------------------
    def read(self, batch: IOBatch, *, qd: int | None = None, latency: bool = False) -> IOResult:
        """Read every entry of ``batch`` into its host buffer; raise on any failure."""
        return self.submit(OP_READ, batch, qd=qd, latency=latency)

    def write(self, batch: IOBatch, *, qd: int | None = None, latency: bool = False) -> IOResult:
        """Write every entry of ``batch`` from its host buffer; raise on any failure."""
        return self.submit(OP_WRITE, batch, qd=qd, latency=latency)

    def read_into(self, dev: int, offset: int, buffer) -> None:
        """Read ``len(buffer)`` bytes at ``offset`` into any writable buffer."""
        view = _as_bytes(buffer, writable=True)
        self.read(IOBatch.single(_address(view), dev, offset, view.size))

    def write_from(self, dev: int, offset: int, buffer) -> None:
        """Write the bytes of any buffer at ``offset``."""
        view = _as_bytes(buffer, writable=False)
        self.write(IOBatch.single(_address(view), dev, offset, view.size))

    def mapped(self, dev: int) -> bool:
        """Whether device ``dev`` is mapped (a fully allocated store file on
        tmpfs): its reads are copies out of the mapping once its pages are
        mapped in, and so are its writes when :meth:`mapped_for_writes` (see
        kvblock/io/mapped.py)."""
        maps = self._maps     # once: close() in another thread may drop it meanwhile
        return maps is not None and maps.mapped(dev)

    def mapped_for_writes(self, dev: int) -> bool:
        """Whether writes to device ``dev`` copy into its mapping (once mapped in)."""
        maps = self._maps
        return maps is not None and bool(maps.writable[dev])

    def start_mapped_reads(self, background: bool | None = None) -> None:
        """For an engine opened with ``defer_mapped_reads``: map the pages in
        and read through the mappings from then on (see MappedDevices.start)."""
        maps = self._maps
        if maps is not None:
            maps.start(background)

    def flush(self) -> None:
        for d in self.devices:
            d.flush()

    def read_hashed(self, batch: IOBatch, streams, seeds, *,
                    qd: int | None = None) -> np.ndarray:
        """:meth:`read`, and return the XXH3-64 checksum of each stream's bytes.

        Entry i of ``batch`` belongs to stream ``streams[i]``; streams are
        numbered 0, 1, ... in batch order (each entry's stream equals or is
        one more than the one before) and a stream's entries are its bytes in
        order.  ``seeds[s]`` seeds stream s.  The result (uint64, one per
        stream) equals ``format.checksum.data_checksum`` of each stream's
        bytes.  The reads are cut into ``HASH_PIECE`` pieces and each piece is
        hashed as soon as it (and every piece before it) has landed, so the
        hashing overlaps the reads still in flight instead of following the
        batch.  Reads of at most HASH_PIECE bytes in all, and engines with
        ``hashes_as_reads_land`` False, hash after the read instead, except
        copies out of mapped devices, which hash each chunk as they copy it,
        while it is in cache (one native call: _copy_part).
        """
        streams, seeds, digests = _hash_streams("read_hashed", batch, streams, seeds)
        n = len(batch)
        nbytes = sum(batch.lens.tolist()) if n <= FEW_IOS else batch.nbytes
        maps = self._maps
        if n and nbytes <= HASH_PIECE and not (maps is not None and maps.covers(batch.devs)):
            # At most one piece's worth: nothing to overlap, and a small read
            # (a 4 KiB get) would pay more for the native hasher than the hash.
            # In flight until hashed (HostBuffer.close() waits for it).
            key = self._enter(batch)
            try:
                self.read(batch, qd=qd)
                native.hash_pieces(batch.addrs, batch.lens, streams, seeds, digests)
            finally:
                del self._inflight[key]     # (inline: see _leave)
                if self._waiters:
                    self._wake()
            return digests
        self.submit(OP_READ, batch, qd=qd, hashing=(streams, seeds, digests))
        return digests

    def write_hashed(self, batch: IOBatch, streams, seeds, *,
                     qd: int | None = None) -> np.ndarray:
        """:meth:`write`, and return the XXH3-64 checksum of each stream's
        bytes (streams and seeds as in :meth:`read_hashed`).  A copy into a
        mapped device hashes each chunk of the source right after copying
        it; elsewhere the sources are hashed, then written."""
        streams, seeds, digests = _hash_streams("write_hashed", batch, streams, seeds)
        self.submit(OP_WRITE, batch, qd=qd, hashing=(streams, seeds, digests))
        return digests

    def submit(self, op: int, batch: IOBatch, *, qd: int | None = None,
               latency: bool = False, hashing=None) -> IOResult:
        if self.closed:
            raise ConfigError(f"{self.name} engine is closed")
        # (the native calls run anything but OP_READ as a write, the mapped
        # copies anything but OP_WRITE as a read)
        if not is_whole(op) or op not in (OP_READ, OP_WRITE):
            raise ConfigError(f"op must be OP_READ (0) or OP_WRITE (1) (kvblock.io), "
                              f"got {op!r}")
        if qd is not None and (not is_whole(qd) or qd < 1):
            raise ConfigError(f"qd must be at least 1 (an integer: I/Os in flight for this "
                              f"batch), got {qd!r}")
        n = len(batch)
        if n == 0:
            return IOResult(0, np.empty(0, np.int64) if latency else None)
        self._validate(batch)
        if hashing is not None:   # (read_hashed's are checked; the native calls index them)
            native.check_pieces("submit", None, batch.lens, *hashing, n=n)
        # In flight from here until the last touch of the caller's memory
        # (the hash after a read, the staged copy-back): close() waits for
        # it, as HostBuffer.close() of the memory does.
        key = next(self._keys)
        self._inflight[key] = batch
        try:
            if self.closed:
                raise ConfigError(f"{self.name} engine is closed")
            maps = self._maps     # (close() keeps it while a call is in flight)
            if maps is not None:
                # (a file cut shorter: its mapping's pages past the end are a SIGBUS)
                if maps.covers(batch.devs, writing=op == OP_WRITE) \
                        and not maps.cut_short(batch.devs):
                    return self._copy_mapped(op, batch, latency, hashing)
                if op == OP_WRITE:
                    maps.last_write = time.monotonic()   # the prefault waits for a gap
            if op == OP_WRITE and hashing is not None:   # the sources, before they are written
                native.hash_pieces(batch.addrs, batch.lens, *hashing)
                hashing = None
            inline = hashing is not None and self.hashes_as_reads_land
            max_io = min(self.max_io, HASH_PIECE) if inline else self.max_io
            run, parent = batch.split(max_io)
            m = len(run)
            # Each slot starts failed: a slot the native call never writes (a
            # broken ring whose drain could not wait for every I/O it had taken)
            # must not hold an earlier batch's lengths, read as 'done'.
            results = np.full(m, UNANSWERED, dtype=np.int64)
            lat = np.empty(m, dtype=np.int64) if latency else None
            hasher = None
            retried = False
            try:
                # Staging and the hasher only in flight: made before, a close()
                # in between would miss the staging and the refusal leak the hasher.
                staged = self._stage(op, run)
                if inline and staged is None:
                    streams, seeds, digests = hashing
                    hasher = native.Hasher(run.addrs, run.lens,
                                           streams if parent is None else streams[parent],
                                           seeds, results, digests)
                target = run if staged is None else staged[0]
                try:
                    self._run(op, target, min(qd or self.queue_depth, m), results, lat, hasher)
                    if (results.item() != run.lens.item() if m == 1
                            else (results != run.lens.astype(np.int64)).any()):
                        retried = self._retry(op, target, results, lat, qd or self.queue_depth)
                except RingBroken as e:
                    self._raise_broken(op, run, results, e.code, parent, n, target)
            finally:
                if hasher is not None:
                    hasher.finish()
            if m == 1:
                if results.item() != run.lens.item():
                    self._raise(op, run, results, results != run.lens.astype(np.int64))
            else:
                bad = results != run.lens.astype(np.int64)
                if bad.any():
                    self._raise(op, run, results, bad, parent, len(batch))
            if staged is not None and op == OP_READ:
                staged[1]()
            # The bytes are in place: hash them now (also after a retry: the
            # native hasher took a piece that came back short for a failed stream).
            if hashing is not None and (hasher is None or retried):
                native.hash_pieces(batch.addrs, batch.lens, *hashing)
        finally:
            del self._inflight[key]     # (inline: see _leave)
            if self._waiters:
                self._wake()
        if lat is not None and parent is not None:
            # one per I/O of the batch: its slowest piece (pieces run side by side)
            lat = np.maximum.reduceat(lat, np.flatnonzero(np.diff(parent, prepend=-1)))
        return IOResult(batch.nbytes, lat)

    def _retry(self, op: int, b: IOBatch, results: np.ndarray, lat: np.ndarray | None,
               qd: int) -> bool:
        """Issue again what is left of the I/Os of ``b`` that came back short
        (a block-aligned part transferred: O_DIRECT takes the rest from
        there) or with -EAGAIN / -EINTR, while they make progress, at most
        RETRY_ROUNDS times; ``results`` (and ``lat``) then count the whole
        I/O.  An I/O that transferred nothing (the end of the device) or
        failed otherwise is left to the caller to report.  Whether anything
        was issued again."""
        todo = np.arange(len(b))
        issued = False
        # Bytes each I/O has transferred so far: a round answered -EAGAIN /
        # -EINTR leaves its errno in ``results``, and the next round goes on
        # from here (not from the I/O's start, transferring its bytes twice).
        done = np.maximum(results, 0)
        for _ in range(RETRY_ROUNDS):
            res, lens = results[todo], b.lens[todo].astype(np.int64)
            part = done[todo]
            again = ((res > 0) & (res < lens) & (part % self._block[b.devs[todo]].astype(np.int64)
                                                 == 0)) | np.isin(res, _RETRY_ERRNOS)
            todo, part = todo[again], part[again].astype(np.uint64)
            if todo.size == 0:
                break
            sub = IOBatch(b.addrs[todo] + part, b.devs[todo], b.offsets[todo] + part,
                          b.lens[todo] - part)
            got = np.full(todo.size, UNANSWERED, dtype=np.int64)
            sub_lat = np.zeros(todo.size, dtype=np.int64) if lat is not None else None
            issued = True
            try:
                self._run(op, sub, min(qd, todo.size), got, sub_lat, None)
            finally:
                # (also for a broken ring: its error counts what did not finish)
                done[todo] += np.maximum(got, 0)
                results[todo] = np.where(got >= 0, done[todo], got)
            if lat is not None:
                lat[todo] += sub_lat
            todo = todo[got != 0]     # nothing more came: the end of the device
        return issued

    def _enter(self, batch: IOBatch) -> int:
        """Count ``batch`` in flight (see _inflight); its key for _leave."""
        key = next(self._keys)
        self._inflight[key] = batch
        if self.closed:
            self._leave(key)
            raise ConfigError(f"{self.name} engine is closed")
        return key

    def _leave(self, key: int) -> None:
        # (The calls' finally blocks do this inline: a KeyboardInterrupt
        # lands at a Python call's entry, and one there left the batch in
        # flight for good, close() waiting for it for ever.  A wake-up
        # cut short is covered by the waits' IDLE_POLL_S.)
        del self._inflight[key]
        if self._waiters:
            self._wake()

    def _wake(self) -> None:
        with self._map_idle:
            self._map_idle.notify_all()

    def _wait_for_batches_into(self, lo: int, hi: int) -> None:
        """Wait until none of the batches in flight now has an entry in
        host memory [lo, hi) (those submitted from now on are not waited
        for)."""
        if not self._inflight:
            return
        with self._map_idle:
            self._waiters += 1
            try:
                # (a copy made in C: listing items makes tuples, and a GC
                # started there runs Python code that may let another thread
                # change the dict under the iteration)
                busy = [k for k, b in self._inflight.copy().items() if _targets(b, lo, hi)]
                while busy:
                    self._map_idle.wait(IDLE_POLL_S)
                    busy = [k for k in busy if k in self._inflight]
            finally:
                self._waiters -= 1

    def _copy_mapped(self, op: int, batch: IOBatch, latency: bool, hashing) -> IOResult:
        """Copy the batch out of the devices' mappings (hashing each chunk as
        it is copied, when asked to), or into them: on this thread, and for
        a large batch also on helper threads, each taking whole streams."""
        n = len(batch)
        results = np.empty(n, dtype=np.int64)
        lat = np.empty(n, dtype=np.int64) if latency else None
        # (in flight: submit counted it, and close() keeps the mappings meanwhile)
        helpers = 0
        try:
            # helpers busy with other callers' copies are not waited for
            if COPY_THREADS > 1 and n > 1 and batch.nbytes >= COPY_SPLIT_BYTES:
                pool, slots = self._copiers_pool()
                while helpers < COPY_THREADS - 1 and slots.acquire(blocking=False):
                    helpers += 1
            cuts = self._copy_cuts(batch, hashing, helpers + 1)
            for _ in range(helpers - (len(cuts) - 2)):
                slots.release()                          # slots the cuts did not use
            helpers = len(cuts) - 2
            if not helpers:
                self._copy_part(op, batch, 0, n, results, lat, hashing)
            else:
                self._copy_shared(op, batch, cuts, results, lat, hashing, pool)
        finally:
            for _ in range(helpers):
                slots.release()
        if n <= FEW_IOS and results.tolist() == batch.lens.tolist():
            return IOResult(sum(batch.lens.tolist()), lat)
        bad = results != batch.lens.astype(np.int64)
        if bad.any():
            self._raise(op, batch, results, bad)
        return IOResult(batch.nbytes, lat)

    def _copy_shared(self, op: int, batch: IOBatch, cuts: list[int], results, lat, hashing,
                     pool: ThreadPoolExecutor) -> None:
        """The parts of a mapped copy between ``cuts``: the first on this
        thread, the others on helpers; returns (or raises the first error)
        only once no part is being copied.  A helper that cannot start (the
        pool's submit raising "can't start new thread") leaves its part, and
        those after it, to this thread: raised from here, the helpers
        started went on copying into (or out of) the caller's buffers and
        the mapping, freed or unmapped from then on.  Each part runs once,
        by whoever claims it first (a failed submit may still have queued
        its helper)."""
        spans = list(zip(cuts[:-1], cuts[1:]))
        claimed = [False] * len(spans)
        running = [0]
        idle = threading.Condition()

        def run(k: int) -> None:
            with idle:
                if claimed[k]:
                    return
                claimed[k] = True
                running[0] += 1
            try:
                a, b = spans[k]
                self._copy_part(op, batch, a, b, results, lat, hashing)
            finally:
                with idle:
                    running[0] -= 1
                    idle.notify_all()

        parts = []
        try:
            try:
                for k in range(1, len(spans)):
                    parts.append(pool.submit(run, k))
            except RuntimeError:
                pass       # (the parts from there on are this thread's, below)
            run(0)
            for k in range(len(parts) + 1, len(spans)):
                run(k)
            for part in parts:
                part.result()    # (raises the first helper's error)
        finally:
            # Also when interrupted (KeyboardInterrupt) while helpers copy:
            # no part starts from now on, and this raises once those copying
            # are done, not with them still at it.
            with idle:
                claimed[:] = [True] * len(spans)
                while running[0]:
                    idle.wait()

    @staticmethod
    def _copy_cuts(batch: IOBatch, hashing, threads: int) -> list[int]:
        """Where to cut a mapped copy between ``threads`` threads: [0, ...,
        n], cut between entries (between streams, when hashing: a stream is
        hashed in order) near equal shares of the bytes; fewer parts where
        there are fewer places to cut."""
        n = len(batch)
        if threads < 2 or n < 2:
            return [0, n]
        if hashing is None:
            allowed = np.arange(1, n)
        else:
            streams = hashing[0]
            allowed = np.nonzero(streams[1:] != streams[:-1])[0] + 1
            if allowed.size == 0:
                return [0, n]
        ends = np.cumsum(batch.lens)                  # bytes before entry i+1
        before = ends[allowed - 1].astype(np.float64)
        share = float(ends[-1]) / threads
        cuts = {int(allowed[np.abs(before - share * k).argmin()]) for k in range(1, threads)}
        return [0, *sorted(cuts), n]

    def _copy_part(self, op: int, batch: IOBatch, a: int, b: int, results, lat,
                   hashing) -> None:
        """kvb_mem_read/_write of entries a..b; when hashing, with their own
        streams (renumbered from 0) hashed as they are copied, in the same
        native call (kvb_mem_copy_hashed: a call releases and retakes the
        GIL, and with other threads waiting each retake can be a thread
        switch)."""
        p = native.ptr
        lib = native.lib()
        maps = self._maps
        args = (b - a, p("uint64_t *", batch.addrs[a:b]), p("uint32_t *", batch.devs[a:b]),
                p("uint64_t *", maps.bases), p("uint64_t *", maps.sizes), len(maps.bases),
                p("uint64_t *", batch.offsets[a:b]), p("uint64_t *", batch.lens[a:b]),
                p("int64_t *", results[a:b]), p("int64_t *", None if lat is None else lat[a:b]))
        if hashing is None:
            copy = lib.kvb_mem_write if op == OP_WRITE else lib.kvb_mem_read
            ret = copy(*args, native.ffi.NULL)
        else:
            streams, seeds, digests = hashing
            s0, s1 = int(streams[a]), int(streams[b - 1]) + 1
            if s1 > len(seeds):
                # (the slices below would come out short: the native copy
                # read seeds and wrote digests past the arrays' ends; the
                # numbering inside the part is checked natively)
                raise ConfigError(f"hashed copy: I/Os {a}..{b - 1} name streams up to "
                                  f"{s1 - 1}, past the {len(seeds)} seed(s); number the "
                                  "streams 0, 1, ... in I/O order, one seed per stream")
            ret = lib.kvb_mem_copy_hashed(
                int(op == OP_WRITE), *args, p("uint32_t *", streams[a:b] - np.uint32(s0)),
                s1 - s0, p("uint64_t *", seeds[s0:s1]), p("uint64_t *", digests[s0:s1]))
        if ret < 0:
            # the whole call failed before copying (ENOMEM for its hasher):
            # not an I/O of a run (IOFailedError would drop its runs)
            path = self._path(int(batch.devs[a]))
            raise DeviceError(
                f"{_OP_NAME[op]} of {b - a} I/O(s) through the mapping of {path}, from offset "
                f"{int(batch.offsets[a])}, failed before copying anything: {strerror(-ret)}",
                path, -ret)

    def _copiers_pool(self) -> tuple[ThreadPoolExecutor, threading.Semaphore]:
        """The helper threads of large mapped copies, and a slot per helper."""
        with self._map_idle:
            if self._copiers is None:
                self._copiers = (ThreadPoolExecutor(COPY_THREADS - 1,
                                                    thread_name_prefix=f"kvblock-{self.name}-copy"),
                                 threading.Semaphore(COPY_THREADS - 1))
            return self._copiers

    def _after_fork(self) -> None:
        """In a forked child: the calls in flight are the parent's threads',
        which the child does not have (close() would wait for them forever),
        and so are the helper threads; locks they held stay held.  Start
        afresh."""
        self._inflight = {}
        self._waiters = 0
        self._map_idle = threading.Condition()
        self._closing = threading.RLock()
        self._copiers = None
        if self._maps is not None:
            self._maps._after_fork()

    def close(self) -> None:
        with self._closing:
            self.closed = True
            with self._map_idle:   # once no call is copying or running I/O (rings, mappings)
                self._waiters += 1
                try:
                    while self._inflight:
                        self._map_idle.wait(IDLE_POLL_S)
                finally:
                    self._waiters -= 1
                maps, self._maps = self._maps, None
                copiers, self._copiers = self._copiers, None
                # Every thread's staging memory: a batch still between its _stage
                # and its copy-back holds its own reference, so the memory goes
                # once that batch is done.
                for box in list(self._stagings):
                    box.buffer = None
            if copiers is not None:
                copiers[0].shutdown(wait=True)
            if maps is not None:
                maps.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- for subclasses ----------------------------------------------------------------
    def _run(self, op: int, batch: IOBatch, qd: int, results: np.ndarray,
             latency: np.ndarray | None, hasher) -> None:
        """Run ``batch``; ``hasher`` (a native.Hasher or None) goes to the
        native call, which hashes reads as they complete."""
        raise NotImplementedError

    # --- helpers -----------------------------------------------------------------------
    def _path(self, dev: int) -> str:
        return self.devices[dev].path if 0 <= dev < len(self.devices) else f"<device #{dev}>"

    def _validate(self, b: IOBatch) -> None:
        if len(b) <= FEW_IOS:
            # Python ints: numpy's per-call cost is most of a small batch's checks.
            # The same errors, in the same order, as the numpy checks below.
            entries = list(zip(b.devs.tolist(), b.offsets.tolist(), b.lens.tolist()))
            for dev, _, _ in entries:
                if dev >= len(self.devices):
                    self._bad_device(dev)
            for dev, off, length in entries:
                bs = self._block_int[dev]
                if off % bs or length % bs or length == 0:
                    self._misaligned(dev, off, length)
            for dev, off, length in entries:
                if off + length > self._capacity_int[dev]:
                    self._beyond(dev, off, length)
            return
        if (b.devs >= len(self.devices)).any():
            self._bad_device(int(b.devs[b.devs >= len(self.devices)][0]))
        bs = self._block[b.devs]
        misaligned = (b.offsets % bs != 0) | (b.lens % bs != 0) | (b.lens == 0)
        if misaligned.any():
            i = int(np.argmax(misaligned))
            self._misaligned(int(b.devs[i]), int(b.offsets[i]), int(b.lens[i]))
        # (offsets + lens could wrap past 2**64 in uint64, hiding a range past the end)
        capacity = self._capacity[b.devs]
        beyond = (b.offsets > capacity) | (b.lens > capacity - np.minimum(b.offsets, capacity))
        if beyond.any():
            i = int(np.argmax(beyond))
            self._beyond(int(b.devs[i]), int(b.offsets[i]), int(b.lens[i]))

    def _bad_device(self, dev: int):
        raise ConfigError(f"device index {dev} out of range: this engine has "
                          f"{len(self.devices)} device(s)")

    def _misaligned(self, dev: int, off: int, length: int):
        bs = self._block_int[dev]
        raise AlignmentError(
            f"{self._path(dev)}: offset {off} / length {length} is not a non-zero multiple "
            f"of the {bs}-byte logical block size; round offsets and lengths to {bs} bytes")

    def _beyond(self, dev: int, off: int, length: int):
        raise IOFailedError(
            f"{self._path(dev)}: range [{off}, {off + length}) ends past the device's "
            f"{self._capacity_int[dev]} bytes", self._path(dev), 22, off, length)

    def _stage(self, op: int, b: IOBatch):
        """Route entries whose host address is not block-aligned through aligned
        staging memory (slow path: one memmove per such entry).  Returns None
        when every address is aligned, else (staged batch, copy-back callable)."""
        if len(b) == 1 and b.addrs.item() % self._block_int[b.devs.item()] == 0:
            return None
        unaligned = np.nonzero(b.addrs % self._block[b.devs] != 0)[0]
        if unaligned.size == 0:
            return None
        sizes = b.lens[unaligned]
        # Each slot starts on its own device's logical block: slots are cut
        # at the largest block among the staged entries (block sizes are
        # powers of two, each dividing the largest; the staging buffer is
        # page-aligned), so a 4 KiB-sector entry placed after a 512-byte one
        # does not start 512-aligned.
        align = np.uint64(int(self._block[b.devs[unaligned]].max()))
        slots = (sizes + align - np.uint64(1)) // align * align
        total = int(slots.sum())
        box = getattr(self._local, "staging", None)
        if box is None:
            box = self._local.staging = _Staging()
            with self._map_idle:
                self._stagings.add(box)
        staging = box.buffer
        # (not one a read left in flight may still land in: kept, never reused)
        if staging is None or staging.nbytes < total or staging.left_in_flight:
            if staging is not None:
                staging.close()
            staging = box.buffer = HostBuffer(total, register=False)
        homes = (np.cumsum(slots) - slots + np.uint64(staging.address)).astype(np.uint64)
        addrs = b.addrs.copy()
        addrs[unaligned] = homes
        pairs = list(zip(b.addrs[unaligned].tolist(), homes.tolist(), sizes.tolist()))
        if op == OP_WRITE:
            for user, home, size in pairs:
                ctypes.memmove(home, user, size)

        def copy_back(_staging=staging):
            # (holds the staging buffer: close() drops the engine's reference,
            # and the memory must outlive this batch's copies)
            for user, home, size in pairs:
                ctypes.memmove(user, home, size)

        return IOBatch(addrs, b.devs, b.offsets, b.lens), copy_back

    def _raise(self, op: int, b: IOBatch, results: np.ndarray, bad: np.ndarray,
               parent: np.ndarray | None = None, total: int | None = None):
        """``parent`` (from IOBatch.split): the caller's I/O of each entry of
        ``b``, and ``total`` the caller's count.  The error names the first
        failed piece, but counts failed I/Os of the caller's batch: pieces of
        one I/O are one failure (the store drops only the run an error names
        when ``failed`` is 1)."""
        i = int(np.argmax(bad))
        dev, off, length, res = int(b.devs[i]), int(b.offsets[i]), int(b.lens[i]), int(results[i])
        path = self._path(dev)
        if parent is None:
            count, total = int(bad.sum()), len(b)
        else:
            count = int(np.unique(parent[bad]).size)
        more = f" ({count} of {total} I/Os failed)" if count > 1 else ""
        if res < 0:
            raise IOFailedError(
                f"{_OP_NAME[op]} of {length} bytes at offset {off} on {path} failed: "
                f"{strerror(-res)}{more}", path, -res, off, length, count)
        raise IOFailedError(
            f"short {_OP_NAME[op]} at offset {off} on {path}: {res} of {length} bytes "
            f"(end of device, or the device shrank){more}", path, 5, off, length, count)


    def _raise_broken(self, op: int, b: IOBatch, results: np.ndarray, code: int,
                      parent: np.ndarray | None, total: int, target: IOBatch):
        """The IOFailedError for a batch the ring broke under (RingBroken):
        it names the first piece that did not finish and counts the
        caller's I/Os that did not (pieces of one I/O are one: the store
        drops only the run an error names when ``failed`` is 1), and, as
        ``in_flight``, those its drain could not wait for (slots never
        answered): they may still land.  The host memory such reads go to
        (``target``'s: the engine's staging for unaligned addresses) is kept
        mapped and out of every pool for the process's life
        (aligned.keep_for_late_reads)."""
        unfinished = np.flatnonzero(results != b.lens.astype(np.int64))
        count = int(unfinished.size if parent is None else np.unique(parent[unfinished]).size)
        i = int(unfinished[0])
        dev, off, length = int(b.devs[i]), int(b.offsets[i]), int(b.lens[i])
        path = self._path(dev)
        waiting = np.flatnonzero((results == UNANSWERED) | (results == _PENDING))
        in_flight = int(waiting.size if parent is None else np.unique(parent[waiting]).size)
        late = ""
        if in_flight:
            j = int(waiting[0])
            if op == OP_READ:
                aligned.keep_for_late_reads(
                    zip(target.addrs[waiting].tolist(),
                        (target.addrs[waiting] + target.lens[waiting]).tolist()),
                    f"a read at offset {int(b.offsets[j])} on {self._path(int(b.devs[j]))}")
            late = (f" {in_flight} of them may still be in flight (the broken ring could not "
                    f"wait for them), the first a {_OP_NAME[op]} at offset {int(b.offsets[j])} "
                    f"on {self._path(int(b.devs[j]))}: " +
                    ("the space it writes must not be reused while this process lives."
                     if op == OP_WRITE else
                     "its buffer may still be written while this process lives."))
        raise IOFailedError(
            f"io_uring failed while running a batch of {total} I/Os: {strerror(code)}; "
            f"{count} of {total} I/Os did not finish, the first a {length}-byte I/O at "
            f"offset {off} on {path}.{late} This thread gets a new ring at its next batch; "
            "retry, or use KVBLOCK_IO_ENGINE=threads if it recurs",
            path, code, off, length, count, device_fault=False, in_flight=in_flight) from None


def _as_bytes(buffer, *, writable: bool) -> np.ndarray:
    try:
        arr = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
    except (TypeError, ValueError):
        arr = None
    if arr is None or not arr.flags.c_contiguous:
        raise ConfigError("buffer must be a C-contiguous numpy array or writable bytes-like object")
    if writable and not arr.flags.writeable:
        raise ConfigError("read target buffer is read-only")
    return arr.reshape(-1).view(np.uint8)


def _address(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)
