"""The vLLM tier's KV events against the store they describe: random store
jobs, deletes of runs, evictions, the removal log lost (a restarted server,
a long pause) and the tier's watch stepping in between.

Folding the events as a reference-counting consumer does (vLLM's
offloading events docstring asks consumers to count repeated announcements:
a stored event adds one per key, a removed one takes one away) must give,
after each step of the watch, a count of one for exactly the keys the tier
stored that the store still holds, and none for the others; and a removed
event never names a key the store holds at that moment (nothing else writes
while the watch steps).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblock.integrations.vllm import KVBlockTierManager
from tests.integrations_vllm.conftest import store_bytes
from tests.integrations_vllm.test_vllm_tier import (
    drain,
    events_spec,
    fill_random,
    job,
    key,
    page_aligned_pool,
)
from tests.integrations_vllm.test_vllm_tier_model import SLOT

KEYS = 24
SLOTS = 16
EXAMPLES = int(os.environ.get("KVBLOCK_MODEL_EXAMPLES", "25"))
# the tier formats the store with its default regions, which the file's
# size sets (and, at 1/8 of one, the most slots a piece holds)
pytestmark = store_bytes(96 << 20)

key_ids = st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=6, unique=True)
steps = st.lists(st.one_of(
    st.tuples(st.just("store"), st.lists(key_ids, min_size=1, max_size=3)),
    st.tuples(st.just("delete"), key_ids),
    st.tuples(st.just("evict"), st.integers(0, 3)),     # regions to free (0: all)
    st.tuples(st.just("lost"), st.none()),
    st.tuples(st.just("watch"), st.none()),
), min_size=1, max_size=14)


def test_events_follow_what_the_store_holds(store_file):
    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(steps=steps)
    def run(steps):
        pool = page_aligned_pool(SLOTS, SLOT)
        fill_random(pool, range(SLOTS))
        tier = KVBlockTierManager(events_spec(True), memoryview(pool.numpy()), "kvblock",
                                  devices=[store_file], format="force", threads=3,
                                  max_run_bytes=4 * SLOT, enable_kv_events=True)
        watch, store = tier._events, tier.store
        watch._ticker.stop()        # no thread of its own: this test steps the watch
        kb = {k: tier.kvblock_key(key(k)) for k in range(KEYS)}
        by_key = {bytes(key(k)): k for k in range(KEYS)}
        stored: set[int] = set()      # keys the tier stored (and announced)
        refs: Counter = Counter()     # the events, folded: announcements per key

        def fold():
            for ev in watch.take():
                ks = [by_key[bytes(k)] for k in ev.keys]
                if ev.removed:
                    held = store.present([kb[k] for k in ks])
                    assert not held.any(), ("a removal of a key the store holds", ks)
                    refs.subtract(ks)
                else:
                    refs.update(ks)

        try:
            job_id = 0
            for op, arg in steps:
                if op == "store":
                    for ks in arg:
                        job_id += 1
                        tier.submit_store(job(job_id, [key(k) for k in ks], range(len(ks))))
                    assert all(r.success for r in drain(tier))
                    stored.update(k for ks in arg for k in ks)
                elif op == "delete":
                    store.delete([kb[k] for k in arg])
                elif op == "evict":
                    if arg:
                        store.evict(store.stats()["regions_free"] * store.regions.size
                                    + arg * store.regions.size)
                    else:
                        store.evict(all=True)
                elif op == "lost":
                    watch._cursor = "a-restarted-server:0"
                watch.poll()
                fold()
                held = {k for k in stored if store.present([kb[k]])[0]}
                assert +refs == Counter(held), (op, arg)
                assert not -refs, (op, arg)        # never removed more than stored
        finally:
            tier.shutdown()

    run()


class _SlowToAnswer:
    """The store, with present() answers that take a while to arrive (as
    from a busy server): the store may change before the watch acts on one."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def present(self, keys):
        held = self._store.present(keys)
        time.sleep(0.003)
        return held


