"""The fast form's host side: a staged layer's misses filled for a device that never blocks the CPU.

In the fast form the step's kernels are enqueued as the engine schedules them; on the
device, each staged layer's lookup hashes the step's tokens, probes the arena's slot index
over UVA, gathers its hits straight from the arena, lists its misses in pinned memory and
rings a doorbell with the step's number (held in a device tensor, so a CUDA graph captures
fixed addresses), then waits on a word the host writes (a spin on pinned memory, or
cuStreamWaitValue32) before it gathers the misses from the channel's rows. This module is
the shared memory of that exchange (`FillChannel`) and the host thread that answers it
(`FillServer`); `ring` and `wait` are the device side's protocol in torch, its reference
(the CPU tests play the device with them from a thread of their own, over the same memory).

The control words, int64 in pinned host memory (the device reads and writes them over UVA):
- DOORBELL: the step whose misses the device listed (written last, after the list and
  COUNT: on a GPU, after a system-scope fence);
- COUNT: the misses listed, ids in `misses[:COUNT]`;
- DONE: the step whose rows the host wrote into `rows[:COUNT]` (written after them);
- FAILED: a step whose fill failed (the error kept on the server, named by `wait`);
- ERROR_STEP, ERROR_CODE: the last step whose device side failed and why (the kernel writes
  them: kernels/staged_gather.py, which names the words).

Invariants:
- The device reads a step's rows only once DONE names that step: never the rows of another
  step, never rows not yet written (the fill guard of staging_buffers.py, on the device).
- A fill that fails (a read that raises: DATA_LOSS, a sidecar away) sets FAILED to its
  step; `wait` raises StagingError with the server's error, never serving the rows.
- A lost host thread is a timeout, not a hang: `wait` gives up after `timeout` seconds and
  raises StagingError (the kernel's spin is bounded the same way and sets its error word).
- One step at a time: the server answers the newest doorbell once; a step rung before the
  last was answered is refused by `ring` (the device waits for each step before the next).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from tierstore.client.engines import StagingError
from tierstore.kernels.staged_gather import (CONTROL_WORDS, COUNT, DONE, DOORBELL, ERROR_CODE, ERROR_STEP, FAILED,
                                             FILL_FAILED, OVERFLOW, TIMED_OUT, staged_gather)

__all__ = ["FillChannel", "FillServer", "DeviceLayer", "device_layers", "ring", "wait", "FILL_TIMEOUT_S",
           "FAST_TOKENS"]

FILL_TIMEOUT_S = 10.0  # the device's spin on a fill before the step fails (a lost host thread)
FAST_TOKENS = 8192  # tokens of a step whose misses a fill channel holds where the engine's step budget is unknown


class FillChannel:
    """The shared memory of one staged layer's exchange: `control` int64 [CONTROL_WORDS] (the words
    above, every one -1 before the first step but COUNT), `misses` int64 [capacity] and `rows` uint8
    [capacity, row_bytes], pinned host memory on CUDA (what a kernel reads and writes over UVA),
    plain host memory on a CPU device."""

    def __init__(self, capacity: int, row_bytes: int, cuda: bool = False):
        import torch

        if capacity <= 0:
            raise ValueError(f"a fill channel of {capacity} misses: it must hold at least one")
        self.capacity, self.row_bytes = capacity, row_bytes
        self.control = torch.full((CONTROL_WORDS,), -1, dtype=torch.int64, pin_memory=cuda)
        self.control[COUNT] = 0
        self.misses = torch.zeros(capacity, dtype=torch.int64, pin_memory=cuda)
        self.rows = torch.zeros((capacity, row_bytes), dtype=torch.uint8, pin_memory=cuda)
        self.words = self.control.numpy()  # the host's view of the same words


class FillServer:
    """The host thread that answers a FillChannel: it polls DOORBELL (every `poll` seconds),
    and for each new step reads its listed misses through `read(ids) -> uint8 [len(ids),
    row_bytes]` (verified rows: a stager reads them with step_reads.read_layers), writes them
    into `rows`, then sets DONE to the step; on an error it keeps it (`error`) and sets FAILED.
    `stop()` ends the thread (a server whose thread is gone leaves `wait` to time out)."""

    def __init__(self, channel: FillChannel, read: Callable[[np.ndarray], np.ndarray], poll: float = 50e-6):
        self.channel, self.read, self.poll = channel, read, poll
        self.error: BaseException | None = None
        self.filled = 0  # steps answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierstore-fill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        words, last = self.channel.words, -1
        while not self._stop.is_set():
            step = int(words[DOORBELL])
            if step == last or step < 0:
                time.sleep(self.poll)
                continue
            n = int(words[COUNT])
            try:
                ids = self.channel.misses[:n].numpy().copy()
                self.channel.rows[:n].numpy()[...] = self.read(ids)
            except Exception as e:  # noqa: BLE001 - whatever the read raised is the step's failure
                self.error = e
                words[FAILED] = step
            else:
                words[DONE] = step
                self.filled += 1
            last = step

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def ring(channel: FillChannel, step: int, ids: np.ndarray) -> None:
    """The device side's listing of step `step`'s misses (its kernel writes the same words): the
    ids, then COUNT, then DOORBELL. ValueError for more misses than the channel holds, or a step
    not after the last one rung."""
    words = channel.words
    if ids.size > channel.capacity:
        raise ValueError(f"{ids.size} misses do not fit the {channel.capacity}-miss fill channel")
    if step <= int(words[DOORBELL]):
        raise ValueError(f"step {step} rung after step {int(words[DOORBELL])}: steps ring in order")
    channel.misses[:ids.size] = channel.misses.new_tensor(ids)
    words[COUNT] = ids.size
    words[DOORBELL] = step


def wait(channel: FillChannel, step: int, timeout: float, server: FillServer | None = None):
    """The device side's wait for step `step`'s rows (its kernel spins on the same word): the
    rows [COUNT, row_bytes] once DONE names the step. StagingError when FAILED names it (with
    the server's error) or after `timeout` seconds (a lost host thread), never the rows of
    another step."""
    words = channel.words
    deadline = time.monotonic() + timeout
    while True:
        if int(words[DONE]) == step:
            return channel.rows[:int(words[COUNT])]
        if int(words[FAILED]) == step:
            why = f"{type(server.error).__name__}: {server.error}" if server is not None else "its read failed"
            raise StagingError(f"tierstore's host thread could not fill step {step}'s Engram misses ({why}): no "
                               f"rows are served in place of the step's own")
        if time.monotonic() > deadline:
            raise StagingError(f"no host thread filled step {step}'s Engram misses within {timeout} s (the fill "
                               f"thread is gone or stuck; DONE names step {int(words[DONE])}): the step stops "
                               f"rather than read another step's rows or wait forever")
        time.sleep(0)


_WHY = {TIMED_OUT: "no host thread filled its misses in time (the fill thread is gone or stuck)",
        FILL_FAILED: "the host thread's read of its misses failed", OVERFLOW: "it missed more rows than the fill "
        "channel holds"}


class DeviceLayer:
    """One staged layer's fast form: `lookup(ids)` on the device (kernels.staged_gather over the
    table's slot index and arena, SlotProbe.tensors), its misses filled by a FillServer whose
    `read(ids)` is the stager's verified read (step_reads.read_layers of this layer).

    capacity: the misses one lookup may list (the channel's rows). The fill guard on the device:
    a lookup's missed rows are the ones the host wrote for its step (DONE), else POISON; a step
    whose device side failed (ERROR_STEP) raises StagingError at the layer's next lookup, naming
    it, before anything more is enqueued (`check`)."""

    def __init__(self, table, read: Callable[[np.ndarray], np.ndarray], device, capacity: int, name: str,
                 timeout_s: float = FILL_TIMEOUT_S):
        import torch

        self.device, self.name, self.timeout_s = torch.device(device), name, timeout_s
        self.index = table.probe.tensors(self.device)
        self.row_bytes = self.index["arena"].shape[1]
        self.channel = FillChannel(capacity, self.row_bytes, cuda=self.device.type == "cuda")
        self.server = FillServer(self.channel, read)
        self.step = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.status = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.miss_at = torch.empty(capacity, dtype=torch.int64, device=self.device)  # a lookup's scratch
        self.failed = -1  # the last failed step raised

    def lookup(self, ids, out=None):
        """uint8 [n, row_bytes] rows of int64 ids [n] (on the device; negative: a zero row), in
        `out` where given. A graph captures it at fixed addresses (the scratch of a lookup of more
        ids than the channel's capacity is its own). StagingError for an earlier step that failed."""
        import torch

        self.check()
        n = ids.shape[0]
        # more ids than the channel holds misses: scratch of the call's own (a graph's pool keeps it for replays)
        miss_at = self.miss_at if n <= self.miss_at.shape[0] else torch.empty(n, dtype=torch.int64, device=self.device)
        if out is None:
            out = torch.empty((n, self.row_bytes), dtype=torch.uint8, device=self.device)
        return staged_gather(ids, out, control=self.channel.control, misses=self.channel.misses,
                             rows=self.channel.rows, step=self.step, status=self.status, miss_at=miss_at,
                             timeout_s=self.timeout_s, **self.index)

    def check(self) -> None:
        """StagingError when a step's device side failed since the last check (read from the
        channel's pinned words: no device sync)."""
        words = self.channel.words
        failed = int(words[ERROR_STEP])
        if failed > self.failed:
            self.failed = failed
            code = int(words[ERROR_CODE])
            why = _WHY.get(code, f"error code {code}")
            if code == FILL_FAILED and self.server.error is not None:
                why += f" ({type(self.server.error).__name__}: {self.server.error})"
            raise StagingError(f"the fast form's lookup of {self.name} failed at its step {failed}: {why}; its "
                               f"missed rows were poisoned (NaN), never another step's: the step stops")

    def close(self) -> None:
        self.server.stop()


def device_layers(tables: list, read_layers: Callable, device, capacity: int, names: list[str]) -> dict:
    """{id(table): DeviceLayer} of each staged table of `tables` (named names[i] in errors), each
    channel `capacity` misses, its misses read by `read_layers([table], [ids])[0]` (the stager's
    verified read). Made with the stager, before any graph is captured: a channel's pinned
    memory and thread are made outside a capture."""
    return {id(t): DeviceLayer(t, lambda ids, t=t: read_layers([t], [np.ascontiguousarray(ids)])[0], device,
                               capacity, name) for t, name in zip(tables, names)}
