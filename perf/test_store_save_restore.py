"""pytest-benchmark (group "store-save-restore"): store save and restore vs
fio sequential write / read on a /dev/shm loop device (perf/store_vs_fio.py
is the longer, two-target version).

    .venv/bin/python -m pytest perf/ --benchmark-only        # or: make bench

Each benchmark round moves ROUND_RUNS runs of 32 blocks (32 layers x 8 KV
heads x 128, bfloat16: 64 MiB per run) through the store, the loops of
``kvblock bench --workload save|restore``: ``put_run`` of fresh keys (once
the store is full every save reclaims a region first), or ``get_run`` of
whole runs with checksums verified (each run saved with its own bytes; each
round's last restore is compared, untimed, with the run it asked for).  The
engine splits each run into 8 MiB pieces, 8 in flight; before every round
(pedantic ``setup``) fio moves the same bytes with ``bs=8M iodepth=8``
(rw=write / rw=read) on the same device, so the two alternate.
``extra_info`` holds both GiB/s (kvblock's from the benchmark's median time,
fio's median), their ratio and the median of the per-round ratios
(``paired_ratio``); bars (issue 3): restore >= 0.90, save >= 0.85, judged on
the paired ratio (``meets_bar``: recorded, not asserted, as timings on a
shared machine are noisy).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fio_support as fs  # noqa: E402
from store_vs_fio import BARS, io_shape  # noqa: E402

from kvblock.bench.store_bench import run_mask  # noqa: E402

MIB = 1 << 20
DEVICE_BYTES = 1 << 30   # regions of 64 MiB: one run each
RUN_BLOCKS = 32
ROUND_RUNS = 8           # 512 MiB per round
ROUNDS = 5

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def shm_loop():
    why = fs.benchmark_skip_reason()
    if why:
        pytest.skip(f"store-vs-fio benchmarks: {why}")
    with fs.loop_target(fs.SHM, DEVICE_BYTES) as dev:
        yield dev


@pytest.mark.parametrize("workload", ["save", "restore"])
def test_store_vs_fio(benchmark, shm_loop, workload):
    from kvblock import Geometry, KVStore
    from kvblock.memory import HostBuffer

    benchmark.group = "store-save-restore"
    g = Geometry(32, 8, 128, "bfloat16", 16)
    run_bytes = RUN_BLOCKS * g.block_bytes
    piece, _, in_flight = io_shape(run_bytes, 32, 1)
    round_bytes = ROUND_RUNS * run_bytes
    fio_rw = "write" if workload == "save" else "read"
    fio_runs: list[dict] = []

    def run_fio_first():
        fio_runs.append(fs.fio_round(shm_loop, fio_rw, piece, in_flight, size=DEVICE_BYTES,
                                     io_size=round_bytes))

    # fio writes over the store between save rounds: harmless, a save only writes.
    with KVStore.format([shm_loop], g, force=True) as store, HostBuffer(run_bytes) as src, \
            HostBuffer(run_bytes) as out:
        src.array[:] = np.random.default_rng(0).integers(0, 256, run_bytes, dtype=np.uint8)
        counter = [0]

        def keys(i):
            return [f"{workload}-{i}-{j}".encode() for j in range(RUN_BLOCKS)]

        words = run_bytes // 8
        last = []                                  # the run the last restore asked for

        def check_last():
            """The last restore's bytes are the run it asked for (untimed)."""
            if last:
                want = np.bitwise_xor(src.numpy(np.uint64, (words,)), run_mask(last[-1]))
                assert np.array_equal(out.numpy(np.uint64, (words,)), want), \
                    f"restore of run {last[-1]} ({stored[last[-1]][0].decode()}...) read " \
                    "other bytes than were saved"

        def setup():
            check_last()
            run_fio_first()

        if workload == "save":
            def kvblock_round():
                for _ in range(ROUND_RUNS):
                    store.put_run(keys(counter[0]), src.array)
                    counter[0] += 1
        else:
            stored = [keys(i) for i in range(6)]   # about half the device
            # each run its own bytes (the source XOR a per-run word), so that
            # a get of another run's blocks shows
            for i, k in enumerate(stored):
                np.bitwise_xor(src.numpy(np.uint64, (words,)), run_mask(i),
                               out=out.numpy(np.uint64, (words,)))
                store.put_run(k, out.array)
            order = np.random.default_rng(1).integers(0, len(stored), 10_000)

            def kvblock_round():
                for _ in range(ROUND_RUNS):
                    run = int(order[counter[0] % order.size])
                    got = store.get_run(stored[run], out.array)
                    assert got == RUN_BLOCKS
                    counter[0] += 1
                last[:] = [run]

        benchmark.pedantic(kvblock_round, setup=setup, rounds=ROUNDS, iterations=1,
                           warmup_rounds=1)
        check_last()
        engine = store.io.engine.name

    # fio's runs before the kept rounds: setup also ran before the warm-up
    # round, whose time is not kept
    fio_runs = fio_runs[-ROUNDS:]
    fio_gib_s = statistics.median(r["gib_s"] for r in fio_runs)
    kvblock_gib_s = round_bytes / benchmark.stats.stats.median / 2**30
    ratio = kvblock_gib_s / fio_gib_s
    # Side by side: each round's kvblock time with the fio run just before it.
    paired = statistics.median(round_bytes / t / 2**30 / f["gib_s"] for t, f in
                               zip(benchmark.stats.stats.data, fio_runs))
    fig = "Store save / restore vs fio (64 MiB runs, loop over /dev/shm)"
    benchmark.extra_info.update({
        "reference": f"fio rw={fio_rw} bs={piece // MIB}M iodepth={in_flight} io_uring "
                     "direct=1, same device, alternating rounds",
        "workload": workload, "run_bytes": run_bytes, "io_size": piece,
        "in_flight": in_flight, "round_bytes": round_bytes, "engine": engine,
        # kvblock's own I/O shape: verified reads go in read_hashed's pieces
        "kvblock_io_size": io_shape(run_bytes, 32, 1, hashed=workload == "restore")[0],
        "kvblock_in_flight": io_shape(run_bytes, 32, 1, hashed=workload == "restore")[2],
        "verify": "always", "device": f"loop over /dev/shm, {DEVICE_BYTES // MIB} MiB",
        "fio_gib_s": round(fio_gib_s, 4), "kvblock_gib_s": round(kvblock_gib_s, 4),
        "ratio": round(ratio, 4), "paired_ratio": round(paired, 4), "bar": BARS[workload],
        "meets_bar": paired >= BARS[workload],
        "fio_runs_gib_s": [round(r["gib_s"], 4) for r in fio_runs],
        "points": [{"figure": fig, "series": f"kvblock {workload}", "x": run_bytes // MIB,
                    "y": round(kvblock_gib_s, 4), "xlabel": "run (MiB)", "ylabel": "GiB/s"},
                   {"figure": fig, "series": f"fio {fio_rw}", "x": run_bytes // MIB,
                    "y": round(fio_gib_s, 4), "xlabel": "run (MiB)", "ylabel": "GiB/s"}],
    })
    assert kvblock_gib_s > 0 and fio_gib_s > 0
