"""The before/after of the O_DIRECT miss path, over `bench large`'s own steps.

    python -m tierstore.bench.ab_misses --data D [--table-gib 34] [--dram-budget 4GiB] [--seed 1] [--pair ring] [--swap]

One `--direct-io` sidecar over bench large's table (written into D once, as bench
large writes it), warmed by the warm-up steps, then the steady prefill and decode
steps in blocks, the blocks dealt in turn to two ways of reading a call's misses
(the same client, the same sidecar: the disk's drift over minutes falls on both):

`--pair ring` (the default):
  ring   a call's rows through one io_uring over all its segments (main since beb73eb)
  pool   the call cut into 128-row chunks over the reader's thread pool, each chunk on
         its thread's ring (before it): this module switches the reader's ring check
         off for the block (SegmentReader.submit then takes the read pool's route)
`--pair publish`:
  publish8192  a client reads the misses it claimed in the miss flights in parts of
               8,192 rows, its waiters seeing each part as it lands (main since 00c2ed0)
  publish1024  in parts of 1,024 (before it: each part fills and drains its ring)
`--pair depth`:
  qd1024, qd512 reads a thread's ring keeps in flight (direct_io.READ_DEPTH; 1024 on main)
`--pair ahead`:
  ahead        a prefill step's next chunk read ahead, in flight across the calls
               (lookup_many's `ahead`)
  none         each step's misses read in its own call (bench large's way)
`--pair tables`:
  together     a step's two tables read overlapped (Client.lookup_many: each begun in turn,
               its misses in flight on the calling thread's ring while the next table's
               hits are copied, then each ended; a long table's begin staggered behind
               LOOKUP_STAGGER of the previous one's reads)
  apart        one Client.lookup a table, in turn (each table's ring drains before the next)
`--pair stagger`:
  staggered    the tables read through Client.lookup_many, table k begun once LOOKUP_STAGGER
               of table k-1's reads have landed (main's way, in one thread)
  atonce       all started at once (LOOKUP_STAGGER 0: before it; each table's note then
               leaves as the step ends, and the next step probes before the sidecar promotes)
`--pair notes`:
  flusher      a step's note (its ids and the misses' records) sent by the client's flusher
               thread while the step reads on, unless an earlier note is still being sent
               (StepChannel._behind, main's way)
  step         sent by the step itself whenever NOTE_BACKLOG_IDS ids wait (before it: every
               prefill step, whose ~63 k ids a table are past the bound, waited on the socket)

`--swap` deals the first block to the pair's second way: the blocks' text differs
(their hit ratios do), which favours the first block's way by a few percent, so
a finding must hold in both orders.

Per variant and phase: misses/s, their ratio to the disk probed right after
(512-B O_DIRECT random reads, the best of QD 32-256), the miss path's own rate
(misses over the seconds the client spent reading them: the part of a step
that is not the probe, the hits' copy or the note) and its ratio, rows/s, hit
ratio and the client's CPU a miss; the rows of each block's first step are
checked against the segment files. Prints one line per variant and phase, and
the JSON with --json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import numpy as np

from tierstore.errors import InvalidArgument
from tierstore.sidecar.config import parse_size

DISK_SECONDS = 1.0  # the disk probe after the steps, per queue depth (--disk-seconds)
PAIRS = {"ring": ("ring", "pool"), "publish": ("publish8192", "publish1024"), "depth": ("qd1024", "qd512"),
         "tables": ("together", "apart"), "notes": ("flusher", "step"),
         "stagger": ("staggered", "atonce"), "ahead": ("ahead", "none")}


@contextlib.contextmanager
def _variant(name: str, side):
    """The miss path set to `name`'s way for a block (module docstring), put back after."""
    from tierstore.cache import miss_flights
    from tierstore.client import client, step_channel
    from tierstore.tiers.nvme import direct_io, reader

    ring, publish, depth = reader.thread_ring, miss_flights.MissFlights.PUBLISH_ROWS, direct_io.READ_DEPTH
    behind, stagger = step_channel.StepChannel._behind, client.LOOKUP_STAGGER
    try:
        side.together = name in ("together", "staggered", "atonce", "ahead", "none")
        side.ahead = name == "ahead"
        if name == "atonce":
            client.LOOKUP_STAGGER = 0.0
        if name == "step":
            step_channel.StepChannel._behind = lambda ch: ch._note_ids >= step_channel.NOTE_BACKLOG_IDS
        elif name == "pool":
            reader.thread_ring = lambda: None
        elif name.startswith("publish"):
            miss_flights.MissFlights.PUBLISH_ROWS = int(name[7:])
        elif name.startswith("qd"):
            direct_io.READ_DEPTH = int(name[2:])
            direct_io._RINGS.tried = False  # this thread's ring made again at that depth
        yield
    finally:
        reader.thread_ring, miss_flights.MissFlights.PUBLISH_ROWS, direct_io.READ_DEPTH = ring, publish, depth
        step_channel.StepChannel._behind, client.LOOKUP_STAGGER = behind, stagger
        side.together, side.ahead = False, False
        if name.startswith("qd"):
            direct_io._RINGS.tried = False


