"""io_uring engine: one ring per thread, device table and long-lived buffers
registered with each ring, a whole batch run in one native call."""

from __future__ import annotations

import itertools
import os
import threading
import weakref

import numpy as np

from kvblock.errors import ConfigError, EngineUnavailableError, strerror
from kvblock.io import native
from kvblock.io.batch import IOBatch
from kvblock.io.engine import IOEngine, RingBroken
from kvblock.memory import registry

# The kernel caps each registered buffer at 1 GiB; the C side holds 64 at most.
_MAX_FIXED_BUF = 1 << 30
_MAX_FIXED_COUNT = 64


def probe() -> tuple[bool, str]:
    """(available, reason): can this process create an io_uring?  A native
    core that cannot load raises NativeLibraryError: no engine runs without
    it (the threads engine calls into it too), so it is no reason to fall
    back to one."""
    return probe_errno()[:2]


def probe_errno() -> tuple[bool, str, int]:
    """:func:`probe`, and the errno io_uring_setup failed with (0 if none)."""
    lib = native.lib()
    err = native.ffi.new("int *")
    ring = lib.kvb_ring_create(4, err)
    if ring == native.ffi.NULL:
        return False, f"io_uring_setup failed: {strerror(-err[0])}", -err[0]
    lib.kvb_ring_destroy(ring)
    return True, "io_uring available", 0


class _Ring:
    """One thread's ring and what it has registered."""

    def __init__(self, engine: "UringEngine"):
        lib = native.lib()
        err = native.ffi.new("int *")
        entries = max(engine.queue_depth, 8)
        self.handle = lib.kvb_ring_create(entries, err)
        if self.handle == native.ffi.NULL:
            raise EngineUnavailableError(f"io_uring_setup failed: {strerror(-err[0])}; "
                                         "use KVBLOCK_IO_ENGINE=threads")
        self._fds = engine.fds  # kept alive for the C side's copy
        self.pid = os.getpid()  # rings are not shared with forked children
        self.thread = threading.get_ident()
        self.fixed_files = lib.kvb_ring_set_files(
            self.handle, native.ptr("int *", engine.fds), len(engine.fds)) == 0
        self.buffers_version = -1
        self.fixed_buffers = False
        # Held by the owning thread while it uses the ring; another thread
        # destroys the ring only when it gets it (see _retire_idle_rings).
        self.lock = threading.Lock()
        self.orphaned = False   # its holder was collected while it ran (see _forget)

    def sync_buffers(self) -> None:
        version, regions = registry.snapshot()
        if version == self.buffers_version or self.handle is None:
            return
        regions = [r for r in regions if r[1] <= _MAX_FIXED_BUF][:_MAX_FIXED_COUNT]
        addrs = np.array([r[0] for r in regions], dtype=np.uint64)
        lens = np.array([r[1] for r in regions], dtype=np.uint64)
        ret = native.lib().kvb_ring_set_buffers(
            self.handle, native.ptr("uint64_t *", addrs), native.ptr("uint64_t *", lens),
            len(regions))
        self.fixed_buffers = ret == 0 and bool(regions)
        self.buffers_version = version

    def destroy(self) -> None:
        """(its lock held, or its thread gone) Free the ring, once."""
        # One destroyer wins (thread exit vs close vs a retire): swapped
        # under a lock, as two threads could otherwise both read the handle
        # before either cleared it (the GIL switches between the two) and
        # both free it: heap corruption, a crash later anywhere.
        with _DESTROYING:
            handle, self.handle = self.handle, None
        if handle is not None:
            native.lib().kvb_ring_destroy(handle)


_DESTROYING = threading.Lock()


def _fresh_destroying_lock() -> None:
    global _DESTROYING
    _DESTROYING = threading.Lock()    # (a parent's thread may have held it at the fork)


os.register_at_fork(after_in_child=_fresh_destroying_lock)


