"""Token ids -> Engram global row ids, on the host, for every token of every step.

For layer L with multipliers m[0..N-1] (EngramSpec.multipliers), the suffix
n-gram ending at position t reads, for each order n = 2..N and head k = 1..K,

    mix   = id[t]*m[0] ^ id[t-1]*m[1] ^ ... ^ id[t-n+1]*m[n-1]
    row   = (mix mod M(n,k)) + offset(n,k)

where ids are *compressed* ids in [0, C) and positions before the start of a
sequence read the pad id. Every product is < 2**63 because m < INT64_MAX // C,
so mix is a non-negative int64 and floor mod equals plain remainder.

Speed: numpy's integer floor division by a Python-int scalar is SIMD
(libdivide), the `%` operator with an array divisor is not; so each head does
`q = mix // p; row = mix - q*p + off` over cache-sized blocks of tokens, and
each order's mix is built from the previous one with a single multiply-xor.
`tierstore.bench.hash.run_hash_bench` measures this against plain numpy.

One cohesive thing (a little over the house's 300 lines): the address function and its
streaming (decode) form must agree bit for bit.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tierstore.table.spec import EngramSpec
from tierstore.errors import IdOutOfRange, InvalidArgument

__all__ = ["NgramHasher", "DecodeState"]


@dataclass
class DecodeState:
    """Per-sequence history for incremental decode.

    history: int64 [batch, max_ngram-1] compressed ids, oldest first; a fresh
    sequence holds the pad id. `NgramHasher.step` updates it in place. Rows are
    sequences: index it (`DecodeState(state.history[keep])`) when sequences
    leave a batch, concatenate `new_state(...)` rows when they join.
    """

    history: np.ndarray

    @property
    def batch(self) -> int:
        return self.history.shape[0]


class NgramHasher:
    """Hashes compressed token ids to global row ids of every Engram layer of `spec`.

    spec: the model's EngramSpec (multipliers, primes, offsets).
    compression_map: optional int64 array [raw_vocab], raw token id -> compressed
        id (see tierstore.table.tokenizer_map). When given, C = map.max() + 1
        *replaces* spec.compressed_vocab_size (C feeds every multiplier, so the
        map is the authority) and the pad id is map[spec.pad_id]; without a map
        the pad id is spec.pad_id as-is and C is spec.compressed_vocab_size.
    threads: worker threads for large inputs (numpy releases the GIL). 1 (the
        default) keeps hashing on the calling thread, leaving cores to the model.
    chunk_tokens: tokens per block; blocks are sized to stay in L2/L3 cache.
    small_tokens: inputs of at most this many tokens take one broadcast pass,
        which has less per-call overhead (decode steps, short prompts).

    Raises ValueError for a malformed map or a pad id outside [0, C).
    Output row ids are int64, columns n-major, head-minor: [..., (N-1)*K].
    """

    def __init__(self, spec: EngramSpec, compression_map: np.ndarray | None = None, *,
                 threads: int = 1, chunk_tokens: int = 16384, small_tokens: int = 512):
        if compression_map is not None:
            compression_map = _check_map(compression_map)
            spec = dataclasses.replace(spec, compressed_vocab_size=int(compression_map.max()) + 1)
            if not 0 <= spec.pad_id < len(compression_map):
                raise InvalidArgument(
                    f"pad id {spec.pad_id} is outside the compression map ({len(compression_map)} raw ids); "
                    "set the spec's pad_id to a raw id the tokenizer has")
            self.pad = int(compression_map[spec.pad_id])
        else:
            self.pad = int(spec.pad_id)
        self.spec = spec
        self.compression_map = compression_map
        self.vocab = spec.compressed_vocab_size
        if not 0 <= self.pad < self.vocab:
            raise InvalidArgument(f"pad id {self.pad} is outside the compressed vocabulary [0, {self.vocab})")
        if threads < 1 or chunk_tokens < 1 or small_tokens < 0:
            raise InvalidArgument("threads and chunk_tokens must be >= 1, small_tokens >= 0")
        self.threads, self.chunk_tokens, self.small_tokens = threads, chunk_tokens, small_tokens
        self.order = spec.max_ngram
        self.heads = spec.n_heads
        self.columns = spec.columns
        # Python ints: numpy takes its SIMD scalar-divisor path only for scalars
        self._m = {L: [int(v) for v in spec.multipliers(L)] for L in spec.layer_ids}
        self._p = {L: [int(v) for v in spec.primes(L)] for L in spec.layer_ids}
        self._o = {L: [int(v) for v in spec.offsets(L)] for L in spec.layer_ids}
        self._pool: ThreadPoolExecutor | None = None

    # ---- inputs ------------------------------------------------------------
    def map_raw(self, raw_ids) -> np.ndarray:
        """Raw tokenizer ids (any shape) -> compressed ids, int64, same shape.

        Raises InvalidArgument without a compression map or for a non-integer
        array, IdOutOfRange for an id outside the map."""
        if self.compression_map is None:
            raise InvalidArgument("this hasher has no compression map; pass compression_map= to map raw ids")
        raw = _as_int_array(raw_ids, "raw token ids")
        _check_range(raw, len(self.compression_map), "raw token id", "the tokenizer map",
                     "check the ids come from the tokenizer the map was built from")
        return self.compression_map[raw]

    def check_ids(self, ids) -> np.ndarray:
        """Validate compressed ids: integer dtype, every value in [0, C). Returns int64."""
        arr = _as_int_array(ids, "token ids")
        _check_range(arr, self.vocab, "compressed id", "the compressed vocabulary",
                     "map raw tokenizer ids with the table's compression map first")
        return np.ascontiguousarray(arr, dtype=np.int64)

    # ---- whole sequences ---------------------------------------------------
    def hash(self, ids, layer_id: int, out: np.ndarray | None = None, dead=None) -> np.ndarray:
        """Row ids of one layer for compressed `ids` [B, T] or [T].

        Returns int64 [B, T, columns] (or [T, columns]); `out`, when given, must
        be a C-contiguous int64 array of that shape and is filled and returned
        (reusing it saves the page faults of a fresh 50 MB array per step).
        dead: optional bool mask shaped like `ids` (image-token positions, see
            `dead_mask`): hashing stops at a dead position, so it and every
            older position read as pad for the n-grams at or after it.
        Raises IdOutOfRange before hashing anything, KeyError for an unknown layer."""
        self.spec.primes(layer_id)  # KeyError naming the layers
        padded, shape = self._prepare(ids)
        dead = self._check_dead(dead, shape)
        if dead is not None:
            return self._hash_dead(padded, shape, dead, layer_id, out)
        return self._hash_padded(padded, shape, layer_id, out)

    def hash_all(self, ids, dead=None) -> dict[int, np.ndarray]:
        """Row ids of every Engram layer: {layer_id: int64 [B, T, columns]}.

        Validates and pads the ids once for all layers; the products themselves
        differ per layer (each layer has its own multipliers), so that is all
        the work layers can share. `dead` as in `hash`."""
        padded, shape = self._prepare(ids)
        dead = self._check_dead(dead, shape)
        if dead is not None:
            return {L: self._hash_dead(padded, shape, dead, L, None) for L in self.spec.layer_ids}
        return {L: self._hash_padded(padded, shape, L, None) for L in self.spec.layer_ids}

    def dead_mask(self, raw_ids) -> np.ndarray | None:
        """Dead positions of *raw* ids: those equal to the spec's image_token_id
        (None when the spec has none or no id is dead)."""
        if self.spec.image_token_id is None:
            return None
        mask = np.asarray(raw_ids) == self.spec.image_token_id
        return mask if mask.any() else None

    # V4.1 (vLLM's _hash_ids_kernel, DeepSeek's reference): walking back from t,
    # the n-gram is "blocked" from the first dead position on; blocked ids read pad.
    def _check_dead(self, dead, shape):
        if dead is None:
            return None
        d = np.asarray(dead)
        if d.dtype != np.bool_ or d.shape != tuple(shape):
            raise InvalidArgument(f"dead must be a bool mask of the ids' shape {tuple(shape)}, "
                                  f"got {d.dtype} {d.shape}")
        if not d.any():
            return None
        return d.reshape(1, -1) if d.ndim == 1 else d

    def _hash_dead(self, padded, shape, dead, layer_id, out):
        n1 = self.order - 1
        B, T = dead.shape
        pos = np.arange(T)
        last = np.maximum.accumulate(np.where(dead, pos, -1), axis=1)  # last dead at or before t
        m = self._m[layer_id]
        mixes = np.empty((B, T, n1), np.int64)
        mix = None
        for s in range(self.order):  # s = how far back: id[t-s]
            v = np.where(pos - s <= last, self.pad, padded[:, n1 - s: n1 - s + T])
            mix = v * m[0] if s == 0 else mix ^ (v * m[s])
            if s:
                mixes[..., s - 1] = mix
        out = self._out(out, (*shape, self.columns))
        self._finish(mixes, layer_id, out.reshape(B, T, self.columns))
        return out

    @staticmethod
    def _out(out, want: tuple) -> np.ndarray:
        """A caller's output array checked (or a new one): C-contiguous int64 of shape `want`."""
        if out is None:
            return np.empty(want, np.int64)
        if out.shape != want or out.dtype != np.int64 or not out.flags.c_contiguous:
            raise InvalidArgument(f"out must be a C-contiguous int64 array of shape {want}, "
                                  f"got {out.dtype} {out.shape}")
        return out

    def _prepare(self, ids) -> tuple[np.ndarray, tuple[int, ...]]:
        arr = self.check_ids(ids)
        if arr.ndim not in (1, 2):
            raise InvalidArgument(f"token ids must be [T] or [B, T], got shape {arr.shape}")
        x = arr.reshape(1, -1) if arr.ndim == 1 else arr
        # pad once on the left; the n-gram at t then reads padded[:, t+N-1-i]
        padded = np.empty((x.shape[0], x.shape[1] + self.order - 1), np.int64)
        padded[:, : self.order - 1] = self.pad
        padded[:, self.order - 1:] = x
        return padded, arr.shape

    def _hash_padded(self, padded, shape, layer_id, out):
        B, T = padded.shape[0], padded.shape[1] - (self.order - 1)
        out = self._out(out, (*shape, self.columns))
        out3 = out.reshape(B, T, self.columns)
        if B * T == 0:
            return out
        if B * T <= self.small_tokens:
            self._block_broadcast(padded, out3, layer_id)
            return out
        rows = max(1, self.chunk_tokens // max(T, 1))
        span = min(T, self.chunk_tokens)
        blocks = [(b, t) for b in range(0, B, rows) for t in range(0, T, span)]

        def one(bt):
            b, t = bt
            t1 = min(t + span, T)
            self._block(padded[b:b + rows, t:t1 + self.order - 1], out3[b:b + rows, t:t1], layer_id)

        if self.threads > 1 and len(blocks) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tierstore-hash")
            list(self._pool.map(one, blocks))
        else:
            for bt in blocks:
                one(bt)
        return out

    def _block(self, window: np.ndarray, out: np.ndarray, layer_id: int) -> None:
        """window: [b, t+N-1] padded ids; out: [b, t, columns] view to fill."""
        m, P, O = self._m[layer_id], self._p[layer_id], self._o[layer_id]
        n1 = self.order - 1
        t = window.shape[1] - n1
        mix = np.multiply(window[:, n1:], m[0])
        prod = np.empty_like(mix)
        q = np.empty_like(mix)
        c = 0
        for i in range(1, self.order):  # order n = i + 1 adds id[t-i]*m[i]
            np.multiply(window[:, n1 - i: n1 - i + t], m[i], out=prod)
            mix ^= prod
            for _ in range(self.heads):
                np.floor_divide(mix, P[c], out=q)
                q *= P[c]
                q -= O[c]
                np.subtract(mix, q, out=out[..., c])
                c += 1

    def _block_broadcast(self, window: np.ndarray, out: np.ndarray, layer_id: int) -> None:
        n1 = self.order - 1
        t = window.shape[1] - n1
        m = self._m[layer_id]
        mixes = np.empty((*window.shape[:-1], t, n1), np.int64)
        mix = window[..., n1:] * m[0]
        for i in range(1, self.order):
            mix ^= window[..., n1 - i: n1 - i + t] * m[i]
            mixes[..., i - 1] = mix
        self._finish(mixes, layer_id, out)

    def _finish(self, mixes: np.ndarray, layer_id: int, out: np.ndarray) -> None:
        """mixes [..., N-1] -> out [..., columns] in one broadcast remainder."""
        P = self.spec.primes(layer_id).reshape(self.order - 1, self.heads)
        O = self.spec.offsets(layer_id).reshape(self.order - 1, self.heads)
        res = out.reshape(*mixes.shape, self.heads)
        np.remainder(mixes[..., None], P, out=res)
        res += O

    # ---- incremental decode ------------------------------------------------
    def new_state(self, batch: int) -> DecodeState:
        """Decode state of `batch` fresh sequences (history all pad)."""
        return DecodeState(np.full((batch, self.order - 1), self.pad, np.int64))

    def state_from_prefix(self, ids, dead=None) -> DecodeState:
        """Decode state after a prefill of compressed `ids` [B, T] or [T] (T may be 0).

        dead: as in `hash`; ids at or before a sequence's last dead position read pad."""
        arr = self.check_ids(ids)
        x = arr.reshape(1, -1) if arr.ndim == 1 else arr
        d = self._check_dead(dead, arr.shape)
        state = self.new_state(x.shape[0])
        keep = min(self.order - 1, x.shape[1])
        if keep:
            tail = x[:, x.shape[1] - keep:]
            if d is not None:
                pos = np.arange(x.shape[1] - keep, x.shape[1])
                last = np.where(d, np.arange(x.shape[1]), -1).max(axis=1, keepdims=True)
                tail = np.where(pos <= last, self.pad, tail)
            state.history[:, self.order - 1 - keep:] = tail
        return state

    def step(self, state: DecodeState, new_ids, layers=None, dead=None) -> dict[int, np.ndarray]:
        """Hash one new compressed id per sequence and advance `state` in place.

        new_ids: int [B] (B == state.batch). layers: layer ids (default all).
        dead: optional bool [B]; a dead new id reads as pad and wipes the history.
        Returns {layer_id: int64 [B, columns]}, identical to the last position of
        `hash` over the whole sequence. Raises IdOutOfRange (state unchanged)."""
        new = self.check_ids(new_ids).reshape(-1)
        if new.shape[0] != state.batch:
            raise InvalidArgument(f"step got {new.shape[0]} ids for a batch of {state.batch} sequences")
        d = self._check_dead(dead, new.shape)
        layers = self.spec.layer_ids if layers is None else layers
        window = np.concatenate([state.history, new[:, None]], axis=1)
        if d is not None:
            window[d.reshape(-1)] = self.pad
        result = {}
        for L in layers:
            self.spec.primes(L)  # KeyError naming the layers
            out = np.empty((state.batch, self.columns), np.int64)
            self._block_broadcast(window, out, L)
            result[L] = out
        state.history[:] = window[:, 1:]
        return result

    def close(self) -> None:
        """Stop worker threads (only started when threads > 1)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _check_map(cmap) -> np.ndarray:
    arr = np.asarray(cmap)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"compression map must be a non-empty 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.min() < 0:
        raise InvalidArgument("compression map holds negative ids; rebuild it with `tierstore tokenizer-map`")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_int_array(ids, what: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got dtype {arr.dtype}")
    return arr


def _check_range(arr: np.ndarray, size: int, what: str, where: str, fix: str) -> None:
    if arr.size == 0:
        return
    lo, hi = arr.min(), arr.max()
    if lo < 0 or hi >= size:
        bad = int(lo) if lo < 0 else int(hi)
        raise IdOutOfRange(f"{what} {bad} is out of range: {where} has {size} ids [0, {size}); {fix}")
