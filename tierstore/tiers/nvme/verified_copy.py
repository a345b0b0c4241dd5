"""A miss's rows placed in their arena slots and verified against their row sums, in one pass.

A cache-mode fill copies each missing row into its arena slot and checks its
row sum under its version's key (tiers/nvme/rowsum.py: RowKey): against the sum stored in the record
beside the row (segment format 2, `place_records`: the record a miss reads
carries it), or against a separate row-sum array (format 1, `place_verified`). In numpy that is a gather into scratch, six
passes of hashing over it and a scatter into the arena, each a call's overhead
plus a trip through memory, which is most of what a decode step's few misses
cost. Compiled (numba), one loop reads each row once, hashes its words as it
copies them and compares the sum: no temporaries (docs/decisions.md, "The miss
path compiled"). The GIL is kept: a call is far shorter than a switch interval,
and giving it up would let another thread take it for one (cpu_token.py).

numba is a dependency, but a platform without a wheel must still serve:
`kernels()` is False there and callers keep the numpy path (the reference the
tests compare the compiled one with). Compilation is cached on disk; the
first cache-mode engine of a process warms it (`warm()`), not its first Plan.
"""
from __future__ import annotations

import numpy as np

from tierstore.jit import Kernel, enabled, inlined, unique_inverse
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.nvme.rowsum import with_id, word_term

__all__ = ["kernels", "place_records", "place_verified", "warm"]

def kernels():
    """True where the compiled kernels run (numba present, TIERSTORE_NO_JIT unset)."""
    return enabled()


# ---- compiled loops (tierstore/jit.py); module constants are compile-time constants ----
@inlined
def _copy_summed(src, r, dest, d, words, row_id, skeys, kkeys, seed, mix_id):
    """dest[d, :words] = src[r, :words]; their row sum as row row_id under the key
    (seed, mix_id), the mix rowsum.py defines (its compiled terms, once)."""
    acc = np.uint64(0)
    for j in range(words):
        w = src[r, j]
        dest[d, j] = w
        acc += word_term(w, skeys[j], kkeys[j])
    return with_id(acc, row_id, seed, mix_id)


def _place_loop(src, row_at, ids, dest, slots, sums, at, skeys, kkeys, seed, mix_id):
    """dest[slots[i]] = src[row_at[i]] (uint64 words) for every i, verified against
    sums[at[i]]; the index of the first row whose sum differs, or -1."""
    words = src.shape[1]
    for i in range(row_at.shape[0]):
        if _copy_summed(src, row_at[i], dest, slots[i], words, ids[i], skeys, kkeys, seed, mix_id) != sums[at[i]]:
            return i
    return -1


def _records_loop(src, row_at, ids, dest, slots, skeys, kkeys, seed, mix_id):
    """dest[slots[i]] = the row words of record src[row_at[i]] (uint64 words; the record's
    last word is the row's sum) for every i, verified against that sum; the index of
    the first row whose sum differs, or -1."""
    words, last = dest.shape[1], src.shape[1] - 1
    for i in range(row_at.shape[0]):
        if _copy_summed(src, row_at[i], dest, slots[i], words, ids[i], skeys, kkeys, seed, mix_id) \
                != src[row_at[i], last]:
            return i
    return -1


_PLACE = Kernel(_place_loop)
_RECORDS = Kernel(_records_loop)


