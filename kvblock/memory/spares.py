"""Host buffers kept between calls for reuse.

A layer-wise load stages its reads in a few buffers of several MiB.
Mapping and touching fresh memory costs milliseconds per load -- on VMs that
hand freed memory back to the host, far more -- and it lands before the first
layer is ready.  So finished loads give their buffers back here and the next
load takes them.
"""

from __future__ import annotations

import threading

from kvblock.memory.aligned import HostBuffer, round_up
from kvblock.memory.forklocks import renew_after_fork

# Buffers are sized in these steps, so loads of slightly different prefixes
# reuse each other's.
STEP = 1 << 20


class SpareBuffers:
    """At most ``keep_bytes`` of idle HostBuffers (``register=False``)."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = int(keep_bytes)
        self._idle: list[HostBuffer] = []
        self._closed = False
        self._lock = threading.Lock()
        renew_after_fork(self)        # a forked child's close() of its copy takes it

    def take(self, nbytes: int) -> HostBuffer:
        """The smallest idle buffer of at least ``nbytes``, else a new one."""
        with self._lock:
            fits = [b for b in self._idle if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._idle.remove(buf)
                return buf
        return HostBuffer(round_up(max(int(nbytes), 1), STEP), register=False)

    def give(self, buf: HostBuffer) -> None:
        """Keep ``buf`` for a later take (evicting the smallest idle ones to
        stay within keep_bytes), or free it when it alone is over the limit,
        or when closed (kept then, nothing would ever free it), or when a
        read left in flight may still land in it (its close() keeps it
        mapped, never reused: aligned.keep_for_late_reads)."""
        with self._lock:
            if not self._closed and buf.nbytes <= self.keep_bytes and not buf.left_in_flight:
                self._idle.append(buf)
                self._idle.sort(key=lambda b: b.nbytes)
                drop = []
                while sum(b.nbytes for b in self._idle) > self.keep_bytes:
                    drop.append(self._idle.pop(0))
            else:
                drop = [buf]
        for b in drop:
            b.close()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._idle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for b in idle:
            b.close()
