"""I/O engines: batched direct I/O into host memory.

``uring`` (io_uring through the native core) is chosen when the kernel allows
it, ``threads`` (pread/pwrite workers) otherwise.  ``KVBLOCK_IO_ENGINE=uring|
threads|auto`` overrides the choice; :func:`io_engine` reports it.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Sequence

from kvblock.errors import ConfigError, EngineUnavailableError
from kvblock.io.batch import IOBatch
from kvblock.io.engine import OP_READ, OP_WRITE, IOEngine, IOResult

ENGINES = ("uring", "threads")

__all__ = ["IOBatch", "IOEngine", "IOResult", "OP_READ", "OP_WRITE", "ENGINES",
           "io_engine", "engine_report", "open_engine"]


@lru_cache(maxsize=1)
def _uring_probe() -> tuple[bool, str]:
    from kvblock.io.uring import probe

    return probe()


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
