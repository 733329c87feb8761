#!/usr/bin/env python3
"""Promoting a few slots of each stored job: what the block digest trailer buys.

vLLM's primary pool often still holds most of a prefix, so a promotion asks
the secondary tier for a few slots of a job it stored as one run.  This
script stores ``--gib`` GiB of ``--slot`` slots through kvblock's vLLM tier
and through vLLM's own fs tier (jobs of ``--job-slots`` slots, as
perf/vllm_tier_vs_fs.py drives them), then promotes ``--take`` slots from
the middle of every job, ``--rounds`` times in three modes, their order
rotated round by round, the page cache dropped before each:

- ``kvblock``: verified reads of those slots' aligned windows and the run's
  block digest trailer (kvblock/format/trailer.py, the default);
- ``kvblock whole ranges``: verified reads of every range of the run, how
  kvblock read part of a run before format version 2;
- ``vLLM fs tier``: its files of those slots (unverified).

Every promoted byte is compared with what was stored.  Prints the median
time per job, the bytes each kvblock mode read per job, and the ratios.

    .venv/bin/python perf/partial_promotions.py                    # loop device on /var/tmp
    .venv/bin/python perf/partial_promotions.py --where /dev/shm --target file
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fio_support  # noqa: E402
import vllm_tier_vs_fs as vt  # noqa: E402

from kvblock.cli.units import parse_size  # noqa: E402
from kvblock.integrations.vllm import KVBlockTierManager  # noqa: E402
from kvblock.store.store import KVStore  # noqa: E402

GIB = 1 << 30
MODES = ("kvblock", "kvblock whole ranges", "vLLM fs tier")


@contextlib.contextmanager
def whole_ranges(on: bool):
    """kvblock's reads of part of a run as before the trailer: whole ranges."""
    if not on:
        yield
        return
    saved = KVStore._verified_window
    KVStore._verified_window = lambda self, *a: None
    try:
        yield
    finally:
        KVStore._verified_window = saved


def promote(tier, pool, expected, jobs, first_id: int) -> float:
    """Zero the slots ``jobs`` load, drop the page cache, load them; the
    seconds it took.  Exits when a loaded byte differs."""
    for _, ids in jobs:
        pool[torch.as_tensor(ids)] = 0
    vt.drop_caches()
    seconds = vt.run_jobs(tier, jobs, True, first_id)
    for _, ids in jobs:
        idx = torch.as_tensor(ids)
        if not torch.equal(pool[idx], expected[idx]):
            raise SystemExit(f"{type(tier).__name__}: promoted bytes differ from stored")
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--where", default="/var/tmp", help="directory for both tiers' data")
    p.add_argument("--target", choices=("loop", "file"), default="loop",
                   help="kvblock's store: a loop device over a file there, or the file")
    p.add_argument("--slot", default="256K", help="slot (vLLM block) size")
    p.add_argument("--job-slots", type=int, default=64, help="slots per stored job")
    p.add_argument("--take", type=int, default=2, help="slots promoted per job")
    p.add_argument("--gib", type=float, default=1.0, help="GiB stored")
    p.add_argument("--region-size", default="128M",
                   help="kvblock's regions (the tier keeps a run within 1/8 of one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = p.parse_args(argv)
    slot = parse_size(args.slot)
    total_slots = int(args.gib * GIB) // slot
    pool = vt.page_aligned_pool(total_slots, slot)
    expected = pool.clone()
    jobs = vt.plan_jobs(total_slots, total_slots, args.job_slots, "adjacent", seed=7)
    mid = (args.job_slots - args.take) // 2
    partial = [(keys[mid:mid + args.take], ids[mid:mid + args.take]) for keys, ids in jobs
               if len(keys) >= mid + args.take]
    base = Path(args.where) / f"kvblock-partial-bench-{os.getpid()}"
    times = {m: [] for m in MODES}
    read_per_job = {}

    def body():
        view = memoryview(pool.numpy())
        try:
            base.mkdir(parents=True, exist_ok=True)
            with vt.store_target(args.target, base, total_slots * slot) as dev:
                kv = KVBlockTierManager(vt.make_spec(), view, "kvblock", devices=[dev],
                                        max_run_bytes=args.job_slots * slot,
                                        region_size=args.region_size)
                fs = vt.FileSystemTierManager(vt.make_spec(), view, "fs",
                                              root_dir=str(base / "fs"))
                try:
                    vt.run_jobs(kv, jobs, False, 1)
                    vt.run_jobs(fs, jobs, False, 1)
                    if kv.stats()["evicted_blocks"]:
                        raise SystemExit(f"kvblock store in {args.where} too small")
                    next_id = 1_000_000
                    for rnd in range(args.rounds):
                        # rotate the order so drift and leftovers hit every mode alike
                        for mode in MODES[rnd % len(MODES):] + MODES[:rnd % len(MODES)]:
                            tier = fs if mode == "vLLM fs tier" else kv
                            before = kv.stats()["bytes_read"]
                            with whole_ranges(mode == "kvblock whole ranges"):
                                times[mode].append(promote(tier, pool, expected, partial,
                                                           next_id))
                            next_id += len(partial)
                            if tier is kv:
                                read_per_job[mode] = ((kv.stats()["bytes_read"] - before)
                                                      / len(partial))
                finally:
                    kv.shutdown()
                    fs.shutdown()
        finally:
            view.release()
            shutil.rmtree(base, ignore_errors=True)

    # detaches the loop device on SIGTERM / SIGHUP too
    rc = fio_support.run_guarded("partial_promotions", body,
                                 "loop device detached" if args.target == "loop"
                                 else "store files removed")
    if rc is not None:
        return rc
    ms = {m: statistics.median(t) / len(partial) * 1e3 for m, t in times.items()}
    print(f"{len(partial)} jobs of {args.job_slots} x {args.slot} slots stored in {args.where} "
          f"(kvblock: {args.target}); {args.take} slots promoted per job, median of "
          f"{args.rounds} rounds")
    print("| mode | ms per job | MiB read per job |\n|---|---|---|")
    for m in MODES:
        got = read_per_job.get(m)
        print(f"| {m} | {ms[m]:.2f} | {got / (1 << 20):.2f} |" if got is not None
              else f"| {m} | {ms[m]:.2f} | {args.take * slot / (1 << 20):.2f} (its files) |")
    # speedups: the other mode's time over kvblock's (>1: kvblock is faster)
    print(f"kvblock's speedup: {ms['kvblock whole ranges'] / ms['kvblock']:.2f}x over whole "
          f"ranges (whole ranges ms / kvblock ms), {ms['vLLM fs tier'] / ms['kvblock']:.2f}x "
          "over the fs tier (fs tier ms / kvblock ms)")
    if args.json:
        print(json.dumps({"rows": [{"mode": m, "ms_per_job": ms[m],
                                    "bytes_read_per_job": read_per_job.get(m)}
                                   for m in MODES]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
