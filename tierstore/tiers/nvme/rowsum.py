"""Per-row checksums: one uint64 per row, computed for a whole batch of rows in
a few numpy passes (no Python loop over rows).

A stored row sum is only ever checked with the algorithm its version's
manifest names (`RowKey.of(version.row_salt)`). A row of B bytes is
zero-padded to W = ceil(B / 8) little-endian uint64 words w_j, and

    sum(row, id) = t(id) + sum_j f(w_j, S_j, K_j)             (mod 2**64)
    f(x, s, k)   = g(g((x ^ s) * M1, 29) * k, 32),   g(x, r) = x ^ (x >> r)

where S_j = splitmix64(2j), K_j = splitmix64(2j + 1) | 1, so each f is a
bijection of uint64 (xor, multiply by an odd constant, xor-shift). The id
term t is what binds a sum to the place it is stored:

- "fmix64-v2" (written by every ingest since versions carry `row_salt`, 64
  random bits drawn when the version is written): t(id) = f(f(id, 0, GOLD),
  KEY, M2) with KEY = splitmix64(salt ^ SEED). The sum holds for this row at
  this id of this version only: the same row at the same id of another table
  or version (another salt, so another KEY) always fails, since t is then a
  bijection of KEY; at another id it fails with probability about 1 - 2**-64
  (the id is mixed before KEY is applied, so no offset between ids lines two
  keys up).
- "fmix64-v1" (versions written before `row_salt`): t(id) = f(id, SEED, M2),
  the id alone: a row of another table or version at the same id passes.
  Readers check such versions' sums where they are stored (the segments, the
  row-sum file), never a sum someone else carries (tierstore/tiers/trust.py).

So, in either algorithm:
- any change confined to one 8-byte word (a single bit flip, a changed word)
  changes exactly one term by a nonzero amount: always detected;
- a torn, zeroed or misplaced row (the id is mixed in) changes several terms:
  missed with probability about 2**-64 (the terms are non-linear in the bits).
It is an integrity check against faults and mix-ups, not a MAC: the salt is in
the manifest, readable by whoever reads the rows.

Where the sums live is the segment format's business (tierstore.store.version):
format 2 stores each row's sum in its record (`records` builds them), format 1
in a separate file of one uint64 per row.

Batches of at least BULK_BYTES of whole-word rows (ingest, verify) go through
a compiled loop (numba, GIL released: ingest hashes one chunk while other
threads read and write others); smaller ones and platforms without numba run
the numpy passes below, the reference the compiled loop is tested against.
"""
from __future__ import annotations

import secrets
from typing import NamedTuple

import numpy as np

from tierstore.jit import Kernel, inlined, mix64

__all__ = ["ALGO", "ALGOS", "RowKey", "new_salt", "records", "row_sums", "word_term", "with_id"]

ALGO = "fmix64-v2"  # what writers write
ALGOS = ("fmix64-v1", "fmix64-v2")  # what readers check
_U = np.uint64
_M1, _M2, _GOLD = _U(0xFF51AFD7ED558CCD), _U(0xC4CEB9FE1A85EC53), _U(0x9E3779B97F4A7C15)
_SEED = _U(0x7469657273746F72)  # "tierstor"
# rows hashed per pass: temporaries of CHUNK x W words stay in L2
CHUNK_BYTES = 256 << 10
# below this a batch is a cache miss's rows: numpy, and the GIL kept (cpu_token.py)
BULK_BYTES = 1 << 20


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(x.astype(np.uint64) * _GOLD + _GOLD)


class RowKey(NamedTuple):
    """What one version's row sums are keyed by (module docstring): `algo`, the
    uint64 `seed` xored into the id term (KEY, or SEED for v1), and `mix_id`
    (v2: the id is mixed before the seed is applied)."""

    algo: str
    seed: np.uint64
    mix_id: bool

    @classmethod
    def of(cls, salt: int | None) -> "RowKey":
        """The key of a version whose manifest holds `row_salt` = salt (None: fmix64-v1)."""
        if salt is None:
            return cls("fmix64-v1", _SEED, False)
        return cls("fmix64-v2", _splitmix(np.array([salt], dtype=np.uint64) ^ _SEED)[0], True)

    @property
    def binds_version(self) -> bool:
        """A sum under this key holds for one version only (fmix64-v2), so a sum carried
        from elsewhere can be checked against the place it is put."""
        return self.mix_id


