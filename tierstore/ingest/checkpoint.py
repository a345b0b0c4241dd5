"""A whole Hugging Face checkpoint directory -> one table per Engram layer.

For each Engram layer of config.json, `embed.weight` (F8_E4M3 [rows, 256]) and
`embed.scale` (F8_E8M0 [rows, 8]) are streamed from their shard (TensorRows:
O_DIRECT from the disk, pread from the page cache) and written as packed rows
(weight || scale, 264 bytes: tierstore's fp8-e4m3-ue8m0 format; write_version
builds each record from the two in one pass) as a new version of table `l{L}`
(spec.table_name) with the spec (every hashing constant, from config.json) in
its manifest.

Memory: CHUNKS_IN_FLIGHT chunks of the shard's bytes and as many of records
(write_version reads, checksums, writes and reads back chunks in a pipeline),
about 12 x chunk_bytes (8 MiB) whatever the shard size.
Each tensor's identity is recorded in the version's manifest (TableVersion.checkpoint,
a TensorSource each): its shard's size, mtime, inode and ctime (fstat when it is
opened, and again once read: a shard that changed meanwhile is SpecMismatch), its
header entry and an xxh3-128 digest of its bytes, hashed as they are read (no second
read). The engines' check compares the checkpoint they load with it.

Atomicity is write_version's: a killed ingest leaves the old current version
serving; a rerun skips layers whose current version's record still matches their
shards (size, mtime, inode, ctime, header: untouched since) and restarts the others,
a version ingested before records were kept among them.
Everything is checked (config fields, index, shards, dtypes, shapes, row counts
against the prime layout, truncation) before the data directory is touched.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from tierstore.errors import SpecMismatch
from tierstore.table.checkpoint import Checkpoint, TensorRef, TensorSource, open_shard, tensor_digest

__all__ = ["ingest_checkpoint", "plain_read_seconds", "plain_copy_seconds", "evict_from_page_cache"]


def _source_note(w: TensorRef, s: TensorRef) -> str:
    st = w.path.stat()
    return f"{w.path}:{w.name}+{s.name} (size {st.st_size}, mtime_ns {st.st_mtime_ns})"


def _unchanged(cur, refs: dict[str, TensorRef]) -> bool:
    """Whether version `cur` was ingested from the tensors `refs` ({"weight", "scale"}) as they
    are now: its checkpoint record holds both, with digests, and neither shard's size, mtime,
    inode, ctime or header entry differs from it."""
    rec = cur.checkpoint_record()
    if rec is None or set(rec) != set(refs):
        return False
    for k, ref in refs.items():
        changed, touched = rec[k].differences(TensorSource.of(ref, os.stat(ref.path)))
        if changed or touched or rec[k].xxh3_128 is None:
            return False
    return True


def _current(data_dir: Path, table: str):
    """The current version of `table`, or None (no catalog, no such table)."""
    from tierstore.store.catalog import Catalog
    from tierstore.errors import NotFound

    try:
        with Catalog(data_dir, readonly=True) as cat:
            return cat.current(table)
    except NotFound:
        return None


# O_DIRECT reads start and end on this boundary (the largest logical block size in use)
ALIGN = 4096


class TensorRows:
    """Rows of one checkpoint tensor read in order into a ring of `slots` buffers of
    `step` rows each (a buffer is reused `slots` reads later).

    A shard that is mostly on the disk (not in the page cache) is read with O_DIRECT:
    the disk writes into this process's buffers, with none of the kernel's page-cache
    fill and copy, which on a shared box cost as much CPU as everything else an ingest
    does; a read then covers whole ALIGN blocks around the rows, which are a view into
    it. A shard in the page cache (just downloaded, read before), or on a filesystem
    without O_DIRECT (tmpfs), is read with plain pread. Either way `read` gives the
    same bytes, and a short shard is SpecMismatch, as TensorRef.pread says it.

    Rows are read in order, each once; `source()` after the last gives the tensor's
    TensorSource, its digest hashed from the rows as they were read."""

    def __init__(self, ref: TensorRef, step: int, slots: int):
        self.ref, self.step = ref, step
        self.fd = open_shard(ref.path)
        self.stat = os.fstat(self.fd)
        self.digest, self.done = tensor_digest(), 0
        self.direct = False
        if not _mostly_cached(self.fd, ref.offset, ref.nbytes):
            try:
                fd = os.open(ref.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:  # EINVAL: this filesystem does not do O_DIRECT
                pass
            else:
                os.close(self.fd)
                self.fd, self.direct = fd, True
        size = step * ref.row_bytes + (2 * ALIGN if self.direct else 0)
        # anonymous maps are page-aligned, as O_DIRECT buffers must be; each is unmapped
        # once the last view of it is gone (the writer may hold one after `close`)
        self._bufs = [np.frombuffer(mmap.mmap(-1, max(size, 1)), np.uint8) for _ in range(slots)]
        self._next = 0

    def read(self, first_row: int, n: int) -> np.ndarray:
        """uint8 [n, row_bytes]: rows first_row.. of the tensor, in the next buffer of the ring."""
        if first_row != self.done:
            raise ValueError(f"{self.ref.where()}: rows are read in order, each once (row {first_row} asked, "
                             f"{self.done} next)")
        buf = self._bufs[self._next]
        self._next = (self._next + 1) % len(self._bufs)
        rb = self.ref.row_bytes
        start = self.ref.offset + first_row * rb
        lo = start - start % ALIGN if self.direct else start
        hi = -(-(start + n * rb) // ALIGN) * ALIGN if self.direct else start + n * rb
        need, got = start + n * rb - lo, 0
        view = memoryview(buf)[:hi - lo]
        while got < need:
            k = os.preadv(self.fd, [view[got:]], lo + got)
            got += k
            if k == 0 or (self.direct and got % ALIGN and got < need):  # O_DIRECT reads end short at EOF only
                raise SpecMismatch(f"{self.ref.where()}: the shard ends {need - got} bytes early "
                                   "(truncated download?); re-fetch the file")
        rows = buf[start - lo:start - lo + n * rb].reshape(n, rb)
        self.digest.update(rows)
        self.done += n
        return rows

    def source(self) -> TensorSource:
        """The tensor's TensorSource once every row is read: SpecMismatch if its shard changed
        (size, mtime, inode or ctime) between its open and now; the digest would not be the file's."""
        assert self.done == self.ref.shape[0], (self.done, self.ref.shape)
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns) != (
                self.stat.st_size, self.stat.st_mtime_ns, self.stat.st_ino, self.stat.st_ctime_ns):
            raise SpecMismatch(f"{self.ref.where()}: the shard changed while it was ingested (size {self.stat.st_size} "
                               f"-> {st.st_size}, mtime_ns {self.stat.st_mtime_ns} -> {st.st_mtime_ns}); ingest "
                               f"again once nothing writes it")
        return TensorSource.of(self.ref, self.stat, self.digest.hexdigest())

    def close(self) -> None:
        os.close(self.fd)
        self._bufs = []


