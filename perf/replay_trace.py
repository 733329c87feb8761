#!/usr/bin/env python3
"""Replay a request trace against stores of given capacities and policies.

    python perf/replay_trace.py ../shared/traces/mooncake_conversation_trace.jsonl \
        [--capacities 64M,256M] [--policies fifo,lru] [--admit-after 1,2] [--limit N]

Each row of the trace is a request whose ``hash_ids`` are its 512-token
blocks (a chained prefix: equal ids mean equal prefixes).  Per request the
replay looks up the longest stored prefix, reads it back (checksums verified),
and saves the rest as one run — what a serving engine does with kvblock as its
KV tier.  Prints hit ratio, bytes written/read and regions reclaimed per
configuration, beside the ideal (infinite-capacity) hit ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support  # noqa: E402

from kvblock import Geometry, KVStore, create_file  # noqa: E402
from kvblock.cli.units import parse_size  # noqa: E402

# 512-token blocks, scaled to 4 KiB each so that the trace's footprint fits a file.
GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float16", block_tokens=512)


def load(path: str, limit: int | None) -> list[list[int]]:
    with open(path) as f:
        rows = [json.loads(line)["hash_ids"] for line in f if line.strip()]
    return rows[:limit] if limit else rows


def ideal(requests) -> float:
    seen, hits, total = set(), 0, 0
    for ids in requests:
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits += n
        total += len(ids)
        seen.update(ids)
    return hits / total


def replay(requests, capacity: int, policy: str, admit_after: int, directory: str) -> dict:
    # A name of its own: the directory may be shared (/dev/shm) with other replays.
    fd, path = tempfile.mkstemp(prefix="kvblock-replay-", suffix=".img", dir=directory)
    os.close(fd)
    store = None
    try:
        create_file(path, capacity)
        store = KVStore.format([path], GEOM, eviction=policy, admit_after=admit_after,
                               region_size=max(1 << 20, capacity // 64 // (1 << 20) * (1 << 20)))
        maxlen = max(len(r) for r in requests)
        data = np.zeros(maxlen * GEOM.block_bytes, np.uint8)
        out = np.zeros(maxlen * GEOM.block_bytes, np.uint8)
        hits = total = 0
        t0 = time.perf_counter()
        for ids in requests:
            n = store.lookup(ids)
            if n:
                n = store.get_run(ids[:n], out[:n * GEOM.block_bytes])
            hits += n
            total += len(ids)
            rest = ids[n:]
            if rest:
                store.put_run(rest, data[:len(rest) * GEOM.block_bytes])
        elapsed = time.perf_counter() - t0     # the requests, not close's checkpoint
        s = store.stats()
    finally:
        try:
            if store is not None:
                store.close()
        finally:
            os.unlink(path)
    return {"policy": policy, "admit_after": admit_after, "capacity_bytes": capacity,
            "hit_ratio": round(hits / total, 4), "bytes_written": s["bytes_written"],
            "bytes_read": s["bytes_read"], "regions_reclaimed": s["evicted_regions"],
            "requests_per_s": round(len(requests) / elapsed, 1), "seconds": round(elapsed, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--capacities", default="64M,256M")
    ap.add_argument("--policies", default="fifo,lru")
    ap.add_argument("--admit-after", default="1,2")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    requests = load(args.trace, args.limit)
    unique = len({h for r in requests for h in r})
    rows = []

    def body():
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            for cap in [parse_size(c) for c in args.capacities.split(",")]:
                for policy in args.policies.split(","):
                    for admit in [int(a) for a in args.admit_after.split(",")]:
                        rows.append(replay(requests, cap, policy, admit, d))
                        if not args.json:
                            print(json.dumps(rows[-1]), flush=True)

    # as the other perf scripts: a SIGTERM or SIGHUP unwinds through replay's
    # finally and the folder's cleanup, which remove the store file, where it
    # killed the process on the spot
    rc = fio_support.run_guarded("replay_trace", body, "store folder removed")
    if rc is not None:
        return rc
    summary = {"requests": len(requests), "unique_blocks": unique,
               "footprint_bytes": unique * GEOM.block_bytes,
               "ideal_hit_ratio": round(ideal(requests), 4), "runs": rows}
    print(json.dumps(summary, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
