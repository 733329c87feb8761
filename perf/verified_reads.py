#!/usr/bin/env python3
"""What verifying checksums costs a load, and what hashing as reads land buys.

Stores ``--gib`` GiB of ``--slot`` slots through kvblock's vLLM tier (the
way perf/vllm_tier_vs_fs.py drives it), then loads them back ``--rounds``
times in each of three modes, their order rotated round by round:

- ``as-they-land``: checksums verified, the engine reads in 512 KiB pieces
  and the C core hashes each piece once it and those before it have arrived
  (``IOEngine.read_hashed``, the default);
- ``after-read``: checksums verified, the whole read first, then the hash
  (how kvblock verified before; the engine's ``hashes_as_reads_land`` off);
- ``unverified``: ``verify="never"``.

With ``KVBLOCK_IO_ENGINE=threads`` the first mode makes that engine's C
workers take turns at the in-order hash cursor (not its default).  A store
file on tmpfs (the default ``--where /dev/shm``) is read through a shared
mapping, which hashes each chunk as it copies it whatever the mode says;
``KVBLOCK_MAPPED_READS=never`` measures the engine's own reads there.

The page cache is dropped before every load.  The primary pool (``--pool``)
is smaller than the data, so keys are stored and loaded in waves of one pool
(perf/vllm_tier_vs_fs.py says how), each key's bytes its own, and every
wave's loaded slots are checked (untimed) to hold their keys' bytes.  Prints
the median GiB/s of each mode.

    .venv/bin/python perf/verified_reads.py --target loop --threads 1
    .venv/bin/python perf/verified_reads.py --where /var/tmp --threads 8
    .venv/bin/python perf/verified_reads.py --target loop --pieces 256K,512K,1M,2M
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fio_support  # noqa: E402
import vllm_tier_vs_fs as vt  # noqa: E402

from kvblock.cli.units import parse_size  # noqa: E402
from kvblock.integrations.vllm import KVBlockTierManager  # noqa: E402
from kvblock.io import engine as engine_mod  # noqa: E402

GIB = 1 << 30


def modes(pieces: list[int]) -> dict:
    """mode name -> (verify, hash as reads land, hash piece bytes)."""
    out = {}
    for p in pieces:
        name = "as-they-land" + (f" {p >> 10}K" if len(pieces) > 1 else "")
        out[name] = ("always", True, p)
    out["after-read"] = ("always", False, engine_mod.HASH_PIECE)
    out["unverified"] = ("never", True, engine_mod.HASH_PIECE)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--where", default="/dev/shm", help="directory of the store file")
    ap.add_argument("--target", choices=("file", "loop"), default="file",
                    help="the store file itself, or a loop device over it (root)")
    ap.add_argument("--slot", default="2M", type=vt.slot_size, help="slot size")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--pool", default="256M", type=fio_support.size_text,
                    help="primary pool size (slots are reused)")
    ap.add_argument("--threads", type=int, default=8, help="tier worker threads")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="threads of the script's own (untimed) torch work "
                         "(fio_support.torch_threads says why 1)")
    ap.add_argument("--pieces", default=f"{engine_mod.HASH_PIECE >> 10}K",
                    type=fio_support.comma_sizes,
                    help="hash piece sizes to try for as-they-land, comma separated")
    args = ap.parse_args(argv)
    if args.torch_threads < 1:
        ap.error(f"--torch-threads must be at least 1, got {args.torch_threads}")
    mode_table = modes(args.pieces)     # sizes checked by argparse
    if args.target == "loop" and os.geteuid() != 0:
        ap.error("--target loop needs root (losetup)")
    slot, total = args.slot, int(args.gib * GIB)
    pool_slots, n = max(1, min(parse_size(args.pool) // slot, total // slot)), total // slot
    pool = vt.page_aligned_pool(pool_slots, slot)
    contents = pool.clone()
    waves = vt.plan_waves(n, pool_slots, 32, "adjacent", seed=slot)
    base = Path(args.where) / f"kvblock-verified-reads-{os.getpid()}"
    samples = {m: [] for m in mode_table}
    engine_name = None
    hash_piece = engine_mod.HASH_PIECE

    def body():
        nonlocal engine_name
        base.mkdir(parents=True, exist_ok=True)
        view = memoryview(pool.numpy())
        try:
            with vt.store_target(args.target, base, n * slot) as dev:
                tier = KVBlockTierManager(vt.make_spec(), view, "kvblock", devices=[dev],
                                          threads=args.threads)
                try:
                    vt.store_waves(tier, waves, pool, contents, 1)
                    engine = tier.store.io.engine
                    job_id = 1_000_000
                    names = list(mode_table)
                    for rnd in range(args.rounds):
                        # rotate the order so drift and leftovers hit every mode alike
                        for mode in names[rnd % len(names):] + names[:rnd % len(names)]:
                            verify, as_they_land, piece = mode_table[mode]
                            tier.store.verify = verify
                            engine.hashes_as_reads_land = as_they_land
                            engine_mod.HASH_PIECE = piece
                            vt.drop_caches()
                            elapsed = vt.load_waves(tier, waves, pool, contents, job_id, mode)
                            job_id += sum(map(len, waves))
                            samples[mode].append(n * slot / GIB / elapsed)
                    engine_name = engine.name
                finally:
                    tier.shutdown()
        finally:
            # the rotation may end on another piece size: the module's as it was
            # (a caller may run us in-process)
            engine_mod.HASH_PIECE = hash_piece
            view.release()
            shutil.rmtree(base, ignore_errors=True)

    # Under run_guarded as the other loop-device scripts: a SIGTERM or SIGHUP
    # unwinds through the finally blocks that detach the loop device (--target
    # loop) and remove the store's folder, where it killed the process on the spot.
    with fio_support.torch_threads(args.torch_threads):
        rc = fio_support.run_guarded("verified_reads", body,
                                     "loop device detached" if args.target == "loop"
                                     else "store file removed")
    if rc is not None:
        return rc
    print(f"{args.gib:g} GiB of {vt.fmt_size(slot)} slots on a {args.target} in {args.where}, "
          f"{args.threads} tier threads, engine {engine_name}, median of {args.rounds} "
          "rotating rounds (GiB/s)")
    for mode, xs in samples.items():
        print(f"  {mode:<18} {statistics.median(xs):6.2f}   "
              f"[{', '.join(f'{x:.2f}' for x in xs)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
