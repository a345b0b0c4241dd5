"""Miss flights: the rows clients on the host of one host are reading from the segment
files, shared, so that a row several clients miss at once (the TP ranks of one
engine staging the same batch) costs one device read, not one per client.

Under `--direct-io` a client on the host reads its misses with O_DIRECT (client/
local_reads.py): nothing is cached between processes, so eight ranks that miss
the same row read it eight times. The sidecar makes one flights file per
cache-mode table version beside its slot index (`<index>.flights`, 0600, the
sidecar's uid: the same peers whose carried records it trusts, served.note),
and every client on the host maps it read-write:

    words  int64 [E]          per entry: (row id + 1) << 24 | seq; key 0: empty.
                              seq odd: a client claimed the row and is reading
                              it; even: the row's verified bytes are in `rows`
    pids   int32 [E]          the claiming client's pid (written after its claim)
    rows   uint8 [E, width]   the row as carried to the sidecar: format 2's
                              record (row and row sum) or format 1's row

Entries are direct-mapped in buckets of WAYS by a hash of the row id. A client
with misses (sorted, distinct ids) claims them in one compiled pass: an entry
holding the id READY is copied at once; one holding it odd is waited on; else
the first entry of the bucket that is not mid-read is taken by compare-and-swap
(an atomic cmpxchg, so two clients never both claim one entry) and the client
reads that row from the device. A bucket whose every entry is mid-read for other
ids: the client reads the row itself and shares nothing. It reads what it
claimed in parts of at most PUBLISH_ROWS (tiers/nvme/miss_batch.py), and as each
part is placed writes its rows and then swaps each word from its claim to even (the swap is ordered after the row
stores, and on x86-64 loads keep order: a reader that sees the even word and,
after its copy, the same word, copied the whole row). Only then does it wait on
the rows others claimed, so no two clients ever wait on each other.

Each copied row is checked, as it is copied out, against its row sum (the record's
own, or the mapped row-sum file's) for the id it is copied as, and its word again
after the copy; a row that fails, or whose word changed during the copy, is read
from the device.

A reader that dies leaks nothing: a waiter whose entries make no progress for
DEAD_CHECK_S asks whether their claimers' pids still live and takes over the
dead ones' entries at once. And a waiter waits WAIT_S at most, from when its wait
began (after its own reads): every entry still unpublished then is taken over,
whoever holds it (a claimer stalled, its pid unknowable from here, or a peer that
holds claims on purpose). The bound is one for the whole wait, not one per entry
renewed by any entry's change: a peer holding N of a lookup's rows, giving one up
just inside the bound each time, delays it WAIT_S, not N x WAIT_S. A taken-over
entry is swapped back to empty (the late claimer's own swap then fails, so it
publishes nothing) and its row read by the waiter itself. (An honest claimer whose
parts take longer than WAIT_S in all, a slow disk's, loses its later rows'
sharing: its waiters read them too.)

What is promised, and to whom. The file is 0600 and the sidecar's uid's, so the
boundary is the uid:
- another uid cannot open it (tests/reliability/test_miss_flights_peer.py): it
  can neither read a row nor change a claim, and costs nobody a wait;
- a crashed client (killed mid-read, its claims left odd) costs its waiters
  DEAD_CHECK_S, or WAIT_S where its pid cannot be asked, and no wrong row (a row
  it did not finish is never published: its word stays odd);
- a buggy client (a torn, stale or misplaced entry, another id's row) costs a
  device read, never a wrong row: the sum binds the row to its id
  (tiers/nvme/rowsum.py), missing such a mix-up with probability about 2^-64;
- a hostile client of the sidecar's uid is not kept out, and no row copied from
  the file is promised right against it: the row sum is a checksum, not a MAC
  (its salt is in the manifest), so such a peer can publish a wrong row with a
  sum that passes, and it is served. Nothing is lost by the file: a process of
  that uid can already write the arena, the slot index and the segment files,
  and signal or trace the sidecar. What is promised against it is the time
  bound: it delays another client's lookup WAIT_S at most, whatever it holds.

numba is required (the compare-and-swap is an LLVM cmpxchg); without it, or
with TIERSTORE_MISS_FLIGHTS=0 in a client, every client reads its own misses
as before. x86-64 only, as local reads are (slot_index.py).
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

import numpy as np

from tierstore.errors import StaleArena
from tierstore.jit import Kernel, enabled
from tierstore.tiers.dram import map_file_readonly
from tierstore.tiers.shm_file import create_shm_file

__all__ = ["MissFlightsFile", "MissFlights", "flights_path", "flight_entries", "usable", "WAYS"]

HEADER_BYTES = 4096
_MAGIC = b"TSFLITE1"
_LAYOUT = struct.Struct("<8sQQQ16s")  # magic, entries, width, rows, instance
_ALIGN = 64
WAYS = 8  # entries a row id may take (one bucket: its words are one 64-B cache line)
ENTRIES_MAX = 1 << 15  # entries per table at most: the most misses shared in flight at once
SEQ_BITS = 24
_SEQ_MASK = (1 << SEQ_BITS) - 1
# rows a claimer reads and publishes at a time: its waiters see progress each part. 8,192 is the
# reader's one ring a call at 264-B rows (RING_BYTES of spans): a prefill's 34 k misses a table drain the ring
# 5 times, not 34 (steady prefill misses +3% in both orders of ab_misses --pair publish), and a
# part lands well inside WAIT_S on any disk past 10 k reads/s
PUBLISH_ROWS = 8192
WAIT_S = 1.0  # a waited entry that makes no progress this long is taken over, whoever holds it
DEAD_CHECK_S = 0.02  # a waiter with no progress this long checks its claimers' pids
POLL_S = 50e-6  # a waiter's sleep between looks (doubled up to 1 ms)

# claim states
_READY, _WAIT, _MINE, _SELF = 0, 1, 2, 3


def usable() -> bool:
    """Clients share misses here: numba compiles the compare-and-swap, and
    TIERSTORE_MISS_FLIGHTS is not 0."""
    return enabled() and os.environ.get("TIERSTORE_MISS_FLIGHTS", "1") != "0"


def flights_path(index_path: str | Path) -> Path:
    """Where the flights file of the slot index at `index_path` lives."""
    return Path(f"{index_path}.flights")


def flight_entries(rows: int) -> int:
    """Entries of a table of `rows` rows: a power of two, at most ENTRIES_MAX."""
    return max(WAYS, min(ENTRIES_MAX, 1 << max(0, int(rows) - 1).bit_length()))


def _layout(entries: int, width: int) -> tuple[int, int, int, int]:
    """Byte offsets of words, pids, rows and the file size."""
    up = lambda x: -(-x // _ALIGN) * _ALIGN
    words = HEADER_BYTES
    pids = up(words + 8 * entries)
    rows = up(pids + 4 * entries)
    return words, pids, rows, up(rows + entries * width)


class MissFlightsFile:
    """The sidecar's flights file of one table version: made empty, removed with the slot index."""

    def __init__(self, path: Path, rows: int, width: int, instance: str = ""):
        self.path = Path(path)
        self.entries = flight_entries(rows)
        size = _layout(self.entries, width)[3]
        with create_shm_file(self.path, size, "the miss flights") as m:  # zeros: every entry empty
            header = _LAYOUT.pack(_MAGIC, self.entries, width, rows, instance.encode()[:16])
            m[:len(header)] = header
        self.nbytes = size

    def close(self) -> None:
        """Remove the file; clients' mappings stay valid until they let go."""
        self.path.unlink(missing_ok=True)


