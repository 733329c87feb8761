"""Run under the LD_PRELOAD faults of tests/support/uring_faults.c by
tests/io/test_uring_faults.py: ``python -m tests.io.uring_faults_child CASE PATH``.
Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from kvblock.devices import Device
from kvblock.errors import IOFailedError
from kvblock.io import IOBatch, open_engine
from kvblock.memory import HostBuffer

MIB = 1 << 20


def broken_ring(path: str) -> dict:
    """The first batch meets a ring that broke (how: the shim's settings);
    the next batch (another region of the file) must read its own bytes."""
    a = np.random.default_rng(1).integers(0, 256, 8 * MIB, dtype=np.uint8)
    b = np.random.default_rng(2).integers(0, 256, 8 * MIB, dtype=np.uint8)
    with open(path, "r+b") as f:
        f.write(a.tobytes())
        f.write(b.tobytes())
    out = {}
    with Device(path) as dev, open_engine([dev], "uring", queue_depth=8) as eng:
        first, second = HostBuffer(8 * MIB), HostBuffer(8 * MIB)
        t0 = time.monotonic()
        try:
            eng.read(IOBatch.contiguous(first.address, 0, 0, 8 * MIB, MIB))
            out["first"] = "no error"
            out["first_equal"] = bool(np.array_equal(first.array, a))
        except IOFailedError as e:
            out["first"] = f"IOFailedError {e.errno}"
            out["failed"] = e.failed
            # the error names the device, the I/O that did not finish, and the fix
            out["named"] = {"path": e.path == path and path in str(e),
                            "offset": e.offset is not None and f"offset {e.offset}" in str(e)
                            and e.offset % MIB == 0 and e.length == MIB,
                            "fix": "KVBLOCK_IO_ENGINE=threads" in str(e)}
        out["first_seconds"] = time.monotonic() - t0
        second.array[:] = 0
        eng.read(IOBatch.contiguous(second.address, 0, 8 * MIB, 8 * MIB, MIB))
        out["second_equal"] = bool(np.array_equal(second.array, b))
        # nothing of the first batch landed in the second's buffer later on
        second.array[:] = 0
        eng.read(IOBatch.contiguous(second.address, 0, 8 * MIB, 8 * MIB, MIB))
        out["again_equal"] = bool(np.array_equal(second.array, b))
    return out


def broken_ring_split(path: str) -> dict:
    """A batch of two 4 MiB reads that the engine splits into 1 MiB pieces
    meets a ring that took none of them: the error counts the caller's I/Os
    that did not finish (2), not the pieces (8)."""
    out = {}
    with Device(path) as dev, open_engine([dev], "uring", queue_depth=8, max_io=MIB) as eng:
        buf = HostBuffer(8 * MIB)
        try:
            eng.read(IOBatch([buf.address, buf.address + 4 * MIB], 0, [0, 4 * MIB],
                             4 * MIB))
            out["first"] = "no error"
        except IOFailedError as e:
            out["first"] = f"IOFailedError {e.errno}"
            out["failed"] = e.failed
            out["says"] = "2 of 2 I/Os" in str(e)
    return out


def fork_old_kernel(path: str) -> dict:
    """A ring made without SINGLE_ISSUER (older kernels) is shared with a
    forked child; the child's close must leave the parent's ring working."""
    with Device(path) as dev, open_engine([dev], "uring") as eng:
        buf = HostBuffer(MIB)
        buf.array[:] = 7
        eng.write(IOBatch.single(buf.address, 0, 0, MIB))
        ring = eng._ring()
        eng._release(ring)      # _ring() hands the ring over locked
        out = {"fixed_files": bool(ring.fixed_files)}
        pid = os.fork()
        if pid == 0:
            eng.close()
            os._exit(0)
        os.waitpid(pid, 0)
        buf.array[:] = 0
        eng.read(IOBatch.single(buf.address, 0, 0, MIB))
        out["parent_read_ok"] = bool((buf.array == 7).all())
    return out


if __name__ == "__main__":
    case, path = sys.argv[1], sys.argv[2]
    print(json.dumps({"broken_ring": broken_ring, "broken_ring_split": broken_ring_split,
                      "fork_old_kernel": fork_old_kernel}[case](path)))
