"""A tier's helper thread: one step every interval, off vLLM's scheduler thread.

The vLLM tier's metrics snapshot and its KV-event watch each ask the store
(a request to its server, when it is served) on a thread of their own, so
the scheduler never waits for an answer.  The thread starts with the first
call that needs it (a tier vLLM never asks runs none) and stops with a
bounded wait: a request to a hung server must not hold up shutdown, and
the daemon thread ends once the store is closed.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger("kvblock")

STOP_WAIT_S = 5.0


class Periodic:
    def __init__(self, step: Callable[[], None], interval: float, name: str):
        self._step, self._interval, self._name = step, interval, name
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, once (not after stop())."""
        if self.thread is None and not self.stopped.is_set():
            self.thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(STOP_WAIT_S)

    def _run(self) -> None:
        failing = False
        while not self.stopped.is_set():
            try:
                self._step()
            except Exception as e:  # noqa: BLE001
                # The steps catch the store's own errors; anything else (a
                # bug, a failure nobody foresaw) must not end the thread, or
                # the tier's metrics / KV events stop for the process's life.
                # Logged whole once, then quietly while it keeps failing.
                if failing:
                    logger.debug("kvblock: %s: step failed again: %s", self._name, e)
                else:
                    logger.warning("kvblock: %s: step failed: %s; trying again every %g s",
                                   self._name, e, self._interval, exc_info=True)
                failing = True
            else:
                failing = False
            self.stopped.wait(self._interval)