class MissFlights:
    """A client's read-write map of a table version's flights file, and the protocol over it
    (the module docstring), as a batch of misses runs it (tiers/nvme/miss_batch.py): `claim`
    its misses, `publish` each part it read, `give_up` what it will not, `take` the rows
    peers read."""

    def __init__(self, path: str | Path, rows: int, width: int, instance: str | None = None):
        """StaleArena when the file at `path` is gone or is not this table's (shape, instance)."""
        head = map_file_readonly(path, HEADER_BYTES, "miss flights", "the sidecar restarted or swapped the version")
        magic, entries, w, n, inst = _LAYOUT.unpack_from(head)
        head.close()
        if magic != _MAGIC or w != width or n != rows or entries != flight_entries(rows) or \
                (instance is not None and inst.rstrip(b"\0").decode() != instance):
            raise StaleArena(f"miss flights {path} are not this table's ({rows} rows of {width} B, instance "
                             f"{instance}); describe the table again")
        size = _layout(entries, width)[3]
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size < size:
                raise StaleArena(f"miss flights {path} are shorter than {size} B; describe the table again")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        o_words, o_pids, o_rows, _ = _layout(entries, width)
        whole = np.frombuffer(self._mmap, dtype=np.uint8)
        self.words = whole[o_words:o_words + 8 * entries].view(np.int64)
        self.pids = whole[o_pids:o_pids + 4 * entries].view(np.int32)
        self.rows = whole[o_rows:o_rows + entries * width].reshape(entries, width)
        self.entries, self.width, self.pid = entries, width, os.getpid()
        self.rows_claimed = self.rows_shared = self.rows_taken_over = 0  # what this client did through it
        self._load_kernels()

    def _load_kernels(self) -> None:
        """Each compiled loop called once on no ids, with the argument types read() gives it:
        numba loads them from its disk cache now, at the map, not in the first step that shares
        a miss (a wait's poll may come steps later, a stall and reads in the middle of serving)."""
        if not enabled():
            return
        none, flags = np.empty(0, np.int64), np.empty(0, np.int8)
        _CLAIM.compiled()(self.words, self.pids, none, flags, none.copy(), none.copy(), self.pid)
        _SWAP.compiled()(self.words, none, none, 0)
        _SAME.compiled()(self.words, none, none, np.empty(0, np.bool_))
        _POLL.compiled()(self.words, none, none, none, none, flags)

    # ---- what a batch of misses asks of the flights (tiers/nvme/miss_batch.py: claim, publish, finish) ----
    MINE = _MINE  # a claim state at or past it: the row is read by the claimer itself
    PUBLISH_ROWS = PUBLISH_ROWS  # the most rows a claimer reads before it publishes them

    def claim(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Claim sorted, distinct `ids` in one compiled pass: (state, entry, seen), per id its
        claim state (READY: a peer published it, WAIT: a peer is reading it, MINE: claimed
        here, SELF: a full bucket, read here unshared), its entry and the word seen there."""
        n = ids.size
        state, entry, seen = np.empty(n, dtype=np.int8), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        _CLAIM.compiled()(self.words, self.pids, ids, state, entry, seen, self.pid)
        self.rows_claimed += int(np.count_nonzero(state == _MINE))
        return state, entry, seen

    def publish(self, entry: np.ndarray, seen: np.ndarray, rows: np.ndarray) -> None:
        """Rows this client read and placed, into its claimed entries, each swapped to READY
        after its row (the swap is ordered after the row stores)."""
        self.rows[entry] = rows
        _SWAP.compiled()(self.words, entry, seen, 1)

    def give_up(self, entry: np.ndarray, seen: np.ndarray) -> None:
        """Claimed entries swapped back to empty: their waiters read those rows themselves."""
        if entry.size:
            _SWAP.compiled()(self.words, entry, seen, 0)

    def take(self, ids, peers, state, entry, seen, dest, dslots, place) -> np.ndarray:
        """The rows of positions `peers` of `ids` (claimed READY or WAIT) copied into
        dest[dslots[i]] as they are published, each checked as it is copied (place: the
        reader's place_carried, tierstore/tiers/trust.py's form) and its word again after;
        returns the positions that must be read here (a failed check, a word that changed
        during the copy, a claimer dead or past WAIT_S)."""
        ready = peers[state[peers] == _READY]
        missed = [self._copy(ids, ready, entry, seen, dest, dslots, place)]
        waited = peers[state[peers] == _WAIT]
        if waited.size:
            missed.append(self._wait(ids, waited, entry, seen, dest, dslots, place))
        return np.concatenate(missed)

    def _copy(self, ids, at, entry, seen, dest, dslots, place) -> np.ndarray:
        """Copy the READY entries of ids[at] into dest[dslots[at]], verified; returns the
        positions not copied (a failed check, or an entry rewritten during the copy)."""
        if at.size == 0:
            return at
        bad = place(ids[at], self.rows, entry[at], dest, dslots[at])
        same = np.empty(at.size, dtype=np.bool_)
        _SAME.compiled()(self.words, entry[at], seen[at], same)
        if bad >= 0:
            same[bad:] = False  # rows after a failure may not have been copied
        self.rows_shared += int(np.count_nonzero(same))
        return at[~same]

    def _wait(self, ids, waited, entry, seen, dest, dslots, place) -> np.ndarray:
        """Wait for the entries others are reading, copying each as it is published; returns
        the positions this client must read itself. Bounded (the module docstring): every entry
        still waited on WAIT_S after the wait began is taken over, so a change of one entry
        never extends the wait on another."""
        poll = _POLL.compiled()
        mine: list[np.ndarray] = []
        pending = waited.copy()
        state = np.full(ids.size, _WAIT, dtype=np.int8)
        last = time.monotonic()  # the last progress, for the dead-claimer check
        deadline = last + WAIT_S
        checked = False
        nap = POLL_S
        while pending.size:
            now = time.monotonic()
            if poll(self.words, ids, pending, entry, seen, state):
                done = pending[state[pending] != _WAIT]
                mine.append(done[state[done] == _SELF])
                mine.append(self._copy(ids, done[state[done] == _READY], entry, seen, dest, dslots, place))
                pending = pending[state[pending] == _WAIT]
                last, checked, nap = now, False, POLL_S
                lost = pending if now >= deadline else pending[:0]
            elif now >= deadline:
                lost = pending  # stalled, or kept busy: taken over whoever holds it
            elif now - last >= DEAD_CHECK_S and not checked:
                checked = True
                holders = self.pids[entry[pending]]
                dead = [p for p in np.unique(holders).tolist() if not _alive(p)]
                lost = pending[np.isin(holders, dead)] if dead else pending[:0]
            else:
                time.sleep(nap)
                nap = min(2 * nap, 1e-3)
                continue
            if lost.size:
                _SWAP.compiled()(self.words, entry[lost], seen[lost], 0)
                self.rows_taken_over += lost.size
                mine.append(lost)
                pending = pending[~np.isin(pending, lost)]
        return np.concatenate(mine) if mine else waited[:0]

    def close(self) -> None:
        self.words = self.pids = self.rows = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it


def _alive(pid: int) -> bool:
    """A process with this pid exists (or cannot be asked: counted alive, the time bound applies)."""
    if pid <= 0:
        return True  # claimed, pid not written yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- compiled passes over the shared words (numba only: the swap is an atomic cmpxchg) ----
def _cas_intrinsic():
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def cas(typingctx, words, i, expected, new):
        """words[i] = new if words[i] == expected, atomically (seq_cst); True when swapped."""
        sig = types.boolean(words, types.intp, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
            pair = builder.cmpxchg(ptr, args[2], args[3], "seq_cst", "seq_cst")
            return builder.extract_value(pair, 1)

        return sig, codegen

    return cas


_cas = _cas_intrinsic() if enabled() else None
_K, _S32 = np.uint64(0x9E3779B97F4A7C15), np.uint64(32)  # a multiplicative hash of the row id


def _claim_loop(words, pids, ids, state, entry, seen, pid):
    mask = np.uint64(words.shape[0] // WAYS - 1)  # buckets: a power of two
    for i in range(ids.shape[0]):
        key = ids[i] + 1
        base = int(((np.uint64(ids[i]) * _K) >> _S32) & mask) * WAYS
        state[i] = _SELF
        entry[i] = -1
        for attempt in range(3):
            free, wfree, found = -1, 0, False
            for j in range(WAYS):
                w = words[base + j]
                if (w >> SEQ_BITS) == key:
                    entry[i], seen[i], found = base + j, w, True
                    state[i] = _READY if (w & 1) == 0 else _WAIT
                    break
                if free < 0 and (w & 1) == 0:
                    free, wfree = base + j, w
            if found or free < 0:
                break
            new = (key << SEQ_BITS) | ((wfree + 1) & _SEQ_MASK)
            if _cas(words, free, wfree, new):
                pids[free] = pid
                entry[i], seen[i], state[i] = free, new, _MINE
                break


def _swap_loop(words, entry, seen, keep):
    """Each claimed word seen[i] -> its next seq: the row published (keep) or the entry emptied."""
    for i in range(entry.shape[0]):
        w = seen[i]
        key = (w >> SEQ_BITS) if keep else 0
        _cas(words, entry[i], w, (key << SEQ_BITS) | ((w + 1) & _SEQ_MASK))


def _same_loop(words, entry, seen, same):
    for i in range(entry.shape[0]):
        same[i] = words[entry[i]] == seen[i]


def _poll_loop(words, ids, pending, entry, seen, state):
    """Waited entries that changed: READY (published, seen updated) or SELF (gone to another
    id); one claimed again for the same id (taken over) is waited on anew. Returns how many changed."""
    changed = 0
    for k in range(pending.shape[0]):
        i = pending[k]
        w = words[entry[i]]
        if w == seen[i]:
            continue
        seen[i] = w
        if (w >> SEQ_BITS) != ids[i] + 1:
            state[i] = _SELF
            changed += 1
        elif (w & 1) == 0:
            state[i] = _READY
            changed += 1
    return changed


_CLAIM, _SWAP, _SAME, _POLL = Kernel(_claim_loop), Kernel(_swap_loop), Kernel(_same_loop), Kernel(_poll_loop)
