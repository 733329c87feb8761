"""Helpers for tests that make two threads meet in one call."""

from __future__ import annotations

import threading

from kvblock.errors import ConfigError


def release_twice(unpin, handle) -> list[str]:
    """Call ``unpin(handle)`` from two threads at once; each one's outcome,
    sorted: "released", or the ConfigError's message."""
    outcomes = []

    def release():
        try:
            unpin(handle)
            outcomes.append("released")
        except ConfigError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=release) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return sorted(outcomes)
