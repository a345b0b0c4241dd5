"""docs/architecture.md's routes and thread list, held to the code.

Each route block of "One route per operation and transport" is parsed for its `Class.method`
names (those outside parentheses), and its operation is run against a real sidecar started in
this process (a real table, arena, sockets and client), every thread traced with
sys.setprofile / threading.setprofile: the names each thread of the block lists must be
called in the order written. The
thread list must name exactly the threads the code starts (each threading.Thread and thread
pool of tierstore/ and client/, found with ast)."""
from __future__ import annotations

import ast
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.ingest.writer import write_version
from tierstore.sidecar.config import ServeConfig
from tierstore.sidecar.server import Server

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
ROWS = 4000


def _section(title: str, upto: str) -> str:
    text = DOC.read_text()
    return text[text.index(title):text.index(upto, text.index(title))]


def routes() -> dict[str, list[list[str]]]:
    """{route heading: for each thread of its block (a line that is not indented starts one),
    the Class.method names outside parentheses, in order}."""
    out = {}
    section = _section("## One route per operation and transport", "### Threads")
    for m in re.finditer(r"^### (.+?)\n.*?```\n(.*?)```", section, re.S | re.M):
        block = m.group(2)
        while re.search(r"\([^()]*\)", block):  # nested parentheses, innermost first
            block = re.sub(r"\([^()]*\)", " ", block)
        threads = re.split(r"^(?=\S)", block, flags=re.M)
        out[m.group(1).strip()] = [names for t in threads
                                   if (names := re.findall(r"(?<![\w./])([A-Z]\w*\.[A-Za-z_]\w*)(?!\w|\.py)", t))]
    return out


class Trace:
    """Every call into this repository's code from any thread, in order, as qualnames."""

    def __init__(self):
        self.calls: list[str] = []
        roots = tuple(str(ROOT / d) + "/" for d in ("tierstore", "client", "proto"))

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(roots):
                self.calls.append(frame.f_code.co_qualname)
        self._profile = profile

    def __enter__(self):
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)

    def mark(self) -> int:
        return len(self.calls)

    def missing(self, names: list[str], since: int) -> str | None:
        """The first of `names` not called after its predecessor (since `since`), or None."""
        calls, at = self.calls[since:], 0
        for name in names:
            try:
                at = calls.index(name, at) + 1
            except ValueError:
                before = names[names.index(name) - 1] if names.index(name) else "the start"
                return f"{name} (after {before})" + (" is never called" if name not in calls else "")
        return None


@pytest.fixture
def table(tmp_path):
    d = tmp_path
    rows = np.random.default_rng(0).integers(0, 256, size=(ROWS, 64), dtype=np.uint8)
    write_version(d / "data", "t", [rows], rows=ROWS, row_format="fp32", row_dim=16)
    return d, rows


@pytest.fixture
def sidecar(table, sock_dir):
    """sidecar(budget) -> (Server, socket): a sidecar in this process over the table (cache mode
    under 64KiB), started inside the trace so its threads are traced; stopped at teardown."""
    started = []

    def start(budget: str):
        d, _ = table
        srv = Server(ServeConfig.from_env(data_dir=d / "data", socket=sock_dir / f"s{len(started)}.sock",
                                          dram_budget=budget, verify_sample=0, warm_start=False,
                                          record_hot_sets=False))
        started.append(srv)
        srv.start()
        return srv, srv.config.socket

    yield start
    for srv in started:
        srv.stop(grace=0)


def _wait(pred, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.02)


def _check(trace: Trace, route: str, since: int) -> None:
    """Each thread's part of the route: its names called in the order written (across threads the
    order is the threads' own: a caller waits while the sidecar serves it)."""
    threads = routes()[route]
    assert threads, f"docs/architecture.md's route {route!r} names no Class.method"
    for names in threads:
        gap = trace.missing(names, since)
        assert gap is None, f"docs/architecture.md, route {route!r}: {gap}; the route lists {names}"


def test_every_route_block_is_run_here():
    assert set(routes()) == {"lookup, on the host, cache mode", "lookup, on the host, full mode",
                             "lookup, inline (a TCP client, or `lookup(inline=True)`)",
                             "plan, on the host, cache mode", "release", "reload"}


