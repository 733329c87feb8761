"""A store's counters (KVStore.counters, RemoteStore.counters), counted from
many threads at once: readers, writers, kvblock.tensors' loads, the server's
connection threads, the integrations' workers.

``counters[name] += n`` is a read and then a write of the item: a thread
switch between the two (the GIL passes at a Python call in ``n``, and at any
point without a GIL) makes two threads write back their own sums, losing an
increment, and the value exported falls for a moment (Prometheus reads a
counter reset).  :meth:`Counters.add` adds under the counters' own lock
(uncontended: well under a microsecond), and :meth:`Counters.snapshot` reads
them all under it (stats()).  Reading one counter (``counters[name]``) needs
no lock; setting one (``counters[name] = v``) is for a single thread
(the open's recovery).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import Counter

# Every Counters made, by id: a forked child's copies get fresh locks (a
# thread of the parent adding at the fork held the lock, held for good in
# the child, whose stats() would wait for it).
_LIVE: "weakref.WeakValueDictionary[int, Counters]" = weakref.WeakValueDictionary()


class Counters(Counter):
    """A Counter of named counts whose add() and snapshot() are thread-safe."""

    def __init__(self, *args, **kwargs):
        self._lock = threading.Lock()
        # when they started from zero (Prometheus: each counter's _created)
        self.created = time.time()
        super().__init__(*args, **kwargs)
        _LIVE[id(self)] = self

    def add(self, name: str, n: int = 1) -> None:
        """``counters[name] += n``, atomically."""
        with self._lock:
            self[name] += n

    def add_each(self, **counts: int) -> None:
        """Each ``name=n`` added, together: a snapshot sees all or none."""
        with self._lock:
            for name, n in counts.items():
                self[name] += n

    def snapshot(self) -> dict[str, int]:
        """Every counter, by name (sorted), read at one moment."""
        with self._lock:
            return {k: int(v) for k, v in sorted(self.items())}


def _fresh_locks() -> None:
    for counters in list(_LIVE.values()):
        counters._lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks)
