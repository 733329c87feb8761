"""Stopping a store server a test's ranks started (``kvblock serve`` runs in
its own session, so it outlives the test unless stopped)."""

from __future__ import annotations

import os
import signal
import time


def stop_server(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM (a clean stop: it checkpoints), then SIGKILL if it lingers."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
