"""`tierstore bench report OUT`: the tables of results.json, printed again."""
from __future__ import annotations

__all__ = ["format_report"]


def _fmt_rate(x) -> str:
    return "-" if x is None else f"{x / 1e6:8.3f}M"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def format_lookup(r: dict) -> list[str]:
    from tierstore.bench.lookup import line_for

    out = [f"== lookup: table {r['table']} v{r['version']}, {r['rows']:,} rows x {r['row_bytes']} B, "
           f"{r['rounds']} interleaved rounds per cell"]
    for name, why in r.get("skipped", {}).items():
        out.append(f"   {name}: skipped ({why})")
    for cell in r["cells"]:
        rows = [["competitor", "rows/s", "p50 ms", "p99 ms", "x ceiling", "hit ratio"]]
        for name, d in cell["competitors"].items():
            h = d.get("hit_ratio")
            rows.append([name, _fmt_rate(d["rows_per_s"]), f"{d['p50_ms']:.3f}", f"{d['p99_ms']:.3f}",
                         f"{d.get('ratio_vs_ceiling', float('nan')):.3g}", "-" if h is None else f"{h:.3f}"])
        out.append(f"-- {cell['dist']} batch={cell['batch']} ({cell['rows_per_pass']:,} ids per pass)")
        out += ["   " + line for line in _table(rows)]
    out += [line_for(c) for c in r["cells"]]
    return out


def format_cold(r: dict) -> list[str]:
    from tierstore.bench.cold import cold_line

    mem = r.get("memory_limits") or {}
    out = [f"== cold: table {r['table_bytes'] / 2**20:.0f} MiB ({r['table_rows']:,} rows), DRAM budget "
           f"{r['dram_budget_bytes'] / 2**20:.0f} MiB; page cache drop: {r.get('page_cache_drop')}; "
           f"memory cgroup: {mem.get('cgroup') or 'none (' + str(mem.get('reason')) + ')'}"]
    rows = [["competitor", "rows/s", "p50 ms", "p99 ms", "x dram", "cold-start rows/s", "cold-start p99 ms"]]
    for name, d in r["competitors"].items():
        cs = r["cold_start"].get(name, {})
        rows.append([name, _fmt_rate(d["rows_per_s"]), f"{d['p50_ms']:.3f}", f"{d['p99_ms']:.3f}",
                     f"{d['ratio_vs_dram']:.3g}", _fmt_rate(cs.get("rows_per_s")),
                     f"{cs['p99_ms']:.3f}" if cs else "-"])
    out += ["   " + line for line in _table(rows)]
    out.append(cold_line(r))
    return out


def format_report(doc: dict) -> str:
    m = doc.get("machine", {})
    out = [f"machine: {m.get('cpu_model')}, {m.get('cores')} cores, {(m.get('ram_bytes') or 0) / 2**30:.1f} GiB, "
           f"kernel {m.get('kernel')}; commit {doc.get('git_commit') or 'unknown'}"]
    for name, r in doc.get("scenarios", {}).items():
        if "error" in r or "skipped" in r and isinstance(r["skipped"], str):
            out.append(f"== {name}: {r.get('error') or r.get('skipped')}")
        elif name == "lookup":
            out += format_lookup(r)
        elif name == "cold":
            out += format_cold(r)
        else:
            out.append(f"== {name}: {r.get('summary') or 'see results.json'}")
        out.append(f"   (seed {r.get('seed')}, {r.get('started_utc')}, {r.get('wall_s', 0):.0f} s: {r.get('command')})")
    return "\n".join(out)
