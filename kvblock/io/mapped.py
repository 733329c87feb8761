"""Reads and writes served from shared mappings of store files that live in RAM.

A store file on tmpfs (/dev/shm, a RAM-backed scratch mount) has no device
to DMA from: every read is a kernel copy out of the page cache, 4 KiB page by
page, which io_uring runs on its worker threads (kernel threads, not the
submitting one), and every write a copy into it.  A copy out of a shared
mapping of the same file reads the same RAM for less CPU, and kvb_mem_read
hashes each 64 KiB chunk right after copying it, while it is in cache;
kvb_mem_write copies into the mapping with streaming stores (a C sketch on
the 2-core VM: 17.4 GiB/s into a mapping against 6.4-6.8 for fio's io_uring
writes to the same file).  Tmpfs keeps nothing else to order or flush: the
stores are fenced before the write returns, so the journal record that
publishes them is written after them, as on any device.

A device is mapped only when it is a regular file on tmpfs whose every byte
is allocated (a pre-sized store file: ``create_file`` reserves it with
posix_fallocate), so a copy through the mapping never has to allocate: a
write into a hole on a full tmpfs would be a SIGBUS, where the kernel's
write path returns ENOSPC.  The store does not punch holes in mapped devices
(:meth:`MappedDevices.mapped`); store-server clients, whose server decides
about holes, write through the kernel (``writes=False``).  A file cut shorter
under a running store is the one thing a mapping turns from an error into a
crash: a copy past the new end is a SIGBUS, where pread returned a short read.
So each copy first checks (lseek to the end) that the files still cover
their mappings, and takes the engine's path when one does not
(:meth:`MappedDevices.cut_short`);
only a cut made during a copy is still a SIGBUS (tmpfs files take no seals,
a read lease none open for writing, and a write lease would stall every other
open of the file).  A file replaced (removed, a new one made under its name)
is no danger: the mapping and the descriptor keep the old one.  The store's
flock keeps other kvblock processes off its files; nothing else may truncate
them while they are open.  ``KVBLOCK_MAPPED_READS=never`` turns mappings off
(reads and writes).

A page's first copy out of a fresh mapping takes a page fault; after the page
cache was dropped the kernel stops mapping neighbouring pages with it, and a
first read ran at 1.3 GiB/s (a C sketch on the 2-core VM, 1 GiB, against 8.4
once mapped).  So every page is mapped in ahead of use (MADV_POPULATE_READ:
0.15-0.36 s per GiB in C sketches, once per open), and until that is done
reads take the engine's own path.  When is a trade-off, measured on the
2-core VM:

- a fresh store (``KVStore.format``) maps in before it returns: format is
  provisioning, and a store's first loads come right after its first saves;
- a reopened store starts only after its recovery (a prefault beside it
  slowed reopening a 100K-block store from 0.064-0.076 s to 0.103-0.138,
  perf/test_store_ops.py), at once up to PREFAULT_INLINE bytes, else on a
  low-priority thread that waits for gaps between the engine's writes: beside
  a vLLM tier's stores it halved them (likely because each populate step
  holds the process's mmap_lock, which mmap and brk need too).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time

import numpy as np

from kvblock.errors import ConfigError, DeviceError, strerror
from kvblock.io import native

TMPFS_MAGIC = 0x01021994
PAGE = mmap.PAGESIZE
PREFAULT_STEP = 64 << 20   # one madvise call (~10-25 ms), then a stop check
PREFAULT_INLINE = 64 << 20  # mapped in on the spot (~10-25 ms); larger ones in the background
PREFAULT_PAUSE = 0.02      # s: the background prefault waits while writes are this recent
PREFAULT_MAX_WAIT = 0.25   # s: ... but no longer than this per step (a store written
                           # every few ms never pauses 20 ms, and reads stay slow unmapped)
_SETTING = "KVBLOCK_MAPPED_READS"
logger = logging.getLogger("kvblock")
_warned: set[tuple[str, str]] = set()   # (device, reason) the loop advice was logged for


def mapped_reads_wanted(choice: bool | None = None) -> bool:
    """``choice`` if given, else the ``KVBLOCK_MAPPED_READS`` setting
    (``auto``, the default, or ``never``)."""
    if choice is not None:
        return bool(choice)
    value = os.environ.get(_SETTING, "auto").strip().lower()
    if value not in ("auto", "never"):
        raise ConfigError(f"{_SETTING}={value!r}: choose auto (map store files on tmpfs) "
                          "or never")
    return value == "auto"


def loop_over_tmpfs(device) -> str | None:
    """The backing file of ``device`` when it is a loop device over a file on
    tmpfs, else None.  Every read of such a device is a copy the loop driver
    makes on its one kernel worker (fio read one at 4.6-7.1 GiB/s on the
    2-core VM, where kvblock's vLLM tier loaded a tmpfs store file through a
    mapping at 11.2-14.3 with 2 MiB slots): the file itself is the faster device to give."""
    if device.kind != "block":
        return None
    from kvblock.devices.device import loop_backing

    backing = loop_backing(os.fstat(device.fd).st_rdev)
    if backing is None:
        return None          # not a loop device
    try:
        fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None          # deleted, or not reachable from this mount namespace
    try:
        return backing if native.lib().kvb_fs_type(fd) == TMPFS_MAGIC else None
    finally:
        os.close(fd)


def loop_advice(device) -> str | None:
    """For a loop device over a tmpfs file: what to give kvblock instead."""
    backing = loop_over_tmpfs(device)
    if backing is None:
        return None
    return (f"a loop device over {backing} on tmpfs: give kvblock that file instead to "
            "read it through a mapping (the loop driver copies every read on one kernel "
            "worker)")


def mappable(device) -> str | None:
    """Why ``device`` cannot be read through a mapping, or None when it can."""
    if device.kind != "file":
        return loop_advice(device) or "not a file"
    fs_type = native.lib().kvb_fs_type(device.fd)
    if fs_type < 0:
        return f"fstatfs failed ({os.strerror(-fs_type)})"
    if fs_type != TMPFS_MAGIC:
        return "not on tmpfs"
    if device.capacity <= 0:
        return "empty"
    # Every page of the file allocated (fallocated pages count; SEEK_HOLE
    # would call them holes): a write into a hole of a full tmpfs through
    # the mapping is a SIGBUS, not ENOSPC.  Against the capacity alone, the
    # page past it could make up for a hole inside.
    st = os.fstat(device.fd)
    if st.st_blocks * 512 < -(-st.st_size // PAGE) * PAGE:
        return "not fully allocated (sparse)"
    return None


class MappedDevices:
    """Shared mappings of the engine's devices that qualify (writable where
    the device was opened to write and writes are wanted).

    ``bases[d]`` is device d's mapping address (0: not mapped) and
    ``sizes[d]`` its length, as kvb_mem_read takes them.
    """

    def __init__(self, devices, start: bool = True, writes: bool = True):
        n = len(devices)
        self.bases = np.zeros(n, dtype=np.uint64)
        self.sizes = np.zeros(n, dtype=np.uint64)
        self.writable = np.zeros(n, dtype=bool)   # writes copy into the mapping too
        self._maps: list[tuple[mmap.mmap, np.ndarray] | None] = [None] * n
        self.reasons: dict[int, str] = {}
        self._paths = [dev.path for dev in devices]
        self._fds = [dev.fd for dev in devices]
        self._lengths = [0] * n               # sizes, as ints (cut_short)
        self._cut_warned: set[int] = set()    # devices found cut shorter (warned once)
        self._stop = threading.Event()
        self._ready = threading.Event()   # every page mapped in: reads may use the mappings
        self._prefaulter = None
        self._refault = False     # a forked child's: covers() maps the pages in afresh
        for d, dev in enumerate(devices):
            why = mappable(dev)
            if why is not None:
                self.reasons[d] = why
                # Advice, not a fault (test rigs and benchmarks do this on
                # purpose), so INFO; `kvblock info` shows it as a hint.
                if why.startswith("a loop device") and (dev.path, why) not in _warned:
                    _warned.add((dev.path, why))      # once per process, not per engine
                    logger.info("kvblock: %s is %s", dev.path, why)
                continue
            writable = writes and dev.writable
            try:
                m = mmap.mmap(dev.fd, int(dev.capacity), flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
            except OSError as e:
                view = None        # (the previous device's array: an export of its map)
                self.close()       # the devices mapped before this one
                raise DeviceError(
                    f"{dev.path}: mapping its {int(dev.capacity)} bytes failed: "
                    f"{strerror(e.errno or 0)}; free address space (ulimit -v, "
                    f"vm.max_map_count), or set {_SETTING}=never to read and write it "
                    "through the I/O engine", dev.path, e.errno) from None
            view = np.frombuffer(m, dtype=np.uint8)
            self._maps[d] = (m, view)
            self.bases[d] = view.ctypes.data
            self.sizes[d] = self._lengths[d] = int(dev.capacity)
            self.writable[d] = writable
        # (the last device's array: an export of its map, which a failing
        # prefault below closes)
        view = None
        self._all = not self.reasons
        self._all_writable = bool(self.writable.all())
        self._any = len(self.reasons) < n
        self._started = False
        self.last_write = 0.0     # monotonic time of the engine's latest write
        if start:
            self.start()

    def start(self, background: bool | None = None) -> None:
        """Map every page in (once), then let reads use the mappings: on this
        thread for up to PREFAULT_INLINE bytes, else (or with ``background``)
        on a low-priority thread."""
        if self._started or not self._any:
            return
        self._started = True
        spans = [(int(b), int(z), d) for d, (b, z) in enumerate(zip(self.bases, self.sizes))
                 if b]
        if background is None:
            background = sum(z for _, z, _ in spans) > PREFAULT_INLINE
        if not background:
            self._prefault(spans)
            return
        self._prefaulter = threading.Thread(target=self._prefault, args=(spans, True),
                                            name="kvblock-prefault", daemon=True)
        self._prefaulter.start()

    def _prefault(self, spans, background: bool = False) -> None:
        if background:
            try:   # yield the cores to the store's own work
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except OSError:
                pass
        lib = native.lib()
        for base, size, dev in spans:
            for off in range(0, size, PREFAULT_STEP):
                # Beside a vLLM tier's stores to a tmpfs file a prefault halved
                # them (likely: a populate step holds the process's mmap_lock,
                # which mmap and brk need too), so it runs between writes.
                waited_since = time.monotonic()
                while background and time.monotonic() - self.last_write < PREFAULT_PAUSE \
                        and time.monotonic() - waited_since < PREFAULT_MAX_WAIT:
                    if self._stop.wait(PREFAULT_PAUSE):
                        return
                if self._stop.is_set():
                    return
                ret = lib.kvb_mem_prefault(base + off, min(PREFAULT_STEP, size - off))
                if ret == -errno.EINVAL:
                    break   # an old kernel: pages fault in on first read
                if ret < 0:
                    # EFAULT: a page the file cannot back (cut shorter since it
                    # was mapped, or a hole a full tmpfs cannot fill); a copy
                    # through the mapping would be a SIGBUS there, where the
                    # engine's path returns an error.  So the mappings go unused:
                    # dropped, so the device is not reported mapped (stats,
                    # `kvblock info`) and the store trims it as any other.
                    # Nothing copies through them: _ready was never set.
                    logger.warning(
                        "kvblock: %s: mapping its pages in failed (from offset %d): %s; it is "
                        "read and written through the I/O engine (was the file cut "
                        "shorter, or is its tmpfs full?)", self._paths[dev], off,
                        strerror(-ret))
                    self._unmap()
                    return
            else:
                continue
            break
        self._ready.set()

    def _after_fork(self) -> None:
        """In a forked child: a prefault under way ran on a parent's thread,
        which the child does not have, so the mappings would never be used.
        The child's first read starts it afresh (not here: most children,
        DataLoader workers, never read the store)."""
        if self._prefaulter is not None and not self._ready.is_set():
            self._prefaulter, self._started = None, False
            self._stop = threading.Event()
            self._refault_lock = threading.Lock()
            self._refault = True

    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        """Block until every mapped page is mapped in (or ``timeout``)."""
        if self._prefaulter is not None:
            self._prefaulter.join(timeout)
            return not self._prefaulter.is_alive()
        return True

    @classmethod
    def open(cls, devices, choice: bool | None = None, start: bool = True,
             writes: bool = True) -> "MappedDevices | None":
        """Mappings of ``devices`` that qualify, or None when none does (or
        mapped reads are turned off).  ``start``: map the pages in now (else
        :meth:`start` does, and reads take the engine's path until then).
        ``writes``: writes to devices opened writable copy into the mappings
        too (else they go through the engine)."""
        if not mapped_reads_wanted(choice):
            return None
        maps = cls(devices, start=start, writes=writes)
        if not maps._any:
            maps.close()
            return None
        return maps

    def mapped(self, dev: int) -> bool:
        return bool(self.bases[dev])

    def covers(self, devs: np.ndarray, writing: bool = False) -> bool:
        """Every entry of a batch (its device indices) is on a mapped device
        (a writable mapping, ``writing``), and the mappings are ready (until
        then reads and writes take the engine's path)."""
        if not self._ready.is_set():
            if self._refault:
                with self._refault_lock:
                    if self._refault:
                        self._refault = False
                        self.start(background=True)
            return False
        if self._all_writable if writing else self._all:
            return True
        table = self.writable if writing else self.bases
        if devs.size == 1:
            return bool(table[devs.item()])
        return bool(table[devs].all())

    def cut_short(self, devs: np.ndarray) -> bool:
        """Whether the file of a device in a batch (its device indices) is
        now shorter than its mapping: cut under the store (truncate), where
        a copy past its new end is a SIGBUS that kills the process, and the
        engine's pread a short read (a typed error; its pwrite grows the
        file).  Its size from lseek(SEEK_END), 0.16 us against fstat's 0.68
        (every I/O on the descriptor is positional: its offset is unused).
        A cut made while a copy runs is not caught (see the module docstring)."""
        ds = (devs.item(),) if devs.size == 1 else set(
            devs.tolist() if devs.size <= 32 else np.unique(devs).tolist())
        for d in ds:
            try:
                size = os.lseek(self._fds[d], 0, os.SEEK_END)
            except OSError:
                return True          # (the engine's path reports what is wrong)
            if size < self._lengths[d]:
                if d not in self._cut_warned:
                    self._cut_warned.add(d)
                    logger.warning(
                        "kvblock: %s was cut shorter under the store (%d bytes, mapped as "
                        "%d): it is read and written through the I/O engine, and reads "
                        "past its end fail; restore its size (truncate -s %d) and reopen "
                        "the store, and let nothing truncate an open store file",
                        self._paths[d], size, self._lengths[d], self._lengths[d])
                return True
        return False

    def close(self) -> None:
        self._stop.set()
        if self._prefaulter is not None:
            self._prefaulter.join()
        self._unmap()

    def _unmap(self) -> None:
        """Drop every mapping (none may be in use: closed, or never ready)."""
        for d in range(len(self._maps)):
            if self._maps[d] is not None:
                m = self._maps[d][0]
                self._maps[d] = None   # drops the array over the mapping, its only export
                self.bases[d] = 0
                self.writable[d] = False
                m.close()
        self._any = False
        self._all = False
        self._all_writable = False