def new_salt() -> int:
    """A fresh version's `row_salt`: 64 random bits."""
    return secrets.randbits(64)


_KEYS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _keys(words: int) -> tuple[np.ndarray, np.ndarray]:
    k = _KEYS.get(words)
    if k is None:
        j = np.arange(words, dtype=np.uint64)
        k = _KEYS[words] = (_splitmix(2 * j), _splitmix(2 * j + _U(1)) | _U(1))  # S_j, odd K_j
    return k


def _mix(x: np.ndarray, s, k, tmp: np.ndarray) -> np.ndarray:
    """x <- f(x, s, k) in place, a bijection of each uint64 (tmp: scratch of x's shape)."""
    np.multiply(x, _M1, out=x)
    np.right_shift(x, _U(29), out=tmp)
    x ^= tmp
    np.multiply(x, k, out=x)
    np.right_shift(x, _U(32), out=tmp)
    x ^= tmp
    return x


@inlined
def word_term(w, skey, kkey):
    """A row word's term of its row sum: the compiled loops' form of _mix with s, k (here and
    verified_copy.py's placing loops: the one compiled mix)."""
    m1, s29, s32 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(29), np.uint64(32)
    x = (w ^ skey) * m1
    x = (x ^ (x >> s29)) * kkey
    return x ^ (x >> s32)


@inlined
def with_id(acc, row_id, seed, mix_id):
    """The words' terms `acc` and the id's term under the key (seed, mix_id): the row sum."""
    m1, m2, gold = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53), np.uint64(0x9E3779B97F4A7C15)
    s29, s32 = np.uint64(29), np.uint64(32)
    x = np.uint64(row_id)
    if mix_id:
        x = x * m1
        x = (x ^ (x >> s29)) * gold
        x = x ^ (x >> s32)
    x = (x ^ seed) * m1
    x = (x ^ (x >> s29)) * m2
    return acc + (x ^ (x >> s32))


def _sums_loop(words, ids, skeys, kkeys, seed, mix_id, out):
    """out[i] = sum of uint64 row words[i] stored as row ids[i] under the key (seed, mix_id)."""
    for i in range(words.shape[0]):
        acc = np.uint64(0)
        for j in range(words.shape[1]):
            acc += word_term(words[i, j], skeys[j], kkeys[j])
        out[i] = with_id(acc, ids[i], seed, mix_id)


_SUMS = Kernel(_sums_loop, nogil=True)


