"""Locks of objects that a forked child gets afresh.

A thread of the parent holding an object's lock at the fork holds it for
good in the child (that thread is not the child's): the child's first use
(a forked store's close() of its copy) would wait forever.  Objects whose
lock a forked child's close() takes register here; each gets a new
``_lock`` in every forked child (and a new ``_cond`` over it, where it has
one: a threading.Condition).
"""

from __future__ import annotations

import os
import threading
import weakref

_OWNERS: "weakref.WeakSet" = weakref.WeakSet()


def renew_after_fork(obj) -> None:
    """Give ``obj`` a fresh ``_lock`` (a threading.Lock) in forked children,
    and a fresh ``_cond`` over it when ``obj`` has one."""
    _OWNERS.add(obj)


def _renew() -> None:
    for obj in list(_OWNERS):
        obj._lock = threading.Lock()
        if hasattr(obj, "_cond"):
            obj._cond = threading.Condition(obj._lock)


os.register_at_fork(after_in_child=_renew)
