"""pytest-benchmark (group "raw-io"): kvblock reads vs fio on a /dev/shm loop device.

    .venv/bin/python -m pytest perf/ --benchmark-only        # or: make bench

Each benchmark round reads a fixed amount (IO_BYTES) through kvblock's engine
in one batch, at the case's queue depth; before every round (pedantic ``setup``) fio moves the
same amount with the same pattern on the same device, so the two alternate.
``extra_info`` records fio's median GiB/s (of its runs before the kept
rounds, not the warm-up's), kvblock's (from the benchmark's
median time), their ratio and both p99 latencies.  Timings on a shared machine
are noisy; perf/vs_fio.py is the longer side-by-side comparison.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support as fs  # noqa: E402

MIB = 1 << 20
DEVICE_BYTES = 512 * MIB  # the /dev/shm backing file (fits a small VM)
IO_BYTES = 2 << 30        # moved per round: several passes over the device

ROUNDS = 5

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def shm_loop():
    why = fs.benchmark_skip_reason()
    if why:
        pytest.skip(f"kvblock-vs-fio benchmarks: {why}")
    with fs.loop_target(fs.SHM, DEVICE_BYTES) as dev:
        yield dev


def _offsets(workload: str, bs: int) -> np.ndarray:
    n = IO_BYTES // bs
    slots = DEVICE_BYTES // bs
    if workload == "randread":
        idx = np.random.default_rng(0).integers(0, slots, n, dtype=np.uint64)
    else:
        idx = np.arange(n, dtype=np.uint64) % np.uint64(slots)
    return idx * np.uint64(bs)


CASES = [("read", 64 << 10, 32), ("read", 256 << 10, 32), ("read", 1 * MIB, 32),
         ("randread", 64 << 10, 1), ("randread", 64 << 10, 8), ("randread", 64 << 10, 32)]


@pytest.mark.parametrize("workload,bs,qd", CASES,
                         ids=[f"{w}-{b >> 10}K-qd{q}" for w, b, q in CASES])
def test_raw_read_vs_fio(benchmark, shm_loop, workload, bs, qd):
    from kvblock.devices import Device
    from kvblock.io import IOBatch, open_engine
    from kvblock.memory import HostBuffer

    benchmark.group = "raw-io"
    fio_runs: list[dict] = []
    last: dict = {}

    def run_fio_first():
        fio_runs.append(fs.fio_round(shm_loop, workload, bs, qd, size=DEVICE_BYTES,
                                     io_size=IO_BYTES))

    with Device(shm_loop, writable=False, exclusive=False) as dev, \
            HostBuffer(bs * qd) as buf, open_engine([dev], queue_depth=qd) as eng:
        offsets = _offsets(workload, bs)
        addrs = (np.arange(offsets.size, dtype=np.uint64) % np.uint64(qd)) * np.uint64(bs) \
            + np.uint64(buf.address)
        batch = IOBatch(addrs, 0, offsets, bs)

        def kvblock_read():
            last["latency_ns"] = eng.read(batch, qd=qd, latency=True).latency_ns

        benchmark.pedantic(kvblock_read, setup=run_fio_first, rounds=ROUNDS, iterations=1,
                           warmup_rounds=1)

    # fio's runs before the kept rounds: setup ran before the warm-up round
    # too, whose kvblock time pytest-benchmark does not keep
    fio_runs = fio_runs[-ROUNDS:]
    fio_gib_s = statistics.median(r["gib_s"] for r in fio_runs)
    kvblock_gib_s = IO_BYTES / benchmark.stats.stats.median / 2**30
    if workload == "read":
        figure, x = "Sequential read vs I/O size (QD 32, loop over /dev/shm)", bs // 1024
        xlabel = "I/O size (KiB)"
    else:
        figure, x, xlabel = "64 KiB random read vs queue depth (loop over /dev/shm)", qd, "QD"
    benchmark.extra_info["points"] = [
        {"figure": figure, "series": "kvblock", "x": x, "y": round(kvblock_gib_s, 4),
         "xlabel": xlabel, "ylabel": "GiB/s"},
        {"figure": figure, "series": "fio", "x": x, "y": round(fio_gib_s, 4),
         "xlabel": xlabel, "ylabel": "GiB/s"}]
    benchmark.extra_info.update({
        "reference": "fio ioengine=io_uring direct=1, same device, alternating rounds",
        "workload": workload, "bs": bs, "qd": qd, "device": f"loop over /dev/shm, "
        f"{DEVICE_BYTES // MIB} MiB", "io_bytes": IO_BYTES, "engine": eng.name,
        "fio_gib_s": round(fio_gib_s, 4),
        "kvblock_gib_s": round(kvblock_gib_s, 4),
        "ratio": round(kvblock_gib_s / fio_gib_s, 4),
        "fio_p99_us": round(statistics.median(r["p99_us"] for r in fio_runs), 1),
        "kvblock_p99_us": round(float(np.percentile(last["latency_ns"], 99)) / 1000, 1),
        "fio_runs_gib_s": [round(r["gib_s"], 4) for r in fio_runs],
    })
    assert kvblock_gib_s > 0 and fio_gib_s > 0