def row_sums(rows: np.ndarray, ids: np.ndarray, key: RowKey, *, compiled: bool = True) -> np.ndarray:
    """uint64 [n]: the sum of each row of uint8 [n, B] `rows` (any strides) stored as
    row `ids[i]` (int64 [n]) of the version whose row sums are keyed by `key`
    (RowKey.of(version.row_salt)). compiled=False always runs the numpy reference."""
    n, b = rows.shape
    words = -(-b // 8)
    s, k = _keys(words)
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    if compiled and n * b >= BULK_BYTES and b % 8 == 0 and rows.strides[1] == 1 and rows.strides[0] % 8 == 0 \
            and rows.ctypes.data % 8 == 0:
        kern = _SUMS.compiled()
        if kern is not None:
            w = rows.view(np.uint64)  # whole words where they lie, no copy
            kern(w, np.asarray(ids, dtype=np.int64), s, k, np.uint64(key.seed), bool(key.mix_id), out)
            return out
    step = max(1, CHUNK_BYTES // (words * 8))
    m0 = min(step, n)
    direct = b % 8 == 0 and rows.strides[1] == 1  # whole words: hash the rows where they lie
    pad = None if direct else np.zeros((m0, words * 8), dtype=np.uint8)  # zero padding past b stays zero
    x, tmp = np.empty((m0, words), dtype=np.uint64), np.empty((m0, words), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for a in range(0, n, step):
            m = min(step, n - a)
            if direct:
                src = rows[a:a + m].view(np.uint64)
            else:
                pad[:m, :b] = rows[a:a + m]
                src = pad[:m].view(np.uint64)
            np.bitwise_xor(src, s, out=x[:m])
            _mix(x[:m], s, k, tmp[:m]).sum(axis=1, dtype=np.uint64, out=out[a:a + m])
        idm = np.asarray(ids, dtype=np.int64).astype(np.uint64)  # a copy: mixed in place
        tmp = np.empty_like(idm)
        if key.mix_id:
            _mix(idm, None, _GOLD, tmp)
        idm ^= np.uint64(key.seed)
        out += _mix(idm, None, _M2, tmp)
    return out


def _records_loop(a, b, ids, skeys, kkeys, seed, mix_id, out):
    """out[i] = a[i] || b[i] || sum (uint64 words): format 2 records of rows given as two
    column blocks of whole words, each row summed as it is copied (one pass over it)."""
    wa, wb = a.shape[1], b.shape[1]
    for i in range(a.shape[0]):
        acc = np.uint64(0)
        for j in range(wa):
            w = a[i, j]
            out[i, j] = w
            acc += word_term(w, skeys[j], kkeys[j])
        for j in range(wb):
            w = b[i, j]
            out[i, wa + j] = w
            acc += word_term(w, skeys[wa + j], kkeys[wa + j])
        out[i, wa + wb] = with_id(acc, ids[i], seed, mix_id)


_RECORDS = Kernel(_records_loop, nogil=True)


def _words(x: np.ndarray) -> np.ndarray | None:
    """uint64 [n, B / 8] view of uint8 [n, B] where its rows lie, or None (not whole aligned words)."""
    if x.shape[1] % 8 or (x.shape[1] and x.strides[1] != 1) or x.strides[0] % 8 or x.ctypes.data % 8:
        return None
    return x.view(np.uint64) if x.shape[1] else np.empty((x.shape[0], 0), np.uint64)


def records(rows, ids: np.ndarray, key: RowKey, out: np.ndarray | None = None) -> np.ndarray:
    """Segment format 2 records of uint8 [n, B] `rows` stored as rows `ids` of the version
    keyed by `key`: uint8 [n, R] (R = tierstore.store.version.record_bytes(B, 2)), each
    the row, zero padding to whole 8-byte words, then its sum as one little-endian uint64.
    rows: one array, or a tuple of two uint8 [n, B_k] column blocks whose concatenation
        is the row (an fp8 checkpoint's weight and scale tensors: no packed copy is made).
    out: optional uint8 [n, R] to fill (C-contiguous).
    Batches of at least BULK_BYTES of whole aligned words are copied and summed in one
    compiled pass (GIL released); the rest, and platforms without numba, concatenate
    and run row_sums' numpy passes: the reference the compiled pass is tested against."""
    parts = rows if isinstance(rows, tuple) else (rows,)
    n, b = parts[0].shape[0], sum(p.shape[1] for p in parts)
    r = -(-b // 8) * 8 + 8
    if out is None:
        out = np.empty((n, r), dtype=np.uint8)
    if len(parts) <= 2 and n * b >= BULK_BYTES and b % 8 == 0 and np.little_endian and out.flags.c_contiguous:
        words = [_words(p) for p in parts] + [np.empty((n, 0), np.uint64)] * (2 - len(parts))
        kern = _RECORDS.compiled()
        if kern is not None and all(w is not None for w in words) and out.ctypes.data % 8 == 0:
            s, k = _keys(b // 8)
            kern(words[0], words[1], np.asarray(ids, dtype=np.int64), s, k, np.uint64(key.seed), bool(key.mix_id),
                 out.view(np.uint64))
            return out
    rows = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    out[:, :b] = rows
    out[:, b:r - 8] = 0
    out[:, r - 8:] = row_sums(rows, ids, key).astype("<u8", copy=False).view(np.uint8).reshape(n, 8)
    return out