def run(data_dir, table_gib: float, budget: int, *, seed: int = 1, prefill_steps: int = 40,
        decode_steps: int = 400, warmup_steps: int = 100, prefill_block: int = 4, decode_block: int = 40,
        disk_seconds: float = DISK_SECONDS, pair: str = "ring", swap: bool = False) -> dict:
    """{"disk_after": probe, "phases": {phase: {variant: figures}}, "rows_wrong": n} (module docstring)."""
    from tierstore.bench.disk import best_iops, disk_limit
    from tierstore.bench.large import _read_rows, _segment_paths, _TierstoreSide, large_tables, text_phases

    spec, versions = large_tables(data_dir, table_gib, seed=seed, progress=False, log=lambda *a: None)
    phases = text_phases(spec, prefill_steps=prefill_steps, decode_steps=decode_steps, warmup_steps=warmup_steps,
                         seed=seed, log=lambda *a: None)
    tables = [v.table for v in versions]
    side = _TierstoreSide(data_dir, tables, budget, ["--direct-io"])
    variants, wrong, blocks = PAIRS[pair][::-1] if swap else PAIRS[pair], 0, []
    counters = ("distinct_cold", "distinct_asked")
    try:
        reads = lambda: [side.client.handle(t).local_reads for t in tables]
        clock = side.client.miss_clock  # the tables' miss paths, overlaps once (lookup_many)
        for step in phases["warmup"]:
            side.get(step)
        for phase, size in (("steady_prefill", prefill_block), ("steady_decode", decode_block)):
            steps = phases[phase]
            for b, a in enumerate(range(0, len(steps), size)):
                variant = variants[b % 2]
                with _variant(variant, side):
                    before = [sum(getattr(r, k) for r in reads()) for k in counters] + [clock.seconds]
                    t0, c0 = time.perf_counter(), time.process_time()
                    block = steps[a:a + size]
                    for i, step in enumerate(block):
                        # a prefill's next chunk is known a step ahead (bench large reads it so)
                        ahead = block[i + 1] if side.ahead and phase == "steady_prefill" and i + 1 < len(block) \
                            else None
                        got = side.get(step, ahead)
                        if i == 0:
                            t_check, c_check = time.perf_counter(), time.process_time()
                            wrong += sum(int((g != _read_rows(data_dir, v, ids)).any(axis=1).sum())
                                         for g, v, ids in zip(got, versions, step))
                            t0 += time.perf_counter() - t_check  # the check is neither timed nor counted
                            c0 += time.process_time() - c_check
                    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                cold, asked, path = (x - x0 for x, x0 in zip(
                    [sum(getattr(r, k) for r in reads()) for k in counters] + [clock.seconds], before))
                blocks.append((phase, variant, cold, asked, sum(x.size for s in steps[a:a + size] for x in s),
                               seconds, cpu, path))
    finally:
        side.close()
    after = best_iops(disk_limit(_segment_paths(data_dir, versions), blocks=(512,), seconds=disk_seconds,
                                 seed=seed), 512)
    out = {"disk_after": after, "rows_wrong": wrong, "phases": {}}
    for phase in ("steady_prefill", "steady_decode"):
        for variant in variants:
            mine = [x for x in blocks if x[:2] == (phase, variant)]
            cold, asked, rows, secs, cpu, path = (sum(x[k] for x in mine) for k in range(2, 8))
            out["phases"].setdefault(phase, {})[variant] = {
                "blocks": len(mine), "misses_per_s": cold / max(secs, 1e-9),
                "misses_per_s_of_disk_after": cold / max(secs, 1e-9) / after["iops"] if after else None,
                "miss_path_misses_per_s": cold / max(path, 1e-9), "miss_path_share": path / max(secs, 1e-9),
                "miss_path_of_disk_after": cold / max(path, 1e-9) / after["iops"] if after else None,
                "rows_per_s": rows / max(secs, 1e-9), "hit_ratio": 1 - cold / max(1, asked),
                "cpu_us_per_miss": cpu / max(1, cold) * 1e6}
    return out


