"""The fast form's device lookup of one staged Engram layer: the rows of a step's hash ids
gathered on the device, resident ones straight from the cache arena, misses filled by a host
thread through pinned memory; the CPU never blocks.

`staged_gather` validates its inputs, then runs three Triton kernels (each a fixed-address
launch: a CUDA graph captures them, the step number lives in a device tensor) or the torch
reference (`staged_gather_torch`, the same math and protocol in torch ops):
1. probe (a program per BLOCK_R ids): each id's slot found by the slot map's bounded probe
   (tierstore/cache/slot_map.py: its hash, tag and entries), then the seqlock read of
   tierstore/cache/slot_index.py: g1 = gen[slot], id_of[slot] == id, the row copied, g2 =
   gen[slot]; the row is kept (written to `out`) only where g1 is even, id_of named the id
   and g2 == g1, and the arena is not retired. Every other id is a miss (`miss_at[i] > 0`); a
   probe longer than MAX_PROBE entries is a miss too (the map is only a hint of where to
   look). A negative id is a zero row, never a miss;
2. ring (one program): the misses listed in order into the channel's `misses` (each missed
   position's place in `miss_at`, -1 elsewhere), COUNT, then DOORBELL = the step (step[0] + 1,
   stored back) after a system-scope fence; then a bounded spin until DONE or FAILED names the
   step. A step without misses rings nothing;
3. fill (a program per BLOCK_R ids): each missed position's row copied from the channel's
   `rows`, or POISON bytes where the step did not complete.

The control words (int64, pinned host memory on CUDA; client/engines/device_fill.py is the host
side): DOORBELL, COUNT, DONE, FAILED as device_fill describes them, and ERROR_STEP /
ERROR_CODE, the last step whose device side failed and why (TIMED_OUT, FILL_FAILED,
OVERFLOW), written by the ring kernel (code first). `status[0]` (device) holds the step's code,
0 when its rows are whole.

Invariants:
- A row kept from the arena was row `id` for the whole copy (the seqlock, as the host's local
  reads keep it); a torn, rewritten, empty or retired slot is a miss, never a hit.
- A missed position reads the rows the host wrote for this step (DONE names it), else POISON
  (0xFF: NaN in e4m3 and in ue8m0): never another step's rows, never zeros that read as real.
- The spin is bounded (`spins` polls): a lost host thread is TIMED_OUT, never a hang.
On CUDA the loads of a seqlock read are ordered by system-scope fences (inline PTX); the
interpreter and the reference run them in program order. Not yet run on a GPU.
"""
from __future__ import annotations

import time

import torch

from tierstore.errors import InvalidArgument

from tierstore.kernels.dispatch import choose_backend, tl, triton

__all__ = ["staged_gather", "staged_gather_torch", "DOORBELL", "COUNT", "DONE", "FAILED", "ERROR_STEP", "ERROR_CODE",
           "CONTROL_WORDS", "TIMED_OUT", "FILL_FAILED", "OVERFLOW", "POISON", "MAX_PROBE", "POLL_S"]

DOORBELL, COUNT, DONE, FAILED, ERROR_STEP, ERROR_CODE = range(6)
CONTROL_WORDS = 6
TIMED_OUT, FILL_FAILED, OVERFLOW = 1, 2, 3  # a step's device-side failure, in ERROR_CODE and status[0]
POISON = 0xFF  # a missed row's bytes where its step did not complete: NaN as e4m3 and as ue8m0
MAX_PROBE = 64  # map entries a probe reads before it calls the id a miss
POLL_S = {"cuda": 1e-6, "interpreter": 2e-5}  # about one poll of the spin: a load over PCIe / in the interpreter
_MUL = 0x9E3779B97F4A7C15  # slot_map.py's multiplicative hash