def _mostly_cached(fd: int, offset: int, nbytes: int, samples: int = 64) -> bool:
    """Whether most of `samples` pages spread over bytes offset..offset+nbytes of `fd`
    are in the page cache (mincore of a map that is never touched); False where
    that cannot be told."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                  ctypes.c_int, ctypes.c_int, ctypes.c_int64)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    except (OSError, AttributeError):
        return False
    page = mmap.PAGESIZE
    lo = offset - offset % page
    length = offset + nbytes - lo
    if nbytes <= 0:
        return False
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
    if addr in (None, ctypes.c_void_p(-1).value):
        return False
    try:
        vec = ctypes.create_string_buffer(1)
        hits = 0
        for k in range(samples):
            at = (length - 1) * k // max(1, samples - 1) // page * page
            if libc.mincore(addr + at, 1, vec) == 0 and vec.raw[0] & 1:
                hits += 1
        return hits * 2 > samples
    finally:
        libc.munmap(addr, length)


def row_chunks(w: TensorRef, s: TensorRef, chunk_bytes: int = 8 << 20, record: dict | None = None):
    """(weight, scale) chunks, uint8 [n, w.row_bytes] and [n, s.row_bytes], in row order:
    the column blocks of the packed rows, which write_version builds records of
    without packing them first. `record`, where given, gets "weight" and "scale", each
    tensor's TensorSource (TensorRows.source), once the last chunk is read.

    Read (TensorRows) straight into a ring of CHUNKS_IN_FLIGHT buffer pairs
    (write_version holds a chunk until it is written and read back, at most that many
    at once); the writer pulls this from a thread of its own, so the reads overlap
    the other stages."""
    from tierstore.ingest.writer import CHUNKS_IN_FLIGHT

    rows, wb, sb = w.shape[0], w.row_bytes, s.row_bytes
    step = max(1, chunk_bytes // (wb + sb))
    slots = min(CHUNKS_IN_FLIGHT, -(-rows // step))
    wr = TensorRows(w, step, slots)
    try:
        sr = TensorRows(s, step, slots)
        try:
            for a in range(0, rows, step):
                n = min(step, rows - a)
                yield wr.read(a, n), sr.read(a, n)
            if record is not None:
                record.update(weight=wr.source(), scale=sr.source())
        finally:
            sr.close()
    finally:
        wr.close()


def ingest_checkpoint(ckpt_dir, data_dir, *, layers=None, prefix: str = "", progress: bool = True,
                      chunk_bytes: int = 8 << 20, block_rows: int | None = None, force: bool = False,
                      name: str | None = None) -> list:
    """Ingest every Engram layer of a checkpoint directory; returns the TableVersions.

    ckpt_dir: config.json + model.safetensors.index.json + shards.
    layers: Engram layer ids to ingest (default all of config.json's).
    prefix: table name prefix; layer L becomes `{prefix}l{L}` (default l1, the name
        spec.table_name gives, which the layers, audit and hash use).
    force: re-ingest a layer even when its current version came from the
        same, untouched shards (default: skip it, so an interrupted run resumes).
    name: spec name stored in the manifest (default config's model type).

    Raises SpecMismatch (naming the file and tensor) for a malformed checkpoint,
    before anything is written; DataLoss / ResourceExhausted as write_version.
    Returns [(TableVersion, skipped: bool)] per layer in layer order."""
    from tierstore.store.catalog import validate_table_name
    from tierstore.errors import SpecMismatch
    from tierstore.ingest.writer import write_version

    ck = Checkpoint(ckpt_dir, name)
    spec = ck.spec
    wanted = list(spec.layer_ids) if layers is None else [int(v) for v in layers]
    for L in wanted:
        if L not in spec.layer_ids:
            raise SpecMismatch(f"{ck.dir / 'config.json'}: layer {L} is not an Engram layer; "
                               f"engram_layer_ids are {list(spec.layer_ids)}")
    plan = []
    for L in wanted:  # check every layer before writing any
        t = ck.engram_tensors(L)
        plan.append((L, validate_table_name(ck.table_name(L, prefix)), t["weight"], t["scale"]))
    data_dir = Path(data_dir)
    out = []
    for L, table, w, s in plan:
        cur = None if force else _current(data_dir, table)
        if cur is not None and cur.spec == spec.to_dict() and _unchanged(cur, {"weight": w, "scale": s}):
            out.append((cur, True))
            continue
        record: dict[str, TensorSource] = {}
        tv = write_version(data_dir, table, row_chunks(w, s, chunk_bytes, record), rows=w.shape[0],
                           row_format=spec.row_format, row_dim=spec.row_dim, spec=spec.to_dict(), layer_id=L,
                           source=_source_note(w, s), checkpoint=lambda: {k: v.to_dict() for k, v in record.items()},
                           block_rows=block_rows, progress=progress)
        out.append((tv, False))
    return out


def _plain_pass(refs, chunk_bytes: int, out_fd: int | None) -> None:
    """Read the bytes of `refs` in order with pread into one reused buffer and,
    when `out_fd` is given, write each piece read to it."""
    buf = memoryview(np.empty(chunk_bytes, np.uint8))
    for r in refs:
        fd = open_shard(r.path)
        try:
            pos, end = r.offset, r.offset + r.nbytes
            while pos < end:
                n = os.preadv(fd, [buf[: min(chunk_bytes, end - pos)]], pos)
                if n == 0:
                    break
                pos += n
                done = 0
                while out_fd is not None and done < n:
                    done += os.write(out_fd, buf[done:n])
        finally:
            os.close(fd)


def plain_read_seconds(refs, chunk_bytes: int = 64 << 20) -> float:
    """Seconds to read the bytes of `refs` sequentially with plain pread into one
    reused buffer: what the disk reads, the floor an ingest is compared against."""
    t0 = time.perf_counter()
    _plain_pass(refs, chunk_bytes, None)
    return time.perf_counter() - t0


def plain_copy_seconds(refs, data_dir, chunk_bytes: int = 64 << 20) -> float:
    """Seconds to copy the bytes of `refs` into one new file under `data_dir`'s tmp/
    (the filesystem an ingest writes to): sequential pread, write, one fsync at the
    end, as `cp` then `sync` would; no checksums, no read-back. What the disk allows
    an ingest, which has to read, write and make durable the same bytes. The file is
    removed before returning, whatever happens, and its removal made durable (untimed)."""
    import errno

    from tierstore.errors import ResourceExhausted
    from tierstore.store.data_dir import fsync_dir, private_dirs

    tmp = private_dirs(Path(data_dir), "tmp")
    fd, path = tempfile.mkstemp(prefix="plain-copy.", dir=tmp)
    try:
        t0 = time.perf_counter()
        _plain_pass(refs, chunk_bytes, fd)
        os.fsync(fd)
        return time.perf_counter() - t0
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise ResourceExhausted(f"disk full while timing a plain copy of the shards into {data_dir} "
                                    f"({e.strerror}); --compare-read needs room for one copy of them "
                                    f"beside the ingest: free space or leave --compare-read out") from e
        raise
    finally:
        os.close(fd)
        os.unlink(path)
        # commit the removal now: on a filesystem mounted with `discard` the freed blocks are
        # trimmed at that commit, which would otherwise land in the next timed pass
        fsync_dir(tmp)


def evict_from_page_cache(refs) -> None:
    """Drop the shard pages of `refs` from the page cache (posix_fadvise DONTNEED),
    so the next read of them comes from the disk: a cold, fair comparison."""
    for path in {r.path for r in refs}:
        fd = open_shard(path)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