def test_the_cache_mode_routes_call_what_the_doc_lists(table, sidecar):
    _, rows = table
    ids = np.array([5, 17, 900, 3000])
    with Trace() as trace:
        srv, sock = sidecar("64KiB")
        eng = srv.served.engines["t"]
        assert not eng.full
        with Client(sock) as c:
            at = trace.mark()
            assert np.array_equal(c.lookup("t", ids), rows[ids])  # misses read here, noted to the sidecar
            _wait(lambda: eng.counters.local_steps >= 1 and eng.counters.note_rows_placed >= ids.size,
                  "the note learned")
            _check(trace, "lookup, on the host, cache mode", at)

            at = trace.mark()
            step = c.plan("t", ids[::-1])
            assert np.array_equal(step.rows(), rows[ids[::-1]])
            _check(trace, "plan, on the host, cache mode", at)

            at = trace.mark()
            step.release()
            _wait(lambda: eng.leases.count_for(eng) == 0, "the lease released")
            _check(trace, "release", at)

            at = trace.mark()
            assert np.array_equal(c.lookup("t", ids + 1, inline=True), rows[ids + 1])
            _check(trace, "lookup, inline (a TCP client, or `lookup(inline=True)`)", at)

            d, _ = table
            write_version(d / "data", "t", [rows[::-1].copy()], rows=ROWS, row_format="fp32", row_dim=16)
            at = trace.mark()
            c.reload("t")
            assert np.array_equal(c.lookup("t", ids, inline=True), rows[::-1][ids])  # the new version
            _check(trace, "reload", at)


def test_the_full_mode_lookup_calls_what_the_doc_lists(table, sidecar):
    _, rows = table
    ids = np.array([3999, 0, 1234])
    with Trace() as trace:
        srv, sock = sidecar("64MiB")
        assert srv.served.engines["t"].full
        with Client(sock) as c:
            at = trace.mark()
            assert np.array_equal(c.lookup("t", ids), rows[ids])
            _check(trace, "lookup, on the host, full mode", at)


# ---- the thread list ---------------------------------------------------------------------------
def _name_of(expr: ast.expr, func: ast.FunctionDef | None, module: ast.Module) -> list[str]:
    """The thread names `expr` gives: a string, an f-string (its fields as <x>), or a parameter of
    the enclosing function `func` (the strings its callers in the module pass for it)."""
    if isinstance(expr, ast.Constant):
        return [expr.value]
    if isinstance(expr, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in expr.values)]
    if isinstance(expr, ast.Name) and func is not None:
        params = [a.arg for a in func.args.args]
        pos = params.index(expr.id) - (params[0] == "self")
        return [c.args[pos].value for c in ast.walk(module) if isinstance(c, ast.Call)
                and getattr(c.func, "attr", getattr(c.func, "id", None)) == func.name
                and len(c.args) > pos and isinstance(c.args[pos], ast.Constant)]
    raise AssertionError(f"a thread named by {ast.unparse(expr)}: name it with a string")


def code_thread_names() -> set[str]:
    names = set()
    for path in [*(ROOT / "tierstore").rglob("*.py"), *(ROOT / "client").rglob("*.py")]:
        module = ast.parse(path.read_text())
        funcs = [f for f in ast.walk(module) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for call in ast.walk(module):
            if not isinstance(call, ast.Call):
                continue
            kind = getattr(call.func, "attr", getattr(call.func, "id", None))
            key = {"Thread": "name", "ThreadPoolExecutor": "thread_name_prefix"}.get(kind)
            if key is None:
                continue
            kw = [k.value for k in call.keywords if k.arg == key]
            assert kw, f"{path.relative_to(ROOT)}:{call.lineno}: a {kind} without {key}=: name it"
            func = next((f for f in funcs if f.lineno <= call.lineno <= f.end_lineno
                         and not any(g is not f and f.lineno < g.lineno <= call.lineno <= g.end_lineno
                                     for g in funcs)), None)
            names.update(_name_of(kw[0], func, module))
    return names


def doc_thread_names() -> set[str]:
    section = _section("### Threads", "## How it is built")
    return {re.sub(r"<[^>]*>", "<x>", n) for line in section.splitlines() if line.startswith("- ")
            for n in re.findall(r"`([^`]+)`", line.split(":")[0])}


def test_the_thread_list_names_every_thread_the_code_starts():
    code, doc = code_thread_names(), doc_thread_names()
    assert code == doc, (f"started in the code, not in docs/architecture.md's thread list: {sorted(code - doc)}; "
                         f"listed there, started nowhere: {sorted(doc - code)}")
