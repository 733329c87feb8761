"""Shared by perf/vs_fio.py and perf/test_raw_io.py: loop-device targets over
files filled with real data, fio runs parsed from its JSON, cache dropping.

Every loop device is attached with ``losetup -f --show --direct-io=on`` and
detached in a ``finally`` (together with any other loop device that ended up
on the same backing file, so an interrupt between attach and bookkeeping
cannot leak one); backing files are removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

GIB = 1 << 30
SHM = Path("/dev/shm")
# The repository's scratch folder (git-ignored): a file on the real disk.
DISK_DIR = Path(__file__).resolve().parent.parent / ".kvblock" / "perf"
PREFIX = "kvblock-vsfio-"


def prerequisites() -> tuple[bool, str]:
    """(ok, reason): can this process make loop devices and run fio?"""
    if os.geteuid() != 0:
        return False, "needs root (losetup for loop devices, drop_caches)"
    for tool in ("fio", "losetup"):
        if shutil.which(tool) is None:
            pkg = "fio" if tool == "fio" else "util-linux"
            return False, f"{tool} not installed (apt-get install {pkg})"
    return True, ""


def drop_caches() -> bool:
    """Write back and drop the page cache so reads reach the device; False
    when it could not be dropped (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def torch_threads(n: int):
    """torch on ``n`` threads while a script runs, then as it was.  A
    script's own torch work (pools written, zeroed and checked) is untimed,
    but torch's OpenMP workers busy-wait for a few ms after each op
    (libgomp's active wait) into the timed loads: on the 2-core VM, a core the
    backends and the loop device's worker lacked (1 thread: kvblock's vLLM
    tier loads 15-27% faster, the fs tier's 11-19%, in one process side by
    side)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fio_round(dev: str, rw: str, bs: int, qd: int, **kw) -> dict:
    """run_fio as a pytest-benchmark ``setup`` before a timed kvblock round:
    the page cache dropped before fio and again after it, so that both
    sides start right after a drop.  The timed round used to start as fio's
    process ended: on this VM a layer-wise restore then ran at 5.3-7.2
    GiB/s, and at 8.7-11 after a drop_caches (fio 12-13 either way)."""
    drop_caches()
    result = run_fio(dev, rw, bs, qd, **kw)
    drop_caches()
    return result


def _losetup(*args: str, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["losetup", *args], capture_output=True, text=True, check=check)


def attached_to(path: Path | str) -> list[str]:
    """Loop devices whose backing file is ``path``."""
    out = _losetup("-j", str(path), check=False).stdout
    return [line.split(":", 1)[0] for line in out.splitlines() if line.strip()]


def detach(dev: str) -> None:
    # udev may still hold the device for a moment after fio or kvblock closed it.
    for _ in range(40):
        if _losetup("-d", dev, check=False).returncode == 0:
            return
        time.sleep(0.05)
    _losetup("-d", dev)


def direct_io_enabled(dev: str) -> bool | None:
    p = Path("/sys/block") / Path(dev).name / "loop" / "dio"
    try:
        return p.read_text().strip() == "1"
    except OSError:
        return None


@contextlib.contextmanager
def loop_target(directory: Path, size: int, *, fill: bool = True,
                write_cache: str | None = None) -> Iterator[str]:
    """A loop device (direct I/O on) over a fresh ``size``-byte file in
    ``directory`` holding real written data; detached and removed on exit.
    ``write_cache`` (one of WRITE_CACHE_MODES) sets the cache mode the device
    reports (see set_write_cache), and the mode it found is set back before
    the device is detached: the kernel keeps the setting for the loop minor,
    so the next loop device there would report it too."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=PREFIX, suffix=".img", dir=directory)
    path = Path(name)
    found = None           # (device, the cache mode it reported) once we change it
    try:
        os.ftruncate(fd, size)
        os.close(fd)
        fd = -1
        dev = _losetup("-f", "--show", "--direct-io=on", str(path)).stdout.strip()
        if write_cache is not None:
            found = (dev, write_cache_of(dev))
            set_write_cache(dev, write_cache)
        if fill:
            fill_device(dev, size)
        yield dev
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            try:
                if found is not None:
                    set_write_cache(*found)
            finally:
                for dev in attached_to(path):
                    detach(dev)
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


# The cache modes a block device reports (/sys/block/*/queue/write_cache).
# A loop device reports "write back" (a volatile cache: the kernel sends it
# flushes, and the loop driver fsyncs its backing file for each; over a disk
# file on this VM that makes the host write its cache to disk).  A drive without
# a volatile cache (NVMe's VWC bit clear, as on many datacenter drives with
# power-loss protection) reports "write through", and the kernel then
# completes flushes without sending them.  Setting "write
# through" on a loop device makes it report what such a drive reports: its
# flushes stop costing, and stop making anything durable.  The kernel keeps
# the setting for the loop minor across detach and attach.
WRITE_CACHE_MODES = ("write back", "write through")
WRITE_CACHE_CHOICES = tuple(m.replace(" ", "-") for m in WRITE_CACHE_MODES)   # on a command line


WRITE_CACHE_HELP = ("with the loop target: the cache mode the loop device reports (default: "
                    "the kernel's, write-back; write-through is what a drive without a volatile "
                    "cache reports, and makes flushes free and nothing durable here)")


def add_write_cache_option(ap) -> None:
    """The comparisons' --loop-write-cache option (see WRITE_CACHE_MODES)."""
    ap.add_argument("--loop-write-cache", choices=WRITE_CACHE_CHOICES, default=None,
                    help=WRITE_CACHE_HELP)


def write_cache_arg(ap, args) -> str | None:
    """--loop-write-cache as the kernel spells it (None: leave the device's);
    refused without the loop target."""
    if args.loop_write_cache and args.kvblock_target != "loop":
        ap.error("--loop-write-cache needs --kvblock-target loop")
    return args.loop_write_cache and args.loop_write_cache.replace("-", " ")


def comma_choices(choices):
    """An argparse ``type=`` for a comma-separated list of ``choices``: a
    value outside them is a usage error naming the option, not a KeyError."""
    import argparse

    def parse(text: str) -> list[str]:
        got = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in got if s not in choices]
        if bad or not got:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, bad)) or 'none given'}: choose from "
                f"{', '.join(sorted(choices))}")
        return got
    return parse