def place_verified(src: np.ndarray, row_at: np.ndarray, ids: np.ndarray, dest: np.ndarray, slots: np.ndarray,
                   sums: np.ndarray, key: rowsum.RowKey, at: np.ndarray | None = None) -> int:
    """Copy rows src[row_at[i]] to dest[slots[i]], each checked against sums[at[i]], the
    sums of the version keyed by `key` (at: default ids, a version's whole row-sum
    array; or positions in a gathered one).

    src, dest: uint8 [*, B], rows contiguous; row_at, ids, slots, at: int64 [n].
    Returns the index of the first row that fails verification, or -1 (rows
    after a failure may not have been copied: the caller discards the call).
    """
    at = ids if at is None else at
    k = _PLACE.compiled()
    b = src.shape[1]
    if k is not None and b % 8 == 0 and _aligned(src) and _aligned(dest):
        s, kk = rowsum._keys(b // 8)
        return int(k(_words(src), row_at, ids, _words(dest), slots, sums, at, s, kk, np.uint64(key.seed),
                     bool(key.mix_id)))
    rows = src[row_at]
    ok = rowsum.row_sums(rows, ids, key) == sums[at]
    dest[slots] = rows
    return -1 if ok.all() else int(np.argmin(ok))


def place_records(src: np.ndarray, row_at: np.ndarray, ids: np.ndarray, dest: np.ndarray,
                  slots: np.ndarray, key: rowsum.RowKey) -> int:
    """Copy the rows of records src[row_at[i]] (segment format 2: row, zero padding to
    whole words, its uint64 row sum) to dest[slots[i]], each checked against the sum
    its record carries for row ids[i] of the version keyed by `key` (the miss path: no
    block checksum is read).

    src: uint8 [*, R] records (R = TableVersion.record_bytes); dest: uint8 [*, B]
    rows, B <= R - 8; row_at, ids, slots: int64 [n]. Returns the index of the first
    row that fails verification, or -1 (rows after a failure may not have been
    copied: the caller discards the call).
    """
    b, r = dest.shape[1], src.shape[1]
    k = _RECORDS.compiled()
    if k is not None and b % 8 == 0 and r % 8 == 0 and _aligned(src) and _aligned(dest):
        s, kk = rowsum._keys(b // 8)
        return int(k(_words(src), row_at, ids, _words(dest), slots, s, kk, np.uint64(key.seed), bool(key.mix_id)))
    recs = src[row_at]
    ok = rowsum.row_sums(recs[:, :b], ids, key) == recs[:, r - 8:].copy().view("<u8").reshape(-1)
    dest[slots] = recs[:, :b]
    return -1 if ok.all() else int(np.argmin(ok))


def _aligned(a: np.ndarray) -> bool:
    """Rows of whole bytes at 8-byte strides (what the compiled loops take as words)."""
    return a.strides[1] == 1 and a.strides[0] % 8 == 0


def _words(a: np.ndarray) -> np.ndarray:
    """uint8 [n, B] (B % 8 == 0, rows 8-byte aligned) as uint64 [n, B / 8] over the same memory."""
    if a.shape[0] == 0:
        return np.empty((0, a.shape[1] // 8), dtype=np.uint64)
    if a.flags.c_contiguous:  # arena, scratch, a note's rows: the common case
        words = a.view(np.uint64)
        if words.flags.aligned:  # 8-byte aligned, checked on the view (a.ctypes builds an object per call)
            return words
    if a.ctypes.data % 8:
        raise ValueError("rows are not 8-byte aligned")
    first = a[:, :8].view(np.uint64)  # [n, 1], the row stride kept
    return np.lib.stride_tricks.as_strided(first, shape=(a.shape[0], a.shape[1] // 8), strides=(a.strides[0], 8),
                                           writeable=a.flags.writeable)


def warm() -> None:
    """Compile (or load from the disk cache) the kernels now, not on a Plan."""
    if not enabled():
        return
    key = rowsum.RowKey.of(0)  # the loops' types are the same under either algorithm's key
    src = np.zeros((2, 8), dtype=np.uint8)
    sums = rowsum.row_sums(src, np.arange(2), key)
    frozen = src.copy()
    frozen.flags.writeable = False  # a note's rows (np.frombuffer of a frame): their own specialisation
    recs = rowsum.records(src, np.arange(2), key)
    frozen_recs = recs.copy()
    frozen_recs.flags.writeable = False
    for rows in (src, frozen):
        place_verified(rows, np.arange(2), np.arange(2), np.zeros((2, 8), dtype=np.uint8), np.arange(2), sums, key)
    for rows in (recs, frozen_recs):
        place_records(rows, np.arange(2), np.arange(2), np.zeros((2, 8), dtype=np.uint8), np.arange(2), key)
    unique_inverse(np.arange(2))
