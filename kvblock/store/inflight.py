"""Calls in flight on a store's devices and buffers, so close() waits for them.

A store's reads, puts and layer-by-layer loads use its I/O engine, its
device mappings (a tmpfs store file is read through one) and its spare
buffers; ``close()`` frees all three.  Were a call in another thread still
using them (an engine shutting down while a load is under way), it would
read into freed memory or through an unmapped device.  So every such call
enters the store's :class:`InFlight` first; ``close()`` shuts the door
(later calls raise StoreClosedError) and waits until the calls inside have
left, then frees.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from typing import Callable

from kvblock.errors import StoreClosedError

logger = logging.getLogger("kvblock")

CLOSE_WAIT_S = 30.0   # close() waits this long for the calls in flight


class InFlight:
    def __init__(self, closed_message: str, forked_message: str | None = None):
        """``forked_message``: a forked child's copy refuses every call with
        it (the parent goes on using what the copy would use)."""
        self._fresh()
        self._closing = False
        self._closed_message = closed_message
        self._forked_message = forked_message
        self.forked = False      # a forked child's copy (see _after_fork_in_child)
        _LIVE.add(self)

    def _fresh(self) -> None:
        """No calls inside.  Also in a forked child: the calls counted are
        the parent's threads', which the child does not have (close() would
        wait for them), and a lock one of them held stays held there."""
        self._lock = threading.Lock()          # taken bare on the hot path (cheaper)
        self._cv = threading.Condition(self._lock)
        self._calls = 0
        self._then = None      # run by the last call to leave once closing (after_drained)

    def enter(self, token: list | None = None) -> None:
        """A call starts (StoreClosedError once the store is closing).
        ``token``: the call's own empty list, given a 1 as the call is
        counted (in one step: no line or call between the two, where a
        KeyboardInterrupt is raised), for leave(token): a caller can then enter
        inside its try (a Ctrl-C as enter returned, the call counted, left
        it counted for good when enter came before the try)."""
        with self._lock:
            if self._closing:
                raise StoreClosedError(self._closed_message)
            if token is None:
                self._calls += 1
            else:   # one line, no call in it: no Ctrl-C lands between the two
                self._calls, token[:] = self._calls + 1, (1,)

    def hold(self, token: list | None = None) -> None:
        """One more for a call already inside (a load's second thread):
        closing does not refuse it.  ``token``: as enter's."""
        with self._lock:
            if token is None:
                self._calls += 1
            else:   # one line, no call in it (see enter)
                self._calls, token[:] = self._calls + 1, (1,)

    def leave(self, token: list | None = None) -> None:
        """A call ends.  ``token``: the one enter(token) filled, taken as
        it is counted out (none counted out for an empty one), so that a leave a KeyboardInterrupt cut (as it began,
        or before it woke a close() waiting) can be called again: it
        counts the call out once, and wakes the waiter (see in_flight)."""
        then = None
        with self._lock:
            if token is None:
                self._calls -= 1
            elif token:
                # Counted out and taken in one line with no call in it
                # (CPython raises a pending KeyboardInterrupt as a call
                # returns: ``token.pop()`` took the token, the count up).
                self._calls, token[:] = self._calls - token[0], ()
            if self._calls == 0 and self._closing:
                self._cv.notify_all()
                then, self._then = self._then, None
        if then is not None:
            _run_then(then)

    def after_drained(self, then: Callable[[], None]) -> None:
        """Once closing and ``drained`` gave up: run ``then`` (free what the
        calls in flight use) when the last of them leaves, in its thread
        (at once when none is inside by now)."""
        with self._lock:
            if self._calls:
                self._then = then
                return
        _run_then(then)

    @property
    def calls(self) -> int:
        """Calls inside now."""
        with self._lock:
            return self._calls

    def shut(self) -> None:
        """Refuse new calls from here on."""
        with self._lock:
            self._closing = True

    def drained(self, timeout: float | None, what: str,
                left_to: str = "the garbage collector") -> bool:
        """Wait (up to ``timeout`` s) for the calls in flight to leave.
        False when some are still inside then: the caller must not free what
        they use (``what`` names the store in the warning, ``left_to`` says
        what becomes of its devices and buffers)."""
        with self._cv:
            if self._cv.wait_for(lambda: self._calls == 0, timeout):
                return True
            left = self._calls
        logger.warning("kvblock: %s closed with %d call(s) still using its devices after "
                       "%.0f s; its devices and buffers are left to %s",
                       what, left, timeout, left_to)
        return False


def _run_then(then: Callable[[], None]) -> None:
    """An after_drained callback, in the thread of the call that left last:
    its failure is logged, not raised out of that call (which went through)."""
    try:
        then()
    except Exception as e:
        logger.warning("kvblock: releasing a closed store's devices after its last call "
                       "failed: %s", e)


_LIVE: "weakref.WeakSet[InFlight]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for gate in list(_LIVE):
        gate._fresh()
        if gate._forked_message is not None:
            gate._closing = True
            gate._closed_message = gate._forked_message
            gate.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def in_flight(method: Callable) -> Callable:
    """A store method that uses the devices or buffers: it runs inside the
    store's InFlight (``_inflight``)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        gate, token = self._inflight, []
        try:
            # inside the try: a Ctrl-C as enter returns (counted) is left
            # below; a call refused (closing) has an empty token
            gate.enter(token)
            return method(self, *args, **kwargs)
        finally:
            try:
                gate.leave(token)
            except BaseException:
                # Cut as it left (a KeyboardInterrupt): left counted, the
                # call made close() wait CLOSE_WAIT_S, then leave the
                # devices open and locked.  Again: it counts out once.
                gate.leave(token)
                raise
    return call
