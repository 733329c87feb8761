#!/usr/bin/env python3
"""Puts of large runs: hashing while the data is written vs before it.

A put computes the run's range checksums (unless a mapped write hashes the
ranges as it copies) and the block digests of its trailer.  Runs of at least
``OVERLAP_HASH_BYTES`` (kvblock/store/writes.py) are hashed on a helper thread
while their data is written, the trailer written after; this script puts
``--gib`` GiB of ``--run`` runs that way and the way smaller runs are put
(hashed first, data and trailer in one write), the two modes alternating
round by round in one process on one store (each mode's last run of a
round read back and compared, untimed), and prints the medians and the
ratio.  One writer thread, as SGLang's backup thread and LMCache's puts
write; the source is an aligned array that is the run's on-device image (no
staging copy) or, with ``--source staged``, an unaligned one.

A store file on tmpfs (``shm-file``) is written through a mapping, and such a
write always hashes first (it hashes each range as it copies it; see
``_stage_run`` in kvblock/store/writes.py): there is no "while writing" way
to time, so that target gets only the "before writing" column, the other and
the ratio printed as n/a (null in --json).

    .venv/bin/python perf/put_hashing.py                          # all targets, root
    .venv/bin/python perf/put_hashing.py --targets shm-file --source staged
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fio_support as fs  # noqa: E402

import kvblock  # noqa: E402
from kvblock.cli.units import parse_size  # noqa: E402
from kvblock.layout import Geometry  # noqa: E402
from kvblock.memory import aligned_empty  # noqa: E402
from kvblock.store import writes as writes_mod  # noqa: E402
from kvblock.store.store import KVStore  # noqa: E402

GIB = 1 << 30
DIRS = {"disk": Path("/var/tmp"), "shm": Path("/dev/shm")}
TARGETS = ("disk-loop", "shm-loop", "disk-file", "shm-file")
MODES = ("while writing", "before writing")
# 64 KiB per (layer, block): 16 tokens x 8 KV heads x 128 x K+V x bf16
GEOM = Geometry(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16,
                kv_parts=2, head_groups=1)


def measure(dev: str, args) -> dict:
    n = max(1, parse_size(args.run) // GEOM.block_bytes)
    runs = max(1, int(args.gib * GIB) // (n * GEOM.block_bytes))
    src = np.random.default_rng(1).integers(0, 256, n * GEOM.block_bytes + 1, dtype=np.uint8)
    if args.source == "image":
        data = aligned_empty(n * GEOM.block_bytes)
        data[:] = src[1:]
    else:
        data = src[1:]                     # not aligned: copied into staging
    speeds = {m: [] for m in MODES}
    default = writes_mod.OVERLAP_HASH_BYTES
    overlap = default if args.overlap_from is None else parse_size(args.overlap_from)
    out = np.zeros(n * GEOM.block_bytes, np.uint8)

    def check(store, keys, how):
        if store.get_run(keys, out) != n or not np.array_equal(out, data):
            raise SystemExit(f"{dev}: a run put {how} read back differs from what was put")

    with KVStore.format([dev], GEOM, force=True) as store:
        # A mapped write hashes before writing whatever OVERLAP_HASH_BYTES
        # says: timing "while writing" there would time the same code twice
        # and print a ratio of it with itself.
        mapped = store.io.engine.mapped_for_writes(0)
        modes = MODES[1:] if mapped else MODES
        first = [b"check-%d" % i for i in range(n)]
        assert store.put_run(first, data) == n
        check(store, first, "the store's default way")
        k = 0
        for rnd in range(args.rounds):
            for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                writes_mod.OVERLAP_HASH_BYTES = overlap if mode == MODES[0] else 1 << 62
                try:
                    t0 = time.perf_counter()
                    for _ in range(runs):
                        keys = [b"r%d-%d" % (k, i) for i in range(n)]
                        k += 1
                        if store.put_run(keys, data) != n:
                            raise SystemExit(f"{dev}: the store declined a run")
                    speeds[mode].append(runs * n * GEOM.block_bytes / GIB
                                        / (time.perf_counter() - t0))
                finally:
                    writes_mod.OVERLAP_HASH_BYTES = default
                check(store, keys, f"hashed {mode}")          # untimed
                store.clear()
    medians = {m: statistics.median(v) if v else None for m, v in speeds.items()}
    return {**medians, "samples": speeds, "run_bytes": n * GEOM.block_bytes,
            "mapped_writes": mapped}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TARGETS), type=fs.comma_choices(TARGETS),
                   help=f"comma separated, of {TARGETS}")
    p.add_argument("--run", default="32M", type=fs.size_text, help="bytes per run")
    p.add_argument("--gib", type=float, default=0.25, help="GiB put per round and mode")
    p.add_argument("--source", choices=("image", "staged"), default="image")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--overlap-from", default=None, type=fs.size_text,
                   help="the smallest run hashed while written in the first mode (default: "
                        "the store's OVERLAP_HASH_BYTES; smaller --run is then hashed first "
                        "in both modes)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    targets = args.targets           # checked by argparse (comma_choices): a usage error
    if any(t.endswith("loop") for t in targets):
        ok, why = fs.prerequisites()
        if not ok:
            print(f"put_hashing: {why}", file=sys.stderr)
            return 2
    size = (max(int(args.gib * GIB), 2 * parse_size(args.run)) * 2 + (256 << 20)) >> 20 << 20
    rows = []

    def body():
        for t in targets:
            where, kind = t.split("-")
            if kind == "loop":
                for _, dev in fs.attached_targets([where], DIRS, size):
                    rows.append({"target": t, **measure(dev, args)})
            else:
                with tempfile.TemporaryDirectory(prefix="kvblock-put-", dir=DIRS[where]) as d:
                    path = kvblock.create_file(Path(d) / "kv.img", size)
                    rows.append({"target": t, **measure(str(path), args)})

    rc = fs.run_guarded("put_hashing", body,
                        "loop devices detached" if any(t.endswith("loop") for t in targets)
                        else "store files removed")
    if rc is not None:
        return rc
    print(f"one writer, {args.run} runs ({args.source} source), {args.gib} GiB per round, "
          f"median of {args.rounds} alternating rounds (GiB/s)")
    print("| target | hashed while writing | hashed before writing | ratio |\n|---|---|---|---|")
    for r in rows:
        a, b = r[MODES[0]], r[MODES[1]]
        if a is None:            # mapped writes: hashed before writing, the only way
            print(f"| {r['target']} | n/a (mapped: hashes first) | {b:.2f} | n/a |")
            continue
        print(f"| {r['target']} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
