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

import functools
import json
import re
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.plugins import load_general_plugins, load_plugins_by_group
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector
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


def offloading_config(extra: dict, engine_id: str, events: bool = False) -> OffloadingConfig:
    """What vLLM derives from its engine config for one rank, one KV group
    of 256 KiB per block (one block per chunk); ``events``: vLLM's KV cache
    events on (``--kv-events-config``)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=SLOT,
        enable_kv_cache_events=events,
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


def readme_config_here(tmp_path) -> KVTransferConfig:
    """The README's config, validated by vLLM, with a store file for the
    device and a CPU pool of SLOTS slots."""
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
    return transfer


class Engine:
    """vLLM's scheduler side as the config builds it: the tiering manager
    from the spec the config names, its kvblock tier, and the CPU pool as
    (slots, SLOT) bytes, let go of before the manager unmaps it."""

    def __init__(self, transfer: KVTransferConfig, events: bool = False):
        self.spec = spec = TieringOffloadingSpec(offloading_config(
            json.loads(json.dumps(transfer.kv_connector_extra_config)),
            f"kvblock-test-{uuid.uuid4().hex[:12]}", events))
        self.m = spec.get_manager()
        (self.tier,) = self.m.secondary_tiers
        assert isinstance(self.tier, KVBlockTierManager)
        assert self.tier.block_size_bytes == SLOT
        # (no local: a frame vLLM's logging keeps alive would keep it exported)
        self.pool = np.frombuffer(self.m.primary_tier.get_kv_memoryview(),
                                  dtype=np.uint8).reshape(-1, SLOT)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.pool = None
        self.m.shutdown()

    def step(self) -> None:
        self.m.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def settle(self) -> None:
        self.tier.drain_jobs()
        self.step()
        self.step()

    def store(self, keys, seed=7, stored=True) -> dict:
        """A request's KV offloaded through the manager: {key: bytes};
        ``stored``: the tier holds it then."""
        rng = np.random.default_rng(seed)
        written = {}
        ctx = ReqContext(req_id=f"store-{seed}")
        self.m.on_new_request(ctx)
        out = self.m.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        for k, c in zip(keys, out.store_spec.chunk_ids):      # "GPU -> CPU"
            self.pool[int(c)] = rng.integers(0, 256, SLOT, dtype=np.uint8)
            written[k] = self.pool[int(c)].copy()
        self.m.complete_store(keys, ctx, success=True)
        self.settle()
        want = LookupResult.HIT if stored else LookupResult.MISS
        assert [self.tier.lookup(k, ctx) for k in keys] == [want] * len(keys)
        self.m.on_request_finished(ctx)
        self.step()
        return written


def test_readmes_config_builds_the_tier_and_its_kv_survives_a_restart(tmp_path):
    transfer = readme_config_here(tmp_path)
    keys = [key(i) for i in range(4)]
    with Engine(transfer) as e:
        assert e.tier.devices == [str(tmp_path / "kv.img")]
        written = e.store(keys)
    assert e.tier.store.closed

    with Engine(transfer) as e:          # the engine restarts: an empty CPU pool
        e.pool[:] = 0
        ctx = ReqContext(req_id="b")
        e.m.on_new_request(ctx)
        assert [e.m.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 4
        e.step()                                   # promotions: the tier loads them
        e.settle()
        assert [e.m.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
        spec = e.m.prepare_load(keys, ctx)
        for k, c in zip(keys, spec.chunk_ids):    # "CPU -> GPU"
            assert np.array_equal(e.pool[int(c)], written[k])
        e.m.complete_load(keys, ctx)
        e.m.on_request_finished(ctx)
        e.step()


def test_kv_events_through_vllms_tracker_remove_the_block_hashes_they_stored(tmp_path):
    """With vLLM's KV cache events on and the tier's ``enable_kv_events``,
    the manager's events go through vLLM's OffloadingEventsTracker (what the
    connector publishes): the tier's stores become BlockStored on STORAGE,
    and once the store evicted them, BlockRemoved of the same block hashes."""
    transfer = readme_config_here(tmp_path)
    tier_cfg = next(t for t in transfer.kv_connector_extra_config["secondary_tiers"]
                    if t["type"] == "kvblock")
    tier_cfg.update(enable_kv_events=True, locality="LOCAL")
    keys = [key(i) for i in range(3)]
    with Engine(transfer, events=True) as e:
        tracker = OffloadingEventsTracker(e.spec.kv_events_config)

        def published(kind):
            return [ev for ev in tracker.take_events(list(e.m.take_events()))
                    if isinstance(ev, kind) and ev.medium == MEDIUM_STORAGE]

        e.store(keys)
        stored = published(BlockStored)
        assert {ev.ownership for ev in stored} == {f"kvblock:{e.tier.store.uuid}"}
        assert {ev.locality for ev in stored} == {"LOCAL"}
        hashes = sorted(h for ev in stored for h in ev.block_hashes)
        assert len(hashes) == len(keys)
        assert published(BlockRemoved) == []
        e.tier.store.evict(all=True)
        e.tier._events.poll()                   # the tier's watch, now
        removed = published(BlockRemoved)
        assert sorted(h for ev in removed for h in ev.block_hashes) == hashes
        assert {ev.ownership for ev in removed} == {f"kvblock:{e.tier.store.uuid}"}


def test_vllms_backpressure_on_the_tier_stops_stores_after_failures(tmp_path):
    """vLLM's per-tier "backpressure" config works on the kvblock tier: the
    factory hands the detector to the tier, successful store jobs feed it
    their bytes, and failed ones (the store closed under the tier) put the
    tier under pressure, so that vLLM stops sending it stores."""
    transfer = readme_config_here(tmp_path)
    tier_cfg = next(t for t in transfer.kv_connector_extra_config["secondary_tiers"]
                    if t["type"] == "kvblock")
    tier_cfg["backpressure"] = {"backpressure_cls": "EMABackpressureDetector",
                                "failure_threshold": 2}
    with Engine(transfer) as e:
        detector = e.tier.bp_detector
        assert isinstance(detector, EMABackpressureDetector)
        submitted = []
        real_submit = e.tier.submit_store
        e.tier.submit_store = lambda job: (submitted.append(job), real_submit(job))
        for i in range(3):
            e.store([key(10 * i), key(10 * i + 1)], seed=i)
        assert len(submitted) == 3 and not detector.is_under_pressure()
        assert detector._completions == 3           # each job's bytes reached it

        e.tier.store.close()                         # every store job fails now
        for i in range(3, 5):
            e.store([key(10 * i)], seed=i, stored=False)
        assert len(submitted) == 5 and detector.is_under_pressure()
        e.store([key(60)], seed=6, stored=False)
        assert len(submitted) == 5, "vLLM kept storing to a tier under pressure"


def test_the_tiers_store_metrics_reach_vllms_prometheus_metrics(tmp_path):
    """The store's gauges and counters go through vLLM's own path: the spec
    declares them (build_metric_definitions), the manager collects them
    (get_stats) and its config info, and vLLM's OffloadPromMetrics
    publishes them (it refuses undeclared names and wrong label counts)."""
    transfer = readme_config_here(tmp_path)
    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry)
                    for cls in (Gauge, Counter, Histogram)}
    prom = OffloadPromMetrics(SimpleNamespace(kv_transfer_config=transfer), metric_types,
                              ["model_name", "engine"], {0: ["m", "0"]})
    with Engine(transfer) as e:
        def publish():
            e.tier._metrics.refresh()          # the tier's snapshot thread, now
            stats = e.m.get_stats()
            stats.set_info(e.m.config_info())  # as vLLM's scheduler does once
            prom.observe(stats.data, engine_idx=0)

        def value(name, suffix=""):
            return registry.get_sample_value(
                name + suffix, {"model_name": "m", "engine": "0", "store": e.tier.store.uuid})

        e.store([key(i) for i in range(3)])
        publish()
        assert value("vllm:kvblock_store_blocks") == 3
        assert value("vllm:kvblock_store_used_bytes") == e.tier.store.stats()["used_bytes"] > 0
        assert value("vllm:kvblock_store_capacity_bytes") >= 32 << 20
        assert value("vllm:kvblock_store_put_blocks", "_total") == 3
        assert value("vllm:kvblock_store_checksum_failures", "_total") == 0
        e.store([key(i) for i in range(3, 5)], seed=8)
        publish()                            # counters grow by what happened since
        assert value("vllm:kvblock_store_put_blocks", "_total") == 5
        assert value("vllm:kvblock_store_blocks") == 5
        info = {s.labels["kvblock_store"]: s.labels for metric in registry.collect()
                if metric.name == "vllm:kv_offload_config_info" for s in metric.samples}
        assert info[e.tier.store.uuid]["kvblock_devices"] == str(tmp_path / "kv.img")
        assert info[e.tier.store.uuid]["kvblock_slot_bytes"] == str(SLOT)
    thread = e.tier._metrics._ticker.thread
    assert thread is not None and not thread.is_alive()     # shutdown stopped it


def test_readmes_list_of_tier_keys_is_every_key_the_tier_takes():
    """README's vLLM paragraph names the tier's settings (the command's JSON,
    "model", "size", "server", then "Other keys: ..."): a key the tier takes
    that README leaves out is one a user never learns of."""
    import inspect

    from kvblock.integrations.vllm import KVBlockTierManager

    text = README.read_text()
    para = text[text.index("**vLLM 0.33**"):text.index("**SGLang 0.5.23**")]
    other = re.search(r"Other keys: (.*?)(?::|\.)\s", para, re.DOTALL).group(1)
    named = set(re.findall(r"`(\w+)`", other))
    named |= set(readme_transfer_config()["kv_connector_extra_config"]["secondary_tiers"][0])
    named -= {"type"}
    named |= {k for k in ("model", "size", "server") if f'"{k}"' in para}
    takes = {name for name, p in inspect.signature(KVBlockTierManager.__init__).parameters.items()
             if p.kind is p.KEYWORD_ONLY}
    assert named == takes, f"README leaves out {sorted(takes - named)}, names {sorted(named - takes)}"


def test_readmes_quoted_tier_defaults_are_the_tiers():
    """README's "Other keys" quote defaults ("`threads` (default 8)"): each
    must be the one the tier takes when the key is left out."""
    import inspect

    from kvblock.integrations.vllm import KVBlockTierManager
    from kvblock.units import parse_size

    text = README.read_text()
    para = text[text.index("**vLLM 0.33**"):text.index("**SGLang 0.5.23**")]
    quoted = dict(re.findall(r"`(\w+)` \(default ([^;)]+)", para))
    assert {"threads", "max_run_bytes", "verify", "eviction", "queue_depth"} <= set(quoted)
    params = inspect.signature(KVBlockTierManager.__init__).parameters
    for name, value in quoted.items():
        default = params[name].default
        assert (parse_size(value) if name == "max_run_bytes" else type(default)(value)) \
            == default, f"README quotes {name} default {value}, the tier's is {default!r}"
