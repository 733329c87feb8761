"""kvblock's vLLM tier against a model: random rounds of store jobs and of
load jobs (big and small, adjacent and scattered slots, several queued at
once so that workers batch the small ones), with restarts between rounds,
checked slot by slot.

vLLM's keys name content (a hash of the tokens), so the model is a set of
stored keys and each key's slot bytes follow from the key.  After a round of
stores, every stored key is a hit; a load job succeeds exactly when all its
keys are stored, and a failed one names in ``successful_keys`` only keys
whose slots hold their bytes.  Slots no load job names stay untouched.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import LookupResult

from kvblock.integrations.vllm import KVBlockTierManager
from tests.integrations_vllm.conftest import store_bytes
from tests.integrations_vllm.test_vllm_tier import (CTX, drain, job, key, make_spec,
                                                     page_aligned_pool)

SLOT = 4 * mmap.PAGESIZE          # 16 KiB slots: many jobs per example, quickly
SLOTS = 64
KEYS = 40
# A longer hunt: KVBLOCK_MODEL_EXAMPLES=1000 (about 1 minute per case).
EXAMPLES = int(os.environ.get("KVBLOCK_MODEL_EXAMPLES", "25"))
# the tier formats the store with its default regions, which the file's
# size sets (and, at 1/8 of one, the most slots a piece holds)
pytestmark = store_bytes(96 << 20)


def slot_bytes(k: int) -> torch.Tensor:
    """Key ``k``'s slot: its bytes as the pool's float32 (compare as bytes:
    random bytes hold NaNs)."""
    rng = np.random.default_rng(k)
    return torch.from_numpy(rng.integers(0, 256, SLOT, dtype=np.uint8)).view(torch.float32)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@st.composite
def rounds_of_jobs(draw):
    """A round: (is_load, restart first?, [(key ids, slot ids), ...]); the
    jobs of a round use distinct slots (stores read them, loads write them)."""
    rounds = []
    for _ in range(draw(st.integers(1, 6))):
        free = list(range(SLOTS))
        jobs = []
        for _ in range(draw(st.integers(1, 6))):
            n = draw(st.sampled_from([1, 2, 2, 3, 5, 9, 12]))
            if len(free) < n:
                break
            keys = draw(st.lists(st.integers(0, KEYS - 1), min_size=n, max_size=n, unique=True))
            if draw(st.booleans()):                 # adjacent slots, ascending
                at = draw(st.integers(0, len(free) - n))
                slots = free[at:at + n]
            else:                                   # anywhere, any order
                slots = draw(st.permutations(free))[:n]
            free = [s for s in free if s not in slots]
            jobs.append((keys, slots))
        rounds.append((draw(st.booleans()), draw(st.integers(0, 4)) == 0, jobs))
    return rounds


@pytest.mark.parametrize("threads", [1, 4])
def test_tier_answers_as_its_model(store_file, threads):
    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(rounds=rounds_of_jobs(), max_run_slots=st.sampled_from([3, 8, 64]))
    def run(rounds, max_run_slots):
        pool = page_aligned_pool(SLOTS, SLOT)

        def start(fmt):
            return KVBlockTierManager(offloading_spec=make_spec(),
                                      primary_kv_view=memoryview(pool.numpy()),
                                      tier_type="kvblock", devices=[store_file], format=fmt,
                                      threads=threads, max_run_bytes=max_run_slots * SLOT)

        tier = start("force")
        stored: set[int] = set()
        job_id = 0
        try:
            for is_load, restart, jobs in rounds:
                if restart:         # vLLM restarted: the store keeps what it held
                    tier.shutdown()
                    tier = start("if-empty")
                pool.zero_()
                results = {}
                ids = {}
                for keys, slots in jobs:
                    job_id += 1
                    ids[job_id] = (keys, slots)
                    if is_load:
                        tier.submit_load(job(job_id, [key(k) for k in keys], slots,
                                             promotion=True))
                    else:
                        for k, s in zip(keys, slots):
                            pool[s] = slot_bytes(k)
                        tier.submit_store(job(job_id, [key(k) for k in keys], slots))
                for r in drain(tier):
                    results[r.job_id] = r
                assert sorted(results) == sorted(ids)
                touched = set()
                for jid, (keys, slots) in ids.items():
                    r = results[jid]
                    if not is_load:
                        assert r.success, (jid, keys)
                        stored.update(keys)
                        continue
                    touched.update(slots)
                    want = all(k in stored for k in keys)
                    assert r.success == want, (jid, keys, sorted(stored))
                    good = keys if r.success and r.successful_keys is None else \
                        [k for k in keys if key(k) in set(r.successful_keys or ())]
                    assert set(good) <= stored
                    for k, s in zip(keys, slots):
                        if k in good:
                            assert same_bytes(pool[s], slot_bytes(k)), (jid, k, s)
                untouched = sorted(set(range(SLOTS)) - touched)
                if is_load:
                    assert not pool[untouched].any(), "a load wrote outside its slots"
                for k in range(KEYS):
                    hit = tier.lookup(key(k), CTX)
                    assert (hit == LookupResult.HIT) == (k in stored), k
        finally:
            tier.shutdown()

    run()
