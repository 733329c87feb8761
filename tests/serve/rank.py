"""A rank process for the store-server tests (run as ``python -m tests.serve.rank``).

Modes:
  mix SOCK DEV RANK NRANKS RUNS   connect (starting the server if none runs),
                                  put runs, delete some, read its own and the
                                  other ranks' runs, checking every byte; the
                                  ranks go in step (at run i a rank reads each
                                  other rank's run i-1, waiting for it), so
                                  their writes and reads interleave
  kill SOCK START HOLD OTHERS...  put (and delete) runs forever, reading its
                                  own and the other ranks' (their STARTs) runs,
                                  printing each acknowledged put; exit 3 on
                                  ServerGoneError.  HOLD > 0: the put after
                                  HOLD acknowledged ones stops with its data
                                  written (commit not asked), prints
                                  "holding I" and goes on at a line on stdin
  stall SOCK                      pin a stored run for reading, then stop in
                                  the middle of a put (data written, commit
                                  not sent) and wait to be killed
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvblock.index import normalize_keys
from kvblock.store.client import RemoteStore, ServerGoneError, connect
from tests.store.workload import GEOM, run_data, run_keys

G = GEOM


def run_index(rank: int, i: int) -> int:
    return 1000 * (rank + 1) + i


def nblocks(i: int) -> int:
    return 1 + i % 4


def deleted(i: int, runs: int) -> bool:
    """Runs the mix workload deletes (run i-2 after putting run i, i % 5 == 4)."""
    return i % 5 == 2 and i + 2 < runs


def marker(rank: int) -> list[bytes]:
    return [f"done{rank}".encode()]


def check(store, keys, expect_all: bool, whole: bool = False) -> int:
    """Read the stored prefix of ``keys`` both ways; every byte must match.
    ``whole``: a run that nobody deletes, so once lookup finds it every read
    must return all of it (a run is published whole)."""
    n = store.lookup(keys)
    if expect_all:
        assert n == len(keys), f"{keys[0]!r}: {n}/{len(keys)} blocks stored"
    if n == 0:
        return 0
    if whole:
        assert n == len(keys), f"{keys[0]!r}: lookup found {n}/{len(keys)} blocks of a run"
    shape = (G.num_layers, G.head_groups, len(keys), G.group_block_bytes)
    want = run_data(keys).reshape(shape)
    out = np.zeros(len(keys) * G.block_bytes, np.uint8)
    lapsed = store.counters["lapsed_pin_gets"]
    got = store.get_run(keys, out)
    if got < n and (store.counters["lapsed_pin_gets"] > lapsed or not store.server_alive):
        raise ServerGoneError("the server went away during the read")   # a miss, not a fault
    assert got == n or not (expect_all or whole), f"{keys[0]!r}: lookup {n}, get_run {got}"
    assert np.array_equal(out.reshape(shape)[:, :, :got], want[:, :, :got]), \
        f"{keys[0]!r}: wrong bytes"
    layer, group = len(keys) % G.num_layers, 1 % G.head_groups
    part = np.zeros(len(keys) * G.group_block_bytes, np.uint8)
    lapsed = store.counters["lapsed_pin_gets"]
    got2 = store.read_range(keys, layer, group, part)
    if got2 < got and (store.counters["lapsed_pin_gets"] > lapsed or not store.server_alive):
        raise ServerGoneError("the server went away during the read")
    if expect_all or whole:
        assert got2 == len(keys), f"{keys[0]!r}: read_range {got2}/{len(keys)}"
    assert np.array_equal(part.reshape(len(keys), -1)[:got2], want[layer, group, :got2]), \
        f"{keys[0]!r}: wrong bytes in read_range"
    return got


def started(rank: int) -> list[bytes]:
    return [f"start{rank}".encode()]


def wait_for(store, keys, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while store.lookup(keys) < len(keys):
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.002)


def mix(sock, dev, rank, nranks, runs):
    store = connect(sock, [dev])
    print(f"server {store.server_pid}", flush=True)
    store.put_run(started(rank), run_data(started(rank)))
    for other in range(nranks):     # all start together: their puts and reads interleave
        wait_for(store, started(other), f"rank {other}'s start")
    cross = live = 0
    for i in range(runs):
        keys = run_keys(run_index(rank, i), nblocks(i))
        assert store.put_run(keys, run_data(keys)) == len(keys)
        print(f"put {run_index(rank, i)}", flush=True)
        check(store, keys, expect_all=True)
        if i % 5 == 4:
            victim = run_keys(run_index(rank, i - 2), nblocks(i - 2))
            assert store.delete(victim[:1]) == len(victim)
            assert store.lookup(victim) == 0
            print(f"del {run_index(rank, i - 2)}", flush=True)
        for other in range(nranks):
            if other == rank:
                continue
            # In step: the other rank's last run, read while it writes its next.
            if i >= 1 and not deleted(i - 1, runs):
                keys = run_keys(run_index(other, i - 1), nblocks(i - 1))
                wait_for(store, keys, f"rank {other}'s run {i - 1}")
                live += check(store, keys, expect_all=True) > 0
            j = (i * 7 + other) % runs  # whatever the others have stored so far
            keys = run_keys(run_index(other, j), nblocks(j))
            cross += check(store, keys, expect_all=False, whole=not deleted(j, runs)) > 0
    store.put_run(marker(rank), run_data(marker(rank)))
    deadline = time.monotonic() + 30
    for other in range(nranks):
        while store.lookup(marker(other)) == 0:
            assert time.monotonic() < deadline, f"rank {other} never finished"
            time.sleep(0.01)
    for other in range(nranks):  # everything every rank acknowledged, byte for byte
        for j in range(runs):
            keys = run_keys(run_index(other, j), nblocks(j))
            if deleted(j, runs):
                assert store.lookup(keys) == 0, f"deleted run {keys[0]!r} still stored"
            else:
                cross += check(store, keys, expect_all=True) > 0 and other != rank
    s = store.stats()
    assert s["pinned_regions"] <= nranks  # only other ranks' reads in flight
    # no read anywhere met a bad block (a dropped run is a read that went wrong)
    assert s["checksum_failures"] == s["read_errors"] == 0, s
    assert s["client"]["checksum_failures"] == s["client"]["read_errors"] == 0, s["client"]
    store.close()
    print(f"live {live}", flush=True)
    print(f"cross {cross}", flush=True)


def deletable(i: int) -> bool:
    """Runs the kill workload may delete (run i-3 after putting run i, i % 7 == 6)."""
    return i % 7 == 3


def kill(sock, start, hold, others):
    store = RemoteStore(sock)
    i = start
    if hold:
        real_write = store._write_run

        def write(batch, sums, run_id):
            out = real_write(batch, sums, run_id)
            if i - start == hold:        # data written, under the fence, commit not sent
                print(f"holding {i}", flush=True)
                sys.stdin.readline()
            return out
        store._write_run = write
    try:
        while True:
            keys = run_keys(i, nblocks(i))
            store.put_run(keys, run_data(keys))
            print(f"put {i}", flush=True)
            if i % 7 == 6:
                store.delete(run_keys(i - 3, nblocks(i - 3))[:1])
                print(f"del {i - 3}", flush=True)
            if i % 3 == 0 and i > start:   # its own last run: acknowledged, not deleted
                check(store, run_keys(i - 1, nblocks(i - 1)), expect_all=True)
            for o in others:               # the other ranks' runs, while they write
                j = o + (i - start) // 2
                check(store, run_keys(j, nblocks(j)), expect_all=False,
                      whole=not deletable(j))
            i += 1
    except ServerGoneError as e:
        assert not store.server_alive
        print(f"gone {type(e).__name__}", flush=True)
        sys.exit(3)


def stall(sock):
    store = RemoteStore(sock)
    keys = [b"stall-read"]
    store.put_run(keys, run_data(keys))
    segs = store._segments(normalize_keys(keys))   # a reader pin, never released
    assert len(segs) == 1
    real_call = store._call_on

    def call(session, op, **args):
        if op == "commit":               # data written and flushed, record not asked for
            print("stalled", flush=True)
            time.sleep(3600)
        return real_call(session, op, **args)

    store._call_on = call
    keys = run_keys(777, 3)
    store.put_run(keys, run_data(keys))


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "mix":
        mix(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
    elif mode == "kill":
        kill(args[0], int(args[1]), int(args[2]), [int(a) for a in args[3:]])
    elif mode == "stall":
        stall(args[0])
    else:
        raise SystemExit(f"unknown mode {mode}")
