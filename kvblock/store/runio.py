"""What reading and writing runs on the devices needs, in both kinds of store.

A :class:`~kvblock.store.store.KVStore` owns its metadata; a
:class:`~kvblock.store.client.RemoteStore` (a rank of a served store) asks
its server for it.  Both do their own I/O on the devices, with the same code:
:class:`~kvblock.store.reads.RunReader` and
:class:`~kvblock.store.writes.RunWriter` on top of this class.  A store using
them has ``geometry``, ``alignment``, ``io`` (a StoreIO), ``counters``,
``verify``, ``host`` (a DRAM tier or None), ``_layouts`` (a dict) and
``_stagings`` (a :class:`StagingBuffers`).
"""

from __future__ import annotations

import logging
import threading
import weakref

from kvblock.errors import StoreClosedError
from kvblock.layout.geometry import RunLayout, round_up
from kvblock.memory import HostBuffer
from kvblock.memory.forklocks import renew_after_fork
from kvblock.store.scatter import BlockList

logger = logging.getLogger("kvblock")


class StagingBuffers:
    """Each thread's aligned buffers, by purpose, kept between calls; and
    every thread's, so that close() frees them all: a thread's locals are
    not reachable from another, and a closed store still referenced would
    keep a long-lived worker's buffer mapped and registered for good."""

    def __init__(self):
        self._local = threading.local()
        self._all: "weakref.WeakSet[HostBuffer]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        renew_after_fork(self)        # a forked child's close() of its copy takes it

    def get(self, nbytes: int, purpose: str) -> HostBuffer:
        """This thread's buffer for ``purpose``, at least ``nbytes`` (grown,
        never shrunk).  StoreClosedError after close(): a buffer made then
        would stay mapped for the thread's life, none freeing it."""
        buf = getattr(self._local, purpose, None)
        # (one a read left in flight may still land in is not handed out
        # again: its close() keeps it mapped, aligned.keep_for_late_reads)
        if buf is None or buf.closed or buf.nbytes < nbytes or buf.left_in_flight:
            if buf is not None:
                buf.close()
            buf = HostBuffer(round_up(nbytes, 1 << 20))
            with self._lock:
                closed = self._closed
                if not closed:
                    self._all.add(buf)
            if closed:
                buf.close()
                raise StoreClosedError("store is closed (its staging buffers freed); reopen it")
            setattr(self._local, purpose, buf)
        return buf

    def close(self) -> None:
        """Free every thread's buffers (no call may be using them); later
        get() calls are refused."""
        with self._lock:
            self._closed = True
            bufs, self._all = list(self._all), weakref.WeakSet()
        for buf in bufs:
            buf.close()


class RunIO:
    """Run layouts, per-thread staging memory, whether caller memory is a
    run's on-device image, and the kvikio handles of GPU loads."""

    def layout(self, nblocks: int) -> RunLayout:
        lay = self._layouts.get(nblocks)
        if lay is None:
            if len(self._layouts) >= 4096:     # runs of many lengths: keep it small
                self._layouts.clear()
            lay = self._layouts[nblocks] = RunLayout(self.geometry, nblocks, self.alignment)
        return lay

    def _staging(self, nbytes: int, purpose: str = "staging") -> HostBuffer:
        """This thread's aligned buffer for ``purpose`` (grown, never shrunk):
        kept between calls because touching fresh memory is slow (and on VMs
        that hand freed memory back, very slow).  Purposes do not share memory:
        "staging" is put_run's, "gather" is save_blocks' source buffer, "pages"
        the SGLang backend's read buffer."""
        return self._stagings.get(nbytes, purpose)

    def _kvikio_reader(self):
        """The store's kvikio file handles (created on first GPU load).
        Two first loads at once may both open one: the first published is
        the store's (close() closes it), the other is closed here.
        StoreClosedError once the store's devices are released."""
        reader = getattr(self, "_kvikio", None)
        if reader is not None:
            return reader
        from kvblock.io.gpu import KvikioReader
        from kvblock.store.store import _RELEASE_LOCK

        io = self.io
        if io is None:
            raise StoreClosedError("store is closed; reopen it")
        mine = KvikioReader([d.path for d in io.devices])
        # Published under the lock _release_devices takes the reader by:
        # one published after it would never be closed.
        with _RELEASE_LOCK:
            reader = getattr(self, "_kvikio", None)
            if reader is None and self.io is not None:
                self._kvikio = reader = mine
        if reader is not mine:
            try:
                mine.close()
            except Exception as e:      # its handles are gone either way
                logger.warning("kvblock: closing a spare kvikio reader failed: %s", e)
            if reader is None:
                raise StoreClosedError("store is closed; reopen it")
        return reader

    def _is_image(self, lay: RunLayout, blocks, any_address: bool = False) -> bool:
        """Are ``blocks`` already the run's on-device image (or aligned,
        unpadded pieces of it), so that writing them needs no staging copy?
        ``any_address``: an array for a copy into a mapped device, which
        needs no aligned memory."""
        if lay.prefix_bytes(lay.nblocks) != lay.range_bytes:
            return False
        if isinstance(blocks, BlockList):
            return blocks.direct(self.alignment)
        return blocks.flags.c_contiguous and (any_address
                                              or blocks.ctypes.data % self.alignment == 0)
