"""A client process of the reliability suite (run as a script, not collected).

    python _worker.py MODE '{"sock": ..., "expected": ".npy", ...}'

steps: plan + read (and inline lookups; local ones every `local_every` steps: the client reads
    the misses from the segment files itself) until `stop` exists or `seconds` pass;
    every row is compared with the expected bytes (exit 3 on the first wrong
    row); Unavailable is counted with how long the failing call took; status is
    written to `status` as JSON after every call; the last stdout line is the final report.
hold: plan `n` ids with a long TTL, map the arena, print "planned", sleep.
"""
import json
import os
import sys
import time

import numpy as np

from tierstore import errors
from tierstore.client.client import Client


def write_status(path, d):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(d, f)
    os.replace(tmp, path)


def steps(a):
    expected = np.load(a["expected"], mmap_mode="r")
    n_rows = len(expected)
    rng = np.random.default_rng(a.get("seed", 0))
    c = Client(a["sock"], timeout=a.get("timeout", 10.0))
    batch, inline_every, local_every = a.get("batch", 256), a.get("inline_every", 2), a.get("local_every", 0)
    st = dict(ok=0, unavailable=0, errors={}, max_unavailable_s=0.0, ok_since_unavailable=0, restarts_seen=0)
    lat, when = [], []
    t_start = time.monotonic()
    deadline = t_start + a.get("seconds", 600)
    instance = None
    step = 0
    while time.monotonic() < deadline and not (a.get("stop") and os.path.exists(a["stop"])):
        step += 1
        ids = (rng.zipf(1.2, batch) - 1) % n_rows if step % 2 else rng.integers(0, n_rows, batch)
        t0 = time.monotonic()
        try:
            if local_every and step % local_every == 0:
                rows = c.lookup(a["table"], ids)
            elif inline_every and step % inline_every == 0:
                rows = c.lookup(a["table"], ids, inline=True)
            else:
                with c.plan(a["table"], ids) as s:
                    s.slots()
                    dt = time.monotonic() - t0
                    rows = s.rows().copy()
                lat.append(dt)
                when.append(t0 - t_start)
                h = c._handles.get(a["table"])
                if h is not None and instance is not None and h.instance != instance:
                    st["restarts_seen"] += 1
                instance = h.instance if h is not None else instance
        except errors.Unavailable:
            st["unavailable"] += 1
            st["ok_since_unavailable"] = 0
            took = time.monotonic() - t0
            if took > st["max_unavailable_s"]:  # which call, and where it gave up: a failing bound names them
                st["max_unavailable_s"] = took
                st["slowest_unavailable"] = ("inline" if inline_every and step % inline_every == 0 else "plan") + \
                    f": {str(sys.exc_info()[1])[:160]}"
            write_status(a["status"], st)
            continue
        except errors.TierstoreError as e:
            st["errors"][type(e).__name__] = st["errors"].get(type(e).__name__, 0) + 1
            st["last_error"] = str(e)[:300]
            st.setdefault("first_error", {}).setdefault(type(e).__name__, str(e)[:300])
            continue
        if not np.array_equal(rows, expected[ids]):
            bad = np.flatnonzero((rows != expected[ids]).any(axis=1))
            print(json.dumps(dict(wrong_rows=int(bad.size), first_id=int(ids[bad[0]]), step=step)), flush=True)
            sys.exit(3)
        st["ok"] += 1
        st["ok_since_unavailable"] += 1
        write_status(a["status"], st)  # every step: a test reads the counts as they are at a kill
    write_status(a["status"], st)
    c.close()
    if a.get("latencies"):
        np.save(a["latencies"], np.array([when, lat], dtype=np.float64))
    st["elapsed_s"] = time.monotonic() - t_start
    st["ids"] = st["ok"] * batch
    print(json.dumps(st), flush=True)


def hold(a):
    c = Client(a["sock"], timeout=10)
    start = a.get("start", 0)
    s = c.plan(a["table"], np.arange(start, start + a["n"]), ttl_s=a.get("ttl_s"))
    rows = s.rows()  # maps the arena and touches the rows
    write_status(a["status"], dict(lease_id=s.lease_id, rows=int(rows.shape[0])))
    print("planned", flush=True)
    time.sleep(600)


def versions(a):
    """Steps over a table swapped between versions: every step's rows must be exactly one
    version's (never a mix, never anything else); records (start time, version, seconds)."""
    exp = [np.load(p, mmap_mode="r") for p in a["expected"]]
    n_rows = len(exp[0])
    rng = np.random.default_rng(a.get("seed", 0))
    c = Client(a["sock"], timeout=10.0)
    log = []
    deadline = time.monotonic() + a["seconds"]
    while time.monotonic() < deadline and not os.path.exists(a["stop"]):
        ids = rng.integers(0, n_rows, a.get("batch", 512))
        t0 = time.time()
        with c.plan(a["table"], ids) as s:
            rows = s.rows()
        dt = time.time() - t0
        which = [k for k, e in enumerate(exp) if np.array_equal(rows, e[ids])]
        if len(which) != 1:
            print(json.dumps(dict(wrong_rows=True, matches=which, t=t0)), flush=True)
            sys.exit(3)
        log.append((t0, which[0], dt))
        if len(log) % 20 == 0:
            write_status(a["status"], dict(steps=len(log)))
    c.close()
    np.save(a["log"], np.array(log, dtype=np.float64))
    write_status(a["status"], dict(steps=len(log)))
    print(json.dumps(dict(steps=len(log))), flush=True)


if __name__ == "__main__":
    {"steps": steps, "hold": hold, "versions": versions}[sys.argv[1]](json.loads(sys.argv[2]))
