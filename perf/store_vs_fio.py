#!/usr/bin/env python3
"""Store save/restore vs fio sequential write/read on the same loop device.

For each target (a loop device over a file in /dev/shm, and one over a file
on disk, as in perf/vs_fio.py) runs, alternating for several rounds (the
order flips every round):

- save: ``kvblock.bench.store_bench.run_store_bench(workload="save")``: a
  fresh store, then runs of ``--run-blocks`` blocks written for ``--seconds``
  (checksums, data flush and the journal commit included; once the device is
  full every save first reclaims a region) vs fio ``rw=write``;
- restore: ``run_store_bench(workload="restore")``: whole runs read back in
  random order (checksums verified unless ``--verify never``) vs fio
  ``rw=read``, once per ``--jobs`` reader count (default 1 and 4: one run in
  flight, whose checksums are computed between runs, and ``kvblock bench``'s
  default of 4 readers, whose checksums overlap the other readers' I/O).

"Same I/O size": the store moves a run as one contiguous range of
``run_bytes`` (``--layers`` x ``--run-blocks`` blocks; 64 MiB by default;
a save writes the run's digest trailer, a few KiB after it, as an I/O of its own)
and the engine splits it into pieces of ``min(run_bytes, 8 MiB)`` with up to
``min(qd, pieces)`` of them in flight per reader (``--jobs`` readers for
restore, one writer for save).  So the device sees I/Os of the piece size,
and fio runs with ``bs`` = that piece size and ``iodepth`` = readers x pieces
in flight (one fio job, io_uring, direct=1).  fio keeps that many I/Os in
flight all the time; kvblock drains between runs (checksums, commits), which
is part of what is measured.  A restore with checksums verified reads in
512 KiB pieces instead (``IOEngine.read_hashed`` hashes each as it lands,
up to ``--qd`` in flight per reader); fio keeps the large pieces.

    .venv/bin/python perf/store_vs_fio.py                  # ~2.5 minutes, needs root
    .venv/bin/python perf/store_vs_fio.py --targets shm --rounds 3 --json
    .venv/bin/python perf/store_vs_fio.py --verify never --jobs 2

Bars (issue 3): restore >= 0.90x fio sequential read, save >= 0.85x fio
sequential write, judged on the median of the per-round ratios (each round
runs the two side by side, so drift in the machine's load cancels).
Backing files hold real data; the page cache is dropped before every run;
loop devices are always detached, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support as fs  # noqa: E402
from vs_fio import human, log, parse_size  # noqa: E402

MIB = 1 << 20
BARS = {"save": 0.85, "restore": 0.90}
FIO_RW = {"save": "write", "restore": "read"}
TARGETS = ("shm", "disk")


def io_shape(run_bytes: int, qd: int, readers: int,
             hashed: bool = False) -> tuple[int, int, int]:
    """(piece size, pieces per run, I/Os in flight) of one run moved by the
    engine; ``hashed``: a read with checksums verified (read_hashed's pieces)."""
    from kvblock.io.batch import DEFAULT_MAX_IO
    from kvblock.io.engine import HASH_PIECE

    piece = min(run_bytes, HASH_PIECE if hashed else DEFAULT_MAX_IO)
    pieces = math.ceil(run_bytes / piece)
    return piece, pieces, readers * min(qd, pieces)


def measure(dev: str, workload: str, jobs: int, geometry, args) -> list[dict]:
    """``args.rounds`` alternating fio/kvblock pairs for one workload."""
    from kvblock.bench.store_bench import run_store_bench

    in_flight = io_shape(args.run_bytes, args.qd, jobs)[2]
    rounds = []
    for r in range(args.rounds):
        got = {}
        for tool in (("fio", "kvblock") if r % 2 == 0 else ("kvblock", "fio")):
            fs.drop_caches()
            if tool == "fio":
                got["fio"] = fs.run_fio(dev, FIO_RW[workload], args.piece, in_flight,
                                        size=args.size, seconds=args.seconds,
                                        extra=args.fio_args)
            else:
                res = run_store_bench(dev, workload, geometry, args.run_blocks, args.seconds,
                                      verify=args.verify, jobs=jobs, qd=args.qd)
                got["kvblock"] = {"gib_s": res["gib_per_s"], "p50_ms": res["p50_us"] / 1e3,
                                  "p99_ms": res["p99_us"] / 1e3, "engine": res["engine"],
                                  "run_bytes": res["bs"]}
        log(f"    round {r + 1}/{args.rounds}: fio {got['fio']['gib_s']:.3f} GiB/s, "
            f"kvblock {got['kvblock']['gib_s']:.3f} GiB/s "
            f"({got['kvblock']['gib_s'] / got['fio']['gib_s']:.3f}x)")
        rounds.append(got)
    return rounds


def summarize(target: str, workload: str, jobs: int, rounds: list[dict], args) -> dict:
    fio = statistics.median(r["fio"]["gib_s"] for r in rounds)
    kvb = statistics.median(r["kvblock"]["gib_s"] for r in rounds)
    # The ratio of the medians, and the median of the per-round (side by side) ratios.
    ratio = kvb / fio if fio else 0.0
    paired = statistics.median(r["kvblock"]["gib_s"] / r["fio"]["gib_s"] for r in rounds)
    bar = BARS[workload]
    kvb_shape = io_shape(args.run_bytes, args.qd, jobs,
                         hashed=workload == "restore" and args.verify == "always")
    return {
        "target": target, "workload": workload,
        "fio_rw": FIO_RW[workload], "run_bytes": rounds[0]["kvblock"]["run_bytes"],
        "io_size": args.piece, "in_flight": io_shape(args.run_bytes, args.qd, jobs)[2],
        "kvblock_io_size": kvb_shape[0], "kvblock_in_flight": kvb_shape[2],
        "jobs": jobs, "qd": args.qd,
        "verify": args.verify if workload == "restore" else "-",
        "fio_gib_s": round(fio, 4), "kvblock_gib_s": round(kvb, 4),
        "ratio": round(ratio, 4), "paired_ratio": round(paired, 4),
        "bar": bar, "ok": paired >= bar,
        "kvblock_run_p50_ms": round(statistics.median(r["kvblock"]["p50_ms"] for r in rounds), 2),
        "rounds": len(rounds),
        "fio_rounds_gib_s": [round(r["fio"]["gib_s"], 4) for r in rounds],
        "kvblock_rounds_gib_s": [round(r["kvblock"]["gib_s"], 4) for r in rounds],
        "engine": rounds[0]["kvblock"]["engine"],
    }


def print_table(results: list[dict], args, geometry) -> None:
    head = ("target", "workload", "fio rw", "I/O size", "in flight", "fio GiB/s",
            "kvblock GiB/s", "kvb/fio", "paired", "bar", "run p50 ms")
    rows = [(r["target"], r["workload"] + (f" {r['jobs']} reader{'s' if r['jobs'] > 1 else ''} "
                                             f"verify={r['verify']}"
                                             if r["workload"] == "restore" else ""),
             r["fio_rw"], human(r["io_size"]), str(r["in_flight"]), f"{r['fio_gib_s']:.3f}",
             f"{r['kvblock_gib_s']:.3f}", f"{r['ratio']:.3f}", f"{r['paired_ratio']:.3f}",
             f">={r['bar']:.2f} {'ok' if r['ok'] else 'LOW'}", f"{r['kvblock_run_p50_ms']:.1f}")
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 3 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    print(f"store save/restore vs fio: medians of {args.rounds} alternating rounds, "
          f"{args.seconds:g} s each, {human(args.size)} loop devices; runs of "
          f"{args.run_blocks} blocks ({geometry.describe()}) = {human(args.run_bytes)} per "
          f"run, one contiguous I/O split into {human(args.piece)} pieces (verified "
          f"restores: {human(io_shape(args.run_bytes, args.qd, 1, True)[0])}); kvblock engine "
          f"{results[0]['engine']}, qd {args.qd}; fio io_uring "
          f"direct=1 bs={human(args.piece)}"
          f"{' ' + ' '.join(args.fio_args) if args.fio_args else ''}")
    print(line(head))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))
    print("kvb/fio: ratio of the medians; paired: median of the per-round (side by side) "
          "ratios, which the bars use")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=1 << 30,
                   help="bytes per backing file / loop device (default 1G)")
    p.add_argument("--seconds", type=float, default=1.5, help="per run (default 1.5)")
    p.add_argument("--rounds", type=int, default=5, help="fio/kvblock pairs per case (default 5)")
    p.add_argument("--targets", default="shm,disk",
                   help="comma list of shm (file in /dev/shm) and disk (default shm,disk)")
    p.add_argument("--workloads", default="save,restore",
                   help="comma list of save and restore (default both)")
    p.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="kv heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--run-blocks", type=int, default=32, help="blocks per run (default 32)")
    p.add_argument("--qd", type=int, default=32, help="engine queue depth (default 32)")
    p.add_argument("--jobs", default="1,4", type=lambda s: [int(j) for j in s.split(",") if j],
                   help="restore: comma list of reader counts, one case each (default 1,4: "
                        "one run in flight at a time, and kvblock bench's default of 4)")
    p.add_argument("--verify", choices=("always", "never"), default="always",
                   help="restore: check data checksums (default always)")
    p.add_argument("--disk-dir", type=Path, default=fs.DISK_DIR,
                   help=f"folder for the disk target's backing file (default {fs.DISK_DIR})")
    p.add_argument("--fio-args", type=shlex.split, default=(),
                   help="extra fio options, given with '=': --fio-args='--fixedbufs'")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--check", action="store_true", help="exit 1 when a case is below its bar")
    args = p.parse_args(argv)

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or any(t not in TARGETS for t in targets):
        p.error(f"--targets: choose from {', '.join(TARGETS)} (got {args.targets!r})")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or any(w not in BARS for w in workloads):
        p.error(f"--workloads: choose from save, restore (got {args.workloads!r})")
    if args.rounds < 1 or args.seconds <= 0 or not args.jobs or min(args.jobs) < 1 \
            or args.qd < 1:
        p.error("--rounds, --seconds, --jobs and --qd must be positive")
    if args.size % MIB:
        p.error("--size must be a multiple of 1 MiB")

    if args.run_blocks < 1:
        p.error("--run-blocks must be positive")
    from kvblock.errors import ConfigError
    from kvblock.layout import Geometry, RunLayout

    try:      # a model size below 1: a usage error here, not a traceback
        geometry = Geometry(args.layers, args.kv_heads, args.head_dim, "bfloat16",
                            args.block_tokens)
    except ConfigError as e:
        p.error(f"--layers, --kv-heads, --head-dim, --block-tokens: {e}")
    # the run's data, one range on the device: its digest trailer (a few KiB
    # after it) is an I/O of its own, which a whole-run get does not read
    args.run_bytes = RunLayout(geometry, args.run_blocks, 4096).data_bytes
    args.piece = io_shape(args.run_bytes, args.qd, 1)[0]
    cases = [(w, j) for w in workloads for j in (args.jobs if w == "restore" else [1])]
    ok, why = fs.prerequisites()
    if not ok:
        print(f"store_vs_fio: {why}", file=sys.stderr)
        return 2

    dirs = {"shm": fs.SHM, "disk": args.disk_dir}
    results = []
    t0 = time.monotonic()

    def body():
        for target, dev in fs.attached_targets(targets, dirs, args.size):
            for workload, jobs in cases:
                log(f"  {target} {dev}: {workload} ({jobs} thread{'s' if jobs > 1 else ''}):"
                    f" runs of {human(args.run_bytes)}, fio {FIO_RW[workload]} "
                    f"bs={human(args.piece)} "
                    f"iodepth={io_shape(args.run_bytes, args.qd, jobs)[2]}")
                rounds = measure(dev, workload, jobs, geometry, args)
                results.append(summarize(target, workload, jobs, rounds, args))

    rc = fs.run_guarded("store_vs_fio", body)
    if rc is not None:
        return rc
    log(f"done in {time.monotonic() - t0:.0f} s")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results, args, geometry)
    if args.check and not all(r["ok"] for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
