"""Process-wide list of long-lived aligned host regions.

The io_uring engine registers these with each ring (fixed buffers) so reads
and writes into them skip per-I/O page pinning.  ``version`` changes on every
update so rings know when to re-register.

A buffer dropped without close() leaves the list from a finalizer, which the
garbage collector may run at any allocation: also inside this module's own
critical section, on the thread that holds its lock.  Such a removal is
deferred to the end of that section (waiting for the lock there would wait
for ever).
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_holder: int | None = None   # the thread inside a critical section
_deferred: list[int] = []    # removals that came (from the GC) inside it
_regions: dict[int, int] = {}
version = 0
_on_remove: list = []   # called (no arguments) after a region leaves the list


def on_remove(callback) -> None:
    """Call ``callback()`` after each removal (engines release the region's pins)."""
    _on_remove.append(callback)


class _Section:
    """The lock held by this thread; removals deferred meanwhile are done
    before it is released, their callbacks after."""

    def __enter__(self):
        global _holder
        _lock.acquire()
        _holder = threading.get_ident()

    def __exit__(self, *exc):
        global _holder
        removed = False
        try:
            while _deferred:
                removed = _drop(_deferred.pop()) or removed
        finally:
            _holder = None
            _lock.release()
        if removed:
            _removed()
        return False


def _drop(address: int) -> bool:
    """(under the lock) take ``address`` off the list; False when not on it."""
    global version
    if _regions.pop(address, None) is None:
        return False
    version += 1
    return True


def _removed() -> None:
    for callback in _on_remove:
        callback()


def add(address: int, nbytes: int) -> None:
    global version
    with _Section():
        _regions[address] = nbytes
        version += 1


def remove(address: int) -> None:
    if _holder == threading.get_ident():
        _deferred.append(address)    # a finalizer run inside this thread's section
        return
    with _Section():
        removed = _drop(address)
    if removed:
        _removed()


def _after_fork_in_child() -> None:
    """In a forked child: a thread of the parent inside a section at the
    fork (making or closing a buffer, a ring re-registering) held _lock,
    and held it stays (that thread is not the child's): every buffer the
    child made or closed would wait for good.  The lock is made afresh, and
    the removals that thread had deferred are done here (the child has its
    own copy of the list; with nobody to do them, those addresses stayed
    on it for good)."""
    global _lock, _holder, version
    _lock = threading.Lock()
    _holder = None
    while _deferred:
        if _regions.pop(_deferred.pop(), None) is not None:
            version += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def snapshot() -> tuple[int, list[tuple[int, int]]]:
    """(version, [(address, nbytes), ...]) largest regions first."""
    with _Section():
        regions = sorted(_regions.items(), key=lambda r: -r[1])
        return version, regions
