"""Save / restore benchmark through the store (``kvblock bench --workload save|restore``).

save: formats TARGET, then writes runs of ``run_blocks`` blocks for the given
time (one run at least).  restore: formats TARGET, fills about half of it with
runs (256 at most; each run its own bytes), then reads whole runs back in
random order (checksums verified unless ``verify=never``) with ``jobs``
readers, each reading one run at least; afterwards every reader's last read
is compared with the run it asked for.  Buffers are aligned and touched
before timing.  An existing TARGET is formatted whole: a ``size`` other than
its own is refused.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from kvblock.devices import Device
from kvblock.devices.device import new_file, refuse_missing, remove_made, said_size
from kvblock.errors import ConfigError, DeviceTooSmallError, KVBlockError
from kvblock.layout import Geometry
from kvblock.memory import HostBuffer
from kvblock.store import KVStore


# Model fingerprint of the stores bench save/restore format: the CLI lets
# them write over one of these without --force, over any other store not.
BENCH_MODEL = "kvblock-bench"


def run_store_bench(target: str, workload: str, geometry: Geometry, run_blocks: int,
                    seconds: float, size: int | None = None, engine: str | None = None,
                    verify: str = "always", jobs: int = 4, qd: int = 32,
                    progress=None) -> dict:
    if workload not in ("save", "restore"):
        raise ConfigError(f"store workload must be save or restore, got {workload!r}")
    made = None
    if not os.path.exists(target):
        if not size:
            # the path not found, as a raw workload and every other command
            # say it (exit 3), not a bad argument
            refuse_missing(target, "pass --size to create a store file there")
        made = new_file(target, size)
    elif size:
        _check_size(target, size)
    try:
        return _format_and_run(target, workload, geometry, run_blocks, seconds, engine, verify,
                               jobs, qd, progress, made)
    except BaseException:
        # a file made here goes again when the run fails (a refused format or
        # --run-blocks, Ctrl-C), as the raw workloads' does
        if made:
            remove_made(made)
        raise


def _format_and_run(target, workload, geometry, run_blocks, seconds, engine, verify, jobs, qd,
                    progress, made=None) -> dict:
    nbytes = run_blocks * geometry.block_bytes
    # before the format wipes the target
    _check_run_fits(target, geometry, run_blocks, made)
    store = KVStore.format([target], geometry, model=BENCH_MODEL, force=True, engine=engine,
                           verify=verify, queue_depth=qd)
    try:
        with HostBuffer(nbytes) as src:
            src.array[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            if workload == "save":
                return _save(store, src, run_blocks, seconds, progress)
            return _restore(store, src, run_blocks, seconds, jobs, progress)
    finally:
        store.close()


def _check_run_fits(target: str, geometry: Geometry, run_blocks: int, made=None) -> None:
    """A run of ``run_blocks`` must fit one region of the store the bench
    formats on ``target``: refused before the format, so a refused run size
    leaves the target as it was (a store there, given --force, stays)."""
    from kvblock.layout.geometry import RunLayout
    from kvblock.store.planning import plan_for

    # opened as the format opens it: a target in use or read-only is
    # refused as that, before its run size
    with Device(target) as dev:
        try:
            plan = plan_for([dev], geometry)    # the format's own: its region size
        except (DeviceTooSmallError, ConfigError) as e:
            raise _too_small(dev, geometry, made, run_blocks) from e
        run_bytes = RunLayout(geometry, run_blocks, plan["alignment"]).run_bytes
        if run_bytes > plan["region_size"]:
            # a larger target has larger regions: name its size too, where one holds the run
            least = _least_for_run(dev, geometry, run_blocks)
            larger = ("" if least is None else
                      f", or give --size {least} or more" if made else
                      f", or use a larger target (at least {least} bytes)")
            raise ConfigError(f"a run of {run_blocks} blocks "
                              f"({run_blocks * geometry.block_bytes} bytes) exceeds the "
                              f"{plan['region_size']}-byte region; use fewer --run-blocks"
                              + larger)


def _least_for_run(dev, geometry: Geometry, run_blocks: int) -> int | None:
    """The least size of ``dev`` whose bench store's regions each hold a
    run of ``run_blocks`` (None: no size's do)."""
    from kvblock.store.planning import StandIn, least_size_for_region

    return least_size_for_region([StandIn(dev.path, dev.block_size)], geometry, run_blocks)


def _too_small(dev, geometry: Geometry, made, run_blocks: int) -> KVBlockError:
    """The store's refusal of ``dev`` in the bench's terms: its advice (a
    smaller region_size, a larger journal_bytes) names settings the bench
    does not take.  Its store's regions and journal follow the target's
    size (and the model's), so the size that holds one, with regions that
    hold a run of ``run_blocks`` (as _check_run_fits asks next), is what to
    give; where no size's regions hold such a run, fewer --run-blocks."""
    from kvblock.store.planning import StandIn, least_size
    from kvblock.store.store import _blocks_too_small

    too_small = _blocks_too_small([dev], geometry)    # no target's size would do
    if too_small is not None:
        return too_small
    if least_size([StandIn(dev.path, dev.block_size)], geometry) is None:
        return ConfigError(f"no target can hold a store for {geometry.describe()}: a run's "
                           "journal record of one block is larger than a store's journal "
                           "can be; bench a smaller model (fewer --layers or --head-groups)")
    least = _least_for_run(dev, geometry, run_blocks)
    if least is None:
        return ConfigError(f"a run of {run_blocks} blocks ({run_blocks * geometry.block_bytes} "
                           "bytes) is larger than the regions of a bench store of any size "
                           f"for {geometry.describe()}; use fewer --run-blocks")
    fix = (f"give --size {least} or more" if made else
           f"use a larger target (or a new file, with --size {least})")
    return DeviceTooSmallError(f"{dev.path}: {said_size(dev)} cannot hold a bench store "
                               f"for {geometry.describe()} with runs of {run_blocks} blocks: it "
                               f"needs at least {least} bytes; " + fix, dev.path)


def _check_size(target: str, size: int) -> None:
    """A store is formatted over all of its target: a --size other than an
    existing target's cannot be honoured, so it is refused before any write."""
    with Device(target) as dev:
        if size // dev.block_size * dev.block_size != dev.capacity:
            raise ConfigError(f"--size {size} differs from {dev.path} ({said_size(dev)}): "
                              "save/restore format all of an existing target; give its size, "
                              "or none, or a new TARGET")


class VerifyError(KVBlockError):
    """The benchmark read back something else than it wrote."""


def target_of(store) -> str:
    return store.io.devices[0].path


def _result(store, workload, run_blocks, lat, total, elapsed, jobs=1):
    """As the raw workloads' numbers: an I/O is one run, ``bs`` its KV data
    (as ``bytes`` and ``gib_per_s`` count it: bs x iops is the throughput);
    ``bs_on_device`` adds the ranges' alignment and the run's digest trailer."""
    lat = np.asarray(lat) * 1e6
    return {"workload": workload, "engine": store.io.engine.name,
            "target": store.io.devices[0].path,
            "bs": run_blocks * store.geometry.block_bytes,
            "bs_on_device": store.layout(run_blocks).run_bytes,
            "qd": store.io.engine.queue_depth,
            "jobs": jobs, "bytes": total, "seconds": round(elapsed, 4),
            "gib_per_s": round(total / elapsed / 2**30, 4),
            "iops": round(len(lat) / elapsed, 1),
            "p50_us": round(float(np.percentile(lat, 50)), 1),
            "p99_us": round(float(np.percentile(lat, 99)), 1),
            "blocks": len(lat) * run_blocks, "verify": store.verify,
            "geometry": store.geometry.as_dict()}


def _save(store, src, run_blocks, seconds, progress):
    lat, total, i = [], 0, 0
    start = time.perf_counter()
    while not lat or time.perf_counter() - start < seconds:   # one put at least: timed
        keys = [f"save-{i}-{j}".encode() for j in range(run_blocks)]
        t = time.perf_counter()
        store.put_run(keys, src.array)
        lat.append(time.perf_counter() - t)
        total += src.nbytes
        i += 1
        if progress:
            progress(time.perf_counter() - start, seconds)
    return _result(store, "save", run_blocks, lat, total, time.perf_counter() - start)


def run_mask(run: int) -> np.uint64:
    """The word XORed into every 8 bytes of the source for run ``run``: no
    two runs hold the same bytes, so a read of another run shows."""
    return np.uint64(((run + 1) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))


def _restore(store, src, run_blocks, seconds, jobs, progress):
    capacity_runs = store.regions.count * (store.sb.region_size //
                                           store.layout(run_blocks).run_bytes)
    runs = max(1, min(capacity_runs // 2, 256))
    keysets = [[f"restore-{i}-{j}".encode() for j in range(run_blocks)] for i in range(runs)]
    words = src.nbytes // 8                  # a block is a multiple of 8 bytes
    with HostBuffer(src.nbytes) as stage:
        for i, keys in enumerate(keysets):
            np.bitwise_xor(src.numpy(np.uint64, (words,)), run_mask(i),
                           out=stage.numpy(np.uint64, (words,)))
            store.put_run(keys, stage.array)
    outs = [HostBuffer(src.nbytes) for _ in range(jobs)]
    last = [None] * jobs                     # the run each reader read last
    lat, total, failed = [], [0], []
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = start + seconds

    def reader(j):
        rng = np.random.default_rng(j)
        out = outs[j].array
        try:
            # one read at least, so a reader that ran late still times and verifies one
            while not failed and (last[j] is None or time.perf_counter() < deadline):
                run = int(rng.integers(0, runs))
                keys = keysets[run]
                t = time.perf_counter()
                got = store.get_run(keys, out)
                dt = time.perf_counter() - t
                if got != run_blocks:
                    raise VerifyError(f"restore read {got} of {run_blocks} blocks of a run "
                                      f"just saved on {target_of(store)} (a checksum failure "
                                      "or an I/O error: kvblock fsck --deep)")
                last[j] = run
                with lock:
                    lat.append(dt)
                    total[0] += out.nbytes
                if progress and j == 0:
                    progress(min(time.perf_counter() - start, seconds), seconds)
        except BaseException as e:   # raised by the caller once every reader stopped
            failed.append(e)

    try:
        threads = [threading.Thread(target=reader, args=(j,)) for j in range(jobs)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except BaseException as e:      # Ctrl-C: the readers stop at their next read
            failed.append(e)
            for t in threads:
                if t.is_alive():
                    t.join()
            raise
        if failed:
            raise failed[0]
        elapsed = time.perf_counter() - start
        for j, run in enumerate(last):   # every reader's last read (untimed)
            if run is None:
                continue
            want = np.bitwise_xor(src.numpy(np.uint64, (words,)), run_mask(run))
            if not np.array_equal(outs[j].numpy(np.uint64, (words,)), want):
                raise VerifyError(f"reader {j} read back other bytes than were saved as run "
                                  f"{run} ({keysets[run][0].decode()}...) on {target_of(store)}")
    finally:
        for o in outs:
            o.close()
    return _result(store, "restore", run_blocks, lat, total[0], elapsed, jobs)
