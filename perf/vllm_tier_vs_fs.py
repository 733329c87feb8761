#!/usr/bin/env python3
"""kvblock's vLLM tier vs vLLM's built-in fs tier: same data, same filesystem.

Both tiers are driven exactly as vLLM 0.33's TieringOffloadingManager drives
them (TransferJobs over a page-aligned CPU primary pool seen through a
memoryview, results polled with get_finished_jobs), one after the other, on
the same filesystem:

- kvblock: ``KVBlockTierManager`` on a pre-sized store file in the same
  directory (``--kvblock-target file``, the default: kvblock's embedded
  target), or on a loop device (direct I/O on) over such a file
  (``--kvblock-target loop``; needs root);
- fs: ``FileSystemTierManager`` (one file per slot, O_DIRECT when the
  filesystem takes it) with its default 16 read + 16 write threads.

For each location (``disk``: /var/tmp; ``shm``: /dev/shm) and slot size,
``--rounds`` times (alternating which tier goes first), it stores ``--gib``
GiB of slots, drops the page cache (``echo 3 >
/proc/sys/vm/drop_caches``; root), loads every slot back and prints the
median store and load GiB/s and the kvblock/fs ratios.  The primary pool
(``--pool``) is smaller than the data, so the keys go in waves of one pool
each (jobs of ``--job-slots`` slots, a wave's jobs all submitted at once,
then drained); every wave stores its own bytes in the pool's slots (the
pool's random bytes XOR a per-wave word, written in untimed), so no two keys
hold the same bytes, and after each wave's loads every slot is checked
(untimed) to hold the bytes of the key it was loaded for.
Then fio reads the same amount, one slot per read with 32 in flight, from a
fresh file in the location (or a loop device over one, with ``--kvblock-target
loop``), page cache dropped: how fast the device itself reads, the ceiling of
any tier on it that reads through the kernel (``--no-fio`` skips it).  Both
tiers' loads are printed relative to it.

    .venv/bin/python perf/vllm_tier_vs_fs.py                  # ~1.5 minutes, root
    .venv/bin/python perf/vllm_tier_vs_fs.py --gib 4 --slots 256K,2M,8M
    .venv/bin/python perf/vllm_tier_vs_fs.py --pattern scattered --json

``--pattern adjacent`` (default) gives each job ascending adjacent slots (how
vLLM's primary pool hands out fresh slots: kvblock's zero-copy path);
``scattered`` gives a fragmented pool (kvblock reads and writes each slot
where it is: put_blocks/get_blocks).  Everything it creates is removed at the end.

On /dev/shm the two targets differ: kvblock reads a store file on tmpfs
through a shared mapping (a copy and a hash per 64 KiB chunk in user space,
kvblock/io/mapped.py; ``KVBLOCK_MAPPED_READS=never`` reads it through
io_uring, whose kernel workers copy on both cores), while a loop device
copies in one worker of the loop driver.

``--loop-write-cache write-through`` makes the loop device report what a
drive without a volatile write cache reports (many with power-loss
protection), so that kvblock's flushes cost what they would on one
(nothing; perf/fio_support.py says why).  The peers
never flush.

Note: vLLM's fs tier has a C extension (vllm.fs_io_C) that the CUDA wheel
links against CUDA libraries; where it cannot load (a CPU-only machine) the fs
tier runs its pure-Python I/O path, and the table says which one ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from unittest.mock import MagicMock

import numpy as np
import torch
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs import io as fs_io
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

import kvblock
from kvblock.cli.units import parse_size
from kvblock.integrations.vllm import DEFAULT_THREADS, KVBlockTierManager

sys.path.insert(0, str(Path(__file__).resolve().parent))      # fio_support
import fio_support as fs  # noqa: E402

GIB = 1 << 30
PAGE = mmap.PAGESIZE
LOCATIONS = {"disk": "/var/tmp", "shm": "/dev/shm"}
CTX = ReqContext(req_id="bench")


def make_spec(tokens: int = 16, layer_names: tuple = ("layers",)) -> MagicMock:
    """The offloading spec a tier gets (what vLLM's TieringOffloadingSpec
    passes): one KV group of ``tokens``-token blocks, one block per chunk."""
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens, layer_names=layer_names,
                                      group_id=0),),
        worker_kv_bytes_per_block=0, enable_kv_cache_events=False, extra_config={},
        engine_id="bench", model=OffloadingModelConfig(name="bench-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False))
    spec.blocks_per_chunk = 1
    spec.kv_events_config = MagicMock(enable_kv_cache_events=False)
    return spec


def page_aligned_pool(num_slots: int, slot: int) -> torch.Tensor:
    raw = torch.empty(num_slots * slot + PAGE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE
    pool = raw[shift:shift + num_slots * slot].view(num_slots, slot)
    gen = torch.Generator().manual_seed(slot)
    pool.view(torch.int64).copy_(torch.randint(-2**62, 2**62, (num_slots, slot // 8),
                                               generator=gen, dtype=torch.int64))
    return pool


drop_caches = fs.drop_caches      # (verified_reads.py takes it from here)


def plan_jobs(total_slots: int, pool_slots: int, job_slots: int, pattern: str, seed: int):
    """[(keys, chunk_ids)]: every key once; slot of key i is i % pool_slots
    (adjacent) or a fixed permutation of it (scattered)."""
    return [job for wave in plan_waves(total_slots, pool_slots, job_slots, pattern, seed)
            for job in wave]


def plan_waves(total_slots: int, pool_slots: int, job_slots: int, pattern: str, seed: int):
    """[[(keys, chunk_ids)]]: the keys in waves of ``pool_slots`` (key i in
    wave i // pool_slots, each slot of the pool at most once per wave, at
    i % pool_slots (adjacent) or a fixed permutation of it (scattered)),
    each wave in jobs of up to ``job_slots`` keys."""
    rng = np.random.default_rng(seed)
    perm = np.arange(pool_slots) if pattern == "adjacent" else rng.permutation(pool_slots)
    waves = []
    for first in range(0, total_slots, pool_slots):
        end = min(total_slots, first + pool_slots)
        jobs = []
        for start in range(first, end, job_slots):
            idx = np.arange(start, min(end, start + job_slots))
            keys = [make_offload_key(int(i).to_bytes(8, "big") + seed.to_bytes(8, "big"), 0)
                    for i in idx]
            jobs.append((keys, perm[idx % pool_slots]))
        waves.append(jobs)
    return waves


def run_jobs(tier, jobs, promotion: bool, first_id: int) -> float:
    t0 = time.perf_counter()
    for n, (keys, ids) in enumerate(jobs):
        job = TransferJob(job_id=first_id + n, keys=keys, chunk_ids=ids,
                          is_promotion=promotion, req_context=CTX)
        (tier.submit_load if promotion else tier.submit_store)(job)
    tier.drain_jobs()
    elapsed = time.perf_counter() - t0
    results = list(tier.get_finished_jobs())
    failed = [r.job_id for r in results if not r.success]
    if len(results) != len(jobs) or failed:
        raise SystemExit(f"{type(tier).__name__}: {len(failed)} of {len(jobs)} "
                         f"{'load' if promotion else 'store'} jobs failed")
    return elapsed


def wave_mask(wave: int) -> int:
    """The int64 wave ``wave``'s slots hold XORed into every word of the base
    pool: a different one per wave, so that no two keys hold the same bytes."""
    m = ((wave + 1) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    return m - (1 << 64) if m >= 1 << 63 else m


def store_waves(tier, waves, pool: torch.Tensor, base: torch.Tensor, first_id: int = 1) -> float:
    """Store every wave, each slot holding that wave's bytes (``base`` XOR
    its mask, written in untimed); the seconds the stores took."""
    seconds = 0.0
    for w, jobs in enumerate(waves):
        torch.bitwise_xor(base.view(torch.int64), wave_mask(w), out=pool.view(torch.int64))
        seconds += run_jobs(tier, jobs, False, first_id)
        first_id += len(jobs)
    return seconds


def load_waves(tier, waves, pool: torch.Tensor, base: torch.Tensor, first_id: int,
               who: str) -> float:
    """Load every wave into a zeroed pool and check each slot holds the bytes
    of the key it was loaded for (untimed); the seconds the loads took."""
    seconds = 0.0
    for w, jobs in enumerate(waves):
        pool.zero_()
        seconds += run_jobs(tier, jobs, True, first_id)
        first_id += len(jobs)
        check_wave(pool, base, w, len(waves), jobs, who)
    return seconds


def check_wave(pool, base, wave: int, waves: int, jobs, who: str) -> None:
    ids = torch.as_tensor(np.concatenate([ids for _, ids in jobs]))
    want = torch.bitwise_xor(base[ids].view(torch.int64), wave_mask(wave))
    got = pool[ids].view(torch.int64)
    if torch.equal(got, want):
        return
    keys = [k for ks, _ in jobs for k in ks]
    row = int((got != want).any(dim=1).nonzero()[0])
    slot = int(ids[row])
    other = next((v for v in range(waves)
                  if torch.equal(got[row], torch.bitwise_xor(base[slot].view(torch.int64),
                                                             wave_mask(v)))), None)
    held = ("all zero (nothing loaded)" if not got[row].any()
            else f"the block of the key stored from it in wave {other}" if other is not None
            else "bytes no key was stored with")
    raise SystemExit(f"{who}: slot {slot}, loaded for key {keys[row]!r} (wave {wave}), holds "
                     f"{held}; {int((got != want).any(dim=1).sum())} of {len(keys)} slots "
                     "of the wave differ")


def measure(kind: str, where: str, slot: int, total_bytes: int, pool: torch.Tensor,
            contents: torch.Tensor, waves, args) -> dict:
    t0 = time.perf_counter()
    base = Path(where) / f"kvblock-vllm-bench-{os.getpid()}"
    view = memoryview(pool.numpy())
    try:
        base.mkdir(parents=True, exist_ok=True)
        target = (store_target(args.kvblock_target, base, total_bytes, args.loop_write_cache)
                  if kind == "kvblock"
                  else contextlib.nullcontext(None))
        with target as dev:
            if kind == "kvblock":
                tier = KVBlockTierManager(make_spec(), view, "kvblock", devices=[dev],
                                          threads=args.threads,
                                          max_run_bytes=args.max_run_bytes, verify=args.verify)
            else:
                tier = FileSystemTierManager(make_spec(), view, "fs", root_dir=str(base / "fs"))
            store_s, load_s, evicted, dropped = _store_and_load(
                kind, tier, pool, contents, waves, f"{kind} at {where}, slot {fmt_size(slot)}")
    finally:
        view.release()
        shutil.rmtree(base, ignore_errors=True)
    if evicted:
        raise SystemExit(f"kvblock store at {where} too small: {evicted} blocks evicted")
    return {"tier": kind, "store_gibps": total_bytes / GIB / store_s,
            "load_gibps": total_bytes / GIB / load_s, "store_s": store_s, "load_s": load_s,
            "total_s": time.perf_counter() - t0, "dropped_caches": dropped}


def fio_read_gibps(kind: str, where: str, slot: int, total_bytes: int) -> float:
    """How fast the device under kvblock's store reads: fio (io_uring,
    O_DIRECT, reads of ``slot`` bytes, 32 in flight) over ``total_bytes`` of a
    fresh file in ``where`` (``kind`` "file"), or of a loop device over one
    ("loop"), with the page cache dropped first."""
    base = Path(where) / f"kvblock-vllm-bench-fio-{os.getpid()}"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if kind == "loop":
            target = fs.loop_target(base, total_bytes)            # filled by fio
        else:
            path = base / "fio.img"
            fs.run_fio(str(path), "write", 8 << 20, 8, size=total_bytes)   # lay it out
            target = contextlib.nullcontext(str(path))
        with target as dev:
            drop_caches()
            return fs.run_fio(dev, "read", slot, 32, size=total_bytes)["gib_s"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def store_target(kind: str, base: Path, total_bytes: int, write_cache: str | None = None):
    """Context manager yielding the device path of a kvblock tier store with
    room for ``total_bytes`` of slots in directory ``base``: a pre-sized file
    (``kind`` "file") or a loop device over one ("loop", detached on exit;
    ``write_cache``: the cache mode it reports, fio_support.set_write_cache)."""
    # runs are at most 1/8 region, so at most 1/8 is lost; plus metadata
    size = total_bytes + total_bytes // 4 + (128 << 20)
    if kind == "loop":
        return fs.loop_target(base, size, fill=False, write_cache=write_cache)
    return contextlib.nullcontext(str(kvblock.create_file(base / "kv.img", size)))


def _store_and_load(kind, tier, pool, base, waves, who):
    """Store every slot, drop the page cache, load them back, each wave
    checked: (store s, load s, blocks kvblock evicted, page cache dropped?)."""
    evicted = 0
    try:
        store_s = store_waves(tier, waves, pool, base, 1)
        if kind == "kvblock":
            evicted = tier.stats()["evicted_blocks"]
        if evicted:
            return store_s, 0.0, evicted, False
        dropped = drop_caches()
        load_s = load_waves(tier, waves, pool, base, 1_000_000, who)
    finally:
        tier.shutdown()
    return store_s, load_s, evicted, dropped


def fmt_size(n: int) -> str:
    """A slot size as it is (1536 KiB, not "1 MiB"): MiB only when whole."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n % 1024 == 0 else f"{n} B"


