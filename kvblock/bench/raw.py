"""Raw device benchmark through a kvblock I/O engine, named after fio's workloads.

Each batch handed to the engine holds many I/Os; the native side keeps ``qd``
of them in flight and refills as they complete, so the queue stays full the
way it does under fio.  In-flight I/Os cycle through ``qd`` buffers of one
registered arena (the bytes are not checked here; the tests do that).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from kvblock.devices import Device
from kvblock.devices.device import new_file, refuse_missing, remove_made, said_size
from kvblock.errors import ConfigError
from kvblock.io import OP_READ, OP_WRITE, IOBatch, open_engine
from kvblock.memory import HostBuffer

# Seconds of I/O per batch handed to the engine, and a cap on its entries.
BATCH_SECONDS = 0.25
MAX_BATCH = 1 << 18

WORKLOADS = {"read": (OP_READ, False), "write": (OP_WRITE, False),
             "randread": (OP_READ, True), "randwrite": (OP_WRITE, True)}


@dataclass
class RawBenchResult:
    workload: str
    engine: str
    target: str
    bs: int
    qd: int
    bytes: int
    seconds: float
    gib_per_s: float
    iops: float
    p50_us: float
    p99_us: float
    ios: int


def run_raw(target: str, workload: str, bs: int, qd: int, seconds: float,
            size: int | None = None, engine: str | None = None,
            progress=None) -> RawBenchResult:
    """Run ``workload`` on ``target`` for about ``seconds`` seconds.  A
    target file it creates (``size``) is removed again when the run fails,
    so a refused size is not left behind to refuse the next run too."""
    import os

    # (a dangling symlink is made too: the file at its target, which is what
    # a failed run removes, keeping the link)
    if size is not None and size <= 0:   # 0 is not "no size": refused, not the whole target
        raise ConfigError(f"--size must be positive, got {size} (leave it out to use the "
                          "whole target)")
    if not size and not os.path.exists(target):
        # bench's own fix (Device's says kvblock format FILE --size ...)
        refuse_missing(target, "pass --size to create a file of that size there")
    made = new_file(target, size) if size and not os.path.exists(target) else None
    try:
        return _run_raw(target, workload, bs, qd, seconds, size, engine, progress)
    except BaseException:
        if made:
            remove_made(made)
        raise


def _run_raw(target, workload, bs, qd, seconds, size, engine, progress) -> RawBenchResult:
    if workload not in WORKLOADS:
        raise ConfigError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if bs <= 0 or qd <= 0 or seconds <= 0:
        raise ConfigError("--bs, --qd and --seconds must be positive")
    op, random = WORKLOADS[workload]
    with Device(target, writable=(op == OP_WRITE), exclusive=(op == OP_WRITE)) as dev:
        if bs % dev.block_size:
            raise ConfigError(f"--bs {bs} is not a multiple of {dev.path}'s "
                              f"{dev.block_size}-byte block size")
        # the whole blocks of --size, as the device's capacity counts a
        # file's: a file made here of --size 1000000 holds 999424 of them
        # (its tail is no direct I/O's), not less than --size asked
        usable = size // dev.block_size * dev.block_size if size else None
        if usable and usable > dev.capacity:
            raise ConfigError(f"--size {size} is larger than {dev.path} ({said_size(dev)}); "
                              "give at most its size, or none")
        span = (usable if size else dev.capacity) // bs * bs
        if span < bs:
            used = f"--size {size}" if size else said_size(dev)
            # (no whole block: no --bs is small enough)
            fix = ("a larger target" if not size and dev.capacity < dev.block_size else
                   "a smaller --bs" + (" or a larger --size" if size else ""))
            raise ConfigError(f"{dev.path}: {used}, smaller than one {bs}-byte I/O; give {fix}")
        slots = span // bs
        rng = np.random.default_rng(0)
        # mapped_reads=False: on a file on tmpfs the I/Os would be copies
        # through its mapping, not the engine's (whose name the result gives)
        with HostBuffer(bs * qd) as buf, open_engine([dev], engine, queue_depth=qd,
                                                     mapped_reads=False) as eng:
            if op == OP_WRITE:
                buf.array[:] = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
            # Batches are sized by time: each holds about BATCH_SECONDS of I/O at
            # the rate measured so far (the first one a few queues' worth), so
            # the drain at the end of a batch and the Python work between
            # batches are a small fraction whatever the device's speed, and
            # the last batch ends close to the deadline, as fio's runs do.
            addrs = (np.arange(MAX_BATCH, dtype=np.uint64) % np.uint64(qd)) * np.uint64(bs) \
                + np.uint64(buf.address)
            n = qd * 4
            cursor = 0
            lat_parts, done, total = [], 0, 0
            start = time.perf_counter()
            deadline = start + seconds
            while True:
                if random:
                    offsets = rng.integers(0, slots, n, dtype=np.uint64) * np.uint64(bs)
                else:
                    offsets = ((np.arange(cursor, cursor + n, dtype=np.uint64)
                                % np.uint64(slots)) * np.uint64(bs))
                    cursor = (cursor + n) % slots
                res = eng.submit(op, IOBatch(addrs[:n], 0, offsets, bs), qd=qd, latency=True)
                lat_parts.append(res.latency_ns)
                done += n
                total += res.nbytes
                now = time.perf_counter()
                if progress:
                    progress(min(now - start, seconds), seconds)
                if now >= deadline:
                    break
                rate = done / (now - start)
                n = int(min(max(rate * min(BATCH_SECONDS, deadline - now), 2 * qd), MAX_BATCH))
            elapsed = time.perf_counter() - start
            name = eng.name
    lat = np.concatenate(lat_parts) / 1000.0
    return RawBenchResult(
        workload=workload, engine=name, target=target, bs=bs, qd=qd, bytes=total,
        seconds=round(elapsed, 4), gib_per_s=round(total / elapsed / 2**30, 4),
        iops=round(done / elapsed, 1), p50_us=round(float(np.percentile(lat, 50)), 1),
        p99_us=round(float(np.percentile(lat, 99)), 1), ios=done)


def as_dict(result: RawBenchResult) -> dict:
    return asdict(result)
