"""kvblock as a vLLM 0.33 secondary tier, against vLLM's real base classes.

Follows vLLM's own tests/v1/kv_offload/tiering/test_fs_tier.py: the primary
pool is a page-aligned CPU tensor seen through a memoryview, jobs are
TransferJobs, results come back from get_finished_jobs().  The store is a
pre-sized file under tmp_path.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import signal
import threading
import time
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

import kvblock
from kvblock import Geometry, KVStore
from kvblock.errors import ConfigError, GeometryMismatchError, KVBlockError, NotAStoreError
from kvblock.integrations import vllm as kv_vllm
from kvblock.integrations.vllm import KVBlockTierManager, slot_geometry
from tests.integrations_vllm.conftest import STORE_REGION_BYTES, store_bytes

PAGE = mmap.PAGESIZE
SLOT = 64 * PAGE            # 256 KiB slots
NUM_SLOTS = 16
CTX = ReqContext(req_id="test")


def make_spec(model="test-model", tp_size=1, dtype="bfloat16", dp_index=0,
              dp_size=1) -> MagicMock:
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=dp_index, data_parallel_size=dp_size,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
    )
    spec.blocks_per_chunk = 1
    return spec


def key(n: int, group: int = 0):
    return make_offload_key(n.to_bytes(8, "big"), group)


def job(job_id, keys, chunk_ids, promotion=False) -> TransferJob:
    return TransferJob(job_id=job_id, keys=list(keys),
                       chunk_ids=np.array(chunk_ids, dtype=np.int64),
                       is_promotion=promotion, req_context=CTX)


def page_aligned_pool(num_slots=NUM_SLOTS, slot=SLOT) -> torch.Tensor:
    """(num_slots, slot/4) float32 tensor on page-aligned memory."""
    raw = torch.zeros(num_slots * slot + PAGE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE
    return raw[shift:shift + num_slots * slot].view(torch.float32).view(num_slots, slot // 4)


def fill_random(t: torch.Tensor, rows) -> None:
    for r in rows:
        t[r] = torch.rand(t.shape[1], dtype=t.dtype)


def drain(tier) -> list[JobResult]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


@pytest.fixture(autouse=True)
def _fresh_metrics_records(monkeypatch):
    """What was reported of each store's counters is kept per store uuid
    for the process (vllm_metrics._REPORTED); tests reuse made-up uuids
    ("u", "shared"), so each starts with none."""
    from kvblock.integrations import vllm_metrics

    monkeypatch.setattr(vllm_metrics, "_REPORTED", {})


@pytest.fixture
def make_tier(store_file):
    made = []

    def make(pool=None, spec=None, **config):
        pool = page_aligned_pool() if pool is None else pool
        if "devices" not in config:
            config["devices"] = [store_file]
            # (the regions, and so the pieces jobs are cut into, of the
            # size every such test was written for, whatever the file's)
            config.setdefault("region_size", STORE_REGION_BYTES)
        config.setdefault("threads", 4)
        tier = KVBlockTierManager(offloading_spec=spec or make_spec(),
                                  primary_kv_view=memoryview(pool.numpy()),
                                  tier_type="kvblock", **config)
        made.append(tier)
        return tier, pool

    yield make
    for tier in made:
        tier.shutdown()


# --------------------------------------------------------------------------- basics
def test_is_a_real_secondary_tier(make_tier):
    tier, _ = make_tier()
    assert isinstance(tier, SecondaryTierManager)
    assert tier.block_size_bytes == SLOT
    assert tier.geometry == slot_geometry(SLOT)
    assert tier.geometry.block_bytes == SLOT and tier.geometry.ranges == 1
    assert tier.store.geometry == tier.geometry


def test_lookup_empty_tier(make_tier):
    tier, _ = make_tier()
    assert [tier.lookup(key(i), CTX) for i in (1, 2)] == [LookupResult.MISS] * 2


def test_store_then_load_roundtrip(make_tier):
    tier, pool = make_tier()
    fill_random(pool, range(2))
    expected = pool[:2].clone()
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    (res,) = drain(tier)
    assert res.job_id == 1 and res.success and res.transfer_bytes == 2 * SLOT
    assert [tier.lookup(k, CTX) for k in (key(1), key(2))] == [LookupResult.HIT] * 2

    pool.zero_()
    tier.submit_load(job(2, [key(1), key(2)], [5, 6], promotion=True))
    (res,) = drain(tier)
    assert res.success and res.successful_keys is None and res.transfer_bytes == 2 * SLOT
    assert torch.equal(pool[5], expected[0]) and torch.equal(pool[6], expected[1])
    # blocks stay in the tier after a load
    assert [tier.lookup(k, CTX) for k in (key(1), key(2))] == [LookupResult.HIT] * 2


PATTERNS = {
    "adjacent": lambda n: list(range(n)),
    "reversed": lambda n: list(range(n))[::-1],              # vLLM's LIFO free list
    "scattered": lambda n: [(3 * i + 1) % NUM_SLOTS for i in range(n)],
}


@pytest.mark.parametrize("batch_size", [0, 1, 2, 5, 8])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_store_load_data_integrity(make_tier, batch_size, pattern):
    """Bytes come back identical for any batch size, whether the slots are
    adjacent (one I/O per run) or not (one I/O per slot), through runs of 2 slots."""
    tier, pool = make_tier(max_run_bytes=2 * SLOT)
    store_ids = PATTERNS[pattern](batch_size)
    fill_random(pool, range(NUM_SLOTS))
    expected = pool[store_ids].clone()
    keys = [key(100 + i) for i in range(batch_size)]

    tier.submit_store(job(1, keys, store_ids))
    results = drain(tier)
    assert [r.success for r in results] == [True]

    pool.zero_()
    load_ids = list(range(NUM_SLOTS - batch_size, NUM_SLOTS))      # other slots
    if pattern != "adjacent":
        load_ids = load_ids[::-1]
    tier.submit_load(job(2, keys, load_ids, promotion=True))
    results = drain(tier)
    assert [r.success for r in results] == [True]
    for i, cid in enumerate(load_ids):
        assert torch.equal(pool[cid], expected[i]), f"slot {cid} differs after store+load"
    untouched = sorted(set(range(NUM_SLOTS)) - set(load_ids))
    assert not pool[untouched].any(), "a load wrote outside its slots"


@store_bytes(96 << 20)    # several of its 16 MiB regions
def test_zero_copy_paths_for_adjacent_slots(make_tier, monkeypatch):
    """Adjacent ascending slots reach put_run/get_run as views of the pool."""
    tier, pool = make_tier(region_size="16M")
    assert tier.max_run_blocks >= 4
    base = pool.numpy().ctypes.data
    seen = []
    put, get = tier.store.put_run, tier.store.get_run

    def spy_put(keys, data):
        seen.append(("put", np.asarray(data).ctypes.data))
        return put(keys, data)

    def spy_get(keys, out):
        seen.append(("get", np.asarray(out).ctypes.data))
        return get(keys, out)

    monkeypatch.setattr(tier.store, "put_run", spy_put)
    monkeypatch.setattr(tier.store, "get_run", spy_get)
    fill_random(pool, range(4))
    tier.submit_store(job(1, [key(i) for i in range(4)], [2, 3, 4, 5]))
    assert drain(tier)[0].success
    tier.submit_load(job(2, [key(i) for i in range(4)], [8, 9, 10, 11], promotion=True))
    assert drain(tier)[0].success
    assert seen == [("put", base + 2 * SLOT), ("get", base + 8 * SLOT)]
    assert tier.stats()["put_runs"] == 1


@store_bytes(96 << 20)    # several of its 16 MiB regions
def test_zero_copy_paths_for_scattered_slots(make_tier, monkeypatch):
    """Scattered slots reach put_blocks/get_blocks as views of the pool slots
    themselves, and the store does direct I/O on them (no staging)."""
    tier, pool = make_tier(region_size="16M")
    base = pool.numpy().ctypes.data
    seen, batches = [], []
    put, get = tier.store.put_blocks, tier.store.get_blocks
    read, write = tier.store.io.read, tier.store.io.write
    hashed, write_hashed = tier.store.io.read_hashed, tier.store.io.write_hashed

    def spy(kind, fn):
        def call(keys, blocks):
            seen.append((kind, [np.asarray(b).ctypes.data for b in blocks]))
            return fn(keys, blocks)
        return call

    monkeypatch.setattr(tier.store, "put_blocks", spy("put", put))
    monkeypatch.setattr(tier.store, "get_blocks", spy("get", get))
    monkeypatch.setattr(tier.store.io, "read", lambda b: (batches.append(b), read(b))[1])
    monkeypatch.setattr(tier.store.io, "read_hashed",
                        lambda b, s, d: (batches.append(b), hashed(b, s, d))[1])
    monkeypatch.setattr(tier.store.io, "write", lambda b: (batches.append(b), write(b))[1])
    monkeypatch.setattr(tier.store.io, "write_hashed",     # into a mapped tmpfs file
                        lambda b, s, d: (batches.append(b), write_hashed(b, s, d))[1])
    fill_random(pool, range(NUM_SLOTS))
    expected = pool[[7, 2, 5]].clone()
    tier.submit_store(job(1, [key(i) for i in range(3)], [7, 2, 5]))
    assert drain(tier)[0].success
    pool.zero_()
    tier.submit_load(job(2, [key(i) for i in range(3)], [1, 6, 3], promotion=True))
    assert drain(tier)[0].success
    assert seen == [("put", [base + c * SLOT for c in (7, 2, 5)]),
                    ("get", [base + c * SLOT for c in (1, 6, 3)])]
    assert torch.equal(pool[[1, 6, 3]], expected)
    pool_end = base + NUM_SLOTS * SLOT
    trailer = tier.store.layout(3).trailer_bytes
    # (new names: the spies above still call ``write`` and ``read``, also
    # for the store's own writes as it closes)
    wrote, = [b for b in batches if b.nbytes == 3 * SLOT + trailer]
    got, = [b for b in batches if b.nbytes == 3 * SLOT]
    # every data I/O comes from / lands in the pool itself; the write's last
    # I/O is the run's block digest trailer
    assert all(base <= a < pool_end for a in wrote.addrs[:-1].tolist())
    assert not base <= int(wrote.addrs[-1]) < pool_end and int(wrote.lens[-1]) == trailer
    assert all(base <= a < pool_end for a in got.addrs.tolist())


def test_many_concurrent_jobs(make_tier):
    """Many jobs in flight on 4 workers: every byte lands where it should."""
    rng = np.random.default_rng(7)
    tier, pool = make_tier(max_run_bytes=3 * SLOT, threads=4)
    fill_random(pool, range(NUM_SLOTS))
    truth = {}
    jid = 0
    for batch in range(6):
        ids = rng.permutation(NUM_SLOTS)[:rng.integers(1, 9)]
        keys = [key(1000 + batch * 100 + i) for i in range(len(ids))]
        for k, c in zip(keys, ids):
            truth[k] = pool[int(c)].clone()
        jid += 1
        tier.submit_store(job(jid, keys, ids))
    results = drain(tier)
    assert len(results) == 6 and all(r.success for r in results)
    pool.zero_()
    all_keys = list(truth)
    for start in range(0, len(all_keys), NUM_SLOTS):
        keys = all_keys[start:start + NUM_SLOTS]
        ids = rng.permutation(NUM_SLOTS)[:len(keys)]
        jid += 1
        tier.submit_load(job(jid, keys, ids, promotion=True))
        assert [r.success for r in drain(tier)] == [True]
        for k, c in zip(keys, ids):
            assert torch.equal(pool[int(c)], truth[k])


# --------------------------------------------------------------------------- misses
def test_load_of_missing_key_fails(make_tier):
    tier, _ = make_tier()
    tier.submit_load(job(1, [key(99)], [0], promotion=True))
    (res,) = drain(tier)
    assert res.job_id == 1 and not res.success and res.successful_keys is None


@pytest.mark.parametrize("bad", [-1, NUM_SLOTS])
def test_a_job_naming_a_slot_outside_the_pool_is_refused(make_tier, caplog, bad):
    """A slot id past the pool shortened the slice a piece read into (the
    job "succeeded" with keys never loaded), a negative one wrapped to
    another slot (its bytes overwritten).  The job is refused: its bytes
    untouched, an error naming the slot logged, and it is reported finished
    as failed (raised out of submit_*, it stayed open in vLLM for good: its
    slots pinned, the request never finalized)."""
    tier, pool = make_tier()
    fill_random(pool, [0, 1])
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert [r.success for r in drain(tier)] == [True]
    before = pool.clone()
    tier.on_new_request(CTX)
    with caplog.at_level(logging.ERROR, logger="kvblock.integrations.vllm"):
        tier.submit_load(job(2, [key(1), key(2)], [0, bad], promotion=True))
        tier.submit_store(job(3, [key(3), key(4)], [0, bad]))
    assert tier.has_pending_work()
    results = drain(tier)
    assert [(r.job_id, r.success, r.successful_keys) for r in results] == \
        [(2, False, None), (3, False, None)]
    assert torch.equal(pool, before)
    assert caplog.text.count(f"primary slot {bad}, outside the pool's {NUM_SLOTS} slots") == 2
    # the refused load's keys miss for its request (a HIT would have vLLM
    # promote them again, refused again, every step); the store kept them
    assert [tier.lookup(k, CTX) for k in (key(1), key(2))] == [LookupResult.MISS] * 2
    other = ReqContext(req_id="other")
    tier.on_new_request(other)
    assert [tier.lookup(k, other) for k in (key(1), key(2))] == [LookupResult.HIT] * 2
    assert [tier.lookup(k, other) for k in (key(3), key(4))] == [LookupResult.MISS] * 2


@pytest.mark.parametrize("what", ["count", "key type", "no keys"])
def test_a_job_vllm_would_never_send_is_reported_failed(make_tier, caplog, what):
    """Keys and chunk ids of different counts, or a key that is not bytes
    (an int became that many zero bytes: int keys of one value were one
    kvblock key, a HIT for another's bytes): the job is reported failed."""
    tier, pool = make_tier()
    fill_random(pool, [0, 1])
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert [r.success for r in drain(tier)] == [True]
    before = pool.clone()
    keys, ids = {"count": ([key(1), key(2)], [0]), "key type": ([key(1), 2], [0, 1]),
                 "no keys": (None, [0])}[what]
    tier.on_new_request(CTX)
    with caplog.at_level(logging.ERROR, logger="kvblock.integrations.vllm"):
        for jid, submit in ((2, tier.submit_load), (3, tier.submit_store)):
            submit(TransferJob(job_id=jid, keys=keys, chunk_ids=np.array(ids),
                               is_promotion=jid == 2, req_context=CTX))
    results = drain(tier)
    assert [(r.job_id, r.success) for r in results] == [(2, False), (3, False)]
    assert torch.equal(pool, before)
    said = {"count": "2 keys but 1 chunk ids", "key type": "key 2 is int, not bytes",
            "no keys": "'NoneType' object is not iterable"}[what]
    assert caplog.text.count(said) == 2, caplog.text
    if what == "key type":
        with pytest.raises(ConfigError, match="is int, not bytes"):
            tier.kvblock_key(2)


def test_a_key_that_is_not_bytes_is_a_miss_for_lookup_and_touch(make_tier, caplog,
                                                                 monkeypatch):
    """vLLM's tiering manager calls a secondary tier's lookup and touch on
    its scheduler thread with no try around them: an exception there ends
    the engine.  A key that is not bytes (vLLM sends bytes OffloadKeys) is
    refused as submit_store and submit_load refuse it (logged, a failure of
    that key only): lookup answers MISS, touch skips it and touches the
    others."""
    tier, pool = make_tier()
    fill_random(pool, [0])
    tier.submit_store(job(1, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    touched = []
    real_touch = tier.store.touch
    monkeypatch.setattr(tier.store, "touch", lambda kbs: (touched.append(list(kbs)),
                                                          real_touch(kbs))[1])
    with caplog.at_level(logging.ERROR, logger="kvblock.integrations.vllm"):
        assert tier.lookup(7, CTX) is LookupResult.MISS
        assert tier.lookup(key(1), CTX) is LookupResult.HIT
        tier.touch([key(1), "k", key(2)], CTX)
        tier.touch([None], CTX)
    assert touched == [[tier.kvblock_key(key(1)), tier.kvblock_key(key(2))]]
    assert caplog.text.count("key 7 is int, not bytes") == 1, caplog.text
    assert caplog.text.count("key 'k' is str, not bytes") == 1, caplog.text
    assert caplog.text.count("key None is NoneType, not bytes") == 1, caplog.text


def test_partial_load_names_the_keys_it_loaded(make_tier):
    """A job with a missing key in the middle fails, loads the others and says
    which (JobResult.successful_keys, as vLLM's manager expects)."""
    tier, pool = make_tier()
    fill_random(pool, range(3))
    expected = pool[:3].clone()
    tier.submit_store(job(1, [key(10), key(11), key(12)], [0, 1, 2]))
    assert drain(tier)[0].success
    pool.zero_()
    keys = [key(10), key(99), key(11), key(12)]
    tier.submit_load(job(2, keys, [4, 5, 6, 7], promotion=True))
    (res,) = drain(tier)
    assert not res.success
    assert set(res.successful_keys) == {key(10), key(11), key(12)}
    assert res.transfer_bytes == 3 * SLOT
    assert torch.equal(pool[4], expected[0])
    assert torch.equal(pool[6], expected[1]) and torch.equal(pool[7], expected[2])
    assert not pool[5].any()


def test_unreadable_run_fails_its_keys_and_becomes_a_miss(make_tier):
    """EIO on one stored run: the load fails for that run's keys only, the
    others load, and the keys that failed miss from then on, so vLLM's
    manager does not promote them again every step."""
    from tests.support.faults import BadSectors

    tier, pool = make_tier()
    fill_random(pool, range(6))
    expected = pool[:6].clone()
    keys = [key(40 + i) for i in range(6)]
    for j in range(3):                                  # three runs of 2 slots
        tier.submit_store(job(1 + j, keys[2 * j:2 * j + 2], [2 * j, 2 * j + 1]))
    assert all(r.success for r in drain(tier))
    store = tier.store
    run = store.index.runs[store.index.segments([tier.kvblock_key(keys[2])])[0][0].run_id]
    bad = BadSectors()
    # both its slots: a piece that reads just one of them (its window and the
    # trailer) meets the error too
    bad.add(*store.regions.address(run.region, run.offset), 2 * SLOT)
    bad.install(store)
    pool.zero_()
    tier.submit_load(job(9, keys, range(8, 14), promotion=True))   # pieces span runs
    (res,) = drain(tier)
    assert not res.success and bad.reads_failed >= 1      # pieces that met it, concurrently
    assert set(res.successful_keys) == {keys[0], keys[1], keys[4], keys[5]}
    for i in (0, 1, 4, 5):
        assert torch.equal(pool[8 + i], expected[i])
    assert [tier.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 2 + \
        [LookupResult.MISS] * 2 + [LookupResult.HIT] * 2
    # one run met the error, however many pieces read it (counted once, as
    # a checksum failure is)
    assert tier.stats()["read_errors"] == 1


@store_bytes(96 << 20)    # two of its 32 MiB regions
@pytest.mark.parametrize("fault", [None, "eio"])
def test_small_loads_queued_together_are_read_in_one_store_call(make_tier, monkeypatch,
                                                                fault):
    """Small promotions queued behind one another are read with one
    KVStore.get_runs call; each job's result is its own: a key that missed
    fails its job only (successful_keys names the others), and with EIO
    under one job's run, that job fails and its keys miss from then on."""
    from tests.support.faults import BadSectors

    tier, pool = make_tier(pool=page_aligned_pool(48), threads=1, region_size="32M")
    assert tier.max_run_blocks >= 10      # every job below is one piece
    fill_random(pool, range(16))
    expected = pool[:16].clone()
    keys = [key(300 + i) for i in range(16)]
    for j, (a, b) in enumerate([(0, 10), (10, 14), (14, 16)]):    # runs of 10, 4, 2 slots
        tier.submit_store(job(1 + j, keys[a:b], range(a, b)))
    assert all(r.success for r in drain(tier))
    store = tier.store
    if fault:
        run = store.index.segments([tier.kvblock_key(keys[14])])[0][0]
        bad = BadSectors()
        bad.add(*store.regions.address(run.region, run.offset), 2 * SLOT)
        bad.install(store)
    pool.zero_()
    gate, calls = threading.Event(), []
    get_run, get_runs = store.get_run, store.get_runs

    def held_get_run(*a):
        gate.wait(10)                    # the worker waits here while the rest queue
        return get_run(*a)

    monkeypatch.setattr(store, "get_run", held_get_run)
    monkeypatch.setattr(store, "get_runs", lambda reqs: (calls.append(len(reqs)),
                                                         get_runs(reqs))[1])
    tier.submit_load(job(10, keys[:10], range(16, 26), promotion=True))   # not small
    tier.submit_load(job(11, keys[11:13], [26, 27], promotion=True))
    tier.submit_load(job(12, keys[14:16], [28, 29], promotion=True))
    tier.submit_load(job(13, [keys[10], key(999), keys[13]], [30, 31, 32], promotion=True))
    gate.set()
    results = {r.job_id: r for r in drain(tier)}
    assert calls[0] == 3
    assert results[10].success and results[11].success
    assert torch.equal(pool[16:26], expected[:10]) and torch.equal(pool[26:28], expected[11:13])
    assert not results[13].success and set(results[13].successful_keys) == {keys[10], keys[13]}
    assert torch.equal(pool[30], expected[10]) and torch.equal(pool[32], expected[13])
    assert not pool[31].any()
    if fault:
        assert not results[12].success and results[12].successful_keys is None
        assert [tier.lookup(k, CTX) for k in keys[14:16]] == [LookupResult.MISS] * 2
        assert bad.reads_failed >= 1
    else:
        assert results[12].success and torch.equal(pool[28:30], expected[14:16])


def _hold_first(store, name: str):
    """Make the store's first ``name`` call wait until the returned event is
    set: the tier's one worker is busy there while the test queues jobs."""
    gate, real = threading.Event(), getattr(store, name)

    def held(*a):
        gate.wait(10)
        return real(*a)

    setattr(store, name, held)
    return gate


@store_bytes(96 << 20)    # two of its 32 MiB regions
def test_small_load_batched_with_others_keeps_its_keys_before_an_unreadable_run(
        make_tier, monkeypatch):
    """A small promotion read with others in one get_runs call, whose keys
    span an intact run and then one under EIO: the store fails the whole
    request (count 0), but only the unreadable run's keys may fail; the key
    of the intact run before it loads (successful_keys names it), as when
    the job is read on its own."""
    from tests.support.faults import BadSectors

    tier, pool = make_tier(pool=page_aligned_pool(48), threads=1, region_size="32M")
    fill_random(pool, range(6))
    expected = pool[:6].clone()
    keys = [key(500 + i) for i in range(6)]
    for j, (a, b) in enumerate([(0, 2), (2, 4), (4, 6)]):         # runs of 2 slots
        tier.submit_store(job(1 + j, keys[a:b], range(a, b)))
    assert all(r.success for r in drain(tier))
    store = tier.store
    run = store.index.segments([tier.kvblock_key(keys[4])])[0][0]
    bad = BadSectors()
    bad.add(*store.regions.address(run.region, run.offset), 2 * SLOT)
    bad.install(store)
    pool.zero_()
    gate = _hold_first(store, "get_blocks")
    calls = []
    get_runs = store.get_runs
    monkeypatch.setattr(store, "get_runs", lambda reqs: (calls.append(len(reqs)),
                                                         get_runs(reqs))[1])
    tier.submit_load(job(10, keys[:2], [16, 18], promotion=True))  # scattered: holds the worker
    tier.submit_load(job(11, keys[:2], [20, 21], promotion=True))
    tier.submit_load(job(12, keys[3:6], [24, 25, 26], promotion=True))   # intact, then EIO
    gate.set()
    results = {r.job_id: r for r in drain(tier)}
    assert calls and calls[0] == 2                   # jobs 11 and 12 read together
    assert results[10].success and results[11].success
    assert bad.reads_failed >= 1
    assert not results[12].success
    assert set(results[12].successful_keys or ()) == {keys[3]}
    assert torch.equal(pool[24], expected[3])
    assert [tier.lookup(k, CTX) for k in keys[3:6]] == [LookupResult.HIT] + \
        [LookupResult.MISS] * 2

@store_bytes(96 << 20)    # two of its 32 MiB regions
@pytest.mark.parametrize("together", [False, True])
def test_a_load_that_fails_midway_keeps_the_keys_it_read(make_tier, monkeypatch, together):
    """A load piece whose read fails after it has read some keys (an I/O
    engine failure that reached no device, past a key that missed): the
    keys read before it are in the pool, verified, so successful_keys names
    them and transfer_bytes counts them, whether the piece was read on its
    own or with other small loads in one get_runs call."""
    from kvblock.errors import IOFailedError

    tier, pool = make_tier(pool=page_aligned_pool(48), threads=1, region_size="32M")
    fill_random(pool, range(4))
    expected = pool[:4].clone()
    keys = [key(700 + i) for i in range(4)]
    for i, k in enumerate(keys):
        tier.submit_store(job(1 + i, [k], [i]))
    assert all(r.success for r in drain(tier))
    store = tier.store
    store.delete([tier.kvblock_key(keys[1])])
    pool.zero_()
    get_run, engine_down = store.get_run, tier.kvblock_key(keys[2])

    def failing_get_run(kbs, out):
        if bytes(kbs[0]) == engine_down:
            raise IOFailedError("io engine: submit failed")   # no device: nothing dropped
        return get_run(kbs, out)

    monkeypatch.setattr(store, "get_run", failing_get_run)
    if together:
        gate = _hold_first(store, "get_blocks")
        # scattered slots: read alone (get_blocks), holding the worker
        tier.submit_load(job(10, [keys[0], keys[3]], [16, 18], promotion=True))
        tier.submit_load(job(11, keys[:1], [30], promotion=True))
    tier.submit_load(job(12, keys, [24, 25, 26, 27], promotion=True))
    if together:
        gate.set()
    results = {r.job_id: r for r in drain(tier)}
    res = results[12]
    assert not res.success and set(res.successful_keys or ()) == {keys[0]}
    assert res.transfer_bytes == SLOT
    assert torch.equal(pool[24], expected[0])


@store_bytes(96 << 20)    # two of its 32 MiB regions
def test_small_stores_queued_together_are_written_with_one_commit(make_tier, monkeypatch):
    """Small stores queued behind one another go to the store in one put_runs
    call (one flush, one journal commit); a job whose keys are stored
    already writes nothing, one with some of them stored writes the rest on
    its own; every slot loads back byte for byte."""
    tier, pool = make_tier(pool=page_aligned_pool(48), threads=1, region_size="32M")
    fill_random(pool, range(24))
    expected = pool[:24].clone()
    keys = [key(500 + i) for i in range(24)]
    tier.submit_store(job(1, keys[20:23], [20, 21, 22]))
    assert drain(tier)[0].success
    store = tier.store
    batches = []
    put_runs = store.put_runs
    monkeypatch.setattr(store, "put_runs", lambda items: (batches.append(len(items)),
                                                          put_runs(items))[1])
    gate = _hold_first(store, "put_run")
    tier.submit_store(job(2, keys[:10], range(10)))                       # not small: alone
    tier.submit_store(job(3, keys[10:12], [10, 11]))
    tier.submit_store(job(4, keys[12:15], [12, 13, 14]))
    tier.submit_store(job(5, keys[20:22], [20, 21]))                      # stored already
    tier.submit_store(job(6, keys[22:24], [22, 23]))                      # half stored
    gate.set()
    results = {r.job_id: r for r in drain(tier)}
    assert all(r.success for r in results.values()), results
    assert batches == [2]
    assert results[5].transfer_bytes == results[6].transfer_bytes == 2 * SLOT     # all keys
    pool.zero_()
    tier.submit_load(job(9, keys[:15] + keys[20:24], range(19), promotion=True))
    assert drain(tier)[0].success
    assert torch.equal(pool[:15], expected[:15]) and torch.equal(pool[15:19], expected[20:24])


@store_bytes(96 << 20)    # two of its 32 MiB regions
@pytest.mark.parametrize("kind", ["load", "store"])
def test_pieces_whose_call_together_fails_go_alone(make_tier, monkeypatch, kind):
    """When the call for several small pieces fails (a bug here: any
    exception), each piece runs on its own; the worker lives on and every
    job lands."""
    tier, pool = make_tier(pool=page_aligned_pool(48), threads=1, region_size="32M")
    fill_random(pool, range(16))
    expected = pool[:16].clone()
    keys = [key(600 + i) for i in range(16)]
    if kind == "load":
        tier.submit_store(job(1, keys[:10], range(10)))
        tier.submit_store(job(2, keys[10:16], range(10, 16)))
        assert all(r.success for r in drain(tier))
        pool.zero_()
    store = tier.store
    monkeypatch.setattr(store, "get_runs" if kind == "load" else "put_runs",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    gate = _hold_first(store, "get_run" if kind == "load" else "put_run")
    submit = tier.submit_load if kind == "load" else tier.submit_store
    offset = 16 if kind == "load" else 0
    submit(job(3, keys[:10], range(offset, offset + 10), promotion=kind == "load"))
    for j in range(3):
        ids = range(offset + 10 + 2 * j, offset + 12 + 2 * j)
        submit(job(4 + j, keys[10 + 2 * j:12 + 2 * j], ids, promotion=kind == "load"))
    gate.set()
    results = drain(tier)
    assert len(results) == 4 and all(r.success for r in results)
    if kind == "store":
        pool.zero_()
        tier.submit_load(job(9, keys, range(16, 32), promotion=True))
        assert drain(tier)[0].success
    assert torch.equal(pool[16:32], expected)


def test_touch_keeps_touched_chunks_when_the_store_evicts(tmp_path):
    """vLLM touches the chunks it is about to use: with LRU eviction they
    outlive chunks stored after them that nobody touched."""
    pool = page_aligned_pool(4)
    tier = KVBlockTierManager(make_spec(), memoryview(pool.numpy()), "kvblock",
                              devices=[str(tmp_path / "kv.img")], size="16M",
                              region_size=4 * (SLOT + 4096), threads=1)
    # a region holds one job: 4 one-slot runs, each with its 4 KiB trailer
    try:
        _touched_chunks_outlive_the_untouched(tier, pool, 40)    # 40 MiB through 16 MiB
    finally:
        tier.shutdown()


def _touched_chunks_outlive_the_untouched(tier, pool, jobs: int) -> None:
    """Four chunks stored, then ``jobs`` store jobs of four chunks more,
    the first four touched after each: the store evicted, and kept the
    touched ones, not the first chunk stored after them."""
    fill_random(pool, range(4))
    hot = [key(900 + i) for i in range(4)]
    tier.submit_store(job(1, hot, range(4)))
    assert drain(tier)[0].success
    for n in range(jobs):
        tier.submit_store(job(2 + n, [key(1000 + 4 * n + i) for i in range(4)], range(4)))
        assert drain(tier)[0].success
        tier.touch(hot, CTX)
    assert tier.stats()["evicted_regions"] > 0
    assert [tier.lookup(k, CTX) for k in hot] == [LookupResult.HIT] * 4
    assert tier.lookup(key(1000), CTX) is LookupResult.MISS


def test_touch_reaches_a_shared_store_through_its_server(tmp_path, shm_target):
    """With "server" the tier passes vLLM's touch to the store server: with
    LRU eviction the touched chunks outlive chunks stored after them that
    nobody touched, as on a store of its own."""
    from tests.support.servers import stop_server

    dev, sock = shm_target(8 << 20), str(tmp_path / "kv.sock")
    pool = page_aligned_pool(4)
    tier = KVBlockTierManager(make_spec(), memoryview(pool.numpy()), "kvblock", devices=[dev],
                              server=sock, region_size=4 * (SLOT + 4096), threads=1)
    pid = tier.store.server_pid
    try:
        assert tier.store.regions.count < 10
        _touched_chunks_outlive_the_untouched(tier, pool, 16)    # 16 MiB through 8 MiB
    finally:
        tier.shutdown()
        stop_server(pid)


def test_group_index_is_part_of_the_key(make_tier):
    tier, pool = make_tier()
    tier.submit_store(job(1, [key(5, group=0)], [0]))
    assert drain(tier)[0].success
    assert tier.lookup(key(5, group=0), CTX) is LookupResult.HIT
    assert tier.lookup(key(5, group=1), CTX) is LookupResult.MISS


# --------------------------------------------------------------------------- in flight
def test_lookup_while_store_in_flight(make_tier, monkeypatch):
    """RETRY while the key's store job runs; HIT once it finished; lookups
    and submits never wait for the I/O."""
    tier, pool = make_tier(threads=1)
    gate, entered = threading.Event(), threading.Event()
    put = tier.store.put_run

    def slow_put(keys, data):
        entered.set()
        assert gate.wait(10)
        return put(keys, data)

    monkeypatch.setattr(tier.store, "put_run", slow_put)
    fill_random(pool, range(2))
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert entered.wait(10)
    try:
        assert tier.lookup(key(1), CTX) is LookupResult.RETRY
        assert tier.lookup(key(3), CTX) is LookupResult.MISS
        assert tier.has_pending_work()
        assert list(tier.get_finished_jobs()) == []
        # a second store of the same key leaves it to the job in flight
        tier.submit_store(job(2, [key(2)], [1]))
    finally:
        gate.set()
    results = sorted(drain(tier), key=lambda r: r.job_id)
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    assert results[1].transfer_bytes == SLOT         # its key, left to job 1
    assert tier.lookup(key(1), CTX) is LookupResult.HIT
    assert tier.stats()["put_blocks"] == 2
    assert not tier.has_pending_work()


def test_a_store_that_left_keys_to_a_failing_job_fails_too(make_tier, monkeypatch):
    """Job 2 leaves key 2 to job 1, which is writing it, and writes key 3
    itself; job 1's write then fails.  Job 2 is reported only after job 1,
    and as failed: key 2 was never stored (vLLM would count it as offloaded
    and never store it again)."""
    tier, pool = make_tier(threads=2)
    gate, entered = threading.Event(), threading.Event()
    put = tier.store.put_run
    first = tier.kvblock_key(key(1))

    def failing_put(keys, data):
        if keys[0] == first:
            entered.set()
            assert gate.wait(10)
            raise KVBlockError("injected: the device failed")
        return put(keys, data)

    monkeypatch.setattr(tier.store, "put_run", failing_put)
    fill_random(pool, range(3))
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert entered.wait(10)
    try:
        tier.submit_store(job(2, [key(2), key(3)], [1, 2]))
        deadline = time.monotonic() + 10
        while tier.lookup(key(3), CTX) is not LookupResult.HIT and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.lookup(key(3), CTX) is LookupResult.HIT     # job 2's own key is in
        time.sleep(0.05)
        assert list(tier.get_finished_jobs()) == []           # but job 2 waits for job 1
        assert tier.lookup(key(2), CTX) is LookupResult.RETRY
    finally:
        gate.set()
    results = sorted(drain(tier), key=lambda r: r.job_id)
    assert [(r.job_id, r.success) for r in results] == [(1, False), (2, False)]
    assert tier.lookup(key(2), CTX) is LookupResult.MISS
    assert not tier.has_pending_work()
    # a later job that leaves nothing to anyone stores key 2 and succeeds
    tier.submit_store(job(3, [key(2)], [1]))
    assert [r.success for r in drain(tier)] == [True]


@pytest.mark.parametrize("together", [False, True])
def test_a_store_a_clear_overtook_fails_quietly(make_tier, monkeypatch, caplog, together):
    """A clear() that comes while a store job's put is under way makes the
    store decline the put (it would publish what was there before the
    clear): the keys miss, and nothing is logged as an error or counted as a
    store failure: it is the store's policy, not a failure.  So the job
    reports success (with all its keys' bytes): vLLM's tiering manager calls its
    back-pressure detector's on_store_failed() for every store result with
    success=False (TieringOffloadingManager._update_backpressure), and the
    EMA detector of a storage tier enters pressure after failure_threshold
    of them in a row, dropping the stores after them.  A later store of the
    keys succeeds."""
    from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

    tier, pool = make_tier(threads=1)
    store = tier.store
    fill_random(pool, range(13))
    write_piece, put_runs = store._write_piece, store.put_runs
    armed, cleared = [not together], []

    def overtaken(*a, **k):
        if armed[0] and not cleared:
            cleared.append(store.clear())
        return write_piece(*a, **k)

    def put_runs_overtaken(items):
        armed[0] = True
        return put_runs(items)

    monkeypatch.setattr(store, "_write_piece", overtaken)
    monkeypatch.setattr(store, "put_runs", put_runs_overtaken)
    keys = [key(1), key(2), key(3)]
    with caplog.at_level(logging.DEBUG, logger="kvblock.integrations.vllm"):
        if together:      # small stores queued behind a running one go in one put_runs
            gate = _hold_first(store, "put_run")      # a large store: alone
            tier.submit_store(job(1, [key(100 + i) for i in range(9)], range(4, 13)))
            tier.submit_store(job(2, keys[:2], [0, 1]))
            tier.submit_store(job(3, keys[2:], [2]))
            gate.set()
        else:
            tier.submit_store(job(2, keys, [0, 1, 2]))
        results = {r.job_id: r for r in drain(tier)}
    assert cleared and all(results[j].success for j in results), results
    assert {j: r.transfer_bytes for j, r in results.items() if j != 1} == \
        ({2: 2 * SLOT, 3: SLOT} if together else {2: 3 * SLOT})
    detector = EMABackpressureDetector(high_water_s=10.0, low_water_s=5.0, failure_threshold=1)
    for r in results.values():           # what the tiering manager does with a store result
        if r.success:
            detector.update(time.monotonic(), r.transfer_bytes)
        else:
            detector.on_store_failed()
    assert not detector.is_under_pressure()
    assert [tier.lookup(k, CTX) for k in keys] == [LookupResult.MISS] * 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert tier.stats()["store_failures"] == 0
    assert tier.stats()["cleared_puts"] >= 1
    tier.submit_store(job(4, keys, [0, 1, 2]))
    assert [r.success for r in drain(tier)] == [True]
    assert [tier.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 3


def test_lookup_is_hit_for_stored_key_with_a_store_in_flight(make_tier, monkeypatch):
    tier, pool = make_tier(threads=1)
    tier.submit_store(job(1, [key(1)], [0]))
    assert drain(tier)[0].success
    gate, entered = threading.Event(), threading.Event()
    put = tier.store.put_run

    def slow_put(keys, data):
        entered.set()
        assert gate.wait(10)
        return put(keys, data)

    monkeypatch.setattr(tier.store, "put_run", slow_put)
    tier.submit_store(job(2, [key(2)], [1]))          # occupies the only worker
    assert entered.wait(10)
    tier.submit_store(job(3, [key(1)], [0]))          # a re-store of key(1), queued
    try:
        assert tier.lookup(key(1), CTX) is LookupResult.HIT
        assert tier.lookup(key(2), CTX) is LookupResult.RETRY
    finally:
        gate.set()
    assert sorted((r.job_id, r.success) for r in drain(tier)) == [(2, True), (3, True)]


def test_lookup_never_waits_for_the_store_lock(make_tier):
    """While a worker holds the store's lock, lookup answers RETRY at once."""
    tier, pool = make_tier()
    tier.submit_store(job(1, [key(1)], [0]))
    assert drain(tier)[0].success
    held, release = threading.Event(), threading.Event()

    def hold():
        with tier.store._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(10)
        assert tier.lookup(key(1), CTX) is LookupResult.RETRY
    finally:
        release.set()
        t.join()
    assert tier.lookup(key(1), CTX) is LookupResult.HIT


@pytest.mark.parametrize("shared", [False, True])
def test_a_busy_store_costs_the_scheduler_one_lock_wait_not_one_per_lookup(tmp_path, shared,
                                                                           monkeypatch):
    """vLLM's scheduler goes on looking up a request's next keys after a
    RETRY (to start their promotions).  While a worker holds the store's
    lock (a checkpoint's snapshot, an eviction's scan of the index) or a
    shared store's connection, lookups answer RETRY and only the first one
    waits for it: not LOOKUP_LOCK_WAIT_S per key of every waiting request,
    every step.  Once it is free, lookups answer (and wait) as before."""
    from kvblock.integrations import vllm as tier_mod
    from tests.support.servers import stop_server

    # A wait long enough that one per lookup (n * 0.1 s) stands far above
    # what n lookups that do not wait cost on a loaded machine: with the
    # real 1 ms wait the bound was n * 0.5 ms, a thread switch or two.
    LOOKUP_LOCK_WAIT_S = 0.1
    monkeypatch.setattr(tier_mod, "LOOKUP_LOCK_WAIT_S", LOOKUP_LOCK_WAIT_S)
    pool = page_aligned_pool(8)
    config = dict(devices=[str(tmp_path / "kv.img")], size="64M", threads=2)
    if shared:
        config["server"] = str(tmp_path / "kv.sock")
    tier = KVBlockTierManager(make_spec(), memoryview(pool.numpy()), "kvblock", **config)
    pid = tier.store.server_pid if shared else None
    try:
        fill_random(pool, range(1))
        tier.submit_store(job(1, [key(1)], [0]))
        assert drain(tier)[0].success
        lock = tier.store._session.lock if shared else tier.store._lock
        held, release = threading.Event(), threading.Event()

        def hold():
            with lock:
                held.set()
                release.wait(30)

        t = threading.Thread(target=hold)
        t.start()
        try:
            assert held.wait(10)
            n = 100
            t0 = time.monotonic()
            answers = {tier.lookup(key(100 + i), CTX) for i in range(n)}
            took = time.monotonic() - t0
            assert answers == {LookupResult.RETRY}
            assert took < n * LOOKUP_LOCK_WAIT_S / 2, f"{n} lookups took {took:.3f} s"
        finally:
            release.set()
            t.join()
        assert tier.lookup(key(1), CTX) is LookupResult.HIT
        assert tier.lookup(key(2), CTX) is LookupResult.MISS
    finally:
        tier.shutdown()
        if pid is not None:
            stop_server(pid)

def test_a_call_stuck_on_a_shared_store_costs_lookups_one_lock_wait(tmp_path, monkeypatch):
    """A worker's call to a hung store server holds the connection for up to
    its own limit (60 s).  Once it has waited past LOOKUP_ANSWER_TIMEOUT_S,
    lookups (and touches) miss at once, as after a hung lookup of its own:
    not LOOKUP_LOCK_WAIT_S each, for every waiting request, every step."""
    from kvblock.integrations import vllm as tier_mod
    from kvblock.integrations.vllm import LOOKUP_ANSWER_TIMEOUT_S
    from tests.support.servers import stop_server

    LOOKUP_LOCK_WAIT_S = 0.1       # as in the test above: a wait per call stands out
    monkeypatch.setattr(tier_mod, "LOOKUP_LOCK_WAIT_S", LOOKUP_LOCK_WAIT_S)

    pool, tier = _served_tier(tmp_path)
    pid = tier.store.server_pid
    try:
        fill_random(pool, range(1))
        tier.submit_store(job(1, [key(1)], [0]))
        assert drain(tier)[0].success
        session = tier.store._session
        held, release = threading.Event(), threading.Event()

        def stuck_call():          # a worker's call whose answer never comes
            with session.lock:
                session.call_started = time.monotonic() - LOOKUP_ANSWER_TIMEOUT_S - 1
                held.set()
                release.wait(30)
                session.call_started = None

        t = threading.Thread(target=stuck_call)
        t.start()
        try:
            assert held.wait(10)
            n = 100
            t0 = time.monotonic()
            answers = {tier.lookup(key(100 + i), CTX) for i in range(n)}
            for i in range(n):
                tier.touch([key(100 + i)], CTX)
            took = time.monotonic() - t0
            assert answers == {LookupResult.MISS}
            assert took < n * LOOKUP_LOCK_WAIT_S / 2, f"{n} lookups took {took:.3f} s"
        finally:
            release.set()
            t.join()
        assert tier.lookup(key(1), CTX) is LookupResult.HIT      # and it waits again
        assert tier.lookup(key(2), CTX) is LookupResult.MISS
        assert tier._lock_wait() == LOOKUP_LOCK_WAIT_S
    finally:
        tier.shutdown()
        stop_server(pid)


@store_bytes(96 << 20)    # several of its 16 MiB regions
def test_load_in_another_grouping_than_the_store(make_tier):
    """Runs stored 8 slots at a time, loaded from the middle, in pieces that
    straddle runs and into scattered slots: still the same bytes."""
    tier, pool = make_tier(region_size="16M", max_run_bytes=8 * SLOT)
    fill_random(pool, range(NUM_SLOTS))
    expected = pool.clone()
    keys = [key(200 + i) for i in range(NUM_SLOTS)]
    tier.submit_store(job(1, keys, list(range(NUM_SLOTS))))
    assert drain(tier)[0].success
    pool.zero_()
    tier.submit_load(job(2, keys[3:13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], promotion=True))
    scattered = [15, 13, 14, 2, 0, 1]
    tier.submit_load(job(3, [keys[i] for i in scattered], scattered, promotion=True))
    assert all(r.success for r in drain(tier))
    assert torch.equal(pool, expected)


def test_duplicate_store_writes_nothing(make_tier):
    tier, pool = make_tier()
    fill_random(pool, range(3))
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert drain(tier)[0].success
    written = tier.stats()["bytes_written"]
    tier.submit_store(job(2, [key(1), key(2), key(3)], [0, 1, 2]))
    (res,) = drain(tier)
    assert res.success and res.transfer_bytes == 3 * SLOT        # every key of the job
    assert tier.stats()["bytes_written"] == written + tier.store.layout(1).run_bytes  # key(3)
    assert tier.store.layout(1).run_bytes == SLOT + 4096          # its slot and trailer


def test_a_store_job_reports_the_bytes_of_all_its_keys(make_tier):
    """vLLM feeds a store job's transfer_bytes, with the time since it was
    submitted (queueing included), to its EMA back-pressure detector as
    seconds per MiB (TieringOffloadingManager._update_backpressure); without
    it, it takes every key of the job, and its fs tier reports them all.  A
    job whose keys are mostly stored already must not look as slow per MiB
    as if its whole wait were spent on the one slot it wrote (vLLM would then
    throttle the stores of new KV), nor one stored whole give no sample."""
    from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

    tier, pool = make_tier()
    fill_random(pool, range(8))
    tier.submit_store(job(1, [key(i) for i in range(7)], range(7)))
    assert drain(tier)[0].success
    tier.submit_store(job(2, [key(i) for i in range(8)], range(8)))      # 7 of 8 stored
    tier.submit_store(job(3, [key(i) for i in range(4)], range(4)))      # all stored
    results = {r.job_id: r for r in drain(tier)}
    assert results[2].success and results[2].transfer_bytes == 8 * SLOT
    assert results[3].success and results[3].transfer_bytes == 4 * SLOT
    assert tier.stats()["put_blocks"] == 8                               # key 7 written once
    # the same 10 ms for an 8-slot job: 5 ms per MiB, not 40 (fs defaults: high 10)
    detector = EMABackpressureDetector(**EMABackpressureDetector.default_config("fs"),
                                       warmup_completions=1)
    detector.on_store_completed(0.010, results[2].transfer_bytes)
    assert not detector.is_under_pressure()


# --------------------------------------------------------------------------- lifecycle
def events_spec(enabled: bool, **spec_args) -> MagicMock:
    spec = make_spec(**spec_args)
    spec.kv_events_config = OffloadingKVEventsConfig(enable_kv_cache_events=enabled,
                                                     self_describing_kv_events=False)
    return spec


def test_kv_events_announce_the_keys_store_jobs_stored(make_tier):
    tier, pool = make_tier(spec=events_spec(True), enable_kv_events=True, locality="LOCAL")
    fill_random(pool, range(4))
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert all(r.success for r in drain(tier))
    tier.submit_store(job(2, [key(2), key(3)], [1, 2]))   # key 2 is stored already
    assert all(r.success for r in drain(tier))
    tier.submit_store(job(3, [key(1)], [0]))               # all stored already
    assert all(r.success for r in drain(tier))
    events = list(tier.take_events())
    # Announced once each: vLLM asks consumers to count repeated
    # announcements, and a key's removal is announced once.
    assert [sorted(bytes(k) for k in e.keys) for e in events] == \
        [sorted(bytes(k) for k in (key(1), key(2))), [bytes(key(3))]]
    assert all(e.medium == Medium.STORAGE and not e.removed and e.locality.value == "LOCAL"
               for e in events)
    assert list(tier.take_events()) == []                   # taken once
    tier.submit_load(job(4, [key(1)], [3], promotion=True))
    assert drain(tier)[0].success and list(tier.take_events()) == []   # loads announce nothing


def test_kv_events_stay_off_unless_vllms_are_on(make_tier, caplog, tmp_path):
    quiet = make_tier()                                      # not asked for
    with caplog.at_level(logging.WARNING, logger="kvblock.integrations.vllm"):
        off = make_tier(spec=events_spec(False), enable_kv_events=True,
                        devices=[str(kvblock.create_file(tmp_path / "b.img", 64 << 20))])
    assert "KV cache events are off" in caplog.text
    for tier, pool in (quiet, off):
        fill_random(pool, [0])
        tier.submit_store(job(1, [key(9)], [0]))
        assert drain(tier)[0].success and list(tier.take_events()) == []


def _keys_of(events, removed: bool) -> list[list[bytes]]:
    """The keys of each stored (or removed) event, in order of their keys
    (concurrent jobs finish in any order)."""
    return sorted(sorted(bytes(k) for k in e.keys) for e in events if e.removed == removed)


def _store_each(tier, pool, keys, first_job=100) -> None:
    """One store job (one run) per key, from slot 0."""
    fill_random(pool, [0])
    for i, k in enumerate(keys):
        tier.submit_store(job(first_job + i, [k], [0]))
    assert all(r.success for r in drain(tier))


def test_a_removal_check_that_raises_the_unforeseen_is_made_again(make_tier):
    """The watch's removal check meeting an error that is not the store's
    (the thread logs it and goes on: periodic.py) kept none of the keys
    announced since the last step: a key the log did not name (its removal
    logged before the cursor, its stored event announced after) was never
    checked again, and vLLM kept a residency the store had dropped."""
    tier, pool = make_tier(spec=events_spec(True), enable_kv_events=True, locality="LOCAL")
    watch = tier._events
    k = key(1)
    _store_each(tier, pool, [k])
    watch.poll()
    assert _keys_of(tier.take_events(), False) == [[bytes(k)]]
    tier.store.delete([tier.kvblock_key(k)])
    # its removal is behind the cursor; only the "announced since" set names it
    watch._cursor = tier.store.removed_since(watch._cursor)[0]
    watch._fresh.add(bytes(tier.kvblock_key(k)))
    real_present = tier.store.present
    calls = []

    def present_once_broken(keys):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unforeseen")
        return real_present(keys)

    tier.store.present = present_once_broken
    with pytest.raises(RuntimeError):
        watch.poll()
    watch.poll()
    assert _keys_of(tier.take_events(), True) == [[bytes(k)]]
    assert watch.announced() == 0


def test_kv_events_announce_the_removal_of_what_the_tier_stored(make_tier):
    """A key the tier announced stored is announced removed once the store
    no longer holds it (deleted, evicted), unless it is back by then; keys
    the tier never announced are not announced removed."""
    tier, pool = make_tier(spec=events_spec(True), enable_kv_events=True, locality="LOCAL")
    watch = tier._events
    ks = [key(i) for i in range(1, 6)]
    kb = tier.kvblock_key
    _store_each(tier, pool, ks)
    tier.store.put_blocks([kb(key(50))], [bytes(SLOT)])       # not the tier's
    stored = list(tier.take_events())
    assert _keys_of(stored, False) == [[bytes(k)] for k in ks]
    assert all(e.ownership == f"kvblock:{tier.store.uuid}" and e.removal_expected
               for e in stored)
    assert watch.announced() == 5

    tier.store.delete([kb(ks[0]), kb(key(50))])
    tier.store.delete([kb(ks[1])])
    # Back before the watch looked: its stored event stands (announcing it
    # again would leave a counting consumer one removal short).
    _store_each(tier, pool, [ks[1]], first_job=200)
    watch.poll()
    events = list(tier.take_events())
    assert _keys_of(events, True) == [[bytes(ks[0])]]
    assert _keys_of(events, False) == []
    (gone,) = [e for e in events if e.removed]
    assert gone.medium == Medium.STORAGE and gone.locality.value == "LOCAL"
    assert gone.ownership == f"kvblock:{tier.store.uuid}" and gone.removal_expected
    watch.poll()
    assert list(tier.take_events()) == []              # announced once

    # The log lost track (a long pause, a restarted server): every key checked.
    tier.store.delete([kb(ks[2])])
    watch._cursor = "another-open:0"
    watch.poll()
    assert _keys_of(tier.take_events(), True) == [[bytes(ks[2])]]

    tier.store.evict(all=True)
    watch.poll()
    assert _keys_of(tier.take_events(), True) == \
        [sorted(bytes(k) for k in (ks[1], ks[3], ks[4]))]
    assert watch.announced() == 0
    # And again: stored, then evicted by the store itself, with the thread
    # vLLM's draining started doing the watching.
    _store_each(tier, pool, ks[:2], first_job=300)
    assert len(_keys_of(tier.take_events(), False)) == 2
    tier.store.evict(all=True)
    deadline = time.monotonic() + 10
    removed = []
    while not removed and time.monotonic() < deadline:
        time.sleep(0.05)
        removed = _keys_of(tier.take_events(), True)
    assert removed == [sorted(bytes(k) for k in ks[:2])]


def test_two_kvblock_tiers_in_one_vllm_announce_distinct_residencies(make_tier, tmp_path):
    """vLLM's OffloadingEventsTracker keeps a chunk's payload per residency
    (medium, ownership): two kvblock tiers (two "type": "kvblock" entries of
    secondary_tiers, each on its own store) must not share one, or one
    tier's removal erases the other's copy (the payload is dropped and the
    other's later removal names no block hashes; a router hears the chunk
    gone from storage while the other tier still holds it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
        _OffloadEventMetadata,
        OffloadingEventGroupSpec,
    )

    a, pool_a = make_tier(spec=events_spec(True), enable_kv_events=True)
    b, pool_b = make_tier(spec=events_spec(True), enable_kv_events=True,
                          devices=[str(kvblock.create_file(tmp_path / "b.img", 64 << 20))])
    assert a.store.uuid != b.store.uuid
    _store_each(a, pool_a, [key(1)])
    _store_each(b, pool_b, [key(1)])
    a.store.delete([a.kvblock_key(key(1))])
    a._events.poll()
    events_a, events_b = list(a.take_events()), list(b.take_events())
    assert [e.removed for e in events_a] == [False, True]
    assert [e.removed for e in events_b] == [False]
    owners = {(e.medium, e.ownership) for e in events_a} | {(e.medium, e.ownership)
                                                             for e in events_b}
    assert len(owners) == 2, owners

    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(
        enable_kv_cache_events=True, self_describing_kv_events=True))
    tracker._pending_event_metadata[key(1)] = _OffloadEventMetadata(
        block_hashes=(b"h0", bytes(key(1))), parent_block_hash=None, token_ids=(1, 2),
        block_size=16, lora_id=None, lora_name=None, extra_keys=None, group_idx=0,
        kv_cache_spec=OffloadingEventGroupSpec(None, None), active_residencies=set())
    list(tracker.take_events([events_a[0], events_b[0], events_a[1]]))
    # tier b still holds the chunk: its payload stays for b's removal
    assert key(1) in tracker._pending_event_metadata


def test_a_declined_store_still_announces_its_keys_found_stored(make_tier):
    """A store job whose piece holds a key stored already (by another replica
    sharing the store, or before a restart) and one the store's admission
    turns away: the key found stored is in the store and lookups hit it, so
    it is announced (as it is when the job's other keys are admitted); only
    the declined key is not."""
    from kvblock.store.policy import Admission

    tier, pool = make_tier(spec=events_spec(True), enable_kv_events=True, threads=1)
    fill_random(pool, range(2))
    kb = tier.kvblock_key
    tier.store.put_blocks([kb(key(1))], [pool[0].numpy()])     # not this tier's
    tier.store.admission = Admission(2)                        # first offers are declined
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert [r.success for r in drain(tier)] == [True]
    assert tier.store.stats()["admission_rejected_runs"] == 1
    assert [tier.lookup(k, CTX) for k in (key(1), key(2))] == \
        [LookupResult.HIT, LookupResult.MISS]
    assert _keys_of(tier.take_events(), False) == [[bytes(key(1))]]


def test_shutdown(make_tier):
    """Shutdown cancels what is queued (reported as failed), stops the
    workers, closes the store and keeps no array over the primary pool."""
    tier, pool = make_tier(threads=2, max_run_bytes=SLOT)
    view = tier._primary_kv_view
    for i in range(10):
        tier.submit_store(job(i, [key(i)], [i % 4]))
    tier.shutdown()
    results = list(tier.get_finished_jobs())
    assert sorted(r.job_id for r in results) == list(range(10))
    assert all(not t.is_alive() for t in tier._workers)
    assert tier.store.closed
    assert tier.lookup(key(0), CTX) is LookupResult.MISS
    tier.submit_load(job(11, [key(0)], [0], promotion=True))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(11, False)]
    tier.drain_jobs()                      # returns at once
    tier.shutdown()                        # idempotent
    assert tier._slots is None             # vLLM's primary tier unmaps the pool next
    view.release()


@pytest.mark.parametrize("failing", ["store", "metrics"])
def test_shutdown_lets_go_of_the_pool_whatever_a_close_raises(make_tier, monkeypatch, failing):
    """shutdown() dropped its array over vLLM's primary pool only after the
    store's close() returned or raised a KVBlockError: anything else (a bug,
    a MemoryError) left the tier holding a view of memory vLLM unmaps next;
    a metrics thread whose close raised skipped the store's close too.  Each
    step now runs whatever an earlier one raised, and the error still
    reaches the caller."""
    tier, pool = make_tier(threads=2)
    store = tier.store
    real_close = store.close if failing == "store" else tier._metrics.close

    def close():
        real_close()
        raise RuntimeError(f"{failing} close failed")

    monkeypatch.setattr(store if failing == "store" else tier._metrics, "close", close)
    with pytest.raises(RuntimeError, match=f"{failing} close failed"):
        tier.shutdown()
    assert tier._slots is None                 # no view of the pool vLLM unmaps next
    assert all(not t.is_alive() for t in tier._workers)
    assert store.closed
    tier.shutdown()                            # (done: the fixture's call returns at once)


def test_shutdown_lets_a_local_stores_call_finish_however_long(make_tier, monkeypatch):
    """Only a shared store's calls are cut at shutdown (a hung server): a
    store of this process has nothing to hang on, and a worker's call to
    it (here one taking longer than SHUTDOWN_WAIT_S) finishes, its job
    reported as it went, as vLLM's fs tier joins its workers."""
    from kvblock.integrations import vllm as tier_mod

    monkeypatch.setattr(tier_mod, "SHUTDOWN_WAIT_S", 0.05)
    tier, pool = make_tier(threads=1)
    started, real = threading.Event(), tier.store.put_runs

    def slow_put_runs(*args, **kwargs):
        started.set()
        time.sleep(0.5)            # longer than SHUTDOWN_WAIT_S: a slow device
        return real(*args, **kwargs)
    monkeypatch.setattr(tier.store, "put_runs", slow_put_runs)
    monkeypatch.setattr(tier.store, "put_run", lambda keys, data: slow_put_runs([(keys, data)])[0])
    fill_random(pool, range(1))
    tier.submit_store(job(1, [key(1)], [0]))
    assert started.wait(10)
    tier.shutdown()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
    assert all(not t.is_alive() for t in tier._workers)


def test_shutdown_cuts_calls_stuck_on_a_hung_shared_server(tmp_path, monkeypatch):
    """shutdown() joined the workers with no limit before it closed the
    store: a worker's call to a store server that never answers (stopped
    here with SIGSTOP) held vLLM's shutdown for the shared store's own
    request timeout (60 s).  Workers still busy after SHUTDOWN_WAIT_S are
    cut now: the store is closed under their calls, their jobs are
    reported failed, once each, and no worker is left running."""
    from kvblock.integrations import vllm as tier_mod
    from kvblock.store.provision import SHARED_CALL_TIMEOUT_S
    from tests.support.servers import stop_process, stop_server

    monkeypatch.setattr(tier_mod, "SHUTDOWN_WAIT_S", 1.0)
    pool, tier = _served_tier(tmp_path)
    pid = tier.store.server_pid
    try:
        fill_random(pool, range(2))
        tier.submit_store(job(1, [key(1)], [0]))
        assert drain(tier)[0].success
        stop_process(pid)
        try:
            tier.submit_store(job(2, [key(2)], [1]))
            tier.submit_load(job(3, [key(1)], [2]))
            deadline = time.monotonic() + 30      # a worker's request sent, unanswered
            while not tier.store.answer_overdue(0):
                assert time.monotonic() < deadline, "no worker called the stopped server"
                time.sleep(0.01)
            t0 = time.monotonic()
            tier.shutdown()
            took = time.monotonic() - t0
            assert took < SHARED_CALL_TIMEOUT_S / 4, f"shutdown took {took:.1f} s"
            results = sorted((r.job_id, r.success) for r in tier.get_finished_jobs())
            assert results == [(2, False), (3, False)]
            assert all(not t.is_alive() for t in tier._workers)
            assert tier.store.closed and tier._slots is None
            assert list(tier.get_finished_jobs()) == []
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        tier.shutdown()
        stop_server(pid)


class _LateStepFailed(Exception):
    """What a step of the tier's start after the store's open raises here."""


def _tier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvblock_tier_")]


@pytest.mark.parametrize("step", ["stats", "events", "last"])
def test_a_start_that_fails_after_the_open_closes_the_store(make_tier, monkeypatch, step):
    """Only the store's open was guarded: a step after it that raised (the
    metrics' or events' setup, a worker thread that would not start, the
    last log line) left the store open, its devices locked, its workers
    running, and an array over vLLM's pool: vLLM's retry of the start (or
    the next process) found the device busy.  Every failure after the open
    now stops what was started and closes the store."""
    opened = []
    real_open = KVBlockTierManager._open_store

    def open_store(self, *args, **kwargs):
        opened.append(real_open(self, *args, **kwargs))
        return opened[-1]

    def fail(*args, **kwargs):
        raise _LateStepFailed(step)

    monkeypatch.setattr(KVBlockTierManager, "_open_store", open_store)
    if step == "stats":
        monkeypatch.setattr(kv_vllm, "StoreStats", fail)
    elif step == "events":
        monkeypatch.setattr(kv_vllm, "TierEvents", fail)
    else:                     # after the workers started
        monkeypatch.setattr(kv_vllm.logger, "info", fail)
    before = set(_tier_threads())
    with pytest.raises(_LateStepFailed):
        make_tier(spec=events_spec(True), enable_kv_events=True)
    monkeypatch.undo()
    assert len(opened) == 1 and opened[0].closed
    assert set(_tier_threads()) <= before            # no worker left running
    again, pool = make_tier(format="never")          # the devices are free again
    fill_random(pool, [0])
    again.submit_store(job(1, [key(1)], [0]))
    assert [r.success for r in drain(again)] == [True]


def test_reopen_keeps_blocks(make_tier, store_file):
    tier, pool = make_tier()
    fill_random(pool, range(2))
    expected = pool[:2].clone()
    tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
    assert drain(tier)[0].success
    tier.shutdown()

    again, pool2 = make_tier(format="never")
    assert again.lookup(key(1), CTX) is LookupResult.HIT
    again.submit_load(job(2, [key(2), key(1)], [3, 2], promotion=True))
    assert drain(again)[0].success
    assert torch.equal(pool2[2], expected[0]) and torch.equal(pool2[3], expected[1])


def test_models_and_namespaces_never_share_blocks(make_tier):
    tier, pool = make_tier(namespace="tenant-a")
    tier.submit_store(job(1, [key(1)], [0]))
    assert drain(tier)[0].success
    tier.shutdown()
    other, _ = make_tier(namespace="tenant-b")
    assert other.lookup(key(1), CTX) is LookupResult.MISS
    other.shutdown()
    # the served model's name is always part of the key, beside the
    # namespace; so is the slot layout (here: TP size)
    model_b, _ = make_tier(namespace="tenant-a", spec=make_spec(model="model-b"))
    assert model_b.lookup(key(1), CTX) is LookupResult.MISS
    model_b.shutdown()
    same, _ = make_tier(namespace="tenant-a")
    assert same.lookup(key(1), CTX) is LookupResult.HIT
    same.shutdown()
    tp2, _ = make_tier(namespace="tenant-a", spec=make_spec(tp_size=2))
    assert tp2.lookup(key(1), CTX) is LookupResult.MISS
    tp2.shutdown()
    # "model" names the model in the keys instead of vLLM's name for it
    renamed, _ = make_tier(namespace="tenant-a", model="test-model",
                           spec=make_spec(model="served-as"))
    assert renamed.lookup(key(1), CTX) is LookupResult.HIT
    assert (renamed.model, renamed.namespace) == ("test-model", "tenant-a")
    renamed.shutdown()
    named, _ = make_tier(spec=make_spec(model="model-a"))
    assert (named.model, named.namespace) == ("model-a", "")


def test_data_parallel_replicas_get_their_own_devices(tmp_path):
    """Every DP replica builds a tier from the same config: {dp_rank} in the
    paths gives each its own store; one plain path is refused for the second
    replica with an error that names both ways out."""
    from kvblock.errors import DeviceBusyError

    pools, tiers = [], []
    try:
        for dp in range(2):
            pools.append(page_aligned_pool(4))
            tiers.append(KVBlockTierManager(
                make_spec(dp_index=dp, dp_size=2), memoryview(pools[-1].numpy()), "kvblock",
                devices=[str(tmp_path / "kv-{dp_rank}.img")], size="64M", threads=1))
        assert [t.devices for t in tiers] == [[str(tmp_path / f"kv-{dp}.img")]
                                              for dp in range(2)]
        shared = [str(tmp_path / "shared.img")]
        tiers.append(KVBlockTierManager(make_spec(dp_size=2), memoryview(pools[0].numpy()),
                                        "kvblock", devices=shared, size="64M", threads=1))
        with pytest.raises(DeviceBusyError, match=r'2 data-parallel.*\{dp_rank\}.*"server"'):
            KVBlockTierManager(make_spec(dp_index=1, dp_size=2), memoryview(pools[1].numpy()),
                               "kvblock", devices=shared, size="64M", threads=1)
        with pytest.raises(ConfigError, match="bad device template"):
            KVBlockTierManager(make_spec(), memoryview(pools[1].numpy()), "kvblock",
                               devices=[str(tmp_path / "kv-{rank}.img")], size="64M")
    finally:
        for t in tiers:
            t.shutdown()


def assert_metrics_blocks(tiers, blocks: int) -> None:
    """What each tier hands vLLM's metrics (get_stats) says the store holds.
    The snapshot is taken here, and the snapshot thread is not started: its
    request to the server could be in flight when the test kills it (a
    lookup then answers RETRY, not the MISS the test expects)."""
    for t in tiers:
        t._metrics.close()
        t._metrics.refresh()
        values = t.get_stats().data["data"]
        assert values["vllm:kvblock_store_blocks"] == {(t.config_info()["kvblock_store"],): blocks}


def _reported_over(snapshots) -> dict:
    """What the tier's StoreStats reports, summed over one refresh per
    snapshot (three) of the store's stats: {metric name: total}."""
    from kvblock.integrations.vllm_metrics import StoreStats

    stats = StoreStats(lambda: next(snapshots))
    stats._ticker.stop()       # snapshots taken here (close() would give up the claim)
    reported = {}
    for _ in range(3):
        stats.refresh()
        for name, values in stats.take().data["data"].items():
            reported[name] = reported.get(name, 0) + values[("u",)]
    return reported


def test_metrics_report_store_failures_while_the_store_is_unavailable(make_tier):
    """The tier's store_failures counter reaches vLLM's metrics when the
    store cannot answer stats() (closed after a failed metadata write, a
    server gone): that is when jobs fail, and an alert on it must fire."""
    tier, pool = make_tier(threads=1)
    uuid = tier.store.uuid
    tier._metrics.close()                       # snapshots taken here
    tier._metrics.refresh()
    first = tier.get_stats().data["data"]
    assert first["vllm:kvblock_store_store_failures"] == {(uuid,): 0}
    tier.store.close()                          # every store job fails now
    fill_random(pool, [0])
    for i in range(3):
        tier.submit_store(job(i, [key(i)], [0]))
    assert not any(r.success for r in drain(tier))
    assert tier.stats()["store_failures"] == 3
    tier._metrics.refresh()
    stats = tier.get_stats()
    assert stats is not None, "the failures were not reported"
    assert stats.data["data"]["vllm:kvblock_store_store_failures"] == {(uuid,): 3}
    assert "vllm:kvblock_store_blocks" not in stats.data["data"]   # no numbers to give


def test_metrics_count_a_restarted_servers_counters_from_zero():
    """A restarted store server counts from zero again: what its counters
    hold is all new, also when they already passed the old server's (a
    young server killed, its successor's recovery); the tier's own counter
    (store_failures) goes on."""
    snapshots = iter([
        {"uuid": "u", "server_pid": 10, "put_runs": 5, "recovery_us": 800, "store_failures": 1},
        {"uuid": "u", "server_pid": 10, "put_runs": 6, "recovery_us": 800, "store_failures": 1},
        {"uuid": "u", "server_pid": 11, "put_runs": 9, "recovery_us": 2500, "store_failures": 2},
    ])
    reported = _reported_over(snapshots)
    assert reported["vllm:kvblock_store_put_runs"] == 6 + 9
    assert reported["vllm:kvblock_store_recovery_us"] == 800 + 2500
    assert reported["vllm:kvblock_store_store_failures"] == 2


def test_metrics_count_a_server_restarted_under_the_same_pid_from_zero():
    """A store server restarted under the same pid (PID 1 in a container)
    was taken for the old one: a counter back at its old value (one
    checkpoint, the fresh open's) stepped by 0 and the new server's count
    was lost.  The server's stats name its run (server_run): a new run
    counts from zero; a server whose stats name no run is told by its pid."""
    snapshots = iter([
        {"uuid": "u", "server_pid": 1, "server_run": "a", "checkpoints": 1, "put_runs": 4},
        {"uuid": "u", "server_pid": 1, "server_run": "b", "checkpoints": 1, "put_runs": 4},
        {"uuid": "u", "server_pid": 1, "server_run": "b", "checkpoints": 2, "put_runs": 5},
    ])
    reported = _reported_over(snapshots)
    assert reported["vllm:kvblock_store_checkpoints"] == 1 + 2
    assert reported["vllm:kvblock_store_put_runs"] == 4 + 5


def test_metrics_of_a_served_store_count_this_replicas_reads():
    """A replica of a store shared through a server reads the devices itself:
    the server's stats never count those reads (its get_blocks, bytes_read,
    read_errors... stay 0), the replica's own counters (stats()["client"])
    do.  Its read counters come from there, and go on across a restart of
    the server (the replica's counters do not start again)."""
    def snap(pid, puts, gets, errors):
        return {"uuid": "u", "server_pid": pid, "put_runs": puts, "get_blocks": 0,
                "read_errors": 0, "client": {"get_blocks": gets, "read_errors": errors,
                                             "put_runs": puts, "engine": "uring"}}
    snapshots = iter([snap(10, 2, 5, 0), snap(10, 3, 9, 1), snap(11, 1, 12, 1)])
    reported = _reported_over(snapshots)
    assert reported["vllm:kvblock_store_get_blocks"] == 12
    assert reported["vllm:kvblock_store_read_errors"] == 1
    assert reported["vllm:kvblock_store_put_runs"] == 3 + 1     # the server's, restarted


def test_metrics_of_two_tiers_on_one_served_store_count_its_counters_once():
    """Two kvblock tiers of one vLLM on one served store (two entries of
    secondary_tiers naming the same "server") each reported the server's
    store-wide counters under the store's uuid, and vLLM's tiering manager
    sums its tiers' counters per label (OffloadingConnectorStats.aggregate):
    every put, eviction and checksum failure of the store counted twice.
    One tier of a process reports a store's own counters; each reports its
    own reads (its connection's, stats()["client"]) and store failures."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    from kvblock.integrations.vllm_metrics import StoreStats

    def snap(puts, gets, failures):
        return {"uuid": "shared", "server_pid": 10, "server_run": "r", "put_runs": puts,
                "evicted_blocks": 2 * puts, "get_blocks": 0, "blocks": 3 * puts,
                "store_failures": failures,
                "client": {"get_blocks": gets, "put_runs": 0, "engine": "uring"}}
    rounds = [(snap(4, 5, 0), snap(4, 1, 1)), (snap(6, 7, 0), snap(6, 2, 1))]
    tiers = [StoreStats(lambda i=i: rounds[at][i]) for i in range(2)]
    for t in tiers:
        t._ticker.stop()     # snapshots taken here (close() would give up the claim)
    totals = {}
    for at in range(len(rounds)):
        merged = OffloadingConnectorStats()      # as TieringOffloadingManager.get_stats
        for t in tiers:
            t.refresh()
            merged.aggregate(t.take())
        for name, values in merged.data["data"].items():
            if merged.data["types"][name] == "counter":
                totals[name] = totals.get(name, 0) + values[("shared",)]
            else:
                totals[name] = values[("shared",)]
    assert totals["vllm:kvblock_store_put_runs"] == 6
    assert totals["vllm:kvblock_store_evicted_blocks"] == 12
    assert totals["vllm:kvblock_store_get_blocks"] == 7 + 2      # each tier's own reads
    assert totals["vllm:kvblock_store_store_failures"] == 1      # each tier's own
    assert totals["vllm:kvblock_store_blocks"] == 18


def _served_snap(puts, failures=0, run="r"):
    return {"uuid": "shared", "server_pid": 10, "server_run": run, "put_runs": puts,
            "store_failures": failures, "client": {"get_blocks": 0, "engine": "uring"}}


def _counted(stats, name="vllm:kvblock_store_put_runs"):
    """What one take() of ``stats`` reports of counter ``name`` (0: none)."""
    got = stats.take()
    return 0 if got is None else got.data["data"].get(name, {}).get(("shared",), 0)


def test_metrics_a_closed_tier_does_not_take_the_stores_counters_back():
    """close() gave up a tier's claim on its store's counters, but its
    next take() (a snapshot still waiting) claimed them again: the closed
    tier held the claim for good and the live tier on the same served
    store reported none of the store's counters from then on.  A closed
    tier claims nothing; the live one takes over."""
    from kvblock.integrations.vllm_metrics import StoreStats

    at = [0]
    puts = [4, 6, 9]
    old, live = (StoreStats(lambda: _served_snap(puts[at[0]])) for _ in range(2))
    for t in (old, live):
        t._ticker.stop()                     # snapshots taken here (the claim kept)
    try:
        for t in (old, live):
            t.refresh()
        assert _counted(old) == 4 and _counted(live) == 0     # old holds the claim
        at[0] = 1
        old.refresh()
        old.close()                          # a snapshot still waiting
        old.take()                           # (vLLM's last collection, say)
        live.refresh()
        at[0] = 2
        got = _counted(live)
        live.refresh()
        got += _counted(live)
        assert got == 9 - 4, "the live tier reported none of the store's puts"
    finally:
        old.close()
        live.close()


@pytest.mark.parametrize("restart", [False, True])
def test_metrics_a_tier_taking_over_the_claim_goes_on_from_the_last_report(restart):
    """A tier without the claim on its store's counters advanced its
    record of them: taking the claim over (the owner closed), it counted
    from what it saw last, and the store's puts between the old owner's
    last report and that were never reported.  The new owner goes on
    from what was reported (counting from zero when the server restarted
    between)."""
    from kvblock.integrations.vllm_metrics import StoreStats

    at = [0]
    rounds = [_served_snap(4), _served_snap(6),
              _served_snap(2, run="s") if restart else _served_snap(7)]
    old, new = (StoreStats(lambda: rounds[at[0]]) for _ in range(2))
    for t in (old, new):
        t._ticker.stop()                     # snapshots taken here (the claim kept)
    try:
        total = 0
        for t in (old, new):
            t.refresh()
            total += _counted(t)             # old claims: 4
        at[0] = 1
        new.refresh()                        # 6: only new looks, old closes
        total += _counted(new)
        old.close()
        at[0] = 2
        new.refresh()
        total += _counted(new)               # new's claim now
        assert total == (4 + 2 if restart else 7), total
    finally:
        old.close()
        new.close()


def test_metrics_go_on_past_a_snapshot_that_raises_something_unforeseen(caplog):
    """The snapshot thread's step catches the store's own errors; anything
    else (a bug, an error no caller foresaw) ended the thread: vLLM got no
    store metrics for the rest of the process's life, and nothing in the
    log said why.  The thread logs it and takes the next snapshot."""
    from kvblock.integrations.vllm_metrics import StoreStats

    calls = []

    def source():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("an unforeseen failure")
        return {"uuid": "u", "put_runs": len(calls)}
    stats = StoreStats(source, interval=0.01)
    try:
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            assert stats.take() is None               # starts the thread
            deadline = time.monotonic() + 5
            got = None
            while got is None and time.monotonic() < deadline:
                time.sleep(0.01)
                got = stats.take()
    finally:
        stats.close()
    assert got is not None, "the snapshot thread ended at the first exception"
    assert "an unforeseen failure" in caplog.text


@contextlib.contextmanager
def replicas_sharing_a_server(tmp_path, slots: int, events: bool = False):
    """Two data-parallel replicas' tiers on one store through a server
    (the first formats it and starts the server), and their pools; with
    ``events`` the first has KV events on.  Shut down, the server stopped."""
    from tests.support.servers import stop_server

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    pools = [page_aligned_pool(slots) for _ in range(2)]
    tiers = []
    try:
        for dp in range(2):
            on = events and dp == 0
            tiers.append(KVBlockTierManager(
                events_spec(on, dp_index=dp, dp_size=2), memoryview(pools[dp].numpy()),
                "kvblock", devices=[dev], server=sock, size="64M", threads=2,
                enable_kv_events=on))
        yield tiers, pools
    finally:
        pid = tiers[0].store.server_pid if tiers else None
        for t in tiers:
            t.shutdown()
        if pid is not None:
            stop_server(pid)


def test_data_parallel_replicas_share_one_store_through_a_server(tmp_path, caplog):
    """"server": the first replica formats the store and starts the server,
    the second connects; what one stores the other finds and loads, byte
    for byte, each doing its own direct I/O."""
    with replicas_sharing_a_server(tmp_path, 8) as (tiers, pools):
        assert tiers[0].store.server_pid == tiers[1].store.server_pid
        fill_random(pools[0], range(4))
        keys = [key(70 + i) for i in range(4)]
        tiers[0].submit_store(job(1, keys[:3], [0, 1, 2]))
        tiers[0].submit_store(job(2, keys[3:], [3]))
        assert all(r.success for r in drain(tiers[0]))
        assert [tiers[1].lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 4
        tiers[1].submit_load(job(3, keys, [7, 5, 6, 4], promotion=True))   # scattered
        assert drain(tiers[1])[0].success
        for i, slot in enumerate([7, 5, 6, 4]):
            assert torch.equal(pools[1][slot], pools[0][i])
        assert_metrics_blocks(tiers, 4)     # both report the one store (its server's numbers)

        # The server dies: lookups miss and jobs fail, at once, and nothing
        # raises into vLLM; the replicas reconnect (one restarts the server)
        # and find what was stored before.
        from tests.support.servers import wait_reconnected

        pid = tiers[0].store.server_pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert tiers[1].lookup(keys[0], CTX) == LookupResult.MISS
        with caplog.at_level(logging.WARNING, logger="kvblock.integrations.vllm"):
            for j in range(8):
                tiers[0].submit_store(job(40 + j, [key(80 + j)], [5]))
            assert not any(r.success for r in drain(tiers[0]))
        lines = [r for r in caplog.records if "answered as a miss" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]   # rate-limited
        assert tiers[0].stats()["store_failures"] >= 8 and "store_error" in tiers[0].stats()
        tiers[1].submit_load(job(5, keys[:2], [2, 3], promotion=True))
        assert not drain(tiers[1])[0].success
        assert time.monotonic() - t0 < 5
        wait_reconnected([t.store for t in tiers], pid)
        assert [tiers[1].lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 4
        tiers[1].submit_load(job(6, keys, [0, 1, 2, 3], promotion=True))
        assert drain(tiers[1])[0].success
        for i in range(4):
            assert torch.equal(pools[1][i], pools[0][i])
        assert_metrics_blocks(tiers, 4)     # the new server's store, recovered


def test_format_force_on_a_store_a_server_already_serves_says_it_did_not_format(
        tmp_path, caplog, monkeypatch):
    """"format": "force" formats every start, says the tier's docstring; on a
    shared store ("server") the server outlives vLLM, and the next start
    connects to it: nothing formats then, and that was silent (the KV stored
    before still hits).  The tier now says so, as it does for "size"; not
    when the server is younger than the process (a sibling DP replica
    started it, formatting as asked)."""
    from kvblock.store import provision
    from tests.support.servers import stop_server

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    pool = page_aligned_pool(4)
    tiers = []

    def tier():
        tiers.append(KVBlockTierManager(make_spec(), memoryview(pool.numpy()), "kvblock",
                                        devices=[dev], server=sock, size="64M", threads=1,
                                        format="force"))
        return tiers[-1]

    def said_force():
        return [r.getMessage() for r in caplog.records if '"force"' in r.getMessage()]

    first = tier()
    pid = first.store.server_pid
    try:
        fill_random(pool, range(1))
        first.submit_store(job(1, [key(1)], [0]))
        assert drain(first)[0].success
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            sibling = tier()                   # a DP replica: the server is younger
        assert sibling.store.server_pid == pid and said_force() == []
        first.shutdown()
        sibling.shutdown()                     # vLLM stops; its server runs on

        ours = provision._start_ticks(pid) + 1         # vLLM started again, later
        real = provision._start_ticks
        monkeypatch.setattr(provision, "_start_ticks",
                            lambda p: ours if p == "self" else real(p))
        with caplog.at_level(logging.WARNING, logger="kvblock"):
            again = tier()
        assert again.store.server_pid == pid
        assert again.lookup(key(1), CTX) is LookupResult.HIT     # not formatted
        said = said_force()
        assert len(said) == 1 and str(pid) in said[0] and "not formatted" in said[0], said
    finally:
        for t in tiers:
            t.shutdown()
        stop_server(pid)


def test_kv_events_announce_what_another_replica_removed_from_a_shared_store(tmp_path):
    """Replicas sharing a store through a server: one's removals reach the
    other's events (the server's removal log), also when the server was
    killed and restarted meanwhile (its log is new: every key is checked)."""
    from tests.support.servers import wait_reconnected

    with replicas_sharing_a_server(tmp_path, 4, events=True) as (tiers, pools):
        watching, other = tiers
        a, b = key(1), key(2)
        _store_each(watching, pools[0], [a, b])
        assert _keys_of(watching.take_events(), False) == [[bytes(a)], [bytes(b)]]
        other.store.delete([watching.kvblock_key(a)])
        watching._events.poll()
        assert _keys_of(watching.take_events(), True) == [[bytes(a)]]

        pid = watching.store.server_pid
        os.kill(pid, signal.SIGKILL)
        wait_reconnected([t.store for t in tiers], pid)
        other.store.delete([watching.kvblock_key(b)])
        watching._events.poll()
        assert _keys_of(watching.take_events(), True) == [[bytes(b)]]
        assert watching._events.announced() == 0


def test_a_hung_shared_server_costs_lookup_one_bounded_wait(tmp_path, monkeypatch):
    """vLLM's scheduler thread calls lookup(): with the store server stopped
    (SIGSTOP) it answers within LOOKUP_ANSWER_TIMEOUT_S (then at once), and
    hits again once the server runs and the tier has reconnected."""
    from kvblock.integrations import vllm as tier_mod
    from tests.support.servers import stop_process, stop_server

    # Long enough that its overheads on a loaded machine (CI: two cores) are
    # a small part of it: the first lookup waits it once, not the store's
    # own timeout= (60 s); the next answers in under half of it, not after it.
    LOOKUP_ANSWER_TIMEOUT_S = 3.0
    monkeypatch.setattr(tier_mod, "LOOKUP_ANSWER_TIMEOUT_S", LOOKUP_ANSWER_TIMEOUT_S)

    pool, tier = _served_tier(tmp_path)
    pid = tier.store.server_pid
    try:
        fill_random(pool, range(2))
        tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
        assert all(r.success for r in drain(tier))
        stop_process(pid)
        try:
            t0 = time.monotonic()
            assert tier.lookup(key(1), CTX) == LookupResult.MISS
            took = time.monotonic() - t0
            assert took < 2 * LOOKUP_ANSWER_TIMEOUT_S, f"the hung lookup took {took:.1f} s"
            t0 = time.monotonic()
            assert tier.lookup(key(2), CTX) == LookupResult.MISS      # now at once
            took = time.monotonic() - t0
            assert took < LOOKUP_ANSWER_TIMEOUT_S / 2, f"the next lookup took {took:.1f} s"
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while tier.lookup(key(1), CTX) != LookupResult.HIT:
            assert time.monotonic() < deadline, "the tier did not reconnect"
            time.sleep(0.05)
        assert tier.store.server_pid == pid          # the same server, a new connection
    finally:
        tier.shutdown()
        stop_server(pid)


def test_refuses_a_store_of_another_slot_size(make_tier):
    tier, _ = make_tier()
    tier.shutdown()
    with pytest.raises(GeometryMismatchError):
        make_tier(pool=page_aligned_pool(slot=2 * SLOT))


def test_refuses_a_store_made_by_something_else(store_file, make_tier):
    KVStore.format([store_file], slot_geometry(SLOT), model="llama-3-8b").close()
    with pytest.raises(GeometryMismatchError):
        make_tier()


def test_format_modes(make_tier, store_file, tmp_path):
    with pytest.raises(NotAStoreError):
        make_tier(format="never")
    tier, _ = make_tier()                       # if-empty: formats the blank file
    tier.submit_store(job(1, [key(1)], [0]))
    assert drain(tier)[0].success
    tier.shutdown()
    wiped, _ = make_tier(format="force")
    assert wiped.lookup(key(1), CTX) is LookupResult.MISS
    wiped.shutdown()
    with pytest.raises(ConfigError):
        make_tier(format="sometimes")
    created = tmp_path / "sub" / "new.img"
    sized, _ = make_tier(devices=[str(created)], size="64M")
    assert created.stat().st_size == 64 << 20
    assert sized.store.geometry.block_bytes == SLOT


def test_bad_config_is_refused(make_tier):
    with pytest.raises(ConfigError, match="unknown config keys"):
        make_tier(root_dir="/tmp")
    with pytest.raises(ConfigError, match="devices"):
        make_tier(devices=[])
    with pytest.raises(ConfigError, match="locality must be one of"):
        make_tier(locality="nearby")
    # settings typed by hand: a clear error naming the setting, never a
    # silent wrong meaning (a devices map made files "0" and "1" in the cwd)
    with pytest.raises(ConfigError, match='"devices" must be a path or a list'):
        make_tier(devices={"0": ["/tmp/a.img"]})
    with pytest.raises(ConfigError, match=r"size must be at least .* \(a unit missing"):
        make_tier(devices=["/tmp/never-made.img"], size=64)
    with pytest.raises(ConfigError, match="max_run_bytes must be at least 1"):
        make_tier(max_run_bytes=0)
    with pytest.raises(ConfigError, match="queue_depth must be a whole number"):
        make_tier(queue_depth="sixteen")
    with pytest.raises(ConfigError, match="threads must be a whole number"):
        make_tier(threads=2.5)
    with pytest.raises(ConfigError, match="bad device template"):
        make_tier(devices=["/tmp/kv-{dp_rank.x}.img"])
    with pytest.raises(ConfigError, match='"server" must be a socket path'):
        make_tier(server=["/run/kvblock/vllm.sock"])
    for engine in (1, ["uring"]):     # not a name: a ConfigError, not an AttributeError
        with pytest.raises(ConfigError, match='"engine" must be one of'):
            make_tier(engine=engine)
    tier, _ = make_tier(queue_depth="16", threads="2")     # digits as strings are fine
    assert len(tier._workers) == 2


def test_a_missing_store_file_names_the_tiers_size_setting(tmp_path):
    """A store file that is not there, with no "size" to create it: the
    error named `kvblock format FILE --size SIZE` as the fix, which makes a
    layered store of another model the tier then refuses (and needs
    --layers...); the tier's own way is its "size" setting."""
    from kvblock.errors import DeviceNotFoundError

    missing = tmp_path / "kv.img"
    pool = page_aligned_pool(4)
    with pytest.raises(DeviceNotFoundError) as e:
        KVBlockTierManager(make_spec(), memoryview(pool.numpy()), "kvblock",
                           devices=[str(missing)], threads=1)
    said = str(e.value)
    assert str(missing) in said and '"size"' in said and "kvblock format" not in said, said
    assert not missing.exists()
    tier = KVBlockTierManager(make_spec(), memoryview(pool.numpy()), "kvblock",
                              devices=[str(missing)], threads=1, size="64M")   # the fix said
    try:
        fill_random(pool, range(1))
        expected = pool[0].clone()
        tier.submit_store(job(1, [key(1)], [0]))
        assert drain(tier)[0].success
        pool[0].zero_()
        tier.submit_load(job(2, [key(1)], [0], promotion=True))
        assert drain(tier)[0].success and torch.equal(pool[0], expected)
    finally:
        tier.shutdown()


def test_names_that_are_not_strings_are_refused(make_tier):
    """"namespace" and "model" are names mixed into every key: a list, a
    map, true or 1.5 typed there was made its repr (the tenant "[1]" or
    "True"), silently keys no other config names.  A whole number stays a
    name ("7"); anything else is a ConfigError naming the key."""
    for key, value in (("namespace", [1]), ("namespace", True), ("namespace", 1.5),
                       ("model", ["org/m"]), ("model", {"name": "m"}), ("model", False)):
        with pytest.raises(ConfigError, match=rf"kvblock tier: {key} must be a string"):
            make_tier(**{key: value})
    tier, _ = make_tier(namespace=7, model=3)
    assert (tier.namespace, tier.model) == ("7", "3")


def test_max_run_bytes_below_one_slot_is_said(make_tier, caplog, tmp_path):
    """A run holds whole slots: max_run_bytes below one slot cannot take
    effect (runs are one slot each), which the tier says at startup rather
    than silently running with another value than the one configured."""
    with caplog.at_level(logging.WARNING, logger="kvblock.integrations.vllm"):
        tier, _ = make_tier(max_run_bytes=SLOT // 2)
    assert tier.max_run_blocks == 1
    assert "max_run_bytes" in caplog.text and str(SLOT) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvblock.integrations.vllm"):
        tier, _ = make_tier(max_run_bytes=SLOT, devices=[
            str(kvblock.create_file(tmp_path / "b.img", 64 << 20))])
    assert tier.max_run_blocks == 1 and "max_run_bytes" not in caplog.text

def test_enable_kv_events_must_be_true_or_false(make_tier):
    """enable_kv_events typed by hand as a string ("false" from a YAML or a
    shell) is refused, naming the setting: a non-empty string is truthy, so
    "false" turned the events (and the removal watch) on."""
    for value in ("false", "no", 0):
        with pytest.raises(ConfigError, match="enable_kv_events must be true or false"):
            make_tier(spec=events_spec(True), enable_kv_events=value)
    tier, _ = make_tier(spec=events_spec(True), enable_kv_events=False)
    assert tier._events is None
    tier.shutdown()
    tier, _ = make_tier(spec=events_spec(True), enable_kv_events=None)   # JSON null: default
    assert tier._events is None


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_eviction_when_full(tmp_path, shm_target, where):
    """A full store evicts old runs; a load of an evicted key fails for that
    key only, and the tier keeps serving (on tmpfs: reclaimed regions are
    rewritten through the mapping)."""
    path = (shm_target(16 << 20, "small.img") if where == "shm" else
            str(kvblock.create_file(tmp_path / "small.img", 16 << 20)))
    pool = page_aligned_pool()
    tier = KVBlockTierManager(make_spec(), memoryview(pool.numpy()), "kvblock",
                              devices=[path], region_size="1M", max_run_bytes=4 * SLOT)
    try:
        fill_random(pool, range(NUM_SLOTS))
        capacity = tier.store.stats()["capacity_bytes"] // SLOT
        jid = 0
        for start in range(0, 2 * capacity, 4):
            jid += 1
            tier.submit_store(job(jid, [key(start + i) for i in range(4)], [0, 1, 2, 3]))
            tier.drain_jobs()
        assert all(r.success for r in tier.get_finished_jobs())
        assert tier.stats()["evicted_blocks"] > 0
        assert tier.store.io.engine.mapped_for_writes(0) == (where == "shm")
        assert tier.lookup(key(0), CTX) is LookupResult.MISS
        last = 2 * capacity - 1
        assert tier.lookup(key(last), CTX) is LookupResult.HIT
        tier.submit_load(job(jid + 1, [key(0), key(last)], [8, 9], promotion=True))
        (res,) = drain(tier)
        assert not res.success and res.successful_keys == (key(last),)
        assert torch.equal(pool[9], pool[3])
    finally:
        tier.shutdown()


# --------------------------------------------------------------------------- factory
def test_factory_creates_the_tier_after_register(store_file):
    kv_vllm.register()
    kv_vllm.register()                           # idempotent (plugins may load twice)
    pool = page_aligned_pool()
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "kvblock", "devices": [store_file], "format": "if-empty",
         "namespace": "factory-test", "threads": 2, "locality": "LOCAL"},
        memoryview(pool.numpy()), make_spec())
    try:
        assert isinstance(tier, KVBlockTierManager)
        assert tier.tier_type == "kvblock" and tier.namespace == "factory-test"
        assert tier.locality is not None and tier.locality.value == "LOCAL"
        fill_random(pool, [0])
        tier.submit_store(job(1, [key(1)], [0]))
        assert drain(tier)[0].success
    finally:
        tier.shutdown()


def test_factory_out_of_tree_module_path(store_file):
    """Without register(): the tier config names the class and module."""
    pool = page_aligned_pool()
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KVBlockTierManager", "module_path": "kvblock.integrations.vllm",
         "devices": [store_file]},
        memoryview(pool.numpy()), make_spec())
    try:
        assert isinstance(tier, KVBlockTierManager)
    finally:
        tier.shutdown()


def test_slot_geometry_is_one_slot_per_block():
    for size in (PAGE, 256 << 10, 2 << 20, 7 * PAGE):
        g = slot_geometry(size)
        assert g.block_bytes == size and g.group_block_bytes == size
        assert (g.kv_parts, g.block_tokens, g.num_layers, g.dtype) == (1, 1, 1, "uint8")
    assert slot_geometry(SLOT) == Geometry(1, 1, SLOT, "uint8", 1, 1, 1)


# --------------------------------------------------------------------------- vLLM's manager
def test_driven_by_vllms_tiering_manager(store_file):
    """The real TieringOffloadingManager cascades stores to the tier, evicts
    them from a 4-slot primary, promotes them back on lookup; the bytes the
    GPU side would read are the bytes it wrote; shutdown releases the pool."""
    num_slots = 4
    pool = page_aligned_pool(num_slots).view(torch.uint8).view(num_slots, SLOT)
    region = MagicMock()
    region.create_kv_memoryview.return_value = memoryview(pool.numpy())
    primary = CPUPrimaryTierOffloadingManager(num_chunks=num_slots, mmap_region=region)
    # (the regions make_tier gives: a batch of 4 keys goes in pieces of 3
    # slots and 1, not 4 of one slot as a 32 MiB store's defaults cut it)
    tier = KVBlockTierManager(make_spec(), primary.get_kv_memoryview(), "kvblock",
                              devices=[store_file], region_size=STORE_REGION_BYTES)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier],
                                       tier_poll_interval_s=0)

    def step():
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def settle():
        tier.drain_jobs()
        step()
        step()

    keys = [key(i) for i in range(8)]
    written = {}
    ctx = ReqContext(req_id="a")
    manager.on_new_request(ctx)
    for batch in (keys[:4], keys[4:]):               # the second batch evicts the first
        out = manager.prepare_store(batch, ctx)
        assert out is not None and list(out.keys_to_store) == batch
        for k, c in zip(batch, out.store_spec.chunk_ids):   # "GPU -> CPU"
            pool[int(c)] = torch.randint(0, 256, (SLOT,), dtype=torch.uint8)
            written[k] = pool[int(c)].clone()
        manager.complete_store(batch, ctx, success=True)
        settle()
    assert all(tier.lookup(k, ctx) is LookupResult.HIT for k in keys)
    assert tier.stats()["blocks"] == 8
    manager.on_request_finished(ctx)
    step()

    ctx2 = ReqContext(req_id="b")
    manager.on_new_request(ctx2)
    assert [manager.lookup(k, ctx2) for k in keys[:2]] == [LookupResult.HIT_PENDING] * 2
    step()                                            # promotions -> submit_load
    settle()
    assert [manager.lookup(k, ctx2) for k in keys[:2]] == [LookupResult.HIT] * 2
    spec = manager.prepare_load(keys[:2], ctx2)
    for k, c in zip(keys[:2], spec.chunk_ids):        # "CPU -> GPU"
        assert torch.equal(pool[int(c)], written[k])
    manager.complete_load(keys[:2], ctx2)
    manager.on_request_finished(ctx2)
    step()
    manager.shutdown()                                # releases the primary memoryview
    assert tier.store.closed
    with pytest.raises(ValueError, match="released"):
        len(primary.get_kv_memoryview())



