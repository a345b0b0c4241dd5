"""Prometheus text endpoint: per-table, per-tier counters and RPC latency.

Counters live as plain ints in each TableEngine (no locking on the hot path);
a collector reads them at scrape time. RPC latency is a real histogram. The
endpoint's HTTP server is ScrapeServer (scrape_server.py: bounded in connections
and time, since every user of the host can reach it).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics", "LATENCY_BUCKETS"]

LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _EngineCollector:
    def __init__(self, served):
        self.served = served

    def collect(self):
        fams = {
            "hits": CounterMetricFamily("tierstore_hits", "Unique ids found resident", labels=["table", "tier"]),
            "misses": CounterMetricFamily("tierstore_misses", "Unique ids not resident", labels=["table", "tier"]),
            "promotions": CounterMetricFamily("tierstore_promotions", "Rows promoted nvme -> dram", labels=["table"]),
            "evictions": CounterMetricFamily("tierstore_evictions", "Rows evicted from the arena", labels=["table"]),
            "lease_refusals": CounterMetricFamily("tierstore_lease_waits",
                                                  "Plans refused: arena full of leased rows / lease limit",
                                                  labels=["table"]),
            "bytes_read": CounterMetricFamily("tierstore_bytes_read", "Bytes read from the cold tier",
                                              labels=["table", "tier"]),
            "plans": CounterMetricFamily("tierstore_plans", "Plan calls", labels=["table"]),
            "notes_refused": CounterMetricFamily("tierstore_access_notes_refused",
                                                 "Access notes from clients on the host refused as malformed",
                                                 labels=["table"]),
            "notes_dropped": CounterMetricFamily("tierstore_access_notes_dropped",
                                                 "Steps of access notes dropped unlearned: the learner was behind "
                                                 "(behind), or their client held the most of its queue while other "
                                                 "clients' notes waited (over_share)", labels=["table", "reason"]),
            "steps_copied": CounterMetricFamily("tierstore_steps_copied",
                                                "Steps another client sent first (a TP rank's copy): not learned again",
                                                labels=["table"]),
        }
        gauges = {
            "leases_active": GaugeMetricFamily("tierstore_leases", "Live leases", labels=["table"]),
            "leased_slots": GaugeMetricFamily("tierstore_leased_slots", "Arena slots pinned by leases",
                                              labels=["table"]),
            "resident": GaugeMetricFamily("tierstore_resident_rows", "Rows in the DRAM arena", labels=["table"]),
            "capacity": GaugeMetricFamily("tierstore_arena_slots", "Arena capacity in rows", labels=["table"]),
            "metadata_bytes": GaugeMetricFamily("tierstore_metadata_bytes",
                                                "DRAM held beyond the arena rows: checksums, id/slot maps, "
                                                "cache policy state", labels=["table"]),
            "arena_page_bytes": GaugeMetricFamily("tierstore_arena_page_bytes", "Page size the arena's filesystem "
                                                  "gives (4096, or huge)", labels=["table"]),
            "arena_huge_bytes": GaugeMetricFamily("tierstore_arena_huge_bytes", "Bytes of the arena the sidecar "
                                                  "maps on huge pages (/proc/self/smaps)", labels=["table"]),
        }
        checked = CounterMetricFamily("tierstore_verified_rows", "Served rows re-checked by online verification",
                                      labels=["table", "tier"])
        bad = CounterMetricFamily("tierstore_verify_mismatches", "Rows online verification found corrupt",
                                  labels=["table", "tier"])
        unreadable = CounterMetricFamily("tierstore_verify_unreadable_blocks", "Cold block reads online verification "
                                         "could not judge (short or failed): re-checked, not refused", labels=["table"])
        lifted = CounterMetricFamily("tierstore_verify_lifted_blocks", "Blocks marked bad whose bytes checked again: "
                                     "served again", labels=["table"])
        for eng in list(self.served.engines.values()):
            vc = eng.verify_counters
            for tier in ("dram", "nvme"):
                checked.add_metric([eng.table, tier], vc.checked[tier])
                bad.add_metric([eng.table, tier], vc.mismatches[tier])
            unreadable.add_metric([eng.table], vc.unreadable)
            lifted.add_metric([eng.table], vc.lifted)
        yield from (checked, bad, unreadable, lifted)
        for eng in list(self.served.engines.values()):
            s = eng.stats()
            t = s["table"]
            fams["hits"].add_metric([t, "dram"], s["hits"])
            fams["misses"].add_metric([t, "dram"], s["misses"])
            fams["bytes_read"].add_metric([t, "nvme"], s["bytes_read"])
            for k in ("promotions", "evictions", "lease_refusals", "plans", "notes_refused", "steps_copied"):
                fams[k].add_metric([t], s[k])
            fams["notes_dropped"].add_metric([t, "behind"], s["notes_dropped"] - s["notes_over_share"])
            fams["notes_dropped"].add_metric([t, "over_share"], s["notes_over_share"])
            for k, g in gauges.items():
                g.add_metric([t], s[k])
        yield from fams.values()
        yield from gauges.values()


class Metrics:
    def __init__(self, served):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(served))
        self.latency = Histogram("tierstore_rpc_seconds", "RPC handling time", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self._http = None

    def observe(self, method: str, seconds: float) -> None:
        self.latency.labels(method).observe(seconds)

    def observer(self, method: str):
        """observe(seconds) for one method, its label looked up once (a hot path's per-call cost)."""
        return self.latency.labels(method).observe

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The registry in the format a scraper's Accept header asks for, and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve the endpoint on addr:port (OSError when the port is taken)."""
        from tierstore.sidecar.scrape_server import ScrapeServer

        self._http = ScrapeServer(self.render, port, addr)
        self._http.start()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
