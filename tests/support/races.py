"""Helpers for tests that make two threads meet in one call."""

from __future__ import annotations

import linecache
import os
import sys
import threading

import kvblock
from kvblock.errors import ConfigError

PACKAGE = os.path.dirname(kvblock.__file__) + os.sep


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


def meet_in_statement(monkeypatch, obj, name: str, marker: str) -> None:
    """Two threads' calls of ``obj.name`` made from a source line of kvblock
    holding ``marker`` wait there for each other (a barrier of two): both are in
    that statement, past whatever it read before the call, before either
    goes on.  A ``d[k] += f()`` unguarded loses one of the two increments."""
    barrier = threading.Barrier(2, timeout=10)
    real = getattr(obj, name)

    def meet(*args, **kwargs):
        caller = sys._getframe(1)
        source = caller.f_code.co_filename
        if source.startswith(PACKAGE) and marker in linecache.getline(source, caller.f_lineno):
            barrier.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, meet)


def in_two_threads(fn, *args) -> None:
    """``fn(arg)`` for each of two ``args`` at once, in two threads; the first
    error raised in either is raised here."""
    errors = []

    def call(arg):
        try:
            fn(arg)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a thread never returned"
    if errors:
        raise errors[0]


class LockStandIn:
    """A lock stood in by a test: its ``acquire`` is the subclass's (cut,
    delayed, made to wake another thread); release and the ``with`` form
    go to the real lock it wraps, ``self.inner``."""

    inner: threading.Lock

    def release(self):
        self.inner.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
