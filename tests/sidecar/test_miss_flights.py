"""Miss flights (tierstore/cache/miss_flights.py): under --direct-io, several real client
processes of one sidecar that miss the same rows at once (TP ranks staging the same batch)
read each from the device once between them, and a reader that dies or stalls holding
claims costs the others a bounded wait, never a wrong row or a hang."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.store.catalog import Catalog
from tierstore.tiers.nvme import rowsum

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from direct_sidecar import direct_sidecar  # noqa: E402

ROWS, WIDTH = 50_000, 64
CLIENTS = 4

# one client process: describe and warm up (its reader, the kernels) on ids of its own, wait for
# the start file, look the batch up, and say what it read: rows to OUT.npy, counts as JSON, and
# what its notes carried for its misses (the ids and records each step handed its step channel,
# the warm-up's too) to OUT.notes.npz
_CLIENT = r"""
import json, os, sys, time
import numpy as np
from tierstore.client.client import Client

sock, table, ids_path, warm, go, out = sys.argv[1:7]
ids = np.load(ids_path)

def read_bytes():
    with open("/proc/self/io") as f:
        return int(next(ln for ln in f if ln.startswith("read_bytes")).split()[1])

with Client(sock) as c:
    noted, send = [], c.step_channel.note
    def note(table, version, ids, row_ids=None, rows=None):
        if row_ids is not None:
            noted.append((row_ids.copy(), rows.copy()))
        send(table, version, ids, row_ids, rows)
    c.step_channel.note = note  # before the table's first read: its local reads note through it
    c.lookup(table, np.array([int(warm)]))
    local = c.handle(table).local_reads
    device, before = local.distinct_device, read_bytes()
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.0005)
    t0 = time.monotonic()
    rows = c.lookup(table, ids)
    took = time.monotonic() - t0
    np.save(out, rows)
    np.savez(out + ".notes.npz", ids=np.concatenate([i for i, _ in noted] or [np.zeros(0, np.int64)]),
             records=np.concatenate([r for _, r in noted] or [np.zeros((0, 0), np.uint8)]))
    print(json.dumps(dict(read_bytes=read_bytes() - before, device=local.distinct_device - device,
                          misses=local.distinct_cold, seconds=took, shared=local._flights.rows_shared)), flush=True)
"""

# a reader that claims rows and dies (or stalls) before it has read them
_CLAIMER = r"""
import os, signal, sys
import numpy as np
from tierstore.cache.miss_flights import MissFlights, _CLAIM
from tierstore.client.client import Client