def staged_gather(ids: torch.Tensor, out: torch.Tensor, *, gen, id_of, table, arena, retired, slot_bits: int,
                  tag_shift: int, tag_mask: int, control, misses, rows, step, status, miss_at, timeout_s: float,
                  backend: str = "auto") -> torch.Tensor:
    """`out` uint8 [n, row_bytes] = the rows of table ids `ids` (int64 [n]; negative: a zero row).

    gen (int32 view of uint32), id_of (int32|int64), table (the map's entries, int32|int64 view),
    arena uint8 [slots, row_bytes], retired uint8 [4] (the arena header's retired word),
    slot_bits / tag_shift / tag_mask: the slot index (client/engines/slot_probe.py,
    SlotProbe.tensors). control int64 [CONTROL_WORDS], misses int64 [capacity], rows uint8
    [capacity, row_bytes]: the fill channel (device_fill.FillChannel). step int64 [1] and status
    int64 [1] on out's device; miss_at int64 [>= n] on out's device (scratch). timeout_s: the
    spin's bound. Returns out. InvalidArgument for shapes, dtypes or devices that do not fit."""
    _check(ids, out, gen, id_of, table, arena, retired, control, misses, rows, step, status, miss_at)
    if choose_backend(backend, ids, out) == "torch":
        return staged_gather_torch(ids, out, gen=gen, id_of=id_of, table=table, arena=arena, retired=retired,
                                   slot_bits=slot_bits, tag_shift=tag_shift, tag_mask=tag_mask, control=control,
                                   misses=misses, rows=rows, step=step, status=status, miss_at=miss_at,
                                   timeout_s=timeout_s)
    n, width = out.shape
    block_c = triton.next_power_of_2(width)
    block_r = max(1, min(64, 8192 // block_c))
    grid = (triton.cdiv(max(n, 1), block_r),)
    fence = ids.is_cuda
    spins = max(1, int(timeout_s / POLL_S["cuda" if ids.is_cuda else "interpreter"]))
    _probe_kernel[grid](ids, out, miss_at, gen, id_of, table, arena, retired, n, table.shape[0], arena.shape[0],
                        arena.stride(0), width, slot_bits, tag_shift, tag_mask,
                        ENTRY32=table.dtype == torch.int32, MAX_PROBE=MAX_PROBE, FENCE=fence,
                        BLOCK_R=block_r, BLOCK_C=block_c)
    _ring_kernel[(1,)](ids, miss_at, control, misses, step, status, n, misses.shape[0], spins,
                       FENCE=fence, BLOCK=1024)
    _fill_kernel[grid](out, miss_at, rows, status, n, rows.stride(0), width, BLOCK_R=block_r, BLOCK_C=block_c)
    return out


def _check(ids, out, gen, id_of, table, arena, retired, control, misses, rows, step, status, miss_at) -> None:
    def want(name, t, dtypes, dim):
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != dim:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(f"staged_gather's {name} must be a {dim}-D {'/'.join(map(str, dtypes))} tensor, "
                                  f"got {got}")

    want("ids", ids, (torch.int64,), 1)
    want("out", out, (torch.uint8,), 2)
    for name, t in (("gen", gen), ("id_of", id_of), ("table", table)):
        want(name, t, (torch.int32, torch.int64) if name != "gen" else (torch.int32,), 1)
    want("arena", arena, (torch.uint8,), 2)
    want("retired", retired, (torch.uint8,), 1)
    want("control", control, (torch.int64,), 1)
    want("misses", misses, (torch.int64,), 1)
    want("rows", rows, (torch.uint8,), 2)
    for name, t in (("step", step), ("status", status), ("miss_at", miss_at)):
        want(name, t, (torch.int64,), 1)
    n = ids.shape[0]
    if out.shape[0] != n or out.stride(1) != 1 or out.stride(0) != out.shape[1]:
        raise InvalidArgument(f"staged_gather's out must be a contiguous uint8 [{n}, row_bytes], got "
                              f"{tuple(out.shape)} strides {out.stride()}")
    width = out.shape[1]
    for name, t in (("arena", arena), ("rows", rows)):
        if t.shape[1] != width or t.stride(1) != 1:
            raise InvalidArgument(f"staged_gather's {name} rows must be {width} contiguous bytes (out's), got "
                                  f"{tuple(t.shape)} strides {t.stride()}")
    if gen.shape[0] != id_of.shape[0] or gen.shape[0] != arena.shape[0]:
        raise InvalidArgument(f"the slot index ({gen.shape[0]} gens, {id_of.shape[0]} ids) does not describe the "
                              f"{arena.shape[0]}-slot arena: map the index and arena of one table version")
    if control.shape[0] < CONTROL_WORDS or rows.shape[0] != misses.shape[0] or retired.shape[0] < 1:
        raise InvalidArgument(f"the fill channel needs {CONTROL_WORDS} control words and as many rows as misses; got "
                              f"{control.shape[0]} words, {misses.shape[0]} misses, {rows.shape[0]} rows")
    if step.shape[0] < 1 or status.shape[0] < 1 or miss_at.shape[0] < n:
        raise InvalidArgument(f"step and status need a word each and miss_at {n} (the ids); got {step.shape[0]}, "
                              f"{status.shape[0]}, {miss_at.shape[0]}")
    for name, t in (("step", step), ("status", status), ("miss_at", miss_at)):
        if t.device != out.device:
            raise InvalidArgument(f"staged_gather's {name} is on {t.device}, out on {out.device}: put the step's "
                                  f"scratch on the device that runs it")


# ---------------------------------------------------------------- torch reference

def staged_gather_torch(ids, out, *, gen, id_of, table, arena, retired, slot_bits: int, tag_shift: int,
                        tag_mask: int, control, misses, rows, step, status, miss_at, timeout_s: float):
    """The reference: the kernels' three phases in torch ops on host tensors (control, misses and
    rows shared with the host thread that fills them), the spin bounded by `timeout_s`."""
    n = ids.shape[0]
    ids = ids.cpu()
    u = ids.to(torch.int64).contiguous()
    wide = table.element_size() == 8
    empty = -1 if wide else (1 << 32) - 1  # an empty entry is all ones
    pos, tag = _home_and_tag(u, table.shape[0], tag_shift, tag_mask)
    slot = torch.full((n,), -1, dtype=torch.int64)
    active = u >= 0
    entries = table.to(torch.int64) if wide else table.to(torch.int64) & empty
    for _ in range(MAX_PROBE):  # phase 1: the bounded probe
        if not bool(active.any()):
            break
        e = torch.where(active, entries[pos.clamp(0, table.shape[0] - 1)], empty)
        match = active & (e != empty) & (((e >> slot_bits) & tag_mask) == tag)
        s = e & ((1 << slot_bits) - 1)
        found = match & (id_of.to(torch.int64)[torch.where(match, s, 0)] == u)
        slot = torch.where(found, s, slot)
        active &= (e != empty) & ~found
        pos = torch.where(pos + 1 == table.shape[0], 0, pos + 1)
    held = slot >= 0
    at = torch.where(held, slot, 0)
    g1 = gen[at]  # the seqlock: g1, id confirmed, copy, g2
    ok = held & ((g1 & 1) == 0) & (id_of.to(torch.int64)[at] == u) & (int(retired.to(torch.int64).sum()) == 0)
    got = arena[at]
    ok &= gen[at] == g1
    out_cpu = torch.where(ok[:, None], got, torch.zeros_like(got))
    miss = (u >= 0) & ~ok
    where = torch.full((n,), -1, dtype=torch.int64)
    where[miss] = torch.arange(int(miss.sum()))
    miss_at[:n] = where.to(miss_at.device)
    # phase 2: list, ring, spin
    s = int(step[0]) + 1
    step[0] = s
    count, code = int(miss.sum()), 0
    if count > misses.shape[0]:
        code = OVERFLOW
    elif count:
        misses[:count] = u[miss]
        control[COUNT] = count
        control[DOORBELL] = s
        deadline = time.monotonic() + timeout_s
        while int(control[DONE]) != s:
            if int(control[FAILED]) == s:
                code = FILL_FAILED
                break
            if time.monotonic() > deadline:
                code = TIMED_OUT
                break
            time.sleep(0)
    if code:
        control[ERROR_CODE] = code
        control[ERROR_STEP] = s
    status[0] = code
    # phase 3: the misses' rows, or POISON
    if count:
        fill = rows[:count].clone() if code == 0 and count <= rows.shape[0] else \
            torch.full((count, out.shape[1]), POISON, dtype=torch.uint8)
        out_cpu[miss] = fill
    out.copy_(out_cpu)
    return out


def _home_and_tag(u: torch.Tensor, entries: int, tag_shift: int, tag_mask: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(home entry, tag) int64 of each id, slot_map.py's hash in uint64 arithmetic (numpy's: torch
    has no wrapping uint64 multiply)."""
    import numpy as np

    with np.errstate(over="ignore"):
        h = u.numpy().view(np.uint64) * np.uint64(_MUL)
    home = ((h >> np.uint64(32)) * np.uint64(entries)) >> np.uint64(32)
    tag = (h >> np.uint64(tag_shift)) & np.uint64(tag_mask)
    return torch.from_numpy(home.astype(np.int64)), torch.from_numpy(tag.astype(np.int64))


# ---------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _fenced(x, FENCE: tl.constexpr):
        # x, after a system-scope fence that orders the loads before it against those after it
        # (on CUDA; the interpreter runs loads in program order). x int32: its data dependency
        # keeps the fence between the loads that made it and the loads that use it.
        if FENCE:
            x = tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                          is_pure=False, pack=1)
        return x

    @triton.jit
    def _probe_kernel(ids_ptr, out_ptr, miss_ptr, gen_ptr, id_of_ptr, table_ptr, arena_ptr, retired_ptr,
                      n, n_map, n_slots, arena_stride, width, slot_bits, tag_shift, tag_mask,
                      ENTRY32: tl.constexpr, MAX_PROBE: tl.constexpr, FENCE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < n
        x = tl.load(ids_ptr + r, mask=live, other=-1)
        valid = live & (x >= 0)
        h = x.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
        pos = (((h >> 32) * n_map.to(tl.uint64)) >> 32).to(tl.int64)
        tag = ((h >> tag_shift.to(tl.uint64)) & tag_mask.to(tl.uint64))
        slot_mask = (tl.full([BLOCK_R], 1, tl.uint64) << slot_bits.to(tl.uint64)) - 1
        slot = tl.full([BLOCK_R], -1, tl.int64)
        active = valid
        for _ in range(MAX_PROBE):  # the bounded probe: every id one entry a round
            raw = tl.load(table_ptr + pos, mask=active, other=-1)
            if ENTRY32:
                e = raw.to(tl.uint32, bitcast=True).to(tl.uint64)
                empty = e == 0xFFFFFFFF
            else:
                e = raw.to(tl.uint64, bitcast=True)
                empty = raw == -1
            s = (e & slot_mask).to(tl.int64)
            match = active & ~empty & (((e >> slot_bits.to(tl.uint64)) & tag_mask.to(tl.uint64)) == tag)
            owner = tl.load(id_of_ptr + s, mask=match & (s < n_slots), other=-1).to(tl.int64)
            found = match & (s < n_slots) & (owner == x)
            slot = tl.where(found, s, slot)
            active = active & ~empty & ~found
            pos = tl.where(pos + 1 == n_map, 0, pos + 1)
        retired = tl.load(retired_ptr)
        held = (slot >= 0) & (retired == 0)
        at = tl.where(held, slot, 0)
        g1 = tl.load(gen_ptr + at, mask=held, other=1, volatile=True)
        g1 = _fenced(g1, FENCE)
        owner = tl.load(id_of_ptr + at, mask=held, other=-1, volatile=True).to(tl.int64)
        ok = held & ((g1 & 1) == 0) & (owner == x)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < width
        row = tl.load(arena_ptr + at[:, None] * arena_stride + cols[None, :], mask=ok[:, None] & cmask[None, :],
                      other=0, volatile=True)
        copied = _fenced(tl.sum(row.to(tl.int32), axis=1), FENCE)  # the copy's loads before the second gen
        g2 = tl.load(gen_ptr + at, mask=ok & (copied >= 0), other=1, volatile=True)
        ok = ok & (g2 == g1)
        tl.store(out_ptr + r[:, None] * width + cols[None, :], tl.where(ok[:, None], row, 0),
                 mask=live[:, None] & cmask[None, :])
        tl.store(miss_ptr + r, tl.where(valid & ~ok, 1, -1).to(tl.int64), mask=live)

    @triton.jit
    def _ring_kernel(ids_ptr, miss_ptr, ctrl_ptr, misses_ptr, step_ptr, status_ptr, n, capacity, spins,
                     FENCE: tl.constexpr, BLOCK: tl.constexpr):
        count = tl.zeros([], tl.int64)
        for start in range(0, n, BLOCK):  # the misses listed in order, each position's place kept
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            flag = (tl.load(miss_ptr + offs, mask=m, other=-1) > 0) & m
            place = count + tl.cumsum(flag.to(tl.int64), 0) - 1
            x = tl.load(ids_ptr + offs, mask=flag, other=0)
            tl.store(misses_ptr + place, x, mask=flag & (place < capacity))
            tl.store(miss_ptr + offs, tl.where(flag, place, -1), mask=m)
            count += tl.sum(flag.to(tl.int64), 0)
        step = tl.load(step_ptr) + 1
        tl.store(step_ptr, step)
        code = tl.zeros([], tl.int64)
        if count > capacity:
            code = tl.full([], 3, tl.int64)  # OVERFLOW
        elif count > 0:
            tl.store(ctrl_ptr + 1, count)  # COUNT
            fenced = _fenced(count.to(tl.int32), FENCE)  # the list and COUNT visible before the doorbell
            tl.store(ctrl_ptr + 0, tl.where(fenced >= 0, step, step))  # DOORBELL
            done = tl.load(ctrl_ptr + 2, volatile=True)
            failed = tl.load(ctrl_ptr + 3, volatile=True)
            polls = 0
            while (done != step) & (failed != step) & (polls < spins):
                done = tl.load(ctrl_ptr + 2, volatile=True)
                failed = tl.load(ctrl_ptr + 3, volatile=True)
                polls += 1
            if done != step:
                code = tl.where(failed == step, 2, 1).to(tl.int64)  # FILL_FAILED, TIMED_OUT
        if code != 0:
            tl.store(ctrl_ptr + 5, code)  # ERROR_CODE, then ERROR_STEP
            tl.store(ctrl_ptr + 4, step)
        tl.store(status_ptr, code)

    @triton.jit
    def _fill_kernel(out_ptr, miss_ptr, rows_ptr, status_ptr, n, rows_stride, width,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        place = tl.load(miss_ptr + r, mask=r < n, other=-1)
        missed = (r < n) & (place >= 0)
        whole = tl.load(status_ptr) == 0
        cols = tl.arange(0, BLOCK_C)
        mask = missed[:, None] & (cols < width)[None, :]
        row = tl.load(rows_ptr + place[:, None] * rows_stride + cols[None, :], mask=mask & whole, other=0xFF,
                      volatile=True)
        tl.store(out_ptr + r[:, None] * width + cols[None, :], row.to(tl.uint8), mask=mask)