def size_text(text: str) -> str:
    """An argparse ``type=`` for a byte size (64K, 2M, 1G): the text as
    given, once it parses; a value that is no size is a usage error naming
    the option, not a ValueError traceback when the script gets to it."""
    import argparse

    from kvblock.units import parse_size
    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def comma_sizes(text: str) -> list[int]:
    """An argparse ``type=`` for a comma-separated list of byte sizes: their
    values in bytes; a bad or empty list is a usage error naming the option."""
    import argparse

    from kvblock.units import parse_size
    got = [s.strip() for s in text.split(",") if s.strip()]
    if not got:
        raise argparse.ArgumentTypeError("none given: a comma-separated list of sizes")
    return [parse_size(size_text(s)) for s in got]


def _write_cache_file(dev: str) -> Path:
    return Path(f"/sys/block/{Path(dev).name}/queue/write_cache")


def write_cache_of(dev: str) -> str:
    """The cache mode block device ``dev`` reports."""
    return _write_cache_file(dev).read_text().strip()


def set_write_cache(dev: str, mode: str) -> None:
    """Make block device ``dev`` report cache mode ``mode`` (root)."""
    if mode not in WRITE_CACHE_MODES:
        raise ValueError(f"write cache mode {mode!r}: one of {WRITE_CACHE_MODES}")
    _write_cache_file(dev).write_text(mode)


def fill_device(dev: str, size: int) -> None:
    """Write every byte once (sequential, fresh random buffers), so reads of
    the backing file are real reads, not holes or unwritten extents."""
    subprocess.run(["fio", "--name=fill", f"--filename={dev}", "--ioengine=io_uring",
                    "--direct=1", "--rw=write", "--bs=1M", "--iodepth=32", f"--size={size}",
                    "--refill_buffers", "--end_fsync=1", "--output-format=json"],
                   check=True, capture_output=True, text=True)


