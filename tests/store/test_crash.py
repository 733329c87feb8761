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
from kvblock.errors import StoreClosedError
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


# ------------------------------------------------------------------ sector-granular tears
SECTOR_MODES = ["sectors", "sector-subset", "sector-subset+reordered-cache"]


def _sector_workload(store, log):
    """Commits of several records crossing 512-byte sectors: put_runs of
    six runs (one commit of six PUTs, about 900 bytes), a delete of three
    runs (a commit of three DROPs), and six PUTs with three DROPs queued
    behind them in one group commit."""
    import threading

    from tests.store.workload import _aligned

    def put_group(first):
        todo = [run_keys(i, 1 + i % 4) for i in range(first, first + 6)]
        for keys in todo:
            log.attempted[keys[0]] = keys
        store.put_runs([(keys, _aligned(run_data(keys))) for keys in todo])
        log.acked.update(keys[0] for keys in todo)

    def delete(victims):
        log.deleting.update(v[0] for v in victims)
        store.delete([v[0] for v in victims])
        log.deleted.update(v[0] for v in victims)

    put_group(0)
    put_group(6)
    delete([run_keys(1, 2), run_keys(4, 1), run_keys(8, 1)])
    put_group(12)
    # PUTs, then DROPs, in one commit (the third DROP's header crosses a
    # sector): both calls wait for the commit lock held here
    errors = []

    def call(fn, *args):
        try:
            fn(*args)
        except BaseException as e:        # the crash, in that thread
            errors.append(e)

    threads = []
    with store._commit_lock:
        for fn, arg in [(put_group, 21), (delete, [run_keys(i, 1 + i % 4) for i in (0, 7, 14)])]:
            before = len(store._pending)
            threads.append(threading.Thread(target=call, args=(fn, arg)))
            threads[-1].start()
            for _ in range(5000):
                if len(store._pending) > before or not threads[-1].is_alive():
                    break
                threading.Event().wait(0.001)
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    put_group(27)


def _sector_run(path, plan):
    log = Journal()
    try:
        store = KVStore.open([path], storeio_factory=plan.factory())
    except SimulatedCrash:
        return log
    try:
        _sector_workload(store, log)
        store.close()
    except (SimulatedCrash, StoreClosedError):
        store._release_devices()
    return log


@pytest.mark.parametrize("mode", SECTOR_MODES)
def test_a_crash_that_tears_a_journal_write_at_sector_granularity_is_no_damage(
        crash_dir, monkeypatch, mode):
    """A device writes each 512-byte sector whole, not a write whole: a
    crash in a journal write leaves any of its sectors old.  After each
    sampled crash (several seeds per journal write): the store opens,
    recovery reports no damaged record (a crash is never damage),
    acknowledged runs read back byte for byte, deleted ones stay gone,
    and fsck finds nothing a crash cannot leave."""
    from kvblock.store.fsck import fsck
    from kvblock.store.recovery import Recovery

    # The harness's device writes sectors whole: recovery may judge damage
    # by them (a store file on tmpfs is otherwise taken for one written
    # through a mapping, which tears anywhere and never shows damage).
    monkeypatch.setattr(Recovery, "_tears_anywhere", lambda self: False)
    path = crash_dir / "sectors.img"
    _fresh(path, 8 << 20)
    counting = CrashPlan()
    _sector_run(path, counting)
    with KVStore.open([path], readonly=True) as store:
        start, size = store.sb.journal_offset, store.sb.journal_bytes
    journal_writes = [n for n, entries in counting.writes
                      if any(dev == 0 and start <= off < start + size and length > 512
                             for dev, off, length in entries)]
    assert len(journal_writes) >= 6
    lose = "random" if mode.endswith("reordered-cache") else False
    torn = mode.split("+")[0]
    for n in journal_writes:
        for seed in range(3):
            _fresh(path, 8 << 20)
            plan = CrashPlan(crash_at=n, torn=torn, lose_unflushed=lose, seed=n * 7 + seed)
            log = _sector_run(path, plan)
            assert plan.crashed, f"crash point {n} was never reached"
            with KVStore.open([path]) as store:
                where = f"crash at I/O {n} (seed {plan.seed})"
                assert store.journal_damaged is None, f"{where}: {store.journal_damaged}"
                check_store(store, log)
                problems = [p for p in fsck(store).problems
                            if "checkpoint slot" not in p and "intact record(s)" not in p]
                assert problems == [], f"{where}: {problems}"