def test_folded_store_failures_are_said_with_when_they_were(monkeypatch, caplog):
    """The tier logs its first store failure, folds those in the next
    LOG_INTERVAL_S, and counts them in the warning of the next failure
    after that: which may come an hour later, and then must not say the
    folded ones came in the last 10 s."""
    from kvblock.errors import StoreClosedError
    from kvblock.integrations import failures

    clock = [1000.0]
    monkeypatch.setattr(failures.time, "monotonic", lambda: clock[0])
    log = failures.FailureLog(logging.getLogger("kvblock.test_failures"), "kvblock tier")
    with caplog.at_level(logging.WARNING, logger="kvblock.test_failures"):
        for at in (0.0, 1.0, 2.0, 3600.0):
            clock[0] = 1000.0 + at
            log("store job 1", StoreClosedError("the store is closed"))
    lines = [r.getMessage() for r in caplog.records]
    assert log.count == 4 and len(lines) == 2, lines
    assert lines[0] == "kvblock tier: store job 1 failed, answered as a miss: the store is closed"
    assert lines[1] == ("kvblock tier: store job 1 failed, answered as a miss: the store is "
                        "closed (2 more store failures in the 3600 s since the last warning)")


def test_a_shared_start_that_will_not_format_names_the_tiers_own_setting(tmp_path):
    """"server" on a device holding a store that cannot be opened (its
    superblocks damaged): the tier will not format over it, and the refusal
    names the tier's own setting, as without a server, not open_or_format's
    generic 'set format to "force"'."""
    from kvblock.errors import UnsafeTargetError
    from kvblock.format import superblock as sbfmt

    dev, sock = str(tmp_path / "kv.img"), str(tmp_path / "kv.sock")
    kvblock.create_file(dev, 16 << 20)
    KVStore.format([dev], slot_geometry(SLOT), region_size=1 << 20).close()
    with open(dev, "r+b") as f:
        for off in sbfmt.COPY_OFFSETS:
            f.seek(off + 100)
            f.write(b"\xff" * 4)
    for shared in ({}, {"server": sock}):
        with pytest.raises(UnsafeTargetError, match="holds a damaged kvblock store") as e:
            KVBlockTierManager(offloading_spec=make_spec(),
                               primary_kv_view=memoryview(page_aligned_pool().numpy()),
                               tier_type="kvblock", devices=[dev], threads=1, **shared)
        assert str(e.value).endswith('set "format": "force" in the tier config'), \
            (shared, str(e.value))
    assert not os.path.exists(sock)


