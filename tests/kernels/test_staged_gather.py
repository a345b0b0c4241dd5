"""staged_gather: the fast form's device lookup (probe the slot index, gather hits, ring the host
for the misses, spin, gather them), the torch reference and the Triton kernel (through Triton's
CPU interpreter, in a child pytest run) over a real slot-index file, a host thread answering the
doorbell (device_fill.FillServer) from the test's rows or from a real sidecar."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from tierstore.cache.slot_index import SlotIndexFile
from tierstore.cache.slot_map import SlotMap
from tierstore.client.engines.device_fill import FillChannel, FillServer
from tierstore.errors import InvalidArgument
from tierstore.kernels import staged_gather as sg

CHILD = os.environ.get("TIERSTORE_KERNEL_TEST_CHILD") == "1"
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter child of test_kernel_under_interpreter")
ROWS, SLOTS, WIDTH = 5000, 256, 72


class Index:
    """A slot index file (the sidecar's layout) over an arena tensor, filled as the sidecar fills it."""

    def __init__(self, path, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.data = rng.integers(0, 256, (ROWS, WIDTH), dtype=np.uint8)
        self.file = SlotIndexFile(path, SLOTS, ROWS)
        self.map = SlotMap(self.file.table, self.file.id_of, SLOTS)
        self.arena = torch.zeros((SLOTS, WIDTH), dtype=torch.uint8)
        self.retired = torch.zeros(4, dtype=torch.uint8)
        self.held = rng.choice(ROWS, 200, replace=False)
        slots = np.arange(self.held.size)
        self.file.id_of[slots] = self.held
        self.map.insert(self.held, slots)
        self.arena[:self.held.size] = torch.from_numpy(self.data[self.held])
        self.file.gen[slots] = 2  # READY

    def args(self, backend: str = "auto") -> dict:
        return dict(gen=torch.from_numpy(self.file.gen.view(np.int32)), id_of=torch.from_numpy(self.file.id_of),
                    table=torch.from_numpy(self.file.table.view(np.int32)), arena=self.arena, retired=self.retired,
                    slot_bits=self.map.slot_bits, tag_shift=self.map.tag_shift, tag_mask=self.map.tag_mask,
                    backend=backend)


@pytest.fixture
def index(tmp_path):
    ix = Index(tmp_path / "index")
    yield ix
    ix.file.close()


def run(ix: Index, ids: np.ndarray, channel: FillChannel, step, backend: str, timeout_s: float = 10.0):
    out = torch.empty((ids.size, WIDTH), dtype=torch.uint8)
    status, miss_at = torch.zeros(1, dtype=torch.int64), torch.empty(max(ids.size, 1), dtype=torch.int64)
    sg.staged_gather(torch.from_numpy(ids), out, control=channel.control, misses=channel.misses, rows=channel.rows,
                     step=step, status=status, miss_at=miss_at, timeout_s=timeout_s, **ix.args(backend))
    return out.numpy(), int(status[0])


def ids_of(ix: Index, seed: int, n: int = 300) -> np.ndarray:
    """Resident ids, ids the index does not hold, repeats and a negative id (a zero row)."""
    rng = np.random.default_rng(seed)
    ids = np.where(rng.random(n) < 0.6, rng.choice(ix.held, n), rng.integers(0, ROWS, n))
    ids[::37] = -1
    return ids.astype(np.int64)


def want(ix: Index, ids: np.ndarray) -> np.ndarray:
    return np.where((ids >= 0)[:, None], ix.data[np.maximum(ids, 0)], 0).astype(np.uint8)


def check_steps(ix: Index, backend: str) -> None:
    """Steps of hits and misses, some slots torn (odd gen), one remapped (id_of names another id)
    and then the arena retired: each step's rows exact, the misses the host filled only."""
    channel = FillChannel(512, WIDTH)
    asked = []
    server = FillServer(channel, lambda ids: (asked.append(ids.copy()), ix.data[ids])[1])
    step = torch.zeros(1, dtype=torch.int64)
    try:
        for s in range(3):
            ids = ids_of(ix, s)
            got, status = run(ix, ids, channel, step, backend)
            assert status == 0 and np.array_equal(got, want(ix, ids)), s
            resident = np.isin(ids, ix.held)
            assert np.array_equal(np.sort(asked[-1]), np.sort(ids[(ids >= 0) & ~resident]))  # misses only
        ix.file.gen[:5] = 3  # torn: being written
        ix.arena[:5] = 0xAB
        ix.file.id_of[5] = ix.held[6]  # slot 5 now claims another id: not a hit of held[5]
        ids = np.concatenate([ix.held[:8], ids_of(ix, 9)])
        got, status = run(ix, ids, channel, step, backend)
        assert status == 0 and np.array_equal(got, want(ix, ids))
        assert set(ix.held[:6]) <= set(asked[-1].tolist())  # read by the host, never from the torn slots
        ix.retired[0] = 1  # the arena retired: every id a miss
        got, status = run(ix, ids, channel, step, backend)
        assert status == 0 and np.array_equal(got, want(ix, ids))
        assert asked[-1].size == np.count_nonzero(ids >= 0)
        assert int(step[0]) == 5
    finally:
        server.stop()


def check_failures(ix: Index, backend: str) -> None:
    """A failed fill, a lost host thread and more misses than the channel holds: the step's
    status and ERROR_STEP / ERROR_CODE say so, its missed rows are POISON, its hits exact."""
    channel = FillChannel(64, WIDTH)
    step = torch.zeros(1, dtype=torch.int64)
    server = FillServer(channel, lambda ids: ix.data[ids] if ids.max() < ROWS - 20 else 1 / 0)  # a read that fails
    ids = np.concatenate([ix.held[:10], np.setdiff1d(np.arange(ROWS - 20, ROWS), ix.held)[:10]])
    hit = np.isin(ids, ix.held)
    got, status = run(ix, ids, channel, step, backend)
    assert status == sg.FILL_FAILED and int(channel.control[sg.ERROR_STEP]) == 1
    assert np.array_equal(got[hit], ix.data[ids[hit]]) and (got[~hit] == sg.POISON).all()
    server.stop()
    got, status = run(ix, ids[:15], channel, step, backend, timeout_s=0.3)  # nobody answers
    assert status == sg.TIMED_OUT and int(channel.control[sg.ERROR_CODE]) == sg.TIMED_OUT
    assert int(channel.control[sg.ERROR_STEP]) == 2 and (got[~hit[:15]] == sg.POISON).all()
    many = np.setdiff1d(np.arange(ROWS), ix.held)[:65]
    got, status = run(ix, many, channel, step, backend)
    assert status == sg.OVERFLOW and (got == sg.POISON).all() and int(channel.control[sg.DOORBELL]) == 2


def check_torn_while_read(ix: Index, backend: str) -> None:
    """A writer rewriting resident rows under the seqlock while the lookup reads them (slot_index.py's
    writer: gen odd, row garbage, row back, gen even again): no garbage is ever kept as a hit."""
    channel = FillChannel(512, WIDTH)
    server = FillServer(channel, lambda ids: ix.data[ids])
    step, stop = torch.zeros(1, dtype=torch.int64), threading.Event()
    gen = ix.file.gen

    def writer():
        k = 0
        while not stop.is_set():
            s = k % 40
            gen[s] += 1  # odd: being written
            ix.arena[s] = 0xCD
            ix.arena[s] = torch.from_numpy(ix.data[ix.held[s]])
            gen[s] += 1
            k += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for s in range(4):
            ids = ix.held[np.random.default_rng(s).integers(0, 40, 200)]
            got, status = run(ix, ids, channel, step, backend)
            assert status == 0 and np.array_equal(got, ix.data[ids]), s
    finally:
        stop.set()
        t.join()
        server.stop()


def test_reference_steps(index):
    check_steps(index, "torch")


def test_reference_failures(index):
    check_failures(index, "torch")


def test_reference_never_keeps_a_torn_row(index):
    check_torn_while_read(index, "torch")


def test_launcher_refuses_inputs_that_do_not_fit(index):
    channel = FillChannel(8, WIDTH)
    kw = dict(control=channel.control, misses=channel.misses, rows=channel.rows, step=torch.zeros(1, dtype=torch.int64),
              status=torch.zeros(1, dtype=torch.int64), miss_at=torch.empty(4, dtype=torch.int64), timeout_s=1.0,
              **index.args("torch"))
    with pytest.raises(InvalidArgument, match="ids must be a 1-D torch.int64"):
        sg.staged_gather(torch.zeros(4, dtype=torch.int32), torch.empty((4, WIDTH), dtype=torch.uint8), **kw)
    with pytest.raises(InvalidArgument, match="arena rows must be 80 contiguous bytes"):
        sg.staged_gather(torch.zeros(4, dtype=torch.int64), torch.empty((4, 80), dtype=torch.uint8), **kw)
    with pytest.raises(InvalidArgument, match="miss_at 5"):
        sg.staged_gather(torch.zeros(5, dtype=torch.int64), torch.empty((5, WIDTH), dtype=torch.uint8), **kw)


def test_kernel_under_interpreter(interpreter_child):
    interpreter_child(__file__)


@interp
def test_interp_kernel_steps(index):
    check_steps(index, "triton")


@interp
def test_interp_kernel_failures(index):
    check_failures(index, "triton")


@interp
def test_interp_kernel_never_keeps_a_torn_row(index):
    check_torn_while_read(index, "triton")


@interp
def test_interp_kernel_over_a_real_sidecar(tmp_path):
    """The kernel over a real cache-mode sidecar's slot index and arena (SlotProbe.tensors), its
    misses filled by a FillServer reading through the sidecar's client: every row exact."""
    from tierstore.client.client import Client
    from tierstore.client.engines.slot_probe import SlotProbe
    from tierstore.ingest.writer import write_version
    from tierstore.sidecar.launcher import SidecarProcess

    data = np.random.default_rng(3).integers(0, 256, (ROWS, WIDTH), dtype=np.uint8)
    write_version(tmp_path / "data", "t", [data], rows=ROWS, row_format="fp32", row_dim=WIDTH // 4)
    with SidecarProcess(tmp_path / "data", dram_budget="128KiB") as sc, Client(sc.socket) as c:
        c.lookup("t", np.arange(0, ROWS, 7))  # some rows resident
        c.flush()
        probe = SlotProbe(c, "t")
        t = dict(probe.tensors("cpu"))
        channel = FillChannel(1024, WIDTH)
        server = FillServer(channel, lambda ids: c.lookup("t", ids))
        step = torch.zeros(1, dtype=torch.int64)
        try:
            for s in range(3):
                ids = np.random.default_rng(s).integers(0, ROWS, 400)
                out = torch.empty((ids.size, WIDTH), dtype=torch.uint8)
                status, miss_at = torch.zeros(1, dtype=torch.int64), torch.empty(ids.size, dtype=torch.int64)
                sg.staged_gather(torch.from_numpy(ids), out, control=channel.control, misses=channel.misses,
                                 rows=channel.rows, step=step, status=status, miss_at=miss_at, timeout_s=20.0,
                                 backend="triton", **t)
                assert int(status[0]) == 0 and np.array_equal(out.numpy(), data[ids]), s
        finally:
            server.stop()
        assert server.filled == 3 and int(channel.control[sg.COUNT]) < 400  # some ids were hits
