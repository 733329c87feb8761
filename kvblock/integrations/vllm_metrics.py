"""The vLLM tier's store metrics, through vLLM's own offloading metrics.

vLLM 0.33 asks each secondary tier class, at start-up, for the metrics it
will report (``build_metric_definitions``) and the label names of its line
in the ``vllm:kv_offload_config_info`` metric (``config_info_keys``); its
tiering manager then collects every tier's ``get_stats()`` each scheduler
step, and ``config_info()`` once, and vLLM's Prometheus logger publishes
them beside its own (with its ``model_name`` and ``engine`` labels).

The kvblock tier reports its store's gauges and counters there, under the
names ``kvblock stats --prometheus`` uses (kvblock/metrics.py) with vLLM's
prefix: ``vllm:kvblock_store_used_bytes``, ``vllm:kvblock_store_blocks``,
``vllm:kvblock_store_checksum_failures``, ``vllm:kvblock_store_evicted_blocks``
..., labelled with the store's uuid.  A tier whose store is served
(``"server"``) reports the server's store, as every replica sharing it does.

``stats()`` of a served store is a request to its server, so the scheduler
thread never makes it: a thread of the tier takes a snapshot every
``STATS_INTERVAL_S`` and ``get_stats`` hands over what changed since the
last one (counters as increments, gauges as values).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from kvblock.errors import KVBlockError
from kvblock.integrations.periodic import Periodic
from kvblock.metrics import GAUGES
from kvblock.store.client import READ_COUNTERS
from kvblock.store.store import COUNTERS

logger = logging.getLogger("kvblock")

PREFIX = "vllm:kvblock_store_"
LABELS = ("store",)                          # the store's uuid
TIER_COUNTERS = COUNTERS + ("store_failures",)   # the tier's own: failed jobs' store errors
# The tier's labels in vLLM's vllm:kv_offload_config_info metric, in the
# order of KVBlockTierManager.config_info's values.
INFO_KEYS = ("kvblock_store", "kvblock_devices", "kvblock_server", "kvblock_slot_bytes",
             "kvblock_model", "kvblock_namespace")
STATS_INTERVAL_S = 1.0
# Counted where the reads happen: a store served to replicas counts none of
# them (each replica reads the devices itself), so a replica reports its own
# (its RemoteStore's stats()["client"]); they go on across a server restart.

# The StoreStats that reports each store's own counters (by uuid) in this
# process: two tiers of one vLLM on one served store both see the server's
# counters, and vLLM's tiering manager sums its tiers' counters per label
# (the store's uuid), so each would count every put twice.  The others
# report their own reads and store failures only.  Weak: a StoreStats let
# go of (a tier gone without close()) hands it on.
_OWNERS: "dict[str, weakref.ref[StoreStats]]" = {}
_OWNERS_LOCK = threading.Lock()
# Per store uuid: [the server (pid, run) of the last report, {counter: value
# reported}], the store's own counters as the claim's holder last reported
# them.  Kept apart from any StoreStats: one taking the claim over goes on
# from there, not from what it saw last without the claim (the counts
# between were never reported), however the old holder went.
_REPORTED: "dict[str, list]" = {}


def _claim(stats: "StoreStats", uuid: str) -> "list | None":
    """The record of what was reported of store ``uuid``'s counters
    (``_REPORTED``) when ``stats`` reports them, else None: it does when no
    other live StoreStats does (close() gives the claim up).  Under
    _OWNERS_LOCK: the record is the holder's to advance."""
    ref = _OWNERS.get(uuid)
    owner = ref() if ref is not None else None
    if owner is None:
        _OWNERS[uuid] = weakref.ref(stats)
    elif owner is not stats:
        return None
    return _REPORTED.setdefault(uuid, [None, {}])


def _release(stats: "StoreStats") -> None:
    with _OWNERS_LOCK:
        for uuid, ref in list(_OWNERS.items()):
            if ref() is stats or ref() is None:
                del _OWNERS[uuid]


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """What the tier reports (``SecondaryTierManager.build_metric_definitions``)."""
    defs: dict[str, OffloadingMetricMetadata] = {}
    for name in GAUGES:
        defs[PREFIX + name] = OffloadingGaugeMetadata(
            documentation=f"kvblock store (vLLM tier): {name.replace('_', ' ')}",
            labelnames=LABELS)
    for name in TIER_COUNTERS:
        defs[PREFIX + name] = OffloadingCounterMetadata(
            documentation=f"kvblock store (vLLM tier): {name.replace('_', ' ')}",
            labelnames=LABELS)
    return defs


