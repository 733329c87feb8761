#!/usr/bin/env python3
"""kvblock vs fio: the same I/O pattern on the same loop device, side by side.

For each target (a loop device over a file in /dev/shm, which stresses
software overhead, and one over a file on disk) and each case, runs fio
(ioengine=io_uring, direct=1) and kvblock (kvblock.bench.raw.run_raw) with the
same workload, block size, queue depth and duration, alternating the two for
several rounds (the order flips every round so drift hits both), and prints
the medians and the kvblock/fio ratio.  Needs root (losetup, drop_caches).

    .venv/bin/python perf/vs_fio.py                       # ~2-3 minutes
    .venv/bin/python perf/vs_fio.py --targets shm --rounds 5 --json
    .venv/bin/python perf/vs_fio.py --writes              # also write cases
    .venv/bin/python perf/vs_fio.py --fio-args='--fixedbufs --registerfiles'

Backing files hold real data (written once with fio) so reads do real I/O;
the page cache is dropped before every run.  Loop devices are always
detached, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support as fs  # noqa: E402

MIB = 1 << 20
# workload -> (default block size, kvblock/fio bar or None)
CASES = {
    "read": (1 * MIB, 0.95),
    "randread": (64 << 10, 0.90),
    "write": (1 * MIB, None),
    "randwrite": (64 << 10, None),
}
TARGETS = ("shm", "disk")


def parse_size(text: str) -> int:
    from kvblock.cli.units import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_case(text: str) -> tuple[str, int, int | None]:
    """``workload[:bs[:qd]]``, e.g. ``randread``, ``randread:4K:64``."""
    parts = text.split(":")
    if parts[0] not in CASES or len(parts) > 3:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use workload[:bs[:qd]] with workload one of {', '.join(CASES)}")
    bs = parse_size(parts[1]) if len(parts) > 1 else CASES[parts[0]][0]
    qd = int(parts[2]) if len(parts) > 2 else None
    # refused here, not by fio or kvblock once a loop device is filled
    if bs < 1 or (qd is not None and qd < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: bs and qd must be positive")
    return parts[0], bs, qd


def human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", MIB), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(dev: str, workload: str, bs: int, qd: int, args) -> list[dict]:
    """``args.rounds`` alternating fio/kvblock pairs; one dict per round."""
    from kvblock.bench.raw import run_raw

    rounds = []
    for r in range(args.rounds):
        got = {}
        order = ("fio", "kvblock") if r % 2 == 0 else ("kvblock", "fio")
        for tool in order:
            fs.drop_caches()
            if tool == "fio":
                got["fio"] = fs.run_fio(dev, workload, bs, qd, size=args.size,
                                        seconds=args.seconds, extra=args.fio_args)
            else:
                res = run_raw(dev, workload, bs, qd, args.seconds, size=args.size)
                got["kvblock"] = {"gib_s": res.gib_per_s, "iops": res.iops,
                                  "p50_us": res.p50_us, "p99_us": res.p99_us,
                                  "engine": res.engine}
        log(f"    round {r + 1}/{args.rounds}: fio {got['fio']['gib_s']:.3f} GiB/s, "
            f"kvblock {got['kvblock']['gib_s']:.3f} GiB/s "
            f"({got['kvblock']['gib_s'] / got['fio']['gib_s']:.3f}x)")
        rounds.append(got)
    return rounds


def summarize(target: str, workload: str, bs: int, qd: int, rounds: list[dict]) -> dict:
    med = {tool: {k: statistics.median(r[tool][k] for r in rounds)
                  for k in ("gib_s", "p99_us", "p50_us", "iops")}
           for tool in ("fio", "kvblock")}
    ratio = med["kvblock"]["gib_s"] / med["fio"]["gib_s"] if med["fio"]["gib_s"] else 0.0
    bar = CASES[workload][1] if (bs, qd) == (CASES[workload][0], 32) else None
    return {
        "target": target, "workload": workload, "bs": bs, "qd": qd,
        "fio_gib_s": round(med["fio"]["gib_s"], 4),
        "kvblock_gib_s": round(med["kvblock"]["gib_s"], 4),
        "ratio": round(ratio, 4),
        "fio_p99_us": round(med["fio"]["p99_us"], 1),
        "kvblock_p99_us": round(med["kvblock"]["p99_us"], 1),
        "fio_p50_us": round(med["fio"]["p50_us"], 1),
        "kvblock_p50_us": round(med["kvblock"]["p50_us"], 1),
        "bar": bar,
        "ok": None if bar is None else ratio >= bar,
        "rounds": len(rounds),
        "fio_rounds_gib_s": [round(r["fio"]["gib_s"], 4) for r in rounds],
        "kvblock_rounds_gib_s": [round(r["kvblock"]["gib_s"], 4) for r in rounds],
        "engine": rounds[0]["kvblock"]["engine"],
    }


def print_table(results: list[dict], args) -> None:
    head = ("target", "workload", "bs", "qd", "fio GiB/s", "kvblock GiB/s", "kvb/fio",
            "bar", "fio p99 us", "kvb p99 us")
    rows = [(r["target"], r["workload"], human(r["bs"]), str(r["qd"]), f"{r['fio_gib_s']:.3f}",
             f"{r['kvblock_gib_s']:.3f}", f"{r['ratio']:.3f}",
             "-" if r["bar"] is None else f">={r['bar']:.2f} {'ok' if r['ok'] else 'LOW'}",
             f"{r['fio_p99_us']:.0f}", f"{r['kvblock_p99_us']:.0f}") for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    print(f"kvblock vs fio: medians of {args.rounds} alternating rounds, {args.seconds:g} s "
          f"each, {human(args.size)} loop devices (kvblock engine: {results[0]['engine']}; "
          f"fio io_uring direct=1{' ' + ' '.join(args.fio_args) if args.fio_args else ''})")
    print(line(head))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=1 << 30,
                   help="bytes per backing file / loop device (default 1G)")
    p.add_argument("--seconds", type=float, default=2.0, help="per run (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="fio/kvblock pairs per case (default 5)")
    p.add_argument("--targets", default="shm,disk",
                   help="comma list of shm (file in /dev/shm) and disk (default shm,disk)")
    p.add_argument("--cases", default="read,randread", type=lambda s: [
        parse_case(c) for c in s.split(",") if c],
        help="comma list of workload[:bs[:qd]] (workloads: read randread write randwrite; "
             "default read,randread = 1M sequential and 64K random reads)")
    p.add_argument("--writes", action="store_true",
                   help="also run the write cases (1M write, 64K randwrite; overwrite the "
                        "scratch files only)")
    p.add_argument("--qd", type=int, default=32, help="queue depth unless a case sets one")
    p.add_argument("--disk-dir", type=Path, default=fs.DISK_DIR,
                   help=f"folder for the disk target's backing file (default {fs.DISK_DIR})")
    p.add_argument("--fio-args", type=shlex.split, default=(),
                   help="extra fio options, given with '=': --fio-args='--fixedbufs --registerfiles' "
                        "(default: none, fio's io_uring defaults)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a case with a bar is below it")
    args = p.parse_args(argv)

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        p.error(f"--targets: choose from {', '.join(TARGETS)} (got {args.targets!r})")
    if args.rounds < 1 or args.seconds <= 0 or args.qd < 1:
        p.error("--rounds, --seconds and --qd must be positive")
    if args.size % MIB:
        p.error("--size must be a multiple of 1 MiB")
    cases = [(w, bs, qd or args.qd) for w, bs, qd in args.cases]
    if args.writes:
        cases += [(w, CASES[w][0], args.qd) for w in ("write", "randwrite")
                  if not any(c[0] == w for c in cases)]
    ok, why = fs.prerequisites()
    if not ok:
        print(f"vs_fio: {why}", file=sys.stderr)
        return 2

    dirs = {"shm": fs.SHM, "disk": args.disk_dir}
    results = []
    t0 = time.monotonic()

    def body():
        for target, dev in fs.attached_targets(targets, dirs, args.size):
            for workload, bs, qd in cases:
                log(f"  {target} {dev}: {workload} bs={human(bs)} qd={qd}")
                rounds = measure(dev, workload, bs, qd, args)
                results.append(summarize(target, workload, bs, qd, rounds))

    rc = fs.run_guarded("vs_fio", body)
    if rc is not None:
        return rc
    log(f"done in {time.monotonic() - t0:.0f} s")
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results, args)
    if args.check and any(r["ok"] is False for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
