"""pytest-benchmark: index and metadata paths, and cache behaviour on a real trace.

Groups: "lookup" (longest-prefix lookups per second), "small-gets" (one-block
get_run latency), "gets-across-runs-file|loop" (one get of 32 blocks stored as
32 runs vs as one run), "puts-of-many-runs-disk|shm" (32 one-block runs with
a put_run each vs one put_runs), "recovery" (reopen time vs indexed blocks), "trace-replay"
(hit ratio vs capacity per eviction policy on ../shared/traces).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvblock import Geometry, KVStore, create_file  # noqa: E402
from kvblock.memory import aligned_empty  # noqa: E402

import fio_support  # noqa: E402  (perf/, on sys.path through perf/conftest.py)

SMALL = Geometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=16)
# Mooncake's public conversation trace (github.com/kvcache-ai/Mooncake,
# FAST25-release/traces/conversation_trace.jsonl); KVBLOCK_TRACE names a copy
# elsewhere.
TRACE = Path(os.environ.get("KVBLOCK_TRACE") or
             ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl")


@pytest.fixture
def shm_dir(tmp_path):
    d = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    return d


def _filled(path, blocks, run_blocks=64):
    create_file(path, blocks * SMALL.block_bytes * 5 // 4 + (256 << 20))
    store = KVStore.format([str(path)], SMALL, region_size=64 << 20, force=True)
    data = np.zeros(run_blocks * SMALL.block_bytes, np.uint8)
    for i in range(blocks // run_blocks):
        store.put_run([(i * run_blocks + j).to_bytes(16, "little") for j in range(run_blocks)],
                      data)
    return store


def test_lookup_prefix(benchmark, shm_dir):
    benchmark.group = "lookup"
    path = shm_dir / f"kvb-bench-lookup-{os.getpid()}.img"
    try:
        store = _filled(path, 100_000)
        rng = np.random.default_rng(0)
        starts = rng.integers(0, 100_000 - 512, 64)
        requests = [[int(s + j).to_bytes(16, "little") for j in range(512)] for s in starts]
        stored = 100_000 // 64 * 64          # _filled's whole runs
        # untimed: the lookups timed find what is stored (a lookup finding
        # nothing would look fast)
        assert [store.lookup(r) for r in requests] == [min(512, stored - int(s))
                                                        for s in starts]
        i = [0]

        def lookup():
            store.lookup(requests[i[0] % len(requests)])
            i[0] += 1

        benchmark(lookup)
        benchmark.extra_info.update({"keys_per_lookup": 512, "indexed_blocks": 100_000,
                                     "keys_per_s": round(512 / benchmark.stats.stats.mean)})
        store.close()
    finally:
        path.unlink(missing_ok=True)


def test_small_random_gets(benchmark, shm_dir):
    benchmark.group = "small-gets"
    path = shm_dir / f"kvb-bench-gets-{os.getpid()}.img"
    try:
        store = _filled(path, 50_000)
        rng = np.random.default_rng(1)
        out = np.zeros(SMALL.block_bytes, np.uint8)
        keys = [int(k).to_bytes(16, "little") for k in rng.integers(0, 49_984, 4096)]
        i = [0]

        def get():
            assert store.get_run([keys[i[0] % len(keys)]], out) == 1
            i[0] += 1

        benchmark(get)
        benchmark.extra_info.update({"block_bytes": SMALL.block_bytes, "verify": store.verify,
                                     "gets_per_s": round(1 / benchmark.stats.stats.mean)})
        store.close()
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("target", ["file", "loop"])
@pytest.mark.parametrize("stored_as", ["32 runs", "one run"])
def test_get_across_runs(benchmark, shm_dir, stored_as, target):
    """One get_blocks of 32 blocks of 1 MiB into aligned buffers, the blocks
    stored one run each (how the LMCache plugin stores chunks, and layer
    objects in layer-wise mode) or as one run: what a run costs a read
    beyond its bytes.  On a store file in /dev/shm (read through its mapping)
    and on a loop device over one (root)."""
    benchmark.group = f"gets-across-runs-{target}"
    if target == "loop" and os.geteuid() != 0:
        pytest.skip("a loop device needs root")
    n, block = 32, 1 << 20
    geo = Geometry(num_layers=1, num_kv_heads=1, head_dim=block, dtype="uint8", block_tokens=1,
                   kv_parts=1)
    base = shm_dir / f"kvb-bench-runs-{os.getpid()}"
    if target == "loop":
        dev_cm = fio_support.loop_target(base, 256 << 20, fill=False)
    else:
        base.mkdir()
        dev_cm = contextlib.nullcontext(str(create_file(base / "kv.img", 256 << 20)))
    try:
        with dev_cm as dev:
            store = KVStore.format([dev], geo, force=True)
            data = np.random.default_rng(2).integers(0, 256, (n, block), dtype=np.uint8)
            keys = [i.to_bytes(16, "little") for i in range(n)]
            if stored_as == "one run":
                store.put_run(keys, data)
            else:
                for key, row in zip(keys, data):
                    store.put_run([key], row)
            outs = list(aligned_empty((n, block)))
            for o in outs:
                o[:] = 0                       # touched before the timed phase

            def get():
                assert store.get_blocks(keys, outs) == n

            benchmark.pedantic(get, rounds=30, warmup_rounds=2)
            assert all(np.array_equal(o, d) for o, d in zip(outs, data))
            store.close()
        benchmark.extra_info.update({
            "blocks": n, "block_bytes": block, "runs": n if stored_as == "32 runs" else 1,
            "device": "loop over /dev/shm" if target == "loop" else "file in /dev/shm",
            "verify": "always",
            "gib_s": round(n * block / benchmark.stats.stats.median / 2**30, 2)})
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("where", ["disk", "shm"])
@pytest.mark.parametrize("how", ["put_run each", "put_runs"])
def test_puts_of_many_runs(benchmark, tmp_path, where, how):
    """32 runs of one 1 MiB block (the LMCache plugin's chunks), stored with
    a put_run each (a journal commit each: data flush, journal write,
    journal flush) or with one put_runs (one commit).  Store file in
    /var/tmp (the VM's disk) or /dev/shm."""
    benchmark.group = f"puts-of-many-runs-{where}"
    n, block = 32, 1 << 20
    geo = Geometry(num_layers=1, num_kv_heads=1, head_dim=block, dtype="uint8", block_tokens=1,
                   kv_parts=1)
    base = Path("/var/tmp" if where == "disk" else "/dev/shm") / f"kvb-bench-puts-{os.getpid()}"
    base.mkdir()
    try:
        path = create_file(base / "kv.img", 512 << 20)
        store = KVStore.format([str(path)], geo, force=True)
        data = aligned_empty((n, block))
        data[:] = np.random.default_rng(3).integers(0, 256, (n, block), dtype=np.uint8)
        rounds = iter(range(1_000_000))

        def put():
            r = next(rounds)
            keys = [(r * n + i).to_bytes(16, "little") for i in range(n)]
            if how == "put_runs":
                assert store.put_runs([([k], row) for k, row in zip(keys, data)]) == [1] * n
            else:
                for k, row in zip(keys, data):
                    assert store.put_run([k], row) == 1

        benchmark.pedantic(put, rounds=20, warmup_rounds=1)
        benchmark.extra_info.update({
            "runs": n, "block_bytes": block, "commits": store.counters["commits"],
            "device": f"file in {base.parent}",
            "gib_s": round(n * block / benchmark.stats.stats.median / 2**30, 2)})
        store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("blocks", [100_000, 300_000, 1_000_000])
def test_recovery_vs_indexed_blocks(benchmark, shm_dir, blocks):
    """Reopen after SIGKILL (perf/recovery.py does the fill and the kill)."""
    benchmark.group = "recovery"
    path = shm_dir / f"kvb-bench-recovery-{os.getpid()}.img"
    out = {}

    def reopen():
        res = subprocess.run([sys.executable, str(ROOT / "perf" / "recovery.py"), "--blocks",
                              str(blocks), "--path", str(path)], capture_output=True, text=True,
                             check=True)
        import json

        out.update(json.loads(res.stdout))

    benchmark.pedantic(reopen, rounds=1, iterations=1)
    benchmark.extra_info.update({
        "blocks": blocks, "reopen_seconds": out["reopen_seconds"],
        "index_bytes_per_block": out["index_bytes_per_block"],
        "points": [{"figure": "Reopen after SIGKILL vs indexed blocks", "series": "kvblock",
                    "x": blocks, "y": out["reopen_seconds"], "xlabel": "indexed blocks",
                    "ylabel": "seconds"}]})


@pytest.mark.skipif(not TRACE.is_file(), reason=f"trace not found at {TRACE}: set KVBLOCK_TRACE "
                    "to a copy of Mooncake's conversation_trace.jsonl")
@pytest.mark.parametrize("policy", ["fifo", "lru"])
@pytest.mark.parametrize("capacity_mib", [32, 64, 128])
def test_trace_replay(benchmark, shm_dir, policy, capacity_mib):
    import replay_trace as rt

    benchmark.group = "trace-replay"
    requests = rt.load(str(TRACE), 3000)
    result = {}

    def replay():
        result.update(rt.replay(requests, capacity_mib << 20, policy, 1, str(shm_dir)))

    benchmark.pedantic(replay, rounds=1, iterations=1)
    ideal = rt.ideal(requests)
    benchmark.extra_info.update({
        **result, "ideal_hit_ratio": round(ideal, 4), "requests": len(requests),
        "reference": "ideal (infinite capacity) hit ratio",
        "ratio": round(result["hit_ratio"] / ideal, 4),
        "points": [{"figure": "Trace replay: hit ratio vs capacity (first 3000 requests)",
                    "series": policy, "x": capacity_mib, "y": result["hit_ratio"],
                    "xlabel": "store capacity (MiB)", "ylabel": "block hit ratio"},
                   {"figure": "Trace replay: hit ratio vs capacity (first 3000 requests)",
                    "series": "ideal", "x": capacity_mib, "y": round(ideal, 4)}]})