sock, table, ids_path, how = sys.argv[1:5]
ids = np.load(ids_path)
with Client(sock) as c:
    h = c.handle(table)
    c.lookup(table, np.array([0]))
    fl = c.handle(table).local_reads._flights
    state, entry, seen = np.empty(ids.size, np.int8), np.empty(ids.size, np.int64), np.empty(ids.size, np.int64)
    _CLAIM.compiled()(fl.words, fl.pids, ids, state, entry, seen, os.getpid())
    print(int((state == 2).sum()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
"""


def _write(d, table: str = "t") -> np.ndarray:
    """Rows that name their id (bytes 0..7), so a row served for another id is caught."""
    data = np.random.default_rng(0).integers(0, 256, size=(ROWS, WIDTH), dtype=np.uint8)
    data[:, :8] = np.arange(ROWS, dtype="<u8").view(np.uint8).reshape(ROWS, 8)
    write_version(d, table, [data], rows=ROWS, row_format="fp32", row_dim=WIDTH // 4)
    return data


@pytest.fixture
def direct(tmp_path):
    """(sidecar, data) of a --direct-io sidecar over tables t and u holding the same rows."""
    d = tmp_path / "data"
    data = _write(d, "t")
    _write(d, "u")
    sc = direct_sidecar(d, "2MiB", ["--verify-sample", "0", "--no-warm-start"])
    try:
        yield sc, data
    finally:
        sc.cleanup()


def _stage(sc, tmp_path, table: str, ids: np.ndarray, n: int, env=None) -> list[dict]:
    """n client processes looking up `ids` of `table` together; each one's counts and rows."""
    ids_path, go = tmp_path / f"ids-{table}.npy", tmp_path / f"go-{table}"
    np.save(ids_path, ids)
    procs = []
    try:
        for k in range(n):
            out = tmp_path / f"rows-{table}-{k}.npy"
            procs.append((subprocess.Popen(
                [sys.executable, "-c", _CLIENT, str(sc.socket), table, str(ids_path), str(ROWS - 1 - k), str(go),
                 str(out)], stdout=subprocess.PIPE, cwd="/", env={**os.environ, **(env or {})}, text=True), out))
        for p, _ in procs:
            assert p.stdout.readline().strip() == "ready", "a client process did not start"
        go.touch()
        res = []
        for p, out in procs:
            r = json.loads(p.stdout.readline())
            assert p.wait(timeout=60) == 0
            r["rows"] = np.load(out)
            with np.load(f"{out}.notes.npz") as notes:
                r["noted_ids"], r["noted"] = notes["ids"], notes["records"]
            res.append(r)
        return res
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_clients_missing_the_same_rows_read_each_from_the_device_once(direct, tmp_path):
    """CLIENTS processes stage the same batch of misses: every one gets every row bit-exact,
    and together they read the device for about the bytes one process alone reads for the
    same batch (of table u, its rows identical), not CLIENTS times that (/proc/<pid>/io); and
    each one's notes carry the table's own record of every row it missed, copied or read."""
    sc, data = direct
    ids = np.random.default_rng(1).choice(ROWS - 16, 3000, replace=False)
    alone = _stage(sc, tmp_path, "u", ids, 1)[0]
    assert np.array_equal(alone["rows"], data[ids]) and alone["read_bytes"] > 0
    together = _stage(sc, tmp_path, "t", ids, CLIENTS)
    for r in together:
        assert np.array_equal(r["rows"], data[ids]), "a client got a wrong row"
    per_miss = sum(r["read_bytes"] for r in together) / alone["read_bytes"]
    assert per_miss <= 1.05, f"{CLIENTS} clients read the device {per_miss:.2f}x per distinct miss"
    assert sum(r["device"] for r in together) <= 1.05 * ids.size
    # every client's notes carry a record for each of its misses (warm-up and batch), read or copied
    # from another client's, each the table's own record of that row (its bytes and its row sum under
    # the version's salt); the sidecar takes them (none refused and read again)
    with Catalog(tmp_path / "data", readonly=True) as cat:
        key = rowsum.RowKey.of(cat.current("t").row_salt)
    assert sum(r["shared"] for r in together) > 0
    for r in together:
        assert r["noted_ids"].size == r["misses"] > 0, "a miss went unnoted, or its note carried no records"
        want = rowsum.records(data[r["noted_ids"]], r["noted_ids"], key)
        assert np.array_equal(r["noted"], want), "a note carried a record other than the row's own"
    with Client(sc.socket) as c:
        deadline = time.monotonic() + 10
        while True:
            s = next(t for t in c.stats()["tables"] if t["table"] == "t")
            if int(s["local_steps"]) >= 2 * CLIENTS or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    assert int(s["local_steps"]) >= 2 * CLIENTS, s  # each client's warm-up and batch
    assert int(s["note_rows_refused"]) == 0 and int(s["note_rows_placed"]) > 0, s


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_a_reader_that_dies_or_stalls_holding_claims_costs_the_others_a_bounded_wait(direct, tmp_path, how):
    """A client claims a batch's rows and is SIGKILLed (or SIGSTOPped) before reading them:
    the clients that then miss those rows get them bit-exact within the bound (its pid found
    dead at once; a stalled one's claims taken over after WAIT_S), and leave no claim behind:
    the next batch over the same rows waits for nothing."""
    from tierstore.cache import miss_flights

    sc, data = direct
    ids = np.sort(np.random.default_rng(2).choice(ROWS - 16, 2000, replace=False))
    ids_path = tmp_path / "claimed.npy"
    np.save(ids_path, ids)
    claimer = subprocess.Popen([sys.executable, "-c", _CLAIMER, str(sc.socket), "t", str(ids_path), how],
                               stdout=subprocess.PIPE, cwd="/", text=True)
    try:
        claimed = int(claimer.stdout.readline())
        assert claimed > 0.9 * ids.size
        if how == "killed":
            assert claimer.wait(timeout=30) == -signal.SIGKILL
        else:
            deadline = time.monotonic() + 30
            while open(f"/proc/{claimer.pid}/stat").read().split()[2] != "T" and time.monotonic() < deadline:
                time.sleep(0.01)
        res = _stage(sc, tmp_path, "t", ids, 2)
        bound = (0.5 if how == "killed" else miss_flights.WAIT_S + 1.0)
        for r in res:
            assert np.array_equal(r["rows"], data[ids]), "a client got a wrong row"
            assert r["seconds"] < bound, f"a client waited {r['seconds']:.2f} s on a {how} reader"
        with Client(sc.socket) as c:  # no claim is left: the same rows again (resident or not) wait for nothing
            t0 = time.monotonic()
            assert np.array_equal(c.lookup("t", ids), data[ids])
            assert time.monotonic() - t0 < 0.5
    finally:
        if claimer.poll() is None:
            claimer.kill()
            claimer.wait()


def test_the_flights_file_goes_with_the_sidecar(tmp_path):
    d = tmp_path / "data"
    _write(d)
    shm = tmp_path / "shm"
    shm.mkdir()
    sc = direct_sidecar(d, env={"TIERSTORE_SHM_DIR": str(shm)})
    try:
        with Client(sc.socket) as c:
            path = c.handle("t").index_path + ".flights"
            assert (shm / path.rsplit("/", 1)[1]).exists()
            assert np.array_equal(c.lookup("t", np.arange(10, 20))[:, :8].view("<u8").ravel(), np.arange(10, 20))
            assert c.handle("t").local_reads._flights is not None
        assert sc.stop() == 0, sc.log()
        assert not list(shm.iterdir()), "the sidecar left files in its shm dir"
    finally:
        sc.cleanup()
