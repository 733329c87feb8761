"""SIGKILL a writer process at random moments; after each kill the store must
reopen with no phantom key, byte-identical data and every acknowledged put
that was not deleted since.  KVBLOCK_KILL_ROUNDS sets the count.  Nothing may
be evicted (a loss would hide behind it): when a quarter of the regions is
left, the store is formatted again and the record of what it holds starts
over, so any number of rounds fits."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest

from kvblock import KVStore, create_file
from kvblock.io.mapped import PREFAULT_INLINE
from tests.store.kill_writer import write_until_killed
from tests.store.workload import GEOM, REGION, Journal, check_store, run_keys

ROUNDS = int(os.environ.get("KVBLOCK_KILL_ROUNDS", "40"))


def _rest(conn) -> list[str]:
    """What a killed writer sent before it died (the pipe's end: EOF)."""
    lines = []
    try:
        while True:
            lines.append(conn.recv_bytes().decode())
    except EOFError:
        return lines
    finally:
        conn.close()


@pytest.mark.parametrize("how", ["put_run", "put_runs"])
@pytest.mark.parametrize("where", ["disk", "shm"])
def test_sigkill_at_random_moments(tmp_path, shm_target, where, how):
    """``shm``: a store file on tmpfs, written through a mapping (small enough
    to be mapped in before the first put).  ``put_runs``: three runs a call,
    published in order by one commit: of the call in flight, a leading part
    (all, some or none of it) may have landed, each run whole."""
    group = 3 if how == "put_runs" else 1
    if where == "shm":
        path = Path(shm_target(PREFAULT_INLINE, "kill.img"))
    else:
        path = tmp_path / "kill.img"
        create_file(path, 96 << 20)   # large enough that nothing is evicted (checked below)

    def fresh_store():
        KVStore.format([str(path)], GEOM, region_size=REGION, journal_bytes=256 << 10,
                       force=True).close()
        return Journal()

    log = fresh_store()
    formats = 1
    rng = random.Random(1234)
    next_run = 0
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.store.kill_writer"])
    for round_ in range(ROUNDS):
        told, tell = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=write_until_killed, args=(str(path), next_run, how, tell))
        proc.start()
        tell.close()
        # Wait for the writer to start writing, then kill it a random moment later.
        lines = [told.recv_bytes().decode()]
        assert lines[0].startswith("put "), lines[0]
        time.sleep(rng.uniform(0.0, 0.05))
        proc.kill()
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, proc.exitcode
        lines += _rest(told)
        started = next_run
        acked_puts = [int(n) for x in lines if x.startswith("put ") for n in x.split()[1:]]
        acked_dels = [int(x.split()[1]) for x in lines if x.startswith("del ")]
        last = max(acked_puts)
        # the call after the last acknowledged one may or may not have landed
        in_flight = [run_keys(i, 1 + i % 4) for i in range(last + 1, last + 1 + group)]
        for i in range(started, last + 1 + group):
            keys = run_keys(i, 1 + i % 4)
            log.attempted[keys[0]] = keys
        for i in acked_puts:
            log.acked.add(run_keys(i, 1)[0])
        for i in acked_dels:
            log.deleted.add(run_keys(i, 1)[0])
            log.deleting.add(run_keys(i, 1)[0])
        for i in range(last + 1 - group, last + 1):     # deletes after the last call's puts
            if i % 7 == 6 and i - 3 not in acked_dels:
                log.deleting.add(run_keys(i - 3, 1)[0])  # may have been in flight
        next_run = last + 1 + group
        with KVStore.open([str(path)]) as store:
            assert store.io.engine.mapped_for_writes(0) == (where == "shm")
            stats = store.stats()
            # (the writer's eviction counters died with it; the store is
            # formatted afresh long before it fills, and a full one says so)
            assert stats["regions_free"] > 0, \
                f"round {round_}: the store filled up (eviction would hide losses)"
            assert check_store(store, log) > 0
            landed = [store.lookup(keys) == len(keys) for keys in in_flight]
            assert landed == sorted(landed, reverse=True), \
                f"round {round_}: the call in flight landed out of order: {landed}"
            low = stats["regions_free"] < stats["regions"] // 4
        if low and round_ + 1 < ROUNDS:
            log = fresh_store()
            formats += 1
    assert next_run > ROUNDS
    assert formats <= 1 + ROUNDS // 20, formats     # each store served many rounds
