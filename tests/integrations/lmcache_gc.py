"""LMCache 0.5.6 can deadlock a test process in its own code: a MemoryObj
whose __del__ runs in a garbage collection frees itself under LMCache's
non-reentrant ``_shared_observability_lock``, and a collection can start
while that very lock is held (a fresh engine building its Prometheus
metrics).  Seen once in a full run: the test process hung there.  The
integration tests collect a closed engine's garbage at a safe point and
make that lock reentrant (``guard_lmcache_gc``); neither changes what the
plugin does."""

from __future__ import annotations

import gc
import threading


def guard_lmcache_gc() -> None:
    """Make LMCache's observability lock reentrant (its users take it by
    name at each call, so replacing the module's lock is enough)."""
    import lmcache.utils

    if not isinstance(lmcache.utils._shared_observability_lock, type(threading.RLock())):
        lmcache.utils._shared_observability_lock = threading.RLock()


def collect_lmcache_garbage() -> None:
    """Collect what a closed LMCache StorageManager leaves in reference
    cycles, now.  Its write-back copies in LocalCPUBackend are MemoryObjs
    whose __del__ frees them under LMCache's non-reentrant observability
    lock: collected by a garbage collection that starts while that lock is
    held (building the next engine's metrics), they deadlock the process."""
    gc.collect()
