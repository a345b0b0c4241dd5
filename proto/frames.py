"""Wire format of the step socket (tierstore/sidecar/step_server.py serves it,
client/step_channel.py speaks it). One frame per request and per reply:

    frame    = [HDR] u32 body_len, u8 op, 3 pad; body      (little-endian; 8-aligned)
    HELLO    > [HELLO_REQ] magic[4] "TSFP", u16 version, 2 pad, conn_id[16];
             < [HELLO_RESP] magic[4], u16 version, 2 pad, u64 max_request_bytes; instance (utf-8)
    PLAN     > [PLAN_REQ] u32 n_items, u32 n_release; u64 release[n_release],
               n_items x ([ITEM] u64 version, u64 request_id, u32 n_ids, u32 ttl_ms,
                          u16 name_len, 6 pad; name padded to 8, i64 ids[n_ids])
             < [COUNT] u32 n_items, 4 pad; n_items x
               (OK: [RES_OK] u8 0, 3 pad, u32 n_slots, u64 lease_id, u64 version,
                    u64 expires_unix_ms, u32 hits, u32 misses, u32 unique, u32 arena_len,
                    u64 arena_slots; i64 slots[n_slots], arena name padded to 8
               | ERR: [RES_ERR] u8 1, 3 pad, u32 name_len, u32 msg_len, 4 pad;
                    name + message padded to 8)
               arena: the arena file the slots index, arena_slots its slot count (the
               client maps it, and maps a new one after a version swap).
    RELEASE  > [COUNT] u32 n, 4 pad; u64 lease_ids[n]    < [U64] u64 released;
    NOTE     > [COUNT] u32 n_items, 4 pad; n_items x ([NOTE_ITEM] u64 version, u32 n_ids,
               u32 n_steps, u32 n_rows, u32 row_bytes, u16 name_len, 6 pad; name padded
               to 8, i64 ids[n_ids], i64 ends[n_steps], i64 row_ids[n_rows],
               u8 rows[n_rows * row_bytes] padded to 8)
             (no reply) steps a client read itself (client/local_reads.py): step k is
               ids[ends[k-1]:ends[k]]; the sidecar's policy learns them and promotes
               the misses. rows: the misses the client read from the segment files
               (row_ids[i]'s bytes), so the sidecar promotes them without reading the
               disk again; it verifies each against its row sum before it places it
               (a row that fails is read from disk instead). row_bytes is the table's
               row width, or for a segment format 2 table under O_DIRECT its record
               width: each row with its own sum (taken only from a peer of the
               sidecar's uid). A hint: errors in it are logged by the sidecar, not
               answered.
    ERROR    < (whole request failed) as an ERR item; after a framing error the
               server closes the connection, otherwise it keeps serving it.

Each bracketed name above, with the fields after it up to the semicolon, is that
Struct of this module field for field (tests/test_frames_spec.py holds the two
together).

Why a stream socket: SOCK_SEQPACKET caps a message at the socket buffer
(~208 KiB by default), below one 32k-id step. Ids and slots are 8-aligned in
the frame so both sides read them with np.frombuffer, no copy.
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
import time
from pathlib import Path
from dataclasses import dataclass

import numpy as np

from tierstore import errors

__all__ = ["step_socket_path", "PlanItem", "PlanResult", "NoteItem", "FrameReader", "FrameError", "send_frame", "parse_plan",
           "encode_plan_results", "encode_note", "parse_note", "encode_error", "decode_error", "MAGIC",
           "PROTOCOL_VERSION"]

MAGIC, PROTOCOL_VERSION = b"TSFP", 2  # 2: NOTE items carry the rows the client read
HELLO, PLAN, RELEASE, NOTE, ERROR = 1, 2, 3, 4, 0x7F
HDR = struct.Struct("<IB3x")
HELLO_REQ = struct.Struct("<4sH2x16s")
HELLO_RESP = struct.Struct("<4sH2xQ")
PLAN_REQ = struct.Struct("<II")
ITEM = struct.Struct("<QQIIH6x")
NOTE_ITEM = struct.Struct("<QIIIIH6x")
COUNT = struct.Struct("<I4x")
RES_OK = struct.Struct("<BxxxIQQQIIIIQ")
RES_ERR = struct.Struct("<BxxxII4x")
U64 = struct.Struct("<Q")
MAX_ITEMS = 4096            # tables in one step; far above any model's Engram layer count
MAX_NAME = 1024
MAX_RELEASE = 1 << 16       # lease ids per request: a list of Python ints, so not left to the frame size
SCRATCH = 64 << 10
SMALL_FRAME = 16 << 10
IOV_CAP = 512  # views one sendmsg takes at most (the kernel's IOV_MAX is 1,024)
MAX_NAMES_KEPT = 4096      # table and arena names kept decoded/encoded (hot path: no codec per step)
_NAMES: dict[bytes, str] = {}
_ARENAS: dict[str, tuple[bytes, bytes]] = {}
_I8, _U8 = np.dtype("<i8"), np.dtype("<u8")
KEEP_BUFFER = 8 << 20      # a connection keeps a receive buffer up to this size between requests
SOCKET_BUFFER = 4 << 20    # asked of SO_SNDBUF/SO_RCVBUF (the kernel caps it): a 32k-id step in one go


def step_socket_path(grpc_socket: Path) -> Path:
    """Where the step socket listens for a sidecar whose gRPC socket is `grpc_socket`."""
    return Path(f"{grpc_socket}.steps")


@dataclass(slots=True)
class PlanItem:
    """One table's ids in a step. On the server, `ids` is a read-only view of the
    request buffer, valid during handler.plan (a handler that keeps it is noticed
    and the buffer is not reused)."""

    table: str
    ids: np.ndarray
    version: int = 0          # 0 = the current version
    ttl_ms: int = 0           # 0 = the sidecar's default
    request_id: int = 0


@dataclass(slots=True)
class NoteItem:
    """Steps of one table a client read itself: step k is ids[ends[k-1]:ends[k]].
    row_ids / rows (optional): rows the client read from disk for its misses, int64
    [n] and uint8 [n, row_bytes], rows[i] being row_ids[i]'s bytes as read (the
    sidecar verifies them). On the server, all four are read-only views of the
    request buffer."""

    table: str
    ids: np.ndarray
    ends: np.ndarray
    version: int = 0
    row_ids: np.ndarray | None = None
    rows: np.ndarray | None = None


@dataclass(slots=True)
class PlanResult:
    lease_id: int
    version: int
    slots: np.ndarray         # int64, one per requested id, in order
    hits: int = 0
    misses: int = 0
    unique: int = 0
    expires_unix_ms: int = 0
    instance: str = ""        # filled by the client: the sidecar instance that answered
    arena: str = ""           # the arena file the slots index (it changes with a version swap)
    arena_slots: int = 0


class FrameError(Exception):
    """The byte stream cannot be framed any more: answer if possible, then close."""

    def __init__(self, err: errors.TierstoreError):
        super().__init__(str(err))
        self.err = err


def pad8(n: int) -> int:
    return -n % 8


def encode_error(e: BaseException) -> list:
    name = errors.wire_name(e).encode()
    msg = str(e).encode("utf-8", "replace")
    return [RES_ERR.pack(1, len(name), len(msg)), name, msg, bytes(pad8(len(name) + len(msg)))]


def decode_error(body, off: int) -> tuple[errors.TierstoreError, int]:
    """The error an ERR record carries, as the same tierstore.errors class when one has that name."""
    _, nlen, mlen = RES_ERR.unpack_from(body, off)
    off += RES_ERR.size
    if off + nlen + mlen > len(body):
        raise FrameError(errors.TierstoreError("truncated error record from the sidecar step socket"))
    name = bytes(body[off:off + nlen]).decode("utf-8", "replace")
    msg = bytes(body[off + nlen:off + nlen + mlen]).decode("utf-8", "replace")
    cls = getattr(errors, name, None)
    if cls is errors.ChecksumError:  # its constructor takes the block's coordinates, the message has them
        cls = errors.DataLoss
    if isinstance(cls, type) and issubclass(cls, errors.TierstoreError):
        err = cls(msg)
    else:
        err = errors.TierstoreError(f"{name}: {msg}")
    return err, off + nlen + mlen + pad8(nlen + mlen)


def send_frame(sock: socket.socket, op: int, parts: list, size: int | None = None) -> None:
    """Send one frame from contiguous buffers; a large one goes out as a scatter list, not joined.

    `size` (the parts' total bytes) lets a small frame skip a memoryview per part."""
    if size is not None and size <= SMALL_FRAME:  # one small copy is cheaper than a scatter list
        sock.sendall(HDR.pack(size, op) + b"".join(parts))
        return
    send_rest(sock, frame_views(op, parts), 0)


def frame_views(op: int, parts: list) -> list[memoryview]:
    """A frame's header and parts as byte views, for a scatter send (send_rest): parts of
    SMALL_FRAME bytes or more as they are (not copied), runs of smaller ones joined (a
    frame of many small parts is a few views, not one a part)."""
    views = [memoryview(p).cast("B") for p in parts]
    out, run = [memoryview(HDR.pack(sum(v.nbytes for v in views), op))], []
    for v in views:
        if v.nbytes < SMALL_FRAME:
            run.append(v)
            continue
        if run:
            out.append(memoryview(b"".join(run)))
            run = []
        out.append(v)
    if run:
        out.append(memoryview(b"".join(run)))
    return out


def send_rest(sock: socket.socket, views: list, sent: int) -> None:
    """Send what is left of a scatter list whose first `sent` bytes went already (blocking)."""
    while True:
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if not views:
            return
        if sent:
            views[0] = views[0][sent:]
        sent = sock.sendmsg(views[:IOV_CAP])


def spin_seconds() -> float:
    """How long a step-socket reader polls before it blocks (FrameReader._recv):
    TIERSTORE_SPIN_US, default 0 (never). Polling saves the wake-up of a
    blocked thread on each side of a step, but burns a core meanwhile: it
    shortens a loop of all-hit steps, yet where client and sidecar share too
    few cores the poller slows its peer's plan as much as it saves, so it is
    off unless asked for; it is meant for hosts with a spare core per worker
    (docs/decisions.md, "Step-socket polling")."""
    try:
        return max(0.0, float(os.environ.get("TIERSTORE_SPIN_US", "0"))) * 1e-6
    except ValueError:
        return 0.0


class FrameReader:
    """Reads whole frames from a stream socket into a reused buffer.

    What a peer can make it hold (the server's reader; see tierstore/sidecar/step_server.py):
    - a frame's body is read only after its header passed the `limit` check;
    - the buffer grows with the bytes that arrived, at most to twice those buffered,
      never to a declared length ahead of them; up to SCRATCH (a HELLO while `limit` is
      HELLO-sized) it is every reader's base, a bytearray; beyond it an anonymous mapping
      (_buffer), resident only where bytes arrived and returned to the OS when dropped;
    - with a `budget` (reserve(nbytes, wait_s), give_back(nbytes)), capacity beyond
      SCRATCH is reserved from it before the buffer grows there, and given back by
      recycle() and close(): `reserved` is always len(buf) - SCRATCH, or 0 below it;
    - with `frame_timeout_s`, a frame begun must be whole that many seconds after its
      first byte (time spent waiting for the budget not counted), or read() raises
      FrameError(Unavailable). Waiting for a frame's first byte is not limited (a decode
      loop may idle), unless read() or header() is given a deadline: then TimeoutError.
      While a deadline runs the socket has a timeout; it is blocking again after each call.
    """

    def __init__(self, sock: socket.socket, limit: int, spin_s: float = 0.0, *, budget=None,
                 frame_timeout_s: float | None = None):
        self.sock, self.limit = sock, limit
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        self.buf = bytearray(min(SCRATCH, HDR.size + limit))  # a HELLO-sized reader starts HELLO-sized
        self.start = self.end = 0
        self.spin_s = spin_s  # poll this long before a blocking recv (see _recv)
        self.budget, self.frame_timeout_s, self.reserved = budget, frame_timeout_s, 0
        self._deadline: float | None = None  # the caller's, for this read
        self._began: float | None = None     # when this frame's first byte was seen
        self._paused = 0.0                   # seconds this frame waited for the budget
        self._timed = False                  # the socket has a timeout set (only while a deadline runs)

    def header(self, deadline: float | None = None) -> tuple[int, int]:
        """(body length, op) of the next frame, which stays unread: a caller can refuse it
        before a byte of its body is read. `deadline`: time.monotonic() by which it must be here."""
        self._deadline = deadline
        if self.start == self.end:
            self.start = self.end = 0
        try:
            self._fill(HDR.size)
            return HDR.unpack_from(self.buf, self.start)
        finally:
            self._untime()

    def read(self, owned: bool = False, deadline: float | None = None):
        """(op, body): body is a view of the buffer, or its own bytes when `owned` (a large
        reply then goes straight into a buffer of its declared size: the client's path, which
        trusts its sidecar's lengths up to `limit`). `deadline` as in header()."""
        try:
            length, op = self.header(deadline)
            if length > self.limit:
                raise FrameError(errors.ResourceExhausted(
                    f"step-socket frame of {length} B exceeds the {self.limit} B request limit; split the step"))
            total = HDR.size + length
            if owned and self.budget is None and total > len(self.buf):
                return op, self._read_owned(length)
            self._fill(total)
            a, self.start = self.start + HDR.size, self.start + total
            self._began, self._paused = None, 0.0
            if owned:
                return op, bytes(memoryview(self.buf)[a:self.start])  # one copy (a bytearray slice would be two)
            return op, memoryview(self.buf)[a:self.start]
        finally:
            self._untime()

    def _read_owned(self, length: int) -> bytearray:
        body = bytearray(length)
        have = self.end - self.start - HDR.size
        body[:have] = self.buf[self.start + HDR.size:self.end]
        self.start = self.end = 0
        view = memoryview(body)
        while have < length:
            n = self.sock.recv_into(view[have:])
            if n == 0:
                raise EOFError("connection closed")
            have += n
        return body

    def _fill(self, n: int) -> None:
        """Until `n` bytes are buffered from `start` (which a growing buffer moves to 0)."""
        while self.end - self.start < n:
            if self.end == len(self.buf):
                self._grow(n)
            timed = self._arm()
            try:
                got = self.sock.recv_into(memoryview(self.buf)[self.end:]) if timed else \
                    self._recv(memoryview(self.buf)[self.end:])
            except TimeoutError:
                if self.end > self.start and timed:
                    raise self._late() from None
                raise
            if got == 0:
                raise EOFError("connection closed")
            self.end += got

    def _grow(self, want: int) -> None:
        """Room for more of a frame of `want` bytes at start: compact, or grow to the base (SCRATCH,
        or a HELLO while that is the limit), beyond it to at most twice what is buffered."""
        live = self.end - self.start
        size = max(min(SCRATCH, HDR.size + self.limit), min(want, 2 * live), len(self.buf) if self.start else 0)
        if self.budget is not None and size - SCRATCH > self.reserved:
            t0 = time.monotonic()
            try:
                self.budget.reserve(size - SCRATCH - self.reserved, self.frame_timeout_s or 0.0)
            except errors.TierstoreError as e:
                raise FrameError(e) from None
            self.reserved = size - SCRATCH
            self._paused += time.monotonic() - t0  # the sidecar's wait, not the client's
        self._move(size)

    def _arm(self) -> bool:
        """Set the socket's timeout to what is left of this frame's deadline; False when none runs."""
        ends = [] if self._deadline is None else [self._deadline]
        if self.frame_timeout_s is not None and self.end > self.start:
            if self._began is None:
                self._began = time.monotonic()
            ends.append(self._began + self._paused + self.frame_timeout_s)
        if not ends:
            self._untime()
            return False
        left = min(ends) - time.monotonic()
        if left <= 0:
            if self.end > self.start:
                raise self._late()
            raise TimeoutError("no frame before the deadline")
        self.sock.settimeout(left)
        self._timed = True
        return True

    def _untime(self) -> None:
        if self._timed:
            self.sock.settimeout(None)
            self._timed = False

    def _late(self) -> FrameError:
        have = self.end - self.start
        what = (f"a step-socket frame of {HDR.unpack_from(self.buf, self.start)[0]} B" if have >= HDR.size
                else "a step-socket frame header")
        return FrameError(errors.Unavailable(
            f"{what} was not whole in time ({have} B of it arrived; a frame must be whole "
            f"{self.frame_timeout_s or 0:g} s after its first byte), so the sidecar closed the connection: send "
            f"each frame at once (client/step_channel.py does)"))

    def _recv(self, view) -> int:
        """recv_into, polling first for up to spin_s (see spin_seconds)."""
        if self.spin_s > 0:
            deadline = time.perf_counter() + self.spin_s
            while True:
                try:
                    return self.sock.recv_into(view, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter() > deadline:
                        break
                    os.sched_yield()  # a runnable thread on this core (the peer?) goes first
        return self.sock.recv_into(view)

    def _move(self, size: int) -> None:
        """Buffered bytes into a new buffer of `size` (or of them all, if more), at its start."""
        live, old = self.end - self.start, self.buf
        self.buf = _buffer(max(size, live))
        memoryview(self.buf)[:live] = memoryview(old)[self.start:self.end]
        self.end, self.start = live, 0
        _drop(old)

    def recycle(self) -> None:
        """After a request: keep the buffer unless someone still holds a view of it; drop a
        big one, or any beyond SCRATCH while the budget is more than half held (so kept
        buffers never take more than half of it from frames in flight)."""
        if _exported(self.buf):
            self._move(SCRATCH)
        elif len(self.buf) > SCRATCH and self.end - self.start <= SCRATCH and (
                len(self.buf) > KEEP_BUFFER or (self.budget is not None and self.budget.crowded())):
            self._move(SCRATCH)
        self._settle()

    def _settle(self) -> None:
        keep = min(self.reserved, max(0, len(self.buf) - SCRATCH))
        if self.budget is not None and self.reserved > keep:
            self.budget.give_back(self.reserved - keep)
        self.reserved = keep

    def close(self) -> None:
        """Give the budget back everything this reader holds (its connection has ended)."""
        if self.budget is not None and self.reserved:
            self.budget.give_back(self.reserved)
        self.reserved = 0
        _drop(self.buf)
        self.buf, self.start, self.end = bytearray(), 0, 0


def _buffer(size: int):
    """A receive buffer: a bytearray up to SCRATCH; beyond it an anonymous mapping, which is
    not zero-filled up front (its pages become resident as bytes are written) and is unmapped
    by _drop, not left to the allocator."""
    return bytearray(size) if size <= SCRATCH else mmap.mmap(-1, size)


def _exported(buf) -> bool:
    """Whether a view of `buf` is alive (a handler kept one): resizing is refused then."""
    try:
        if isinstance(buf, bytearray):
            buf.append(0)
            buf.pop()
        else:
            buf.resize(len(buf))
    except BufferError:
        return True
    return False


def _drop(buf) -> None:
    if isinstance(buf, mmap.mmap):
        try:
            buf.close()
        except BufferError:  # a handler still holds a view: unmapped when it lets go
            pass


def _name(body, off: int, name_len: int, what: str) -> str:
    raw = bytes(body[off:off + name_len])
    table = _NAMES.get(raw)
    if table is None:
        try:
            table = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise errors.InvalidArgument(f"step-socket {what}: the table name is not UTF-8") from None
        if len(_NAMES) < MAX_NAMES_KEPT:  # a client sending endless names cannot grow it
            _NAMES[raw] = table
    return table


def encode_note(items: list[NoteItem]) -> tuple[list, int]:
    """(parts, their total bytes) of a NOTE frame; ids, ends and row_ids int64, rows
    uint8 [n, row_bytes], all contiguous."""
    parts, size = [COUNT.pack(len(items))], COUNT.size
    for it in items:
        name = it.table.encode("utf-8")
        n_rows, row_bytes = (0, 0) if it.rows is None else it.rows.shape
        parts += [NOTE_ITEM.pack(it.version, it.ids.size, it.ends.size, n_rows, row_bytes, len(name)), name,
                  bytes(pad8(len(name))), it.ids, it.ends]
        size += NOTE_ITEM.size + len(name) + pad8(len(name)) + it.ids.nbytes + it.ends.nbytes
        if n_rows:
            tail = bytes(pad8(it.rows.nbytes))
            parts += [it.row_ids, it.rows, tail]
            size += it.row_ids.nbytes + it.rows.nbytes + len(tail)
    return parts, size


def parse_note(body) -> list[NoteItem]:
    """NOTE body -> items; every length is checked against the body before use."""
    bad = errors.InvalidArgument
    if len(body) < COUNT.size:
        raise bad(f"step-socket NOTE body of {len(body)} B is shorter than its header")
    (n_items,), off, items = COUNT.unpack_from(body), COUNT.size, []
    if n_items > MAX_ITEMS:
        raise bad(f"step-socket NOTE names {n_items} tables; at most {MAX_ITEMS}")
    for i in range(n_items):
        if NOTE_ITEM.size > len(body) - off:
            raise bad(f"step-socket NOTE is truncated in the header of item {i}")
        version, n_ids, n_steps, n_rows, row_bytes, name_len = NOTE_ITEM.unpack_from(body, off)
        off += NOTE_ITEM.size
        pad, row_part = -name_len % 8, n_rows * (8 + row_bytes) + -(n_rows * row_bytes) % 8
        if name_len > MAX_NAME or name_len + pad + (n_ids + n_steps) * 8 + row_part > len(body) - off:
            raise bad(f"step-socket NOTE item {i} declares a {name_len} B name, {n_ids} ids, {n_steps} steps and "
                      f"{n_rows} rows of {row_bytes} B, more than the frame carries")
        if n_rows and not row_bytes:
            raise bad(f"step-socket NOTE item {i} carries {n_rows} rows of 0 B")
        table = _name(body, off, name_len, f"NOTE item {i}")
        off += name_len + pad
        ids = np.frombuffer(body, _I8, n_ids, off)
        ends = np.frombuffer(body, _I8, n_steps, off + n_ids * 8)
        off += (n_ids + n_steps) * 8
        row_ids = rows = None
        if n_rows:
            row_ids = np.frombuffer(body, _I8, n_rows, off)
            rows = np.frombuffer(body, np.uint8, n_rows * row_bytes, off + n_rows * 8).reshape(n_rows, row_bytes)
            off += row_part
        items.append(NoteItem(table, ids, ends, version, row_ids, rows))
    if off != len(body):
        raise bad(f"step-socket NOTE has {len(body) - off} B after its last item")
    return items


def parse_plan(body) -> tuple[list[PlanItem], list[int]]:
    """PLAN body -> (items, release); every length is checked against the body before use."""
    bad = errors.InvalidArgument
    if len(body) < PLAN_REQ.size:
        raise bad(f"step-socket PLAN body of {len(body)} B is shorter than its {PLAN_REQ.size} B header")
    n_items, n_release = PLAN_REQ.unpack_from(body, 0)
    if n_items > MAX_ITEMS:
        raise bad(f"step-socket PLAN names {n_items} tables; at most {MAX_ITEMS} per step")
    off = PLAN_REQ.size
    if n_release > MAX_RELEASE:
        raise bad(f"step-socket PLAN releases {n_release} leases; at most {MAX_RELEASE} per request")
    if n_release * 8 > len(body) - off:
        raise bad(f"step-socket PLAN declares {n_release} releases but carries {len(body) - off} B")
    if n_release == 1:  # a step loop's last lease: no array for one id
        release = [U64.unpack_from(body, off)[0]]
    else:
        release = np.frombuffer(body, _U8, n_release, off).tolist() if n_release else []
    off += n_release * 8
    items = []
    for i in range(n_items):
        if ITEM.size > len(body) - off:
            raise bad(f"step-socket PLAN is truncated in the header of item {i}")
        version, request_id, n_ids, ttl_ms, name_len = ITEM.unpack_from(body, off)
        off += ITEM.size
        pad = -name_len % 8
        if name_len > MAX_NAME or name_len + pad + n_ids * 8 > len(body) - off:
            raise bad(f"step-socket PLAN item {i} declares a {name_len} B name and {n_ids} ids, more than the frame "
                      f"carries")
        table = _name(body, off, name_len, f"PLAN item {i}")
        off += name_len + pad
        ids = np.frombuffer(body, _I8, n_ids, off)  # a dtype object: a "<i8" string is parsed per call
        ids.setflags(write=False)
        off += n_ids * 8
        items.append(PlanItem(table, ids, version, ttl_ms, request_id))
    if off != len(body):
        raise bad(f"step-socket PLAN has {len(body) - off} B after its last item")
    return items, release


def encode_plan_results(results: list) -> tuple[list, int]:
    """(parts, their total bytes) of a PLAN reply."""
    parts, size = [COUNT.pack(len(results))], COUNT.size
    for r in results:
        if isinstance(r, PlanResult):
            slots = r.slots
            if type(slots) is not np.ndarray or slots.dtype != _I8 or not slots.flags.c_contiguous:
                slots = np.ascontiguousarray(slots, dtype="<i8")
            arena = _ARENAS.get(r.arena)
            if arena is None:  # the names of served arenas, kept encoded and padded to 8
                arena = r.arena.encode()
                arena = (arena, bytes(pad8(len(arena))))
                if len(_ARENAS) >= MAX_NAMES_KEPT:
                    _ARENAS.clear()
                _ARENAS[r.arena] = arena
            parts += [RES_OK.pack(0, slots.size, r.lease_id, r.version, r.expires_unix_ms, r.hits, r.misses,
                                  r.unique, len(arena[0]), r.arena_slots), slots.reshape(-1), *arena]
            size += RES_OK.size + slots.nbytes + len(arena[0]) + len(arena[1])
        else:
            parts += encode_error(r)
            size += sum(len(p) for p in parts[-4:])
    return parts, size

