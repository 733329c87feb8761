"""Page-aligned host buffers backed by anonymous mmap.

O_DIRECT needs buffer addresses aligned to the device's logical block size;
mmap gives page alignment (4 KiB, which also satisfies GPUDirect Storage).
Buffers are pre-faulted at allocation so that the first I/O into them is not
slowed by page faults (this matters on VMs that hand freed memory back).
Buffers of at least one huge page start on a huge-page boundary and ask for
transparent huge pages (MADV_HUGEPAGE): a large direct I/O into 4 KiB pages
registered with io_uring is a bio of one segment per page, which a device
with a segment limit (loop: 128, many NVMe drives: 127 or fewer) must split (a
1 MiB read becomes two requests or more); io_uring registers huge pages as
large segments, so the I/O stays one request.
Every buffer is registered in :mod:`kvblock.memory.registry` so the io_uring
engine can use fixed-buffer I/O on it.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import mmap
import operator
import os
import threading
import weakref

import numpy as np

from kvblock.errors import ConfigError
from kvblock.memory import registry
from kvblock.memory.forklocks import renew_after_fork
from kvblock.units import is_whole

logger = logging.getLogger("kvblock.memory")

PAGE_SIZE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels: touch pages by hand
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def _huge_page_size() -> int:
    """The PMD huge-page size when transparent huge pages can be used, else 0."""
    thp = "/sys/kernel/mm/transparent_hugepage"
    try:
        with open(f"{thp}/enabled") as f:
            if "[never]" in f.read():
                return 0
        with open(f"{thp}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


HUGE_PAGE_SIZE = _huge_page_size()


# Called by HostBuffer.close() with (address, nbytes) before it unmaps the
# memory: each returns once no I/O in flight reads into or writes from it
# (kvblock.io.engine registers one, for every engine's batches).
_before_unmap: list = []


# Host memory a read may still write into, [lo, hi) each: the kernel took it
# and a broken io_uring could not wait for it (kvblock.io.engine, its
# IOFailedError.in_flight).  The HostBuffers there stay mapped while the
# process lives (their mappings held here: one collected would be unmapped)
# and say so (left_in_flight), so that no pool hands them out again.
_LATE: list[tuple[int, int]] = []
_KEPT: list = []
# Reentrant: a collection while keep_for_late_reads holds it may close a
# HostBuffer in a late range (a finalizer), whose close() takes it again.
_LATE_LOCK = threading.RLock()
# Every HostBuffer not yet closed, by a key each (a dict of weakrefs, listed
# from any thread with one copy in C, as kvblock.io.engine's _BY_KEY).
_LIVE: "dict[int, weakref.ref[HostBuffer]]" = {}
_LIVE_KEYS = itertools.count()


def _late_lock_after_fork() -> None:
    global _LATE_LOCK
    _LATE_LOCK = threading.RLock()   # (one a parent's thread held at the fork stays held)


os.register_at_fork(after_in_child=_late_lock_after_fork)


def keep_for_late_reads(ranges, why: str) -> None:
    """``ranges`` of host memory ([lo, hi) each) may still be written by
    reads nobody can wait for (``why`` names the first, its device and
    offset): never unmap the HostBuffers holding them, nor let them be
    reused, while this process lives (a deliberate leak, logged once for
    each)."""
    ranges = [(int(lo), int(hi)) for lo, hi in ranges]
    with _LATE_LOCK:
        _LATE.extend(ranges)
        for ref in _LIVE.copy().values():
            buf = ref()
            mm = buf._mm if buf is not None else None
            if mm is None or buf._kept or not _late(buf.address, buf._size):
                continue
            buf._kept = True
            _KEPT.append(mm)
            logger.warning("kvblock: host buffer at 0x%x (%d bytes) is kept mapped and "
                           "never reused while this process lives: %s may still land in "
                           "it (a broken io_uring could not wait for it)",
                           buf.address, buf.nbytes, why)


def _late(address: int, nbytes: int) -> bool:
    """Whether a read left in flight may land in [address, address + nbytes)."""
    return any(lo < address + nbytes and address < hi for lo, hi in _LATE)


def before_unmap(wait) -> None:
    """Have HostBuffer.close() call ``wait(address, nbytes)`` before it unmaps."""
    _before_unmap.append(wait)


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def is_aligned(address: int, align: int = PAGE_SIZE) -> bool:
    return address % align == 0


class HostBuffer:
    """One page-aligned, pre-faulted region of host memory.

    ``.array`` is a uint8 numpy view of the whole region; :meth:`numpy` and
    :meth:`torch` return typed views without copying.  Close it (or use it as
    a context manager) to unmap; views taken before keep their pages mapped
    (numpy and torch alike) until the last of them goes, no new view is given.
    """

    def __init__(self, nbytes: int, *, register: bool = True):
        # a whole number: 1.5 would silently become a 1-byte buffer
        if not is_whole(nbytes) or nbytes <= 0:
            raise ConfigError(f"buffer size must be a positive number of bytes, got {nbytes!r}")
        self.nbytes = int(nbytes)
        size = round_up(self.nbytes, PAGE_SIZE)
        huge = HUGE_PAGE_SIZE if HUGE_PAGE_SIZE and size >= HUGE_PAGE_SIZE else 0
        # Room to start on a huge-page boundary (untouched slack is only
        # address space, never memory).
        try:
            self._mm = mmap.mmap(-1, (round_up(size, huge) + huge) if huge else size,
                                 flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, OverflowError) as e:   # ENOMEM; past ssize_t: OverflowError
            raise ConfigError(f"{self.nbytes} bytes of host memory cannot be mapped: "
                              f"{getattr(e, 'strerror', None) or e}; ask for less than the "
                              "machine has free") from None
        self._offset = 0
        if huge:
            base = int(np.frombuffer(self._mm, dtype=np.uint8, count=1).ctypes.data)
            self._offset = (-base) % huge
            # io_uring turns a registered buffer into large segments only when
            # every page of it lies in a huge page, so a partial last huge page
            # is used too (at most 1/8 more memory; beyond that the tail stays
            # in 4 KiB pages and large I/Os there are split as before).
            whole = round_up(size, huge)
            if whole - size > size // 8:
                whole = size // huge * huge
            try:
                self._mm.madvise(_MADV_HUGEPAGE, self._offset, whole)
            except (OSError, ValueError):
                pass
        try:
            _prefault(self._mm, self._offset, size)
        except OSError as e:
            self._mm.close()
            raise ConfigError(f"{self.nbytes} bytes of host memory cannot be populated: "
                              f"{e.strerror}; free memory, raise the memory limit (the "
                              "cgroup's memory.max) or ask for less") from None
        self._size = size
        self.array = np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes,
                                   offset=self._offset)
        self.address = int(self.array.ctypes.data)
        self._registered = register
        self._cuda_pinned = False     # page-locked with CUDA (None: it failed, not again)
        self._cuda_unpin = None       # pinned: its unregistration (a finalizer)
        self.cuda_pin_refusal = None  # why pin_for_cuda left it pageable (None: it did not)
        self._lock = threading.Lock()
        self._kept = False            # a read left in flight may land in it (keep_for_late_reads)
        key = next(_LIVE_KEYS)
        _LIVE[key] = weakref.ref(self, lambda _, key=key: _LIVE.pop(key, None))
        self._live_key = key
        renew_after_fork(self)        # a forked child's close() of its copy takes it
        if register:
            registry.add(self.address, size)
            # A buffer dropped without close() (a thread's staging buffer when
            # the thread ends) must leave the registry too: a stale region
            # makes every later ring's fixed-buffer registration fail.
            self._unregister = weakref.finalize(self, registry.remove, self.address)

    def numpy(self, dtype=np.uint8, shape=None, offset: int = 0) -> np.ndarray:
        """A typed numpy view (no copy) starting ``offset`` bytes in."""
        dtype = np.dtype(dtype)
        count, shape, offset = self._view_count(dtype.itemsize, shape, offset)
        view = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._offset + offset)
        return view if shape is None else view.reshape(shape)

    def torch(self, dtype=None, shape=None, offset: int = 0):
        """A torch CPU tensor sharing this memory (no copy)."""
        import torch  # optional dependency, imported only when asked for

        dtype = dtype or torch.uint8
        itemsize = torch.empty((), dtype=dtype).element_size()
        count, shape, offset = self._view_count(itemsize, shape, offset)
        if count == 0:      # torch.frombuffer refuses a count of 0 (numpy gives the view)
            return torch.empty(shape if shape is not None else (0,), dtype=dtype)
        # Through a numpy view, which the tensor keeps alive: it holds the
        # mapping's buffer export, so close() leaves the pages mapped while
        # the tensor lives, as for numpy views.  torch.frombuffer releases
        # the export at once: close() unmapped the memory under the tensor,
        # and a buffer mapped there later showed through it.
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=count * itemsize,
                            offset=self._offset + offset)
        t = torch.from_numpy(raw).view(dtype)
        # (a tuple: view(*()) is no shape to torch, () a 0-d one)
        return t if shape is None else t.view(shape)

    def _view_count(self, itemsize: int, shape, offset: int) -> tuple[int, tuple | None, int]:
        """(items, shape, offset as an int) of a view starting ``offset`` bytes in (of ``shape``,
        else to the end), checked to lie inside the buffer's nbytes; a -1 in
        ``shape`` is the dim that fills the rest of them (numpy's meaning: a
        negative count would be read as 'to the end of the mapping', past
        nbytes)."""
        if self._mm is None:
            raise ConfigError(f"{self!r} is closed: its memory is unmapped; take a view "
                              "before closing it, or use a new buffer")
        # whole numbers, multiplied as Python ints: np.prod wraps in int64
        # (2**64 - 1 items counted -1, 'the whole buffer'), and int() cut
        # 2.5 to 2 (an offset so cut was checked, then passed on as given)
        if not is_whole(offset, index=True):
            raise ConfigError(f"a view's offset must be a whole number of bytes, got {offset!r}")
        offset = operator.index(offset)
        rest = (self.nbytes - offset) // itemsize
        if shape is not None:
            dims = np.atleast_1d(np.asarray(shape, dtype=object)).tolist()
            if not all(is_whole(n, index=True) for n in dims):
                raise ConfigError(f"a view's shape must be whole numbers, got {shape!r}")
            shape = tuple(operator.index(n) for n in dims)
            known = math.prod(n for n in shape if n != -1)
            wild = shape.count(-1)
            if wild > 1 or any(n < -1 for n in shape) or \
                    (wild and (known == 0 or rest < 0 or rest % known)):
                raise ConfigError(f"a view of shape {shape} at offset {offset} of a "
                                  f"{self.nbytes}-byte buffer of {itemsize}-byte items: dims "
                                  "must be sizes, with at most one -1 that the rest of the "
                                  "buffer fills")
            if wild:
                shape = tuple(rest // known if n == -1 else n for n in shape)
        count = rest if shape is None else math.prod(shape)
        if not 0 <= offset <= self.nbytes or offset + count * itemsize > self.nbytes:
            raise ConfigError(f"a view of {max(count, 0) * itemsize} bytes at offset {offset} "
                              f"of a {self.nbytes}-byte buffer; keep views inside the buffer")
        return count, shape, offset

    def close(self) -> None:
        """Unmap the memory (views taken before keep it mapped; see the class).

        A batch of an engine (kvblock.io) that reads into or writes from
        this buffer and is in flight in another thread when close() is
        called is waited for: close() returns once it is done, then
        unmaps, as the engines' and the store's close() wait for their
        calls in flight.  Unmapped under it, the read failed with EFAULT at
        best; at worst its bytes landed in (or a write or hash read from)
        whatever memory was mapped at the address next.  A batch submitted
        after close() has begun is the caller's error: its addresses name
        unmapped memory.  Do not close a buffer from the thread whose batch
        uses it (it would wait for itself)."""
        if self._mm is None:
            return
        for wait in _before_unmap:
            wait(self.address, self._size)
        with self._lock:
            if self._mm is None:
                return
            if self._registered:
                self._unregister()     # once: a later buffer may get this address
            if self._cuda_pinned:
                # unmapping does not unlock: the driver would keep the pages
                # locked, and a buffer mapped there later could not be pinned
                self._cuda_unpin()     # once (a finalizer runs once)
                self._cuda_pinned = False
            self.array = None
            _LIVE.pop(self._live_key, None)
            if self.left_in_flight:
                # A read left in flight may still land here: the mapping
                # stays (held in _KEPT) for the process's life, not reused.
                with _LATE_LOCK:
                    if not self._kept:
                        self._kept = True
                        _KEPT.append(self._mm)
                self._mm = None
                return
            try:
                self._mm.close()
            except BufferError:
                # A caller still holds a view; the kernel frees the pages when
                # the last view goes away.
                pass
            self._mm = None

    def pin_for_cuda(self, device: int | None = None) -> bool:
        """Page-lock this buffer with CUDA (cudaHostRegister, for every
        GPU), for copies to the GPU at DMA speed instead of through the
        driver's pageable bounce buffer: once (True from then on), undone by
        close() before it unmaps.  ``device``: the CUDA device index to make
        current for it (the GPU the copies go to; None: the thread's own).
        False when it stays pageable (no GPU, the driver refused: not tried
        again, ``cuda_pin_refusal`` says why; closed)."""
        with self._lock:
            if self._mm is None or self._cuda_pinned is None:
                return False
            if not self._cuda_pinned:
                from kvblock.memory.cudapin import pin_refused, unpin_at

                try:
                    refusal = pin_refused(self, device)
                    if refusal is None:
                        # Dropped without close() (a store collected unclosed,
                        # its spares with it), the buffer is unregistered as it
                        # is collected, before its memory goes (weakref
                        # callbacks run before the instance's attributes, its
                        # mapping among them, are cleared).  Not at exit: the
                        # process's end unlocks everything.
                        self._cuda_unpin = weakref.finalize(self, unpin_at, self.address,
                                                            device)
                        self._cuda_unpin.atexit = False
                    self.cuda_pin_refusal = refusal
                    self._cuda_pinned = None if refusal else True
                except BaseException:
                    # a Ctrl-C as cudaHostRegister returns or before the
                    # finalizer is set: nothing else would unlock the pages
                    # (maybe never locked: then unregistering is refused, quietly)
                    if self._cuda_unpin is not None:
                        self._cuda_unpin.detach()
                        self._cuda_unpin = None
                    self._cuda_pinned = False
                    unpin_at(self.address, device, quiet=True)
                    raise
            return bool(self._cuda_pinned)

    @property
    def cuda_pinned(self) -> bool:
        return bool(self._cuda_pinned)

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def left_in_flight(self) -> bool:
        """Whether a read a broken io_uring could not wait for may still land
        in this buffer (keep_for_late_reads): a pool must not hand it out
        again; its close() leaves it mapped."""
        return self._kept or (bool(_LATE) and _late(self.address, self._size))

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostBuffer(address=0x{self.address:x}, nbytes={self.nbytes})"


def _prefault(mm: mmap.mmap, start: int, length: int) -> None:
    """Fault the pages in; OSError(ENOMEM) when the kernel has no memory
    for them (touched by hand then, the OOM killer would end the process)."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE, start, length)
    except (OSError, ValueError) as e:
        if getattr(e, "errno", None) == errno.ENOMEM:
            raise
        view = np.frombuffer(mm, dtype=np.uint8, count=length, offset=start)
        view[::PAGE_SIZE] = 0


def aligned_empty(shape, dtype=np.uint8) -> np.ndarray:
    """A page-aligned, uninitialised numpy array (its memory stays mapped while
    the array or any view of it lives)."""
    # as numpy.empty takes them, each refused by name: a negative count was
    # read as the whole mapping (aligned_empty(-1): 4096 bytes, silently)
    try:
        dtype = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"aligned_empty: dtype {dtype!r} is no numpy dtype ({e})") from None
    if dtype.hasobject:
        raise ConfigError(f"aligned_empty: dtype {dtype} holds Python objects, not bytes; "
                          "pass a numeric dtype")
    # a 0-d integer array (np.array(5)) is one count, as numpy.empty takes
    # it: iterated, it was a bare TypeError ('iteration over a 0-d array')
    dims = tuple(shape) if isinstance(shape, (tuple, list)) or \
        (isinstance(shape, np.ndarray) and shape.ndim) else (shape,)
    dims = tuple(n[()] if isinstance(n, np.ndarray) and n.ndim == 0 else n for n in dims)
    if not all(is_whole(n) and n >= 0 for n in dims):
        raise ConfigError(f"aligned_empty: shape must be a whole number of items >= 0 or a "
                          f"tuple of them, got {shape!r}")
    shape = tuple(int(n) for n in dims)
    count = int(np.prod(shape, dtype=object))
    buf = HostBuffer(max(count * dtype.itemsize, 1), register=False)
    return np.frombuffer(buf._mm, dtype=dtype, count=count, offset=buf._offset).reshape(shape)
