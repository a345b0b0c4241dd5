"""The audit's sidecar processes (full-resident, cache-mode, cold) and what their counters say."""
from __future__ import annotations

import numpy as np

__all__ = ["Sidecars", "tier_note"]

class Sidecars:
    """The audit's sidecar processes by kind ("full", "cache", "cold"), started on first use."""

    def __init__(self, data_dir, budgets: dict[str, int]):
        self.data_dir, self.budgets = data_dir, budgets
        self.procs, self.clients = {}, {}

    def client(self, kind: str):
        if kind not in self.clients:
            from tierstore.bench.lookup import BENCH_SIDECAR_FLAGS
            from tierstore.client.client import Client
            from tierstore.sidecar.launcher import SidecarProcess

            # over the user's data: a cold start, and their hot sets left as they were
            proc = SidecarProcess(self.data_dir, dram_budget=str(self.budgets[kind]), extra_args=BENCH_SIDECAR_FLAGS)
            try:
                proc.start()
            except BaseException:
                proc.cleanup()
                raise
            self.procs[kind] = proc
            self.clients[kind] = Client(proc.socket)
        return self.clients[kind]

    def start(self, kinds) -> None:
        """Start several sidecars at once (each start mostly waits for the child to come up)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, len(kinds))) as pool:
            for f in [pool.submit(self.client, k) for k in kinds]:
                f.result()

    def restart(self, kind: str):
        self.stop(kind)
        return self.client(kind)

    def counts(self, kind: str | None) -> dict:
        """{table: (mode, hits, misses)} of a running sidecar."""
        if kind not in self.clients:
            return {}
        return {t["table"]: (t["mode"], int(t["hits"]), int(t["misses"]))
                for t in self.clients[kind].stats()["tables"]}

    def served(self, kind: str | None, run, tally: dict):
        """run()'s result; what sidecar `kind` served meanwhile is added to tally, {table: [mode, hits,
        misses]} (nothing for None, no sidecar)."""
        before = self.counts(kind)
        out = run()
        for t, (mode, hits, misses) in self.counts(kind).items():
            _, h0, m0 = before.get(t, (mode, 0, 0))
            row = tally.setdefault(t, [mode, 0, 0])
            row[1] += hits - h0
            row[2] += misses - m0
        return out

    def flush(self, kind: str, keep: dict) -> None:
        """Fill a cache-mode arena with rows the audit does not read, so the next run starts cold:
        twice the arena's slots of other rows, in steps this client may lease with the table to
        itself (sole_client_slots: all but the reserve kept for the next client, at the default
        --max-client-share the audit's sidecars run with). Twice: a row asked once leaves the
        policy's probation queue first, so one arena of them leaves some of the audit's rows."""
        from dataclasses import fields

        from tierstore.cache.leases import sole_client_slots
        from tierstore.sidecar.config import ServeConfig

        share = next(f.default for f in fields(ServeConfig) if f.name == "max_client_share")
        client = self.client(kind)
        for t in client.stats()["tables"]:
            if t["mode"] == "full" or t["table"] not in keep:
                continue
            capacity = int(t["capacity"])
            step = sole_client_slots(capacity, share)
            other = np.setdiff1d(np.arange(client.table_info(t["table"])["rows"]), keep[t["table"]])[:2 * capacity]
            for a in range(0, other.size, step):
                with client.plan(t["table"], other[a:a + step]) as planned:
                    planned.slots()

    def stop(self, kind: str) -> None:
        client, proc = self.clients.pop(kind, None), self.procs.pop(kind, None)
        if client is not None:
            client.close()
        if proc is not None:
            proc.cleanup()

    def close(self) -> None:
        for kind in list(self.procs):
            self.stop(kind)

def tier_note(served: dict) -> str:
    """What the two runs read from where, from Sidecars.served's tally."""
    if {mode for mode, _, _ in served.values()} == {"full"}:
        return "full-resident arena, every row from DRAM (slot == id)"
    hits = sum(h for _, h, _ in served.values())
    miss = sum(m for _, _, m in served.values())
    return (f"cache-mode arena: 2 runs read {hits} rows from DRAM, {miss} promoted from NVMe "
            f"({100 * miss / max(1, hits + miss):.0f}% from NVMe)")
