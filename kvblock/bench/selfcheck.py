"""End-to-end I/O self-check: every available engine writes random bytes to a
scratch target, reads them back and compares; reports engine choice and speed."""

from __future__ import annotations

import os
import time

import numpy as np

from kvblock.bench.store_bench import VerifyError
from kvblock.devices import Device, create_file
from kvblock.devices.device import new_file, remove_made, said_size
from kvblock.errors import ConfigError, DeviceTooSmallError
from kvblock.io import ENGINES, IOBatch, engine_report, open_engine
from kvblock.io.uring import probe
from kvblock.memory import HostBuffer

UNIT = 1 << 20   # the check writes and reads whole MiB


def run_selfcheck(path: str, size: int, keep_created: bool = False) -> dict:
    """Check ``size`` bytes of ``path`` (a file of that size made if absent;
    an existing one smaller is refused) with every engine.
    A file made here is removed at the end (success, failure or Ctrl-C)
    unless ``keep_created`` (kvblock's own default scratch file, which an
    earlier, smaller check left: it is grown to ``size``, not refused)."""
    if size < UNIT:       # refused before a scratch file too small for any later check is made
        raise ConfigError(f"selfcheck --size {size}: the check writes whole MiB; give at least 1M")
    if os.path.exists(path):
        if keep_created and os.path.isfile(path) and os.path.getsize(path) < size:
            create_file(path, size)
        return _check(path, size)
    made = new_file(path, size)
    try:
        return _check(path, size)
    finally:
        if not keep_created:
            remove_made(made)


def _check(path: str, size: int) -> dict:
    report = {"selected_engine": engine_report()["engine"], "reason": engine_report()["reason"]}
    with Device(path) as dev:
        if dev.capacity < UNIT:
            raise DeviceTooSmallError(f"{path} has {said_size(dev)}; selfcheck writes whole "
                                      "MiB and needs at least 1 MiB: give a larger --path", path)
        if size > dev.capacity:   # checking less than asked would pass for the full check
            raise ConfigError(f"selfcheck --size {size} is larger than {path} "
                              f"({said_size(dev)}); give at most its size, or another --path "
                              "(a scratch file made there is of --size)")
        span = size // UNIT * UNIT
        rng = np.random.default_rng()
        with HostBuffer(span) as src, HostBuffer(span) as dst:
            for name in ENGINES:
                if name == "uring" and not probe()[0]:
                    report[f"{name}"] = "unavailable"
                    continue
                # bytes of this engine's own: with the same bytes as the
                # engine before, writes that went nowhere read back as good
                src.array[:] = rng.integers(0, 256, span, dtype=np.uint8)
                dst.array[:] = 0
                # mapped_reads=False: a file on tmpfs would be copied through
                # a mapping, and the engine being checked never do an I/O
                with open_engine([dev], name, queue_depth=32, mapped_reads=False) as eng:
                    t0 = time.perf_counter()
                    eng.write(IOBatch.contiguous(src.address, 0, 0, span, 1 << 20))
                    dev.flush()
                    t1 = time.perf_counter()
                    eng.read(IOBatch.contiguous(dst.address, 0, 0, span, 1 << 20))
                    t2 = time.perf_counter()
                ok = bool(np.array_equal(src.array, dst.array))
                report[name] = (f"{'ok' if ok else 'MISMATCH'}: wrote {span >> 20} MiB at "
                                f"{span / (t1 - t0) / 2**30:.2f} GiB/s, read at "
                                f"{span / (t2 - t1) / 2**30:.2f} GiB/s")
                if not ok:
                    at = int(np.flatnonzero(src.array != dst.array)[0])
                    raise VerifyError(f"selfcheck: the {name} engine read back other bytes than "
                                      f"it wrote to {path}, first at offset {at}; that device "
                                      "or engine loses data: check the kernel log (dmesg), "
                                      f"and try another engine (KVBLOCK_IO_ENGINE)")
    report["device"] = path
    return report
