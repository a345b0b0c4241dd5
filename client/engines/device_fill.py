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
from tierstore.kernels.staged_gather import CONTROL_WORDS, COUNT, DONE, DOORBELL, FAILED

__all__ = ["FillChannel", "FillServer", "ring", "wait"]


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