def test_events_follow_the_store_while_the_watch_runs_beside_the_jobs(store_file):
    """The watch steps in a thread of its own, as in vLLM, while store jobs
    put keys back that deletes just removed: once all is quiet and the
    watch took a last step, the folded events are what the store holds."""
    pool = page_aligned_pool(SLOTS, SLOT)
    fill_random(pool, range(SLOTS))
    tier = KVBlockTierManager(events_spec(True), memoryview(pool.numpy()), "kvblock",
                              devices=[store_file], format="force", threads=4,
                              max_run_bytes=SLOT, enable_kv_events=True)
    watch, store = tier._events, tier.store
    watch._ticker.stop()
    watch._store = _SlowToAnswer(store)      # a job may announce a key meanwhile
    kb = {k: tier.kvblock_key(key(k)) for k in range(KEYS)}
    by_key = {bytes(key(k)): k for k in range(KEYS)}
    refs: Counter = Counter()     # announcements per key, as a counting consumer folds them
    quiet = threading.Event()

    def watching():
        while not quiet.is_set():
            watch.poll()

    rng = random.Random(5)
    thread = threading.Thread(target=watching)
    thread.start()
    try:
        job_id = 0
        for _ in range(150):
            ks = rng.sample(range(KEYS), 4)
            for k in ks:
                job_id += 1
                tier.submit_store(job(job_id, [key(k)], [k % SLOTS]))
            store.delete([kb[k] for k in rng.sample(range(KEYS), 3)])
            tier.drain_jobs()
            for ev in watch.take():
                (refs.subtract if ev.removed else refs.update)(
                    by_key[bytes(k)] for k in ev.keys)
    finally:
        quiet.set()
        thread.join()
    try:
        assert all(r.success for r in tier.get_finished_jobs())
        watch.poll()
        for ev in watch.take():
            (refs.subtract if ev.removed else refs.update)(
                by_key[bytes(k)] for k in ev.keys)
        held = {k for k in range(KEYS) if store.present([kb[k]])[0]}
        assert +refs == Counter(held) and not -refs
    finally:
        tier.shutdown()


def test_a_key_removed_before_its_job_is_announced_is_announced_gone(store_file):
    """A store job is announced when its last piece is done.  A key of an
    earlier piece evicted in between, its removal already passed by the
    watch (the key was not announced then), must still be announced gone
    after its BlockStored: else a router keeps sending requests for it."""
    pool = page_aligned_pool(SLOTS, SLOT)
    fill_random(pool, [0, 1])
    tier = KVBlockTierManager(events_spec(True), memoryview(pool.numpy()), "kvblock",
                              devices=[store_file], format="force", threads=1,
                              max_run_bytes=SLOT, enable_kv_events=True)   # a piece per slot
    try:
        watch, store = tier._events, tier.store
        watch._ticker.stop()
        first_done, go = threading.Event(), threading.Event()
        real, pieces = store.put_run, []

        def put_run(keys, data):
            pieces.append(keys)
            if len(pieces) == 2:          # the job's second piece waits
                first_done.set()
                assert go.wait(30)
            return real(keys, data)
        store.put_run = put_run
        k0, k1 = key(1), key(2)
        tier.submit_store(job(1, [k0, k1], [0, 1]))
        assert first_done.wait(30)
        store.evict(all=True)             # k0's run goes before the job is announced
        watch.poll()                      # the watch passes its removal by
        go.set()
        assert [r.success for r in drain(tier)] == [True]
        events = watch.take()
        watch.poll()
        events += watch.take()
        stored = [bytes(k) for ev in events if not ev.removed for k in ev.keys]
        removed = [bytes(k) for ev in events if ev.removed for k in ev.keys]
        assert sorted(stored) == sorted([bytes(k0), bytes(k1)])
        assert removed == [bytes(k0)] and not store.contains(tier.kvblock_key(k0))
        assert watch.announced() == 1 and store.contains(tier.kvblock_key(k1))
    finally:
        tier.shutdown()