def test_a_failed_load_the_store_kept_is_a_miss_for_its_request(store_file, monkeypatch):
    """A promotion that fails while the store keeps the key (an I/O engine
    failure that reached no device, a run whose drop failed, a bug) left the
    key a HIT: vLLM's tiering manager freed the slot, looked the key up
    again, promoted it again, failed again... every step, and the request
    waited for good (vLLM's own fs tier marks such keys a miss for the
    request: the livelock of vLLM #49176).  The request that met the
    failure now misses the keys it could not load and recomputes them; a
    request that did not meet it still promotes them, and the request's
    record goes with on_request_finished."""
    from kvblock.errors import IOFailedError

    num_slots = 4
    pool = page_aligned_pool(num_slots).view(torch.uint8).view(num_slots, SLOT)
    region = MagicMock()
    region.create_kv_memoryview.return_value = memoryview(pool.numpy())
    primary = CPUPrimaryTierOffloadingManager(num_chunks=num_slots, mmap_region=region)
    tier = KVBlockTierManager(make_spec(), primary.get_kv_memoryview(), "kvblock",
                              devices=[store_file], threads=2)
    pool[0] = torch.randint(0, 256, (SLOT,), dtype=torch.uint8)
    tier.submit_store(job(100, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]      # (before vLLM's manager sees it)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier],
                                       tier_poll_interval_s=0)
    try:
        def step():
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

        store = tier.store

        def engine_down(*a, **k):
            raise IOFailedError("io engine: submit failed")   # no device: nothing dropped

        monkeypatch.setattr(store, "get_run", engine_down)
        monkeypatch.setattr(store, "get_runs", engine_down)
        monkeypatch.setattr(store, "get_blocks", engine_down)
        ctx = ReqContext(req_id="a")
        manager.on_new_request(ctx)
        assert manager.lookup(key(1), ctx) is LookupResult.HIT_PENDING
        step()                                        # submit_load
        tier.drain_jobs()
        # the failed promotion is processed here; the key must not be promoted again
        assert manager.lookup(key(1), ctx) is LookupResult.MISS
        step()
        assert not manager.has_pending_work()
        assert tier.lookup(key(1), ctx) is LookupResult.MISS
        # another request did not meet the failure: the store still holds the key
        other = ReqContext(req_id="b")
        manager.on_new_request(other)
        assert tier.lookup(key(1), other) is LookupResult.HIT
        manager.on_request_finished(ctx)
        manager.on_request_finished(other)
        assert tier.lookup(key(1), ctx) is LookupResult.HIT     # its record went with it
        step()
    finally:
        manager.shutdown()


