"""Fixtures: real targets for direct I/O.

``target`` is parametrised over a loop device (root only; skipped with the
reason otherwise), a plain pre-sized file and a fully allocated file on tmpfs
(read and written through a shared mapping), so every I/O test runs on all three.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support import loopdev

MIB = 1 << 20


@pytest.fixture
def loop_device(request):
    """Factory: ``loop_device(size)`` -> /dev/loopN, detached after the test."""
    ok, why = loopdev.can_make_loop_devices()
    if not ok:
        pytest.skip(why)
    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)
    return lambda size=64 * MIB: stack.enter_context(loopdev.loop_device(size))


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


@pytest.fixture(params=["loop", "file", "shm"])
def target(request, tmp_path):
    """Factory returning a fresh target path of the parametrised kind: a loop
    device, a sparse file on disk, or a pre-sized file on tmpfs."""
    if request.param == "loop":
        return request.getfixturevalue("loop_device")
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
