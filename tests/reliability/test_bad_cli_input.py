"""Bad input at the commands and the client, as one suite against a real sidecar:
`tierstore lookup` (a real process) with ids out of range, negative, floats, strings,
other scripts' digits, none at all, and table names with `../`, undecodable bytes or
100,000 characters; the client's lookup with ids of the wrong dtype or shape, out of
range, and names with NUL; `tierstore serve` with budgets and bounds 0, -1, 1e999 and
NaN. Each is exit 2 (the client: InvalidArgument / NOT_FOUND) with one line naming the
input, no traceback, and nothing changed on disk or in shared memory.
(`tests/cli/test_lookup.py` and `tests/cli/test_commands.py` hold the in-process cases.)"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tierstore import errors
from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess

pytestmark = pytest.mark.reliability
ROWS = 5000


def _snapshot(data_dir) -> dict:
    """Every file of the data directory with its size and mtime (the LMDB lock file aside)."""
    out = {}
    for root, _, files in os.walk(data_dir):
        for f in files:
            p = os.path.join(root, f)
            if f != "lock.mdb":
                st = os.stat(p)
                out[os.path.relpath(p, data_dir)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, rel):
    d = tmp_path_factory.mktemp("badcli") / "data"
    expected = rel.write_table(d, "t", ROWS, dim=16, seed=4)
    with SidecarProcess(d, dram_budget="100KiB", extra_args=["--hot-set-interval", "0"]) as sc:
        yield sc, d, expected


def _unchanged(served, before):
    sc, d, expected = served
    assert _snapshot(d) == before[0], "the data directory changed"
    assert sorted(sc.arena_files()) == before[1], "the sidecar's shared memory changed"
    assert sc.proc.poll() is None, sc.log()
    with Client(sc.socket, timeout=10) as c:  # and it still serves the right rows
        assert np.array_equal(c.lookup("t", [0, ROWS - 1]), expected[[0, ROWS - 1]])


LOOKUPS = [  # (extra argv, what the error line must say)
    (["--table", "t", "--ids", "0,5000"], f"table 't' has {ROWS} rows; id 5000 is out of range"),
    (["--table", "t", "--ids=-1,2"], "id -1 is out of range"),
    (["--table", "t", "--ids", f"3,{2 ** 40}"], f"id {2 ** 40} is out of range"),
    (["--table", "t", "--ids", "-9223372036854775809"], "beyond int64 ('-9223372036854775809')"),
    (["--table", "t", "--ids", "1.5"], "--ids must be comma-separated integers, got '1.5'"),
    (["--table", "t", "--ids", "1e3"], "got '1e3'"),
    (["--table", "t", "--ids", "0x10"], "got '0x10'"),
    (["--table", "t", "--ids", "1_000"], "got '1_000'"),
    (["--table", "t", "--ids", "\u0663"], "got '\\u0663'"),  # ARABIC-INDIC DIGIT THREE: int() takes it
    (["--table", "t", "--ids", ""], "--ids names no row id, got ''"),
    (["--table", "t", "--ids", " , "], "--ids names no row id"),
    (["--table", "../t", "--ids", "1"], "--table '../t' is not a table name"),
    (["--table", "../../etc/passwd", "--ids", "1"], "--table '../../etc/passwd' is not a table name"),
    (["--table", "t/../t", "--ids", "1", "--inline"], "--table 't/../t' is not a table name"),
    (["--table", "", "--ids", "1"], "--table '' is not a table name"),
    (["--table", "x" * 100_000, "--ids", "1"], "... (100000 characters) is not a table name"),
    (["--table", os.fsdecode(b"t\xff"), "--ids", "1"], "--table 't\\udcff' is not a table name"),
]


@pytest.mark.parametrize("argv, says", LOOKUPS, ids=[f"lookup{i}" for i in range(len(LOOKUPS))])
def test_tierstore_lookup_refuses_bad_input_by_name(served, argv, says):
    sc, d, _ = served
    before = (_snapshot(d), sorted(sc.arena_files()))
    done = subprocess.run([sys.executable, "-m", "tierstore", "lookup", "--socket", str(sc.socket),
                           *[os.fsencode(a) for a in argv]], capture_output=True, timeout=120)
    err = done.stderr.decode(errors="backslashreplace")
    assert done.returncode == 2, (argv[:4], done.returncode, err[-2000:])
    assert err.startswith("tierstore lookup: error: ") and err.count("\n") == 1, err[-2000:]
    assert says in err and len(err) < 1000, err[-2000:]
    assert done.stdout == b""
    _unchanged(served, before)


CLIENT_LOOKUPS = [  # (table, ids, error class, what its message must say)
    ("t", np.array([1.5]), errors.InvalidArgument, "ids must be integers, got dtype float64"),
    ("t", ["1"], errors.InvalidArgument, "got dtype <U1"),
    ("t", np.array([True]), errors.InvalidArgument, "got dtype bool"),
    ("t", np.array([1j]), errors.InvalidArgument, "got dtype complex128"),
    ("t", [[1, 2], [3]], errors.InvalidArgument, "ids must be integers in one flat sequence"),
    ("t", np.array([2 ** 64 - 1], np.uint64), errors.IdOutOfRange, f"id {2 ** 64 - 1} is beyond int64"),
    ("t", [-1], errors.IdOutOfRange, "id -1 is out of range"),
    ("t", [ROWS], errors.IdOutOfRange, f"id {ROWS} is out of range"),
    ("../t", [1], errors.TableNotFound, "no table '../t' is served"),
    ("t\x00", [1], errors.TableNotFound, "no table 't\\x00' is served"),
    ("x" * 100_000, [1], errors.TableNotFound, "(100000 characters) is served"),
]


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "arena"])
def test_the_clients_lookup_refuses_bad_input_by_name(served, inline):
    sc, d, _ = served
    before = (_snapshot(d), sorted(sc.arena_files()))
    with Client(sc.socket, timeout=10) as c:
        for table, ids, cls, says in CLIENT_LOOKUPS:
            with pytest.raises(cls) as e:
                c.lookup(table, ids, inline=inline)
            assert says in str(e.value) and len(str(e.value)) < 1000, (table[:10], ids, str(e.value)[:500])
    _unchanged(served, before)


SERVE = [  # (flag, value, what the error line must say)
    ("--dram-budget", "0", "size 0 is outside 1 byte..1 PiB"),
    ("--dram-budget", "-1", "cannot read size '-1'"),
    ("--dram-budget", "1e999GiB", "cannot read size '1e999GiB'"),
    ("--lease-ttl", "nan", "--lease-ttl must be seconds in (0, 86400], got nan"),
    ("--lease-ttl", "1e999", "got inf"),
    ("--max-leases", "-1", "--max-leases must be 1..61440, got -1"),
    ("--max-client-share", "1e999", "--max-client-share is a fraction of an arena's slots in (0, 1], got inf"),
    ("--hot-set-interval", "nan", "--hot-set-interval must be seconds >= 0"),
    ("--verify-sample", "-1", "--verify-sample is a fraction in [0, 1], got -1.0"),
]


@pytest.mark.parametrize("flag, value, says", SERVE, ids=[f"{f}={v}" for f, v, _ in SERVE])
def test_tierstore_serve_refuses_a_bad_bound_by_name_and_makes_nothing(tmp_path, rel, flag, value, says):
    d = tmp_path / "data"
    rel.write_table(d, "t", 1000, dim=16)
    shm, sock = tmp_path / "shm", tmp_path / "s.sock"
    shm.mkdir()
    before = _snapshot(d)
    done = subprocess.run([sys.executable, "-m", "tierstore", "serve", "--data", str(d), "--socket", str(sock),
                           "--shm-dir", str(shm), f"{flag}={value}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (flag, value, done.stdout[-500:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr and says in done.stderr, done.stderr[-2000:]
    assert f"{flag}" in done.stderr.splitlines()[-1], done.stderr[-2000:]
    assert not sock.exists() and list(shm.iterdir()) == [] and _snapshot(d) == before


def _serve(d, tmp_path, sock) -> subprocess.CompletedProcess:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "tierstore", "serve", "--data", str(d), "--socket", str(sock),
                           "--shm-dir", str(shm), "--dram-budget", "1MiB"], capture_output=True, text=True,
                          timeout=60)


def test_tierstore_serve_refuses_a_percent_escape_that_would_take_a_live_sidecars_socket(tmp_path, rel, sock_dir):
    """gRPC decodes %XX in a unix socket path: `live%2Fs.sock` would bind `live/s.sock`, replacing
    the socket a live sidecar serves on. Refused by name before anything binds; the live one
    keeps its socket and serves on."""
    d = tmp_path / "data"
    expected = rel.write_table(d, "t", 1000, dim=16)
    (sock_dir / "live").mkdir()
    with SidecarProcess(d, sock_dir / "live" / "s.sock", dram_budget="1MiB") as live:
        ino = os.stat(live.socket).st_ino
        before = sorted(p.name for p in sock_dir.iterdir())
        done = _serve(d, tmp_path, sock_dir / "live%2Fs.sock")
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and "it decodes each %XX escape" in done.stderr, done.stderr[-2000:]
        assert "--socket" in done.stderr.splitlines()[-1]
        assert sorted(p.name for p in sock_dir.iterdir()) == before and os.stat(live.socket).st_ino == ino
        with Client(live.socket, timeout=10) as c:
            assert np.array_equal(c.lookup("t", [0, 999]), expected[[0, 999]])
    assert list((tmp_path / "shm").iterdir()) == []


SOCKET_PATHS = [  # (--socket in a fresh directory, what the error line must say)
    ("x,y.sock", "a client splits the path into several addresses at each ','"),
    ("x?y.sock", "a client ends the path at '?'"),
    ("x#y.sock", "a client ends the path at '#'"),
    ("//x.sock", "a client reads what follows a leading // as a host"),
]


@pytest.mark.parametrize("name, says", SOCKET_PATHS, ids=[n for n, _ in SOCKET_PATHS])
def test_tierstore_serve_refuses_a_socket_no_client_could_reach_and_binds_nothing(tmp_path, rel, sock_dir, name,
                                                                                   says):
    """A gRPC client splits `unix:` paths at commas, ends them at ? or #, and reads a leading //
    as a host: a sidecar bound there would serve nobody. Refused by name; nothing is bound."""
    d = tmp_path / "data"
    rel.write_table(d, "t", 1000, dim=16)
    sock = f"/{sock_dir}/x.sock" if name.startswith("//") else sock_dir / name
    done = _serve(d, tmp_path, sock)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and says in done.stderr, done.stderr[-2000:]
    assert "no client could reach this sidecar" in done.stderr and "--socket" in done.stderr.splitlines()[-1]
    assert list(sock_dir.iterdir()) == [] and list((tmp_path / "shm").iterdir()) == []
