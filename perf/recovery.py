#!/usr/bin/env python3
"""Cold recovery: time to reopen a store after SIGKILL with N indexed blocks,
and index memory per block.

    python perf/recovery.py [--blocks 1000000] [--path /dev/shm/kvblock-recovery.img]

A writer subprocess fills a store (small geometry so a million blocks fit a
file) and is SIGKILLed without a clean shutdown; then a fresh process opens
the store (checkpoint + journal replay) and reports time and memory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support  # noqa: E402

from kvblock import Geometry, KVStore, create_file  # noqa: E402

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=16)
RUN_BLOCKS = 64   # 512 B per block -> 32 KiB per run


def fill(path: str, blocks: int) -> None:
    import numpy as np

    store = KVStore.open([path])
    data = np.random.default_rng(0).integers(0, 256, RUN_BLOCKS * GEOM.block_bytes, np.uint8)
    for i in range(blocks // RUN_BLOCKS):
        keys = [(i * RUN_BLOCKS + j).to_bytes(16, "little") for j in range(RUN_BLOCKS)]
        store.put_run(keys, data)
        # journal replay matters too: leave the last stretch un-checkpointed
    print(json.dumps(store.stats()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean shutdown, no final checkpoint


def measure(path: str) -> dict:
    # 1. Time the cold reopen after the SIGKILL (checkpoint + journal replay).
    t0 = time.perf_counter()
    store = KVStore.open([path])
    seconds = time.perf_counter() - t0
    replayed = store.counters["replayed_records"]
    store._release_devices()  # die again: no clean shutdown
    # 2. Memory held by the recovered index, traced on a second open.
    tracemalloc.start()
    store = KVStore.open([path])
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    blocks = store.stats()["blocks"]
    result = {"blocks": blocks, "reopen_seconds": round(seconds, 3),
              "replayed_records": replayed,
              "index_bytes_per_block": round(current / max(blocks, 1), 1),
              "peak_bytes_per_block": round(peak / max(blocks, 1), 1)}
    store.close()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--path", default="/dev/shm/kvblock-recovery.img")
    ap.add_argument("--fill", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fill:
        fill(args.path, args.blocks)
        return 0
    if args.measure:
        print(json.dumps(measure(args.path)))
        return 0
    size = args.blocks * GEOM.block_bytes * 5 // 4 + (512 << 20)

    def body():
        if os.path.exists(args.path):
            os.unlink(args.path)
        try:
            create_file(args.path, size)
            KVStore.format([args.path], GEOM, region_size=64 << 20,
                           journal_bytes=64 << 20).close()
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--fill", "--path", args.path,
                                   "--blocks", str(args.blocks)], capture_output=True, text=True)
            assert proc.returncode == -signal.SIGKILL, proc.stderr
            fill_s = time.perf_counter() - t0
            out = subprocess.run([sys.executable, __file__, "--measure", "--path", args.path],
                                 capture_output=True, text=True, check=True).stdout
            result = json.loads(out)
            result["fill_seconds"] = round(fill_s, 1)
            print(json.dumps(result))
        finally:
            if os.path.exists(args.path):
                os.unlink(args.path)

    # as the other perf scripts: a SIGTERM or SIGHUP unwinds through the
    # finally that removes the store file (~1.1 GiB of RAM in /dev/shm by
    # default), where it killed the process on the spot
    return fio_support.run_guarded("recovery", body, "store file removed") or 0


if __name__ == "__main__":
    sys.exit(main())
