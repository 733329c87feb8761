"""A short client timeout= on the one call a test means to time out.

A RemoteStore made with ``timeout=0.3`` puts every call under it: on a
loaded machine (CI: xdist on two cores beside other runs) any of the
test's ordinary calls (a put, a lookup, a reconnect's hello) can take
longer and be abandoned, failing the test where nothing is wrong.  Make
the store with a generous timeout= and give the short one only to the
answers that are meant to be late (the server holds those until the
test lets them go: an event, not a sleep racing the timeout)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from kvblock.store.client import RemoteStore

# a RemoteStore's own timeout= in these tests: no ordinary call waits this long
GENEROUS_S = 60.0


def short_timeout_on(monkeypatch, ops, seconds: float,
                     when: Callable[[], bool] = lambda: True) -> None:
    """Every RemoteStore's calls of one of ``ops`` wait ``seconds`` at most
    for their answer (as with ``timeout=seconds``), while ``when()``;
    every other call keeps the store's own timeout=."""
    ops = frozenset(ops)
    real = RemoteStore._call_locked

    def call_locked(self, s, op, args, timeout=None, **kw):
        if op in ops and when():
            timeout = seconds if timeout is None else min(timeout, seconds)
        return real(self, s, op, args, timeout=timeout, **kw)
    monkeypatch.setattr(RemoteStore, "_call_locked", call_locked)


def hold_checkpoint(server, hold_s: float = 60.0) -> Callable[..., None]:
    """The served store's checkpoint() (a slow server, for a call meant to
    time out) waits until the returned ``let_go()``: called once the client
    has given up, it lets the checkpoint go on and, unless ``wait=False``,
    waits until the server has answered it (the call returned, no session
    busy), as a sleep longer than the timeout meant to, without racing a
    loaded machine.  Checkpoints after ``let_go()`` are not held."""
    real = server.store.checkpoint
    go, entered, done = threading.Event(), threading.Event(), threading.Event()

    def held():
        if not go.is_set():
            entered.set()
            go.wait(hold_s)
        try:
            return real()
        finally:
            if entered.is_set():
                done.set()
    server.store.checkpoint = held

    def let_go(wait: bool = True) -> None:
        go.set()
        if not wait:
            return
        assert entered.is_set(), "no checkpoint was held"
        assert done.wait(20), "the held checkpoint did not return"
        deadline = time.monotonic() + 20
        while any(s.busy for s in list(server._sessions.values())):
            assert time.monotonic() < deadline, "the held checkpoint was not answered"
            time.sleep(0.01)
    return let_go


class HelloWait:
    """The served store's hello wait (the lease thread's passes that close
    connections which have not said hello in time), held until
    ``let_go()`` (``held=False``: not held) and again after ``hold()``,
    and counted: a test with a short hello_timeout= opens its connections
    and has them say hello (or not) first, then lets the wait run, so a
    client thread not scheduled between its connect and its hello (a
    loaded machine) is not closed for it.  ``passes(n)`` waits until ``n``
    more passes have run (each closes every connection late by then), in
    place of a sleep meant to let the lease thread look.  Make it before
    the server."""

    def __init__(self, monkeypatch, held: bool = True):
        from kvblock.store import server as server_mod

        self._go = not held
        self._cond = threading.Condition()
        self._count = self._running = 0
        real = server_mod.StoreServer._drop_silent

        def drop_silent(server, hello):
            with self._cond:
                if not self._go:
                    return
                self._running += 1
            try:
                real(server, hello)
            finally:
                with self._cond:
                    self._running -= 1
                    self._count += 1
                    self._cond.notify_all()
        monkeypatch.setattr(server_mod.StoreServer, "_drop_silent", drop_silent)

    def let_go(self) -> None:
        with self._cond:
            self._go = True

    def hold(self, timeout: float = 20.0) -> None:
        """Hold the wait again, once a pass under way is done."""
        with self._cond:
            self._go = False
            assert self._cond.wait_for(lambda: not self._running, timeout), \
                "a pass of the hello wait did not end"

    def passes(self, n: int = 2, timeout: float = 20.0) -> None:
        with self._cond:
            assert self._go, "the hello wait is held"
            until = self._count + n
            assert self._cond.wait_for(lambda: self._count >= until, timeout), \
                "the lease thread ran no pass of the hello wait"


class QuietPasses:
    """The served store's lease passes (the lease thread's drops of the
    connections that hold pins and have gone quiet), timed: ``past(t)``
    waits until a pass that began after ``time.monotonic()`` was ``t`` has
    run, in place of a sleep meant to outlast a lease (on a loaded machine
    the sleep can end before the lease thread has looked at all, and a
    test that a lease did not lapse then passes having checked nothing).
    Make it before the server."""

    def __init__(self, monkeypatch):
        from kvblock.store import server as server_mod

        self._cond = threading.Condition()
        self._last = float("-inf")       # when the last pass to end began
        real = server_mod.StoreServer._drop_quiet

        def drop_quiet(server, lease):
            began = time.monotonic()
            try:
                real(server, lease)
            finally:
                with self._cond:
                    self._last = max(self._last, began)
                    self._cond.notify_all()
        monkeypatch.setattr(server_mod.StoreServer, "_drop_quiet", drop_quiet)

    def past(self, t: float, timeout: float = 20.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._last > t, timeout), \
                "the lease thread ran no pass of its lease drops"