def slot_size(text: str) -> int:
    """An argparse ``type=`` for a slot size: of whole 8-byte words (the
    pool is filled as int64) and not 0 (slots per pool divide by it)."""
    size = parse_size(fs.size_text(text))
    if size < 8 or size % 8:
        raise argparse.ArgumentTypeError(f"{text!r}: a slot is a positive multiple of 8 "
                                         "bytes, e.g. 256K or 2M")
    return size


def slot_sizes(text: str) -> list[int]:
    """An argparse ``type=`` for a comma-separated list of slot sizes."""
    got = [s.strip() for s in text.split(",") if s.strip()]
    if not got:
        raise argparse.ArgumentTypeError("none given: a comma-separated list of sizes")
    return [slot_size(s) for s in got]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.75, help="GiB stored and loaded per case")
    ap.add_argument("--slots", default="256K,2M", type=slot_sizes,
                    help="slot sizes, comma separated")
    ap.add_argument("--locations", default="disk,shm", type=fs.comma_choices(LOCATIONS),
                    help=f"comma separated, of {sorted(LOCATIONS)}")
    ap.add_argument("--pool", default="256M", type=fs.size_text,
                    help="primary pool size (slots are reused)")
    ap.add_argument("--job-slots", type=int, default=32, help="slots per TransferJob")
    ap.add_argument("--pattern", choices=("adjacent", "scattered"), default="adjacent")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                    help="kvblock tier worker threads (default: the tier's)")
    ap.add_argument("--max-run-bytes", default="16M", type=fs.size_text,
                    help="kvblock tier max_run_bytes")
    ap.add_argument("--kvblock-target", choices=("file", "loop"), default="file",
                    help="kvblock's store: a file in the location (default) or a loop "
                         "device over one (root)")
    fs.add_write_cache_option(ap)
    ap.add_argument("--verify", choices=("always", "never"), default="always",
                    help="kvblock tier verify (the fs tier checks nothing)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds per case (order alternates); medians are printed")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="threads of the script's own (untimed) torch work; more leave "
                         "OpenMP workers spinning into the timed loads (default 1)")
    ap.add_argument("--no-fio", action="store_true",
                    help="skip fio's read of the same device (the load column's ceiling)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.torch_threads < 1:
        ap.error(f"--torch-threads must be at least 1, got {args.torch_threads}")
    use_fio = not args.no_fio and shutil.which("fio") is not None
    args.loop_write_cache = fs.write_cache_arg(ap, args)
    if args.kvblock_target == "loop" and os.geteuid() != 0:
        ap.error("--kvblock-target loop needs root (losetup); run as root or pass "
                 "--kvblock-target file")
    slots = args.slots      # sizes checked by argparse: a bad one is a usage error
    locations = args.locations
    total = int(args.gib * GIB)
    rows = []

    def body():
        for loc in locations:
            where = LOCATIONS[loc]
            for slot in slots:
                pool_slots = max(1, min(parse_size(args.pool) // slot, total // slot))
                n = total // slot
                pool = page_aligned_pool(pool_slots, slot)
                base = pool.clone()
                waves = plan_waves(n, pool_slots, args.job_slots, args.pattern, seed=slot)
                samples = {"kvblock": [], "fs": []}
                for rnd in range(args.rounds):
                    # alternate the order so drift and leftovers hit both tiers alike
                    for kind in (("kvblock", "fs") if rnd % 2 == 0 else ("fs", "kvblock")):
                        samples[kind].append(measure(kind, where, slot, n * slot, pool, base,
                                                     waves, args))
                fio = (fio_read_gibps(args.kvblock_target, where, slot, n * slot) if use_fio
                       else None)
                for kind in ("kvblock", "fs"):
                    runs = samples[kind]
                    rows.append({
                        "tier": kind, "location": loc, "path": where, "slot": slot,
                        "bytes": n * slot, "fio_read_gibps": fio,
                        "store_gibps": statistics.median(r["store_gibps"] for r in runs),
                        "load_gibps": statistics.median(r["load_gibps"] for r in runs),
                        "samples": runs,
                        "dropped_caches": all(r["dropped_caches"] for r in runs)})
                del pool, base

    with fs.torch_threads(args.torch_threads):
        rc = fs.run_guarded("vllm_tier_vs_fs", body,      # detaches loop devices on SIGTERM
                            "loop devices detached" if args.kvblock_target == "loop"
                            else "store files removed")
    if rc is not None:
        return rc
    fs_impl = "C (fs_io_C)" if fs_io._HAS_FSIO_C else "pure Python (fs_io_C unavailable)"
    if args.json:
        print(json.dumps({"rows": rows, "fs_io": fs_impl, "pattern": args.pattern,
                          "verify": args.verify, "kvblock_target": args.kvblock_target,
                          "loop_write_cache": args.loop_write_cache,
                          "job_slots": args.job_slots, "threads": args.threads,
                          "torch_threads": args.torch_threads}, indent=2))
        return 0
    print(f"{args.gib:g} GiB per case, median of {args.rounds} rounds, "
          f"jobs of {args.job_slots} slots ({args.pattern}), "
          f"kvblock on a {args.kvblock_target}"
          f"{f' ({args.loop_write_cache})' if args.loop_write_cache else ''} "
          f"threads={args.threads} "
          f"max_run_bytes={args.max_run_bytes} verify={args.verify} "
          f"torch_threads={args.torch_threads}, "
          f"fs tier: 16+16 threads, I/O {fs_impl}")
    if not all(r["dropped_caches"] for r in rows):
        print("warning: could not drop the page cache (not root?): loads may hit memory")
    if use_fio:
        print(f"fio: reads of one slot, 32 in flight, O_DIRECT, of the {args.kvblock_target} "
              "kvblock's store sits on (the device's own read speed)")
    head = (f"{'where':<6} {'slot':>8} | {'kvblock store':>13} {'fs store':>9} {'ratio':>6} | "
            f"{'kvblock load':>12} {'fs load':>8} {'ratio':>6}"
            + (f" | {'fio read':>8} {'kv/fio':>6} {'fs/fio':>6}" if use_fio else "")
            + "   (GiB/s)")
    print(head)
    print("-" * len(head))
    for i in range(0, len(rows), 2):
        kv, fs_row = rows[i], rows[i + 1]
        line = (f"{kv['location']:<6} {fmt_size(kv['slot']):>8} | "
                f"{kv['store_gibps']:>13.2f} {fs_row['store_gibps']:>9.2f} "
                f"{kv['store_gibps'] / fs_row['store_gibps']:>5.2f}x | "
                f"{kv['load_gibps']:>12.2f} {fs_row['load_gibps']:>8.2f} "
                f"{kv['load_gibps'] / fs_row['load_gibps']:>5.2f}x")
        if use_fio:
            fio = kv["fio_read_gibps"]
            line += (f" | {fio:>8.2f} {kv['load_gibps'] / fio:>5.2f}x "
                     f"{fs_row['load_gibps'] / fio:>5.2f}x")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
