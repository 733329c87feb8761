"""Process-wide list of long-lived aligned host regions.

The io_uring engine registers these with each ring (fixed buffers) so reads
and writes into them skip per-I/O page pinning.  ``version`` changes on every
update so rings know when to re-register.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_regions: dict[int, int] = {}
version = 0
_on_remove: list = []   # called (no arguments) after a region leaves the list


def on_remove(callback) -> None:
    """Call ``callback()`` after each removal (engines release the region's pins)."""
    _on_remove.append(callback)


def add(address: int, nbytes: int) -> None:
    global version
    with _lock:
        _regions[address] = nbytes
        version += 1


def remove(address: int) -> None:
    global version
    with _lock:
        if _regions.pop(address, None) is None:
            return
        version += 1
    for callback in _on_remove:
        callback()


def snapshot() -> tuple[int, list[tuple[int, int]]]:
    """(version, [(address, nbytes), ...]) largest regions first."""
    with _lock:
        regions = sorted(_regions.items(), key=lambda r: -r[1])
        return version, regions