def run_fio(dev: str, rw: str, bs: int, qd: int, *, size: int, seconds: float | None = None,
            io_size: int | None = None, extra: tuple[str, ...] = ()) -> dict:
    """One fio job (io_uring, O_DIRECT, fio's other defaults) on ``dev``.

    Time-based when ``seconds`` is given, else it moves ``io_size`` bytes;
    ``extra`` options (e.g. ``--fixedbufs``) go last.
    Returns gib_s, iops, and total (submit-to-completion) latency p50/p99 in
    microseconds, the span kvblock's latencies cover too.
    """
    cmd = ["fio", "--name=vsfio", f"--filename={dev}", "--ioengine=io_uring", "--direct=1",
           f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", f"--size={size}",
           "--norandommap", "--lat_percentiles=1",
           "--output-format=json"]
    if seconds is not None:
        cmd += ["--time_based", f"--runtime={max(1, round(seconds * 1000))}ms"]
    if io_size is not None:
        cmd += [f"--io_size={io_size}"]
    cmd += list(extra)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    # fio may print warnings before the JSON document.
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if "write" in rw else "read"]
    if job.get("error"):
        raise RuntimeError(f"fio {rw} on {dev} failed: error {job['error']}")
    lat = side.get("lat_ns", {}).get("percentile") or side["clat_ns"]["percentile"]
    return {"gib_s": side["bw_bytes"] / GIB, "iops": side["iops"],
            "p50_us": lat["50.000000"] / 1000.0, "p99_us": lat["99.000000"] / 1000.0,
            "seconds": side["runtime"] / 1000.0, "bytes": side["io_bytes"]}


def run_guarded(prog: str, body, cleaned: str = "loop devices detached") -> int | None:
    """Run ``body()`` so that Ctrl-C, SIGTERM and SIGHUP unwind through the
    finally blocks that detach loop devices (SIGINT too when a shell started us
    with it ignored), and a failing fio/losetup or a ConfigError from kvblock
    (a run larger than the store's regions) becomes one line on stderr.
    ``cleaned`` ends that line: what body's finally blocks clean up (a script
    with no loop device says what it removes instead).
    Returns None on success, else the exit code (130 interrupted, 2 refused
    by kvblock, 1 failed)."""
    import signal
    import sys

    from kvblock.errors import ConfigError

    def stop(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        body()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {cleaned}", file=sys.stderr)
        return 130
    except ConfigError as e:
        # what kvblock refuses once a device is there (a run larger than the
        # store's regions): its message is the fix, not a traceback
        print(f"{prog}: {e}; {cleaned}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()[-3:]
        print(f"{prog}: {e.cmd[0]} exited with status {e.returncode}"
              f"{': ' + ' / '.join(tail) if tail else ''}; {cleaned}",
              file=sys.stderr)
        return 1
    finally:
        for sig, handler in old.items():     # as they were (a caller may run us in-process)
            signal.signal(sig, handler)
    return None


def benchmark_skip_reason() -> str | None:
    """Why the side-by-side fio benchmarks cannot run here (None: they can)."""
    ok, why = prerequisites()
    if not ok:
        return why
    if not SHM.is_dir():
        return "/dev/shm is missing"
    from kvblock.io import io_engine

    if io_engine() != "uring":
        return ("io_uring unavailable here (fio would run io_uring, kvblock its threads "
                "fallback)")
    return None


def attached_targets(targets, dirs: dict, size: int,
                     write_cache: str | None = None) -> Iterator[tuple[str, str]]:
    """For each target name, fill a ``size``-byte backing file in ``dirs[name]``,
    attach it and yield (name, loop device); detached after each."""
    import sys

    for target in targets:
        print(f"{target}: filling a {size >> 20} MiB file in {dirs[target]} ...",
              file=sys.stderr, flush=True)
        with loop_target(dirs[target], size, write_cache=write_cache) as dev:
            if direct_io_enabled(dev) is False:
                print(f"  warning: {dev} runs without direct I/O on its backing file",
                      file=sys.stderr, flush=True)
            yield target, dev
