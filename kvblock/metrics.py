"""Prometheus metrics of a store (prometheus_client custom collector).

Counters are named ``kvblock_store_<counter>_total``; gauges
``kvblock_store_<gauge>``; every sample carries the store uuid as a label.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = ("capacity_bytes", "used_bytes", "regions", "regions_free", "regions_sealed", "runs",
          "blocks", "checkpoint_generation")


class StoreCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        s = self.store.stats()
        labels = ["store"]
        for name in GAUGES:
            g = GaugeMetricFamily(f"kvblock_store_{name}", f"kvblock store {name}",
                                  labels=labels)
            g.add_metric([s["uuid"]], s[name])
            yield g
        for name, value in s.items():
            if name in GAUGES or not isinstance(value, int) or isinstance(value, bool):
                continue
            c = CounterMetricFamily(f"kvblock_store_{name}", f"kvblock store {name}",
                                    labels=labels)
            c.add_metric([s["uuid"]], value)
            yield c
