#!/usr/bin/env python3
"""kvblock's LMCache plugin vs LMCache's own LocalDiskBackend: same chunks,
same filesystem.

Both backends run inside LMCache 0.5's ``StorageManager``, built from an
``LMCacheEngineConfig`` as LMCache builds it (the plugin through
``storage_plugins``; LocalDiskBackend through ``local_disk`` with
``use_odirect``, since kvblock does direct I/O too), next to the
``LocalCPUBackend`` whose allocator makes the chunks.  For each location
(``disk``: /var/tmp; ``shm``: /dev/shm) and chunk shape, ``--rounds`` times
(alternating which backend goes first), it puts ``--gib`` GiB of chunks
(``StorageManager.batched_put`` of ``--batch`` chunks at a time, as the cache
engine stores a request's chunks, then waits until every chunk is stored),
drops the page cache (root), gets them back (``batched_get``, ``--batch`` at
a time), checks every byte and prints the median put and get GiB/s and the
ratios.

    .venv/bin/python perf/lmcache_vs_localdisk.py              # ~1 minute, root
    .venv/bin/python perf/lmcache_vs_localdisk.py --gib 1 --locations disk

Chunk shapes (256 tokens, bf16): ``2M`` = 16 layers x 1 KV head x 128 (a
small model, 2 MiB a chunk); ``32M`` = Llama-3-8B, 32 layers x 8 KV heads x
128 (32 MiB a chunk).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

import kvblock

sys.path.insert(0, str(Path(__file__).resolve().parent))      # fio_support
import fio_support  # noqa: E402

GIB = 1 << 30
TOKENS = 256
LOCATIONS = {"disk": "/var/tmp", "shm": "/dev/shm"}
SHAPES = {"2M": (16, 1, 128), "32M": (32, 8, 128)}     # layers, KV heads, head size
MODEL = "bench/lmcache-model"


def metadata(shape) -> LMCacheMetadata:
    layers, heads, head = shape
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(layers, 2, TOKENS, heads, head), use_mla=False,
                           chunk_size=TOKENS)


def config(kind: str, base: Path, total: int) -> LMCacheEngineConfig:
    cpu_gb = 2 * total / GIB + 0.25          # the chunks put, and those got back
    if kind == "kvblock":
        # twice the data: a 32 MiB chunk is one run, and a run does not span regions
        dev = kvblock.create_file(base / "kv.img", 2 * total + (512 << 20))
        return LMCacheEngineConfig.from_defaults(
            chunk_size=TOKENS, local_cpu=False, max_local_cpu_size=cpu_gb,
            storage_plugins=["kvblock"],
            extra_config={"storage_plugin.kvblock.module_path": "kvblock.integrations.lmcache",
                          "storage_plugin.kvblock.class_name": "KVBlockStorageBackend",
                          "kvblock.devices": [str(dev)]})
    (base / "disk").mkdir()
    return LMCacheEngineConfig.from_defaults(
        chunk_size=TOKENS, local_cpu=False, max_local_cpu_size=cpu_gb,
        local_disk=f"file://{base / 'disk'}/", max_local_disk_size=2 * total / GIB + 0.25,
        extra_config={"use_odirect": True})


def measure(kind: str, where: str, shape, total: int, batch: int, seed: int) -> dict:
    base = Path(where) / f"kvblock-lmcache-bench-{os.getpid()}"
    base.mkdir()
    manager = None
    try:
        md = metadata(shape)
        manager = StorageManager(config(kind, base, total), md, EventManager())
        name = "kvblock" if kind == "kvblock" else "LocalDiskBackend"
        backend = manager.storage_backends[name]
        shapes, dtypes = md.get_shapes(), md.get_dtypes()
        n = max(1, total // (md.get_shapes()[0].numel() * 2))
        keys = [CacheEngineKey(MODEL, 1, 0, seed * 1_000_000 + i, torch.bfloat16)
                for i in range(n)]
        objs, want = [], []
        g = torch.Generator().manual_seed(seed)
        for _ in keys:
            obj = manager.allocate(shapes, dtypes)
            raw = obj.raw_tensor.view(torch.uint8)[:obj.get_size()]
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
            want.append(raw.clone())
            objs.append(obj)
        nbytes = sum(w.numel() for w in want)
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            manager.batched_put(keys[i:i + batch], objs[i:i + batch])   # drops our references
        deadline = time.monotonic() + 600
        while any(backend.exists_in_put_tasks(k) for k in keys) or \
                not all(backend.contains(k) for k in keys):
            if kind == "kvblock" and backend.stats()["evicted_blocks"]:
                raise SystemExit(f"kvblock store at {where} too small: chunks were evicted")
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: puts did not finish")
            time.sleep(0.001)
        put_s = time.perf_counter() - t0
        dropped = fio_support.drop_caches()
        t0 = time.perf_counter()
        got = []
        for i in range(0, n, batch):
            got += manager.batched_get(keys[i:i + batch], location=name)
        get_s = time.perf_counter() - t0
        ok = len(got) == n and all(
            o is not None and torch.equal(o.raw_tensor.view(torch.uint8)[:o.get_size()], w)
            for o, w in zip(got, want))
        for o in got:
            if o is not None:
                o.ref_count_down()
        if not ok:
            raise SystemExit(f"{name} at {where}: chunks read back differ from those put")
        return {"put_gibps": nbytes / GIB / put_s, "get_gibps": nbytes / GIB / get_s,
                "chunks": n, "bytes": nbytes, "dropped_caches": dropped}
    finally:
        if manager is not None:
            manager.close()
            if not manager.thread.is_alive():
                manager.loop.close()
        shutil.rmtree(base, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5, help="GiB put and got per case")
    ap.add_argument("--shapes", default="2M,32M", type=fio_support.comma_choices(SHAPES),
                    help=f"comma separated, of {sorted(SHAPES)}")
    ap.add_argument("--locations", default="disk,shm", type=fio_support.comma_choices(LOCATIONS),
                    help=f"comma separated, of {sorted(LOCATIONS)}")
    ap.add_argument("--batch", type=int, default=8, help="chunks per batched_put / batched_get")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds per case (order alternates); medians are printed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logging.getLogger("lmcache").setLevel(logging.WARNING)
    total = int(args.gib * GIB)
    rows = []

    def body():
        for loc in args.locations:
            for shape_name in args.shapes:
                shape = SHAPES[shape_name]
                samples = {"kvblock": [], "localdisk": []}
                for rnd in range(args.rounds):
                    order = ("kvblock", "localdisk") if rnd % 2 == 0 else ("localdisk", "kvblock")
                    for kind in order:
                        samples[kind].append(measure(kind, LOCATIONS[loc], shape, total,
                                                     args.batch, seed=rnd + 1))
                for kind, runs in samples.items():
                    rows.append({"backend": kind, "location": loc, "chunk": shape_name,
                                 "put_gibps": statistics.median(r["put_gibps"] for r in runs),
                                 "get_gibps": statistics.median(r["get_gibps"] for r in runs),
                                 "samples": runs})

    # as the other comparisons: a SIGTERM or SIGHUP unwinds through measure's
    # finally, which removes the store file and the chunk files, where it
    # killed the process on the spot
    rc = fio_support.run_guarded("lmcache_vs_localdisk", body, "store and chunk files removed")
    if rc is not None:
        return rc
    if args.json:
        print(json.dumps({"rows": rows, "batch": args.batch, "gib": args.gib}, indent=2))
        return 0
    dropped = all(s["dropped_caches"] for r in rows for s in r["samples"])
    print(f"{args.gib:g} GiB per case, median of {args.rounds} rounds, batches of {args.batch} "
          "chunks; LocalDiskBackend with use_odirect")
    if not dropped:
        print("warning: could not drop the page cache (not root?): gets may hit memory")
    head = (f"{'where':<6} {'chunk':>6} | {'kvblock put':>11} {'disk put':>9} {'ratio':>6} | "
            f"{'kvblock get':>11} {'disk get':>9} {'ratio':>6}   (GiB/s)")
    print(head)
    print("-" * len(head))
    for i in range(0, len(rows), 2):
        kv, disk = rows[i], rows[i + 1]
        print(f"{kv['location']:<6} {kv['chunk'] + 'iB':>6} | {kv['put_gibps']:>11.2f} "
              f"{disk['put_gibps']:>9.2f} {kv['put_gibps'] / disk['put_gibps']:>5.2f}x | "
              f"{kv['get_gibps']:>11.2f} {disk['get_gibps']:>9.2f} "
              f"{kv['get_gibps'] / disk['get_gibps']:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
