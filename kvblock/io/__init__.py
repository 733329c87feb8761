"""I/O engines: batched direct I/O into host memory.

``uring`` (io_uring through the native core) is chosen when the kernel allows
it, ``threads`` (pread/pwrite workers) otherwise.  ``KVBLOCK_IO_ENGINE=uring|
threads|auto`` overrides the choice; :func:`io_engine` reports it.
"""

from __future__ import annotations

import errno
import logging
import os
from functools import lru_cache
from typing import Sequence

from kvblock.errors import ConfigError, EngineUnavailableError
from kvblock.io.batch import IOBatch
from kvblock.io.engine import OP_READ, OP_WRITE, IOEngine, IOResult

ENGINES = ("uring", "threads")

__all__ = ["IOBatch", "IOEngine", "IOResult", "OP_READ", "OP_WRITE", "ENGINES",
           "io_engine", "engine_report", "open_engine"]


logger = logging.getLogger("kvblock")

# io_uring_setup failures that may pass (memory or descriptors short at that
# moment): not kept, or one at the first open pinned every `auto` engine of
# the process on threads for good.  A refusal that stays (ENOSYS: seccomp or
# an old kernel; EPERM: io_uring_disabled) is kept.
_TRANSIENT = frozenset({errno.ENOMEM, errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.EINTR})
_said: set[str] = set()     # the passing failures logged (once each)


class _ForNow(Exception):
    """(inside _uring_probe) a failure not to cache."""


@lru_cache(maxsize=1)
def _kept_probe() -> tuple[bool, str]:
    from kvblock.io.uring import probe_errno

    ok, reason, code = probe_errno()
    if not ok and code in _TRANSIENT:
        raise _ForNow(reason)       # (lru_cache keeps no exception)
    return ok, reason


def _uring_probe() -> tuple[bool, str]:
    try:
        return _kept_probe()
    except _ForNow as e:
        reason = str(e)
        if reason not in _said:
            _said.add(reason)
            logger.warning("kvblock: %s (memory or file descriptors short; before Linux "
                           "5.12 a ring counts against ulimit -l); the `auto` I/O engine "
                           "uses threads until io_uring can be set up again (probed at "
                           "each engine open); KVBLOCK_IO_ENGINE=threads keeps it there",
                           reason)
        return False, reason


_uring_probe.cache_clear = _kept_probe.cache_clear


_ALIASES = {"io_uring": "uring", "iouring": "uring", "liburing": "uring"}


def _requested(kind: str | None) -> str:
    if kind is not None and not isinstance(kind, str):   # (a number or list in a config)
        raise ConfigError(f"the I/O engine must be a name (uring, threads, auto), got "
                          f"{type(kind).__name__} {kind!r}")
    source = "the engine setting" if kind else "KVBLOCK_IO_ENGINE"
    kind = (kind or os.environ.get("KVBLOCK_IO_ENGINE") or "auto").strip().lower()
    kind = _ALIASES.get(kind, kind)
    if kind not in ENGINES + ("auto",):
        raise ConfigError(f"unknown I/O engine {kind!r} ({source}); choose one of "
                          "uring, threads, auto")
    return kind


def engine_report(kind: str | None = None) -> dict:
    """Which engine :func:`open_engine` picks here, and why."""
    from_setting = bool(kind)     # as _requested: an empty setting defers to the variable
    kind = _requested(kind)
    if kind == "threads":
        # Not probed: where io_uring_setup kills the process (a seccomp
        # policy that does not answer ENOSYS) threads is the way to run.
        # The native core loads, or its error is the report (as the open's).
        from kvblock.io import native

        native.lib()
        return {"engine": "threads", "reason": "requested (the engine setting)" if from_setting
                else "requested (KVBLOCK_IO_ENGINE=threads)"}
    ok, reason = _uring_probe()
    if kind == "uring" and not ok:
        if from_setting:
            raise EngineUnavailableError(f"the engine setting 'uring' but {reason}; set it to "
                                         "'auto' to fall back to the threads engine")
        raise EngineUnavailableError(f"KVBLOCK_IO_ENGINE=uring but {reason}; "
                                     "unset it to fall back to the threads engine")
    if ok:
        return {"engine": "uring", "reason": "requested" if kind == "uring" else reason}
    return {"engine": "threads", "reason": f"fallback: {reason}"}


def io_engine(kind: str | None = None) -> str:
    """Name of the engine in use on this machine: ``"uring"`` or ``"threads"``."""
    return engine_report(kind)["engine"]


def open_engine(devices: Sequence, kind: str | None = None, **kwargs) -> IOEngine:
    """An engine over ``devices`` (a sequence of :class:`kvblock.devices.Device`)."""
    name = io_engine(kind)
    if name == "uring":
        from kvblock.io.uring import UringEngine

        return UringEngine(devices, **kwargs)
    from kvblock.io.threads import ThreadEngine

    return ThreadEngine(devices, **kwargs)
