"""Which keys left the store: a bounded log for those who watch its contents.

An engine that announces what a store holds (vLLM's KV cache events) must
also announce what leaves it: runs evicted to make room, deleted, cleared,
or dropped after a failed read.  The store logs each such run's keys here;
a watcher asks for the keys removed since its cursor (``KVStore.removed_since``,
over a server too).  The log keeps the runs of the last ``max_keys`` keys
(at least), in memory only: a watcher that fell further behind, or holds a cursor from another
open of the store (a restarted server), is told so (``None``) and checks
the keys it cares about with ``present()`` instead.

A key in the log may be in the store again (put again since, or held by a
newer run too): the log says a run holding it went, not that it is gone.
A position a newer run took over, which a run reopened from a checkpoint
names as SUPERSEDED (zero bytes), is left out.
"""

from __future__ import annotations

import os
import threading
from collections import deque

from kvblock.errors import ConfigError
from kvblock.index.index import SUPERSEDED
from kvblock.index.keys import KEY_BYTES

MAX_KEYS = 1 << 16     # 1 MiB of keys: a few evicted regions' worth


class RemovalLog:
    def __init__(self, max_keys: int = MAX_KEYS):
        self._max = max_keys
        # Removed runs, oldest first: (keys logged since the store was
        # opened, up to this run's; its packed keys).  One append logs a
        # run (a KeyboardInterrupt cannot leave the counts and the runs
        # apart: a run logged but not counted gave a watcher another
        # run's keys for its own, and never the keys of the one it missed).
        self._runs: deque[tuple[int, bytes]] = deque()
        self._epoch = os.urandom(8).hex()    # this open of the store
        self._lock = threading.Lock()

    def add(self, keys: bytes) -> None:
        """Log a removed run's keys (``Run.keys``: 16 bytes each, packed);
        one append, whatever the run's size (it runs under the store's lock)."""
        n = len(keys) // KEY_BYTES
        with self._lock:
            self._runs.append((self._count() + n, keys))
            while self._held() - len(self._runs[0][1]) // KEY_BYTES >= self._max:
                self._runs.popleft()

    def _count(self) -> int:
        """(under the lock) keys logged since the store was opened."""
        return self._runs[-1][0] if self._runs else 0

    def _held(self) -> int:
        """(under the lock) keys the log holds."""
        if not self._runs:
            return 0
        return self._runs[-1][0] - self._runs[0][0] + len(self._runs[0][1]) // KEY_BYTES

    def since(self, cursor: str | None) -> tuple[str, list[bytes] | None]:
        """(a new cursor, the keys logged after ``cursor``), oldest first.
        ``cursor`` None starts watching: no keys.  The keys are None when
        the log no longer holds them all, or the cursor is not from this
        open of the store."""
        with self._lock:
            count = self._count()
            now = f"{self._epoch}:{count}"
            if cursor is None:
                return now, []
            epoch, seen = _parse(cursor)
            if epoch != self._epoch or seen > count:
                return now, None
            missed = count - seen
            if missed > self._held():
                return now, None
            blobs, got = [], 0
            for _, blob in reversed(self._runs):    # the newest runs hold them
                if got >= missed:
                    break
                blobs.append(blob)
                got += len(blob) // KEY_BYTES
        packed = b"".join(reversed(blobs))[(got - missed) * KEY_BYTES:]
        keys = (packed[at:at + KEY_BYTES] for at in range(0, len(packed), KEY_BYTES))
        # A run reopened from a checkpoint names positions a newer run took
        # over as SUPERSEDED: no key to announce.
        return now, [k for k in keys if k != SUPERSEDED]


def _parse(cursor) -> tuple[str, int]:
    if isinstance(cursor, str):
        epoch, sep, count = cursor.partition(":")
        # ASCII digits only (isdigit() takes superscripts, which int()
        # refuses), and not past int()'s 4300: a cursor holds a key count
        if sep and count.isascii() and count.isdigit() and len(count) <= 20:
            return epoch, int(count)
    raise ConfigError(f"removed_since: {repr(cursor)[:80]} is not a cursor; pass None to start "
                      "watching, then the cursor each call returns")