def lines(r: dict) -> list[str]:
    after = r["disk_after"]
    head = f"disk after: {after['iops'] / 1e3:.0f}k IOPS at QD{after['qd']}" if after else "disk after: n/a"
    out = [head + f"; rows wrong {r['rows_wrong']}"]
    for phase, by in r["phases"].items():
        for variant, d in by.items():
            ratio, path = d["misses_per_s_of_disk_after"], d["miss_path_of_disk_after"]
            out.append(f"{phase} {variant}: misses {d['misses_per_s'] / 1e3:.1f}k/s"
                       + (f" = {ratio:.2f} of the disk" if ratio is not None else "")
                       + f" (reading them {d['miss_path_misses_per_s'] / 1e3:.1f}k/s"
                       + (f" = {path:.2f}" if path is not None else "")
                       + f", {d['miss_path_share']:.0%} of the time)"
                       + f", rows {d['rows_per_s'] / 1e3:.1f}k/s, hit {d['hit_ratio']:.4f}, "
                       f"CPU {d['cpu_us_per_miss']:.1f} us a miss, {d['blocks']} blocks")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierstore.bench.ab_misses", description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="bench large's data directory (the table is written once)")
    p.add_argument("--table-gib", type=float, default=34.0)
    p.add_argument("--dram-budget", default="4GiB")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefill-steps", type=int, default=40)
    p.add_argument("--decode-steps", type=int, default=400)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--pair", choices=sorted(PAIRS), default="ring",
                   help="the two ways of reading misses to alternate (module docstring; default ring)")
    p.add_argument("--swap", action="store_true",
                   help="deal the first block to the pair's second way: the blocks' own text then falls the other "
                        "way round (run both orders: what follows the blocks, not the way, flips)")
    p.add_argument("--disk-seconds", type=float, default=DISK_SECONDS,
                   help=f"seconds of the disk probe after the steps, per queue depth (default {DISK_SECONDS:g})")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    a = p.parse_args(argv)
    try:
        budget = parse_size(a.dram_budget)
        if a.table_gib <= 0 or min(a.prefill_steps, a.decode_steps, a.warmup_steps) < 1:
            raise InvalidArgument(f"--table-gib must be > 0 and every step count >= 1, got {a.table_gib}, "
                                  f"{a.prefill_steps}, {a.decode_steps}, {a.warmup_steps}")
        if not a.disk_seconds > 0:  # also refuses nan
            raise InvalidArgument(f"--disk-seconds must be > 0, got {a.disk_seconds}")
    except InvalidArgument as e:
        p.error(str(e))  # before anything is written into --data
    r = run(a.data, a.table_gib, budget, seed=a.seed, prefill_steps=a.prefill_steps,
            decode_steps=a.decode_steps, warmup_steps=a.warmup_steps,
            prefill_block=max(1, min(4, a.prefill_steps // 2)), decode_block=max(1, min(40, a.decode_steps // 2)),
            disk_seconds=a.disk_seconds, pair=a.pair, swap=a.swap)
    print("\n".join(lines(r)))
    if a.json:
        print(json.dumps(r, indent=1))
    return 0 if r["rows_wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
