"""How the engine integrations turn store failures into misses.

An engine must not crash or stall because its KV store is unavailable for a
while: a store server gone (the ranks reconnect, restarting it), a device
error, a store closed after a failed metadata write.  The integrations'
calls then answer as for a miss (not found, not stored, not loaded) and log
the failure: the first one at once, then at most one line per
``LOG_INTERVAL_S`` saying how many more there were.  Misuse (a ConfigError
and the like) raises at setup; met in a data call, that call answers a
failure and logs an error each time.
"""

from __future__ import annotations

import logging
import threading
import time

from kvblock.errors import DeviceError, ReadOnlyStoreError, StoreClosedError, StoreFullError
from kvblock.store.client import ServerError

# Failures of the store, not of the caller: an integration answers a miss.
RUNTIME_FAILURES = (DeviceError, StoreClosedError, StoreFullError, ReadOnlyStoreError,
                    ServerError)
LOG_INTERVAL_S = 10.0


class FailureLog:
    """Rate-limited warnings for store failures turned into misses."""

    def __init__(self, logger: logging.Logger, owner: str, interval: float = LOG_INTERVAL_S):
        self.logger, self.owner, self.interval = logger, owner, interval
        self.count = 0                 # failures so far (all of them, logged or not)
        self._folded = 0
        self._last = -float("inf")
        self._lock = threading.Lock()

    def __call__(self, what: str, exc: BaseException) -> None:
        if not isinstance(exc, RUNTIME_FAILURES):
            # A misuse in a data call (an unregistered pool...): the caller
            # still answers a failure (an engine must not crash on it), but
            # it is an error of the setup, logged each time, not counted.
            self.logger.error("%s: %s failed: %s", self.owner, what, str(exc))
            return
        now = time.monotonic()
        with self._lock:
            self.count += 1
            if now - self._last < self.interval:
                self._folded += 1
                return
            folded, self._folded = self._folded, 0
            since, self._last = now - self._last, now
        # The folded ones came since the last warning, which may be long ago.
        more = f" ({folded} more store failures in the {since:.0f} s since the last " \
            "warning)" if folded else ""
        # The text, not the exception: a kept record (a capturing or queueing
        # handler) would keep its traceback's frames and their buffers alive.
        self.logger.warning("%s: %s failed, answered as a miss: %s%s", self.owner, what,
                            str(exc), more)
