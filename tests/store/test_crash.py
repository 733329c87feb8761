"""Crash at every I/O: for each N, the store dies at its N-th write/flush/
discard; reopening must show no phantom key, only byte-identical data, and
every acknowledged put (not deleted since) present.  Variants tear the dying
write and roll back every write not yet flushed (a lost drive cache)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from kvblock import KVStore, create_file
from tests.support import loopdev
from tests.store.workload import (GEOM, REGION, Journal, check_store, run_data, run_keys,
                                  workload)
from tests.support.faults import CrashPlan, SimulatedCrash


@pytest.fixture
def crash_dir(monkeypatch):
    """Store files on tmpfs, read and written by the io_uring engine as on a
    device (mappings off, so discards punch holes as on disk): what a crash
    keeps is decided by the fault plan's simulated drive cache, so a real
    disk adds only its latency (it made these the suite's slowest tests)."""
    monkeypatch.setenv("KVBLOCK_MAPPED_READS", "never")
    directory = Path(tempfile.mkdtemp(prefix="kvblock-crash-", dir=loopdev.backing_dir()))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _fresh(path, size):
    if path.exists():
        path.unlink()
    create_file(path, size)
    KVStore.format([path], GEOM, region_size=REGION, journal_bytes=64 << 10).close()


def _run(path, plan, runs, evicting, batched=False):
    log = Journal()
    try:
        store = KVStore.open([path], storeio_factory=plan.factory())
    except SimulatedCrash:
        return log
    try:
        workload(store, log, runs=runs, evicting=evicting, batched=batched)
        store.close()
    except SimulatedCrash:
        store._release_devices()  # the process "died": no clean shutdown
    return log


def _total_ops(tmp_path, size, runs, evicting, batched=False):
    path = tmp_path / "count.img"
    _fresh(path, size)
    plan = CrashPlan()
    _run(path, plan, runs, evicting, batched)
    return plan.ops


MODES = ["clean-stop", "torn", "torn+lost-cache", "torn+reordered-cache"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("evicting", [False, True], ids=["fits", "evicting"])
def test_crash_at_every_io(crash_dir, mode, evicting):
    _crash_everywhere(crash_dir, mode, evicting, batched=False)


@pytest.mark.parametrize("mode,evicting", [(m, False) for m in MODES]
                         + [("torn+reordered-cache", True)],
                         ids=[f"fits-{m}" for m in MODES] + ["evicting-torn+reordered-cache"])
def test_crash_at_every_io_of_batched_puts(crash_dir, mode, evicting):
    """put_runs: three runs written, then published with one commit."""
    _crash_everywhere(crash_dir, mode, evicting, batched=True)


def _crash_everywhere(tmp_path, mode, evicting, batched):
    size = (3 << 20) if evicting else (8 << 20)
    runs = 30 if evicting else 12
    total = _total_ops(tmp_path, size, runs, evicting, batched)
    assert total > 30
    path = tmp_path / "store.img"
    for n in range(1, total + 1):
        _fresh(path, size)
        lose = {"torn+lost-cache": True, "torn+reordered-cache": "random"}.get(mode, False)
        plan = CrashPlan(crash_at=n, torn=mode != "clean-stop", lose_unflushed=lose, seed=n)
        log = _run(path, plan, runs, evicting, batched)
        assert plan.crashed, f"crash point {n} of {total} was never reached"
        with KVStore.open([path]) as store:
            check_store(store, log, evicting=evicting)
            if batched and not evicting:     # a put_runs call: published in order, by one commit
                firsts = list(log.attempted)
                for g in range(0, len(firsts), 3):
                    group = [log.attempted[f] for f in firsts[g:g + 3] if f not in log.deleting]
                    kept = [store.lookup(keys) == len(keys) for keys in group]
                    assert kept == sorted(kept, reverse=True), \
                        f"crash at {n}: put_runs published out of order: {kept}"
            # and the recovered store keeps working
            store.put_run([b"after-crash"], run_data([b"after-crash"]))
            assert store.lookup([b"after-crash"]) == 1
        with KVStore.open([path]) as store:
            assert store.lookup([b"after-crash"]) == 1


def _served_put_runs(sock, path, plan, log):
    """Runs of a rank's put_runs, three per call, published by the server's
    commit_runs (one journal commit each), with a delete, a delete_prefix
    and a checkpoint between them, until the server's store "dies"."""
    from kvblock.index.keys import normalize_key
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background
    from tests.store.workload import _aligned

    try:
        server = serve_in_background([str(path)], sock, storeio_factory=plan.factory())
    except SimulatedCrash:
        return
    try:
        with RemoteStore(sock) as rank:
            for g in range(0, 15, 3):
                todo = [run_keys(i, 1 + i % 4) for i in range(g, g + 3)]
                for keys in todo:
                    log.attempted[keys[0]] = keys
                rank.put_runs([(keys, _aligned(run_data(keys))) for keys in todo])
                log.acked.update(keys[0] for keys in todo)
                victim = {6: run_keys(4, 1), 9: run_keys(7, 4)}.get(g)
                if victim is not None:
                    log.deleting.add(victim[0])
                    if g == 6:
                        rank.delete(victim[:1])
                        rank.checkpoint()
                    else:    # the runs holding a key that starts as run 7's first
                        rank.delete_prefix(normalize_key(victim[0])[:8])
                    log.deleted.add(victim[0])
    except Exception:        # the server's store died under the call
        if not plan.crashed:
            raise
    finally:
        try:
            server.stop()
        except Exception:
            if not plan.crashed:
                raise
        if server.store.io is not None:
            server.store._release_devices()


@pytest.mark.parametrize("mode", ["clean-stop", "torn+reordered-cache"])
def test_crash_at_every_io_of_a_served_put_runs(crash_dir, mode):
    """put_runs through a store server (its commit_runs publishes each
    group with one journal commit): a crash at any of the server's I/Os
    keeps every acknowledged run byte for byte and a leading part of each
    group, never a deleted run; fsck finds nothing to report."""
    from kvblock.store.fsck import fsck

    sock = str(crash_dir / "kv.sock")
    path = crash_dir / "served.img"
    _fresh(path, 8 << 20)
    counting = CrashPlan()
    _served_put_runs(sock, path, counting, Journal())
    total = counting.ops
    assert total > 20
    for n in range(1, total + 1):
        _fresh(path, 8 << 20)
        plan = CrashPlan(crash_at=n, torn=mode != "clean-stop",
                         lose_unflushed="random" if mode != "clean-stop" else False, seed=n)
        log = Journal()
        _served_put_runs(sock, path, plan, log)
        assert plan.crashed, f"crash point {n} of {total} was never reached"
        with KVStore.open([path]) as store:
            check_store(store, log)
            firsts = list(log.attempted)
            for g in range(0, len(firsts), 3):
                group = [log.attempted[f] for f in firsts[g:g + 3] if f not in log.deleting]
                kept = [store.lookup(keys) == len(keys) for keys in group]
                assert kept == sorted(kept, reverse=True), \
                    f"crash at {n}: commit_runs published out of order: {kept}"
            report = fsck(store)
            # a torn checkpoint write leaves its slot damaged (the crash explains it)
            problems = [p for p in report.problems
                        if not (mode != "clean-stop" and "checkpoint slot" in p)]
            assert problems == [], f"crash at {n}: {problems}"