class _RingHolder:
    """Thread-local owner of a thread's ring (see UringEngine._ring)."""

    __slots__ = ("ring", "__weakref__")

    def __init__(self, ring):
        self.ring = ring


# The open engines, each by a key of its own: {key: weakref to it}.  Not a
# WeakSet: _buffer_removed runs in any thread (a buffer's close, a GC
# finalizer), and a WeakSet is iterated in Python, so an engine opened or
# closed in another thread meanwhile raised RuntimeError ("Set changed size
# during iteration") out of that buffer's close(), leaving it mapped.
_ENGINES: "dict[int, weakref.ref[UringEngine]]" = {}
_ENGINE_KEYS = itertools.count()


def _buffer_removed() -> None:
    for ref in list(_ENGINES.values()):   # (one copy in C: no thread runs meanwhile)
        engine = ref()
        if engine is not None:
            engine._retire_idle_rings()


registry.on_remove(_buffer_removed)


class UringEngine(IOEngine):
    """Batched direct I/O over io_uring (liburing, native/kvblock_io.c)."""

    name = "uring"

    def __init__(self, devices, **kwargs):
        ok, reason = probe()
        if not ok:
            raise EngineUnavailableError(f"io_uring engine unavailable: {reason}; "
                                         "use KVBLOCK_IO_ENGINE=threads")
        super().__init__(devices, **kwargs)
        self._rings: list[_Ring] = []
        self._rings_lock = threading.Lock()
        self._engine_key = key = next(_ENGINE_KEYS)
        _ENGINES[key] = weakref.ref(self, lambda _, key=key: _ENGINES.pop(key, None))

    def _ring(self) -> _Ring:
        """This thread's ring, not locked (_run takes its lock)."""
        holder = getattr(self._local, "holder", None)
        ring = holder.ring if holder is not None else None
        if ring is None or ring.pid != os.getpid():
            # First use on this thread, or a forked child: the parent's ring
            # (single-issuer) is not this process's to submit to.
            ring = _Ring(self)
            holder = self._local.holder = _RingHolder(ring)
            # The ring lives as long as its thread: when the thread ends, its
            # thread-local holder is collected and the ring (and its fds) freed,
            # so engines used from short-lived threads (one per load) do not
            # accumulate rings.
            weakref.finalize(holder, self._forget, ring)
            with self._rings_lock:
                self._rings.append(ring)
        return ring

    def _release(self, ring: _Ring) -> None:
        """(after _run let go of the ring's lock) What was left to its holder."""
        if ring.orphaned and ring.lock.acquire(blocking=False):   # see _forget
            try:
                ring.destroy()
            finally:
                ring.lock.release()
            return
        # A buffer closed while this ring ran: _retire_idle_rings found the
        # ring busy, so drop the buffer's registration here, or an idle ring
        # would keep its pages pinned until this thread's next batch.
        if ring.buffers_version != registry.version and ring.lock.acquire(blocking=False):
            try:
                if ring.handle is not None:
                    ring.sync_buffers()
            finally:
                ring.lock.release()

    def _retire_idle_rings(self) -> None:
        """A registered buffer was closed: its pages stay pinned while any
        ring has it registered.  A single-issuer ring can only change its
        registration from its own thread, so rings idle now are destroyed
        (their threads get fresh ones at their next batch); busy ones
        re-register in _release."""
        # No blocking lock here: this may run from a finalizer (a buffer
        # dropped unclosed) in a thread that holds _rings_lock or a ring.
        for ring in list(self._rings):
            if ring.pid == os.getpid() and ring.lock.acquire(blocking=False):
                try:
                    if ring.thread == threading.get_ident():
                        ring.sync_buffers()     # its own thread may re-register
                    else:
                        ring.destroy()
                finally:
                    ring.lock.release()

    def _forget(self, ring: _Ring) -> None:
        """(a thread's ring holder collected: the thread ended, or the
        engine closed or replaced the holder) Destroy the ring, under its
        lock: collected while its thread still ran a batch on it (close()
        dropping every thread's holder), it was freed under that native
        call, or passed as NULL to the next one.  Busy: its thread destroys
        it as it releases it (_release)."""
        ring.orphaned = True    # (first: a _release between the two would miss it)
        if ring.lock.acquire(blocking=False):
            try:
                ring.destroy()
            finally:
                ring.lock.release()
        with self._rings_lock:
            if ring in self._rings:
                self._rings.remove(ring)

    @property
    def live_rings(self) -> int:
        with self._rings_lock:
            return len(self._rings)

    def _run(self, op, batch: IOBatch, qd, results, latency, hasher) -> None:
        while True:
            ring = self._ring()
            try:
                # The lock taken by the with statement: taken by an acquire()
                # call before this try, a KeyboardInterrupt landing as that
                # call returned left it held, and this thread's next batch
                # waited on it for good.
                with ring.lock:
                    retired = ring.handle is None and not self.closed
                    if not retired:
                        if ring.handle is None:   # destroyed by close(): the native call would crash
                            raise ConfigError("uring engine is closed")
                        # under the with: an error registering (no memory, a Ctrl-C)
                        # left the lock held, and close() waited for it for good
                        ring.sync_buffers()
                        p = native.ptr
                        ret = native.lib().kvb_ring_run(
                            ring.handle, op, len(batch), p("uint64_t *", batch.addrs),
                            p("uint32_t *", batch.devs), p("uint64_t *", batch.offsets),
                            p("uint64_t *", batch.lens), qd, p("int64_t *", results),
                            p("int64_t *", latency),
                            native.ffi.NULL if hasher is None else hasher.handle)
            finally:
                self._release(ring)
            if not retired:
                break
            # retired while idle (_retire_idle_rings): a new one
            self._forget(ring)
            self._local.holder = None
        if ret < 0:
            # A broken ring is retired (kvb_ring_run first waited for the
            # I/Os it had taken): this thread's next batch gets a new one.
            self._local.holder = None
            # A batch whose I/Os all completed has its bytes: nothing failed.
            # Otherwise IOEngine.submit names the first I/O that did not
            # finish (the ring's drain waited for those it had taken; the
            # rest are ECANCELED), counting the caller's I/Os, not pieces.
            if (results != batch.lens.astype(np.int64)).any():
                raise RingBroken(-ret)

    def _after_fork(self) -> None:
        super()._after_fork()
        # locks the parent's threads may have held at the fork (their
        # rings are not the child's: it destroys them only at close)
        self._rings_lock = threading.Lock()
        for ring in self._rings:
            ring.lock = threading.Lock()

    def close(self) -> None:
        with self._closing:   # a second close() returns once this one is done
            if not self.closed:
                super().close()
                _ENGINES.pop(getattr(self, "_engine_key", None), None)
            # The rings stay on the engine until each is destroyed (a second
            # destroy does nothing): a child forked while a thread of the
            # parent was here finds its copy closed, and destroys the copies
            # of those left at its close(); taken off first, they were only
            # in that thread's frame, and the child kept their descriptors
            # (an io_uring keeps the device files it registered open: a
            # block device's O_EXCL claim while the child lives).
            with self._rings_lock:
                rings = list(self._rings)
            for ring in rings:
                # A ring's own thread may be re-registering its buffers (a buffer
                # closed there: _retire_idle_rings), the GIL released in the
                # native call: destroy it once that is done, not under it.
                with ring.lock:
                    ring.destroy()
            with self._rings_lock:
                self._rings = [r for r in self._rings if r.handle is not None]
            # Each thread's ring holder has a finalizer that holds this engine;
            # a thread that lives on (an engine's main or scheduler thread) would
            # keep the closed engine alive for good: drop every thread's holder.
            self._local = threading.local()
