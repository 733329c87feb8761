"""Fixtures: real targets for direct I/O.

``target`` is parametrised over a loop device (root only; skipped with the
reason otherwise) with 512-byte or with 4 KiB sectors, a plain pre-sized file
and a fully allocated file on tmpfs (read and written through a shared
mapping), so every I/O test runs on all four.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support import loopdev

MIB = 1 << 20

# `make test` (and so CI) sets KVBLOCK_NO_SKIPS=1: it installs every
# dependency and runs as root on a kernel with io_uring and loop devices,
# so there a skip (a missing module, no loop device, io_uring refused) could
# only hide a failure, and it fails the test instead.  Tests marked ``gpu``
# still skip on a machine without CUDA.
NO_SKIPS = os.environ.get("KVBLOCK_NO_SKIPS") == "1"


def _skip_is_a_failure(report, item=None) -> bool:
    if not (NO_SKIPS and report.skipped) or hasattr(report, "wasxfail"):
        return False
    return item is None or item.get_closest_marker("gpu") is None


def _fail_skip(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = (f"skipped ({reason}), but KVBLOCK_NO_SKIPS=1 (make test) expects "
                       "everything this test needs to be here: install it (make install) "
                       "or run as root, or mark the test gpu if it needs CUDA")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """A test process killed by SIGTERM or SIGHUP dies with no report (under
    pytest-xdist: "node down: Not properly terminated", the test it was on
    blamed): print every thread's stack first, where pytest's faulthandler
    prints a crash's, so that such a death says where the process was."""
    import faulthandler
    import signal

    from _pytest.faulthandler import fault_handler_stderr_fd_key

    fd = config.stash.get(fault_handler_stderr_fd_key, None)
    if fd is not None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            faulthandler.register(sig, file=fd, all_threads=True, chain=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if _skip_is_a_failure(report, item):
        _fail_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()    # a module-level importorskip, for one
    if _skip_is_a_failure(report):
        _fail_skip(report)


@pytest.fixture
def loop_device(request):
    """Factory: ``loop_device(size, sector_size=None)`` -> /dev/loopN, detached
    after the test."""
    ok, why = loopdev.can_make_loop_devices()
    if not ok:
        pytest.skip(why)
    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)
    return lambda size=64 * MIB, sector_size=None: stack.enter_context(
        loopdev.loop_device(size, sector_size=sector_size))


@pytest.fixture
def file_target(tmp_path):
    """Factory: ``file_target(size)`` -> path of a pre-sized file on disk."""
    count = iter(range(1_000_000))

    def make(size=64 * MIB, name=None):
        path = tmp_path / (name or f"target{next(count)}.img")
        with open(path, "wb") as f:
            f.truncate(size)
        return str(path)

    return make


@pytest.fixture
def shm_target(request):
    """Factory: ``shm_target(size)`` -> path of a fully allocated file on tmpfs
    (/dev/shm): engines read and write it through a shared mapping (kvblock/io/mapped.py)."""
    from kvblock.devices import create_file

    base = Path(tempfile.mkdtemp(prefix="kvblock-test-", dir=loopdev.SHM))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    count = iter(range(1_000_000))
    return lambda size=64 * MIB, name=None: str(
        create_file(base / (name or f"target{next(count)}.img"), size))


@pytest.fixture(params=["file", "shm"])
def store_target(request):
    """Factory of store files of the parametrised kind: a file on disk, or a
    pre-sized file on tmpfs (read and written through a shared mapping)."""
    return request.getfixturevalue("shm_target" if request.param == "shm" else "file_target")


@pytest.fixture(params=["loop", "loop4k", "file", "shm"])
def target(request, tmp_path):
    """Factory returning a fresh target path of the parametrised kind: a loop
    device (512-byte sectors, or 4 KiB ones as on an NVMe namespace formatted
    with 4 KiB LBAs), a sparse file on disk, or a pre-sized file on tmpfs."""
    if request.param == "loop":
        return request.getfixturevalue("loop_device")
    if request.param == "loop4k":
        make = request.getfixturevalue("loop_device")
        return lambda size=64 * MIB: make(size, sector_size=4096)
    if request.param == "shm":
        return request.getfixturevalue("shm_target")
    return request.getfixturevalue("file_target")


@pytest.fixture(scope="session", autouse=True)
def no_leaked_loop_devices():
    yield
    leaked = loopdev.still_attached()
    for dev in leaked:
        loopdev.detach(dev)
    assert not leaked, f"tests left loop devices attached: {leaked}"


@pytest.fixture(autouse=True)
def no_late_io_between_tests(monkeypatch):
    """The process-wide records of I/Os a broken io_uring left in flight
    (kvblock.store.storeio: devices no store writes again; kvblock.memory.
    aligned: host memory kept mapped) are each test's own: a test that
    provokes one would otherwise refuse a later test's store whose file
    reuses the inode of its (deleted) store file."""
    from kvblock.memory import aligned
    from kvblock.store import storeio

    for module, name, empty in ((storeio, "_LATE_WRITES", dict),
                                (storeio, "_LATE_DATA_WRITES", dict),
                                (aligned, "_LATE", list), (aligned, "_KEPT", list)):
        monkeypatch.setattr(module, name, empty())
