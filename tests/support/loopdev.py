"""Real block devices for tests: loop devices over files, always detached.

``losetup -f --show --direct-io=on`` attaches a backing file; the context
manager detaches it on the way out whatever happened inside.  Backing files
live in /dev/shm by default (a fast "drive" that keeps tests quick).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

SHM = Path("/dev/shm")


def can_make_loop_devices() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "loop devices need root (losetup); running tests on plain files"
    if shutil.which("losetup") is None:
        return False, "losetup not installed (util-linux); running tests on plain files"
    return True, ""


def backing_dir() -> Path:
    return SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())


@contextlib.contextmanager
def backing_file(size: int, directory: Path | None = None, prefix="kvblock-test-") -> Iterator[Path]:
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".img", dir=directory or backing_dir())
    try:
        os.ftruncate(fd, size)
        os.close(fd)
        yield Path(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


_ATTACHED: set[str] = set()  # loop devices this process attached and has not detached


def attach(path: Path | str, sector_size: int | None = None, partscan: bool = False,
           device: str | None = None) -> str:
    """``sector_size``: the device's logical block size (default 512; 4096
    makes it look like an NVMe namespace formatted with 4 KiB LBAs).
    ``partscan``: let the device have partitions (losetup -P); they go
    when it is detached.  ``device``: this /dev/loopN (default: the first
    free one)."""
    sectors = ["--sector-size", str(sector_size)] if sector_size else []
    sectors += ["-P"] if partscan else []
    out = subprocess.run(["losetup", device or "-f", "--show", "--direct-io=on", *sectors,
                          str(path)], check=True, capture_output=True, text=True)
    dev = out.stdout.strip()
    _ATTACHED.add(dev)
    return dev


def detach(dev: str) -> None:
    # Retry briefly: udev may still hold the device right after a test used it.
    for _ in range(20):
        if subprocess.run(["losetup", "-d", dev], capture_output=True).returncode == 0:
            _ATTACHED.discard(dev)
            return
        import time

        time.sleep(0.05)
    subprocess.run(["losetup", "-d", dev], check=True, capture_output=True)
    _ATTACHED.discard(dev)


def backing_of(dev: str) -> str:
    """The backing file the loop device ``dev`` is attached to."""
    return (Path("/sys/block") / Path(dev).name / "loop" / "backing_file").read_text().strip()


def still_attached() -> list[str]:
    """Loop devices this process attached and never detached (the leak check)."""
    return sorted(_ATTACHED)


@contextlib.contextmanager
def loop_device(size: int, directory: Path | None = None,
                sector_size: int | None = None) -> Iterator[str]:
    """A loop device of ``size`` bytes over a fresh backing file.  The write
    cache mode it reports is set back to what it was before it is detached
    (a test may change it, and the kernel keeps it for the loop minor)."""
    with backing_file(size, directory) as path:
        dev = attach(path, sector_size)
        cache = Path("/sys/block") / Path(dev).name / "queue" / "write_cache"
        mode = cache.read_text().strip()
        try:
            yield dev
        finally:
            try:
                if cache.read_text().strip() != mode:
                    cache.write_text(mode)
            finally:
                detach(dev)
