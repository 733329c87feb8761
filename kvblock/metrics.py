"""Prometheus metrics of a store (prometheus_client custom collector).

Counters are named ``kvblock_store_<counter>_total``, each with its
``_created`` sample (when its count started from zero: a store server's
run, or the in-process store's open), so that a restart shows as a reset
even when the counters climbed past their old values before the next
scrape; gauges ``kvblock_store_<gauge>``; every sample carries the store
uuid as a label.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = ("capacity_bytes", "used_bytes", "regions", "regions_free", "regions_sealed", "runs",
          "blocks", "checkpoint_generation")
# A store server's own numbers (its stats add them): these go up and down.
SERVER_GAUGES = ("clients", "pinned_regions")
# A DRAM host tier's (present when the store has one): its blocks come and go.
HOST_GAUGES = ("host_blocks", "host_capacity_blocks")
OPTIONAL_GAUGES = SERVER_GAUGES + HOST_GAUGES
# identities (the server's process, and its run: restarted, it counts from 0)
# and a setting, not quantities
NOT_METRICS = ("server_pid", "server_run", "server_started", "pin_lease")


class StoreCollector:
    """Samples ``stats()`` of a store at each scrape.  ``source`` is a
    store (anything with ``stats()``) or a callable returning a stats dict:
    the CLI passes one that re-reads the devices (or asks a store server),
    so the numbers follow a store another process is using.
    ``counters=False`` exports the gauges only: counters are a process's
    own, and a process that just opened the devices has done nothing."""

    def __init__(self, source, counters: bool = True):
        self.source = source.stats if hasattr(source, "stats") else source
        # an in-process store's counters: created at its open (a store
        # server's stats name its run's start instead)
        self._counters = getattr(source, "counters", None)
        self.counters = counters

    def collect(self):
        s = self.source()
        labels = ["store"]
        for name in GAUGES + tuple(n for n in OPTIONAL_GAUGES if n in s):
            g = GaugeMetricFamily(f"kvblock_store_{name}", f"kvblock store {name}",
                                  labels=labels)
            g.add_metric([s["uuid"]], s[name])
            yield g
        if not self.counters:
            return
        created = s.get("server_started")
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            # (a server's stats without it: no time rather than this process's)
            created = None if "server_pid" in s else getattr(self._counters, "created", None)
        for name, value in s.items():
            if name in GAUGES or name in OPTIONAL_GAUGES or name in NOT_METRICS or \
                    not isinstance(value, int) or isinstance(value, bool):
                continue
            c = CounterMetricFamily(f"kvblock_store_{name}", f"kvblock store {name}",
                                    labels=labels)
            c.add_metric([s["uuid"]], value, created=created)
            yield c
