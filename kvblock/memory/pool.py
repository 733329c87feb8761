"""A pool of equal-sized page-aligned buffers cut from one pre-faulted arena.

Used as staging memory wherever a caller's buffer is not aligned for O_DIRECT,
and as the I/O buffers of benchmarks and the store.  One arena means one
fixed-buffer registration with io_uring.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import numpy as np

from kvblock.errors import ConfigError, KVBlockError
from kvblock.memory.aligned import PAGE_SIZE, HostBuffer, round_up
from kvblock.memory.forklocks import renew_after_fork
from kvblock.units import is_whole


class PoolExhaustedError(KVBlockError, TimeoutError):
    """No buffer became free within the timeout."""


class BufferPool:
    """``count`` buffers of ``buffer_bytes`` (rounded up to a page) each."""

    def __init__(self, buffer_bytes: int, count: int):
        if not all(is_whole(n) and n > 0 for n in (buffer_bytes, count)):
            raise ConfigError(f"BufferPool needs positive whole buffer_bytes and count, got "
                              f"{buffer_bytes!r} x {count!r}")
        self.buffer_bytes = round_up(int(buffer_bytes), PAGE_SIZE)
        self.count = int(count)
        self.arena = HostBuffer(self.buffer_bytes * self.count)
        self._free = list(range(self.count - 1, -1, -1))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # a child forked while a thread of the parent was inside acquire()
        # or release() would find the condition held for good
        renew_after_fork(self)

    def address_of(self, index: int) -> int:
        self._check_open()
        index = self._check_index(index)
        return self.arena.address + index * self.buffer_bytes

    def view(self, index: int, nbytes: int | None = None) -> np.ndarray:
        self._check_open()
        index = self._check_index(index)
        if nbytes is not None and (not is_whole(nbytes) or not 0 < nbytes <= self.buffer_bytes):
            raise ConfigError(f"a view of {nbytes!r} bytes of a {self.buffer_bytes}-byte pool "
                              "buffer; ask for at most one buffer")
        start = index * self.buffer_bytes
        return self.arena.array[start:start + (nbytes or self.buffer_bytes)]

    def acquire(self, timeout: float | None = None) -> int:
        """Take a free buffer index, waiting up to ``timeout`` seconds."""
        self._check_open()
        with self._cond:
            # close() wakes the wait: a buffer of the closed pool is unmapped memory
            if not self._cond.wait_for(lambda: self._free or self.arena.closed,
                                       timeout=timeout):
                raise PoolExhaustedError(
                    f"all {self.count} buffers of {self.buffer_bytes} bytes are in use; "
                    "release buffers or create a larger pool")
            self._check_open()
            return self._free.pop()

    def release(self, index: int) -> None:
        index = self._check_index(index)
        with self._cond:
            if index in self._free:     # twice: two callers would share it
                raise ConfigError(f"pool buffer {index} is not in use (released twice?)")
            self._free.append(index)
            self._cond.notify()

    def _check_open(self) -> None:
        # The arena is unmapped: an address in it may be another buffer's
        # by now (mmap reuses addresses), and I/O there would land in it.
        if self.arena.closed:
            raise ConfigError(f"this BufferPool ({self.count} x {self.buffer_bytes} bytes) is "
                              "closed: its memory is unmapped; make a new pool")

    def _check_index(self, index: int) -> int:
        """``index`` as an int; a float, bool or None is no buffer (1.0
        released went on the free list, 1.5 made an address inside one)."""
        if not is_whole(index) or not 0 <= index < self.count:
            raise ConfigError(f"no pool buffer {index!r}: the pool has {self.count} "
                              "(indices 0 to count - 1, as acquire() returns them)")
        return int(index)

    @contextlib.contextmanager
    def buffer(self, timeout: float | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """``with pool.buffer() as (index, view):`` — released on exit."""
        index = self.acquire(timeout)
        try:
            yield index, self.view(index)
        finally:
            self.release(index)

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        self.arena.close()
        with self._cond:
            self._cond.notify_all()     # acquire()s waiting: the pool is closed

    def __enter__(self) -> "BufferPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
