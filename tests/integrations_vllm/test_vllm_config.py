"""The README's vLLM configuration, taken as vLLM takes it.

``vllm serve --kv-transfer-config '{...}'``: vLLM loads its general plugins
(kvblock's entry point registers the tier type), validates the JSON as a
``KVTransferConfig``, and the ``TieringOffloadingSpec`` named in it builds
the CPU primary tier and, through ``SecondaryTierFactory``, each secondary
tier.  Here the JSON comes from README.md itself (its device swapped for a
store file, its CPU pool made small), so the documented command is the one
tested; then KV stored through vLLM's manager comes back, byte for byte,
through a second spec built from the same config (an engine restart).
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import numpy as np
from vllm.config import KVTransferConfig
from vllm.plugins import load_general_plugins, load_plugins_by_group
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvblock.integrations.vllm import KVBlockTierManager, register
from tests.integrations_vllm.test_vllm_tier import key

README = Path(__file__).resolve().parents[2] / "README.md"
SLOT = 256 << 10
SLOTS = 8


def readme_transfer_config() -> dict:
    """The JSON of the README's ``vllm serve ... --kv-transfer-config '...'``."""
    found = re.findall(r"^vllm serve .*--kv-transfer-config '([^']+)'", README.read_text(),
                       re.MULTILINE)
    assert len(found) == 1, "README.md should show one vllm serve command with the tier"
    return json.loads(found[0])


def offloading_config(extra: dict, engine_id: str) -> OffloadingConfig:
    """What vLLM derives from its engine config for one rank, one KV group
    of 256 KiB per block (one block per chunk)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=SLOT,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig(name="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))


def test_vllms_plugin_loader_finds_the_entry_point_and_it_registers_the_tier():
    plugins = load_plugins_by_group("vllm.general_plugins")   # as load_general_plugins
    assert plugins.get("kvblock_tier") is register, \
        "kvblock's vllm.general_plugins entry point (kvblock_tier) is not installed"
    SecondaryTierFactory._registry.pop("kvblock", None)   # as in a fresh vLLM process
    plugins["kvblock_tier"]()
    assert "kvblock" in SecondaryTierFactory._registry


def test_readmes_config_builds_the_tier_and_its_kv_survives_a_restart(tmp_path):
    load_general_plugins()              # what each vLLM process does first
    config = readme_transfer_config()
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    tier_cfg = next(t for t in extra["secondary_tiers"] if t["type"] == "kvblock")
    tier_cfg["devices"] = [str(tmp_path / "kv.img")]
    tier_cfg["size"] = "64M"
    extra["cpu_bytes_to_use"] = SLOTS * SLOT
    transfer = KVTransferConfig(**config)          # vLLM's own validation of the flag
    assert transfer.kv_connector == "OffloadingConnector"

    def manager():
        spec = TieringOffloadingSpec(offloading_config(
            json.loads(json.dumps(transfer.kv_connector_extra_config)),
            f"kvblock-test-{uuid.uuid4().hex[:12]}"))
        m = spec.get_manager()
        (tier,) = m.secondary_tiers
        assert isinstance(tier, KVBlockTierManager)
        assert tier.devices == tier_cfg["devices"] and tier.block_size_bytes == SLOT
        pool = np.frombuffer(m.primary_tier.get_kv_memoryview(), dtype=np.uint8)
        return m, tier, pool.reshape(-1, SLOT)

    def step(m):
        m.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def settle(m, tier):
        tier.drain_jobs()
        step(m)
        step(m)

    keys = [key(i) for i in range(4)]
    rng = np.random.default_rng(7)
    written = {}
    m, tier, pool = manager()
    try:
        ctx = ReqContext(req_id="a")
        m.on_new_request(ctx)
        out = m.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        for k, c in zip(keys, out.store_spec.chunk_ids):      # "GPU -> CPU"
            pool[int(c)] = rng.integers(0, 256, SLOT, dtype=np.uint8)
            written[k] = pool[int(c)].copy()
        m.complete_store(keys, ctx, success=True)
        settle(m, tier)
        assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
        m.on_request_finished(ctx)
        step(m)
    finally:
        m.shutdown()
    assert tier.store.closed

    m, tier, pool = manager()          # the engine restarts: an empty CPU pool
    try:
        pool[:] = 0
        ctx = ReqContext(req_id="b")
        m.on_new_request(ctx)
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 4
        step(m)                                   # promotions: the tier loads them
        settle(m, tier)
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
        spec = m.prepare_load(keys, ctx)
        for k, c in zip(keys, spec.chunk_ids):    # "CPU -> GPU"
            assert np.array_equal(pool[int(c)], written[k])
        m.complete_load(keys, ctx)
        m.on_request_finished(ctx)
        step(m)
    finally:
        m.shutdown()
