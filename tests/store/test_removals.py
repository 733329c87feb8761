"""removed_since: the keys of runs the store evicted, deleted, cleared or
dropped, for those who announce what it holds (the vLLM tier's KV events)."""

from __future__ import annotations

import pytest

from kvblock import KVStore
from kvblock.errors import ConfigError
from kvblock.index import normalize_keys
from kvblock.store.client import RemoteStore
from kvblock.store.removals import RemovalLog
from kvblock.store.server import serve_in_background
from tests.store.workload import run_data, run_keys, small_store


@pytest.fixture
def store_file(tmp_path):
    return small_store(tmp_path / "kv.img")


def _put(store, i, n=4):
    keys = run_keys(i, n)
    store.put_run(keys, run_data(keys))
    return normalize_keys(keys)


def test_the_log_answers_keys_after_a_cursor_and_none_once_it_lost_some():
    log = RemovalLog(max_keys=4)
    start, keys = log.since(None)
    assert keys == []
    log.add(b"a" * 16 + b"b" * 16)
    mid, keys = log.since(start)
    assert keys == [b"a" * 16, b"b" * 16]
    assert log.since(mid)[1] == []
    log.add(b"c" * 16 + b"d" * 16 + b"e" * 16)
    assert log.since(mid)[1] == [b"c" * 16, b"d" * 16, b"e" * 16]
    assert len(log.since(start)[1]) == 5     # whole runs go: the newer ones hold 3 < 4
    log.add(b"f" * 16)
    assert log.since(start)[1] is None       # the first run went: 4 keys after it
    assert log.since(mid)[1] == [bytes([c]) * 16 for c in b"cdef"]
    assert RemovalLog().since(mid)[1] is None          # another open of the store
    for bad in ("", "abc", f"{mid}x", 7):
        with pytest.raises(ConfigError, match="not a cursor"):
            log.since(bad)


def test_evicted_deleted_and_cleared_runs_are_reported(store_file):
    store = KVStore.open([store_file])
    try:
        cursor, none_yet = store.removed_since()
        assert none_yet == []
        a, b = _put(store, 1), _put(store, 2)
        cursor, keys = store.removed_since(cursor)
        assert keys == []                              # puts remove nothing
        assert store.delete([a[0]]) == 4
        cursor, keys = store.removed_since(cursor)
        assert keys == a
        store.evict(all=True)
        cursor, keys = store.removed_since(cursor)
        assert keys == b
        c = _put(store, 3)
        store.clear()
        cursor, keys = store.removed_since(cursor)
        assert keys == c
        assert store.removed_since(cursor)[1] == []
    finally:
        store.close()
    reopened = KVStore.open([store_file])
    try:
        assert reopened.removed_since(cursor)[1] is None    # a cursor of the last open
    finally:
        reopened.close()


def test_runs_evicted_to_make_room_are_reported(store_file):
    """A full store reclaims the least recently used region for a put."""
    store = KVStore.open([store_file])
    try:
        cursor, _ = store.removed_since()
        stored = [_put(store, i, 8) for i in range(40)]          # 40 x 64 KiB in 4 MiB
        _, keys = store.removed_since(cursor)
        gone = [k for run in stored for k in run if not store.contains(k)]
        assert store.counters["evicted_blocks"] > 0
        assert sorted(keys) == sorted(gone) and len(keys) == store.counters["evicted_blocks"]
    finally:
        store.close()


def test_a_ranks_removals_reach_another_rank_through_the_server(store_file, tmp_path):
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([store_file], sock):
        writer, watcher = RemoteStore(sock), RemoteStore(sock)
        try:
            cursor, _ = watcher.removed_since()
            a = _put(writer, 1)
            writer.delete(a[:1])
            cursor, keys = watcher.removed_since(cursor)
            assert keys == a
            with pytest.raises(ConfigError, match="not a cursor"):
                watcher.removed_since("nonsense")
        finally:
            writer.close()
            watcher.close()
    with serve_in_background([store_file], sock):       # a restarted server
        watcher = RemoteStore(sock)
        try:
            assert watcher.removed_since(cursor)[1] is None
        finally:
            watcher.close()


def test_a_position_a_newer_run_took_over_is_not_logged_after_a_reopen(store_file):
    """A checkpoint names a run's positions that a newer run took over as
    SUPERSEDED (zero bytes); evicting the reopened run logs its own keys."""
    store = KVStore.open([store_file])
    a = _put(store, 1)
    newer = run_keys(1, 4)[1:2] + run_keys(9, 1)        # a[1] again, and a new key
    store.put_run(newer, run_data(newer))
    store.close()
    store = KVStore.open([store_file])
    try:
        cursor, _ = store.removed_since()
        store.evict(all=True)
        _, keys = store.removed_since(cursor)
        assert bytes(16) not in keys
        assert sorted(keys) == sorted(a + normalize_keys(newer[1:]))
    finally:
        store.close()


def test_a_log_interrupted_at_any_line_of_add_still_answers_the_keys_logged():
    """A KeyboardInterrupt landing at any line of RemovalLog.add (a Ctrl-C
    while a store forgets a run): cut between the run's append and its
    count, a watcher was handed the new run's keys in place of an older
    run's, and never told those left.  Now the run is logged whole or not
    at all, and since() answers exactly the runs logged after a cursor."""
    import sys

    from tests.store.test_store import _pending_interrupt_points

    code = RemovalLog.add.__code__
    # (not where CPython cannot raise one: a with block's normal exit)
    skip = _pending_interrupt_points(code)
    n = 0
    while True:
        n += 1
        log = RemovalLog(max_keys=8)
        runs = [normalize_keys(run_keys(i, 3)) for i in range(4)]
        for keys in runs[:3]:
            log.add(b"".join(keys))            # the first is trimmed at the next adds
        cursor, _ = log.since(None)
        seen, fired = [0], [False]

        def line(frame, event, arg):
            if event == "line" and frame.f_lasti not in skip:
                seen[0] += 1
                if seen[0] == n:
                    fired[0] = True
                    raise KeyboardInterrupt
            return line
        sys.settrace(lambda frame, event, arg: line if frame.f_code is code else None)
        try:
            log.add(b"".join(runs[3]))
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        _, after = log.since(cursor)
        assert after in ([], runs[3]), n
        now, _ = log.since(None)
        epoch, count = now.split(":")
        _, back = log.since(f"{epoch}:{int(count) - 3 - len(after)}")
        assert back == runs[2] + after, n     # the run before, then the cut one if logged
        if not fired[0]:
            break
        assert n < 50, "a log.add of a few lines"
    assert n > 4