def test_keys_name_the_canonical_format_version(make_tier, monkeypatch):
    """With vLLM's canonical host layout, a slot holds pages in vLLM's
    canonical byte format, whose version vLLM bumps on any change of it
    (canonical_mapping.CANONICAL_FORMAT_VERSION; its fs tier names
    canonical_format_id() in its paths).  The keys named the layout but not
    the version: a store kept across a vLLM upgrade handed the new vLLM
    slots in the old format as hits -- wrong KV read by the model."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping

    def canonical_spec():
        spec = make_spec()
        spec.config = dataclasses.replace(spec.config, canonical_layout=True,
                                          kv_cache_layout="LBNHC")
        return spec

    tier, pool = make_tier(spec=canonical_spec())
    fill_random(pool, [0])
    tier.submit_store(job(1, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    assert tier.lookup(key(1), CTX) is LookupResult.HIT
    tier.shutdown()
    again, _ = make_tier(spec=canonical_spec(), format="never")
    assert again.lookup(key(1), CTX) is LookupResult.HIT      # the same vLLM: the same keys
    again.shutdown()
    monkeypatch.setattr(canonical_mapping, "CANONICAL_FORMAT_VERSION",
                        canonical_mapping.CANONICAL_FORMAT_VERSION + 1)
    upgraded, _ = make_tier(spec=canonical_spec(), format="never")
    assert upgraded.lookup(key(1), CTX) is LookupResult.MISS


def _sharded_spec(tp_size: int, *, replicated=False, canonical=False, agnostic=False):
    import dataclasses

    spec = make_spec(tp_size=tp_size)
    config = spec.config
    spec.config = dataclasses.replace(
        config, replicated_layout=replicated, canonical_layout=canonical,
        kv_cache_layout="LBNHC" if canonical else None,
        parallel=dataclasses.replace(config.parallel, is_parallelism_agnostic=agnostic))
    return spec


@pytest.mark.parametrize("flags, shared", [
    # vLLM's single-copy MLA layout: the slot is the latent, the same on every TP size
    (dict(replicated=True), True),
    # vLLM's canonical pages: topology-free, certified per layer (fails closed)
    (dict(canonical=True, agnostic=True), True),
    (dict(canonical=True, replicated=True, agnostic=True), True),
    # no flag: every layout its own keys, as before
    (dict(), False),
    (dict(canonical=True), False),
    # the direct layout under is_parallelism_agnostic alone: a slot is each
    # worker's cell in rank order, each cell its own tensors (layers) and
    # blocks of its heads, not the bytes a TP-1 worker's cell holds: kept apart
    (dict(agnostic=True), False),
])
def test_parallelism_free_slots_are_shared_across_tp_sizes(make_tier, flags, shared):
    """The keys always named the world/TP/PP/PCP/DCP sizes: a slot whose
    bytes vLLM makes the same under any TP size (the replicated MLA layout,
    certified canonical pages), which vLLM's fs tier shares across
    deployments sharded differently, missed in a kvblock store.  Those keys
    now leave the parallel sizes out, as the fs tier's paths do; other keys
    are unchanged (stores keep their hits)."""
    tier, pool = make_tier(spec=_sharded_spec(2, **flags))
    fill_random(pool, [0])
    tier.submit_store(job(1, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    tier.shutdown()
    other, pool4 = make_tier(spec=_sharded_spec(4, **flags), format="never")
    want = LookupResult.HIT if shared else LookupResult.MISS
    assert other.lookup(key(1), CTX) is want
    if shared:
        other.submit_load(job(2, [key(1)], [3], promotion=True))
        assert [r.success for r in drain(other)] == [True]
        assert torch.equal(pool4[3], pool[0])
    other.shutdown()
    # a layout whose keys named the parallel sizes before keeps its keys
    same, _ = make_tier(spec=_sharded_spec(2, **flags), format="never")
    assert same.lookup(key(1), CTX) is LookupResult.HIT


def test_unflagged_keys_are_unchanged():
    """Keys of layouts without the flags are the ones stores already hold."""
    import json

    import xxhash

    spec = make_spec(tp_size=2)
    facts = {"dtype": "bfloat16", "tokens_per_hash": 16, "blocks_per_chunk": 1,
             "parallel": [2, 2, 1, 1, 1], "groups": [[0, 16, ["l0", "l1"]]],
             "replicated_layout": False, "canonical_layout": False, "kv_cache_layout": None,
             "slot_bytes": SLOT}
    text = json.dumps(["m", "ns", facts], sort_keys=True, separators=(",", ":"))
    assert kv_vllm.key_prefix("m", "ns", spec, SLOT) == xxhash.xxh3_128_digest(
        b"kvblock-vllm-key-v2\0" + text.encode())


def _served_tier(tmp_path):
    """(pool, tier): a kvblock tier of 2 workers over an 8-slot pool, its
    64 MiB store kv.img in ``tmp_path`` served by a kvblock serve it starts
    on kv.sock there."""
    pool = page_aligned_pool(8)
    return pool, KVBlockTierManager(make_spec(), memoryview(pool.numpy()), "kvblock",
                                    devices=[str(tmp_path / "kv.img")], size="64M",
                                    threads=2, server=str(tmp_path / "kv.sock"))