class StoreStats:
    """Snapshots of ``source()`` (the tier's ``stats()``) taken by a thread
    of their own, handed to vLLM as increments and gauge values."""

    def __init__(self, source: Callable[[], dict], interval: float = STATS_INTERVAL_S):
        self._source = source
        self._lock = threading.Lock()
        self._latest: dict | None = None   # the last snapshot not handed over yet
        self._reported: dict[str, int] = {}  # counter values handed over, by name
        # The store's uuid label, kept for snapshots of a store that could not
        # answer (closed, its server gone): the tier's own counters go on.
        self._labels: tuple[str] | None = None
        self._closed = False     # close() gave the claim up: never taken again
        # (weakly: a thread holding self would keep a StoreStats nobody
        # closed, and its claim on the store's counters, for good)
        ref = weakref.ref(self)
        self._ticker = Periodic(lambda: _refresh(ref), interval, "kvblock-tier-stats")

    def refresh(self) -> None:
        """Take a snapshot now (the thread's step; tests call it)."""
        try:
            snapshot = self._source()
        except KVBlockError as e:   # a closed store or a gone server: nothing to report
            logger.debug("kvblock tier: stats: %s", e)
            return
        with self._lock:
            self._latest = snapshot

    def take(self) -> OffloadingConnectorStats | None:
        """What changed since the last call (None: nothing new).  Starts the
        snapshot thread on the first call, so a tier vLLM never asks runs none."""
        self._ticker.start()
        with self._lock:
            s, self._latest = self._latest, None
            if s is None:
                return None
            client = s.get("client")
            if isinstance(client, dict):
                s = dict(s, **{n: client[n] for n in READ_COUNTERS if n in client})
            # The tier's own counters; the others are the store's, reported
            # by the StoreStats holding the claim on them.
            own = {"store_failures"}
            if isinstance(client, dict):
                own.update(READ_COUNTERS)
            if "uuid" in s:
                self._labels = (str(s["uuid"]),)
            elif self._labels is None:
                return None
            stats = OffloadingConnectorStats()
            labels = self._labels
            for name in GAUGES:
                if isinstance(s.get(name), int):
                    stats.set_gauge(PREFIX + name, s[name], labels)
            for name in TIER_COUNTERS:
                if name in own:
                    _step(stats, name, s.get(name), self._reported, labels)
            if "uuid" not in s:      # no numbers of the store's
                return stats
            # The store server's (pid, run): a new run counts from zero, also
            # under the same pid (PID 1 in a container); a server whose stats
            # name no run is told by its pid alone.
            server = (s.get("server_pid"), s.get("server_run"))
            if server == (None, None):    # an in-process store: no server
                server = None
            with _OWNERS_LOCK:
                # (a closed tier's snapshot still waiting claimed the
                # counters again, for good: a live tier reported none)
                record = None if self._closed else _claim(self, labels[0])
                if record is None:
                    return stats
                if server != record[0]:
                    if record[0] is not None:
                        # A restarted server counts from zero: all it holds is new.
                        record[1] = dict.fromkeys(record[1], 0)
                    record[0] = server
                for name in TIER_COUNTERS:
                    if name not in own:
                        _step(stats, name, s.get(name), record[1], labels)
            return stats

    def close(self) -> None:
        """Stop the snapshot thread (a bounded wait: periodic.py); another
        StoreStats of the store reports its counters from now on."""
        self._ticker.stop()
        with self._lock:        # a take() under way claims before this or not at all
            self._closed = True
        _release(self)


def _step(stats: OffloadingConnectorStats, name: str, value, reported: dict,
          labels: tuple) -> None:
    """Report counter ``name``'s increase to ``value`` since ``reported``
    (advanced to it)."""
    if not isinstance(value, int):
        return
    first = name not in reported
    last = reported.get(name, 0)
    # A counter that went down started again (a restarted server whose
    # stats name no pid).
    step = value - last if value >= last else value
    reported[name] = value
    if step or first:       # the first report makes every series exist
        stats.increase_counter(PREFIX + name, step, labels)


def _refresh(ref) -> None:
    """The snapshot thread's step: refresh() of the StoreStats, while it lives."""
    stats = ref()
    if stats is not None:
        stats.refresh()
