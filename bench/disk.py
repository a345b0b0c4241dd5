"""The disk's own limit: random O_DIRECT reads at each queue depth, as `bench large` and
`bench cold` set tierstore's misses against it.

Reads of one block size at uniformly random block offsets over the given files
(a table's segment files), `qd` in flight, for a few seconds, as fio's
`randread` with `--direct=1 --ioengine=io_uring --iodepth=qd` measures it;
depths 32 to 256 by default, and the best of them is the limit. The reads go
through the io_uring the miss path reads with (tierstore/tiers/nvme/uring.py:
`Ring.submit` and `wait`, each completion's place taken by the next read at once), so a
miss path short of this figure is short of it above the ring, and a ring short
of what fio measures shows here too. With `rings=2` the same total depth is
split over two rings on two threads (is one thread's CPU the limit?). Each
result carries the CPU this process spent per read (user + system), the
figure that caps IOPS on a host with few cores.
"""
from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

import numpy as np

from tierstore.errors import InvalidArgument

__all__ = ["DEPTHS", "disk_limit", "best_iops", "burst_limit"]

DEPTHS = (32, 64, 128, 256)
# a probe's first batch is this many depths of reads; the reads share this many depths of memory
FIRST_DEPTHS, BUFFER_DEPTHS = 8, 4
RING_ENTRIES = 256  # a probe ring's entries, as the miss path's (direct_io.thread_ring)


def disk_limit(paths, *, blocks=(512, 4096), depths=DEPTHS, rings=(1,), seconds: float = 3.0,
               seed: int = 0) -> dict:
    """Random-read IOPS of O_DIRECT reads over `paths`, per block size, queue depth and
    number of rings: {"512B_qd32": {"iops", "reads", "seconds", "block", "qd", "rings",
    "cpu_us_per_read"}, ..., "512B_qd128x2": ... (two rings)}. A block smaller than the
    device's O_DIRECT alignment is {"skipped": why} under "<block>B"; where O_DIRECT or
    io_uring is refused the whole result is {"skipped": why}."""
    from tierstore.tiers.nvme.uring import Ring

    if not seconds > 0:
        raise InvalidArgument(f"disk probe seconds must be > 0, got {seconds}")
    for k in rings:
        for qd in depths:
            if k < 1 or qd < k or qd % k:
                raise InvalidArgument(f"queue depth {qd} does not split over {k} rings: give depths that are "
                                      f"multiples of the number of rings")
            if qd // k > RING_ENTRIES:
                raise InvalidArgument(f"queue depth {qd} over {k} ring(s) is more than a ring's {RING_ENTRIES} "
                                      f"entries: probe depths up to {RING_ENTRIES * k}")
    paths, files = _direct_files(paths)
    if isinstance(files, dict):
        return files
    try:
        ring = Ring.open(2)  # (DirectFiles has compiled the read loop: no probe's time pays for that)
        if ring is None:
            return {"skipped": "io_uring is unavailable here (see the log line of tierstore.tiers.nvme.uring)"}
        ring.close()
        fds = np.array(files.fds, dtype=np.int32)
        out = {}
        for block in blocks:
            if block < files.align:
                out[f"{block}B"] = {"skipped": f"the device's O_DIRECT alignment is {files.align} B"}
                continue
            held = np.array([p.stat().st_size // block for p in paths], dtype=np.int64)
            for k in rings:
                for qd in depths:
                    probes = [_Probe(fds, held, block, qd // k, [seed, block, qd, k, i]) for i in range(k)]
                    threads = [threading.Thread(target=p.run, args=(seconds,), name=f"disk-probe-{i}")
                               for i, p in enumerate(probes)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    for p in probes:
                        if p.error is not None:
                            raise p.error
                    reads = sum(p.reads for p in probes)
                    secs = max(p.seconds for p in probes)
                    out[f"{block}B_qd{qd}" + (f"x{k}" if k > 1 else "")] = {
                        "iops": reads / secs, "reads": reads, "seconds": secs, "block": block, "qd": qd,
                        "rings": k, "cpu_us_per_read": sum(p.cpu for p in probes) / max(1, reads) * 1e6}
        return out
    finally:
        files.close()


def burst_limit(paths, burst: int, *, qd: int = 256, seconds: float = 3.0, seed: int = 0) -> dict:
    """The disk's rate for reads that come in steps: bursts of `burst` random 512-B O_DIRECT
    reads at depth `qd`, each burst waited for whole before the next begins, back to back for
    `seconds`, through one ring as disk_limit reads: {"iops", "reads", "seconds", "burst",
    "qd", "cpu_us_per_read"}, or {"skipped": why} where O_DIRECT or io_uring is refused. A
    decode step's misses come so (the next step's ids are not known before this one's
    forward): its queue fills and drains once a step, however it is read, so this is the
    most misses/s any step-by-step reader of `burst` misses a step gets from this disk, with
    no work of its own between steps; disk_limit's sustained depth is the most any reader gets."""

    wrong = [need for need, ok in (("seconds must be > 0", seconds > 0), ("a burst must be >= 1 read", burst >= 1),
                                   (f"the depth must be 1..{RING_ENTRIES}", 1 <= qd <= RING_ENTRIES)) if not ok]
    if wrong:
        raise InvalidArgument(f"burst probe: {'; '.join(wrong)} (got seconds {seconds}, burst {burst}, qd {qd})")
    paths, files = _direct_files(paths)
    if isinstance(files, dict):
        return files
    try:
        held = np.array([p.stat().st_size // 512 for p in paths], dtype=np.int64)
        probe = _Probe(np.array(files.fds, dtype=np.int32), held, 512, qd, [seed, 512, qd, burst], burst=burst)
        probe.run(seconds)
        if isinstance(probe.error, OSError) and "refused" in str(probe.error):
            return {"skipped": "io_uring is unavailable here (see the log line of tierstore.tiers.nvme.uring)"}
        if probe.error is not None:
            raise probe.error
        return {"iops": probe.reads / probe.seconds, "reads": probe.reads, "seconds": probe.seconds,
                "burst": burst, "qd": qd, "cpu_us_per_read": probe.cpu / max(1, probe.reads) * 1e6}
    finally:
        files.close()


def _direct_files(paths) -> tuple[list[Path], object]:
    """(the paths, the files opened O_DIRECT: tiers/nvme/direct_io.DirectFiles, or {"skipped": why})."""
    from tierstore.tiers.nvme.direct_io import DirectFiles

    paths = [Path(p) for p in paths]
    try:
        return paths, DirectFiles(paths)
    except Exception as e:  # noqa: BLE001 - the reason is reported, the bench goes on without it
        return paths, {"skipped": str(e)}


def best_iops(disk: dict, block: int = 512) -> dict | None:
    """The probe of `block`-B reads with the most IOPS: {"iops", "qd", "rings", "key"}, or None."""
    runs = [(d["iops"], k, d) for k, d in disk.items() if isinstance(d, dict) and d.get("block") == block]
    if not runs:
        return None
    iops, key, d = max(runs, key=lambda r: r[0])
    return {"iops": iops, "qd": d["qd"], "rings": d["rings"], "key": key}


class _Probe:
    """One ring on one thread: `qd` random reads in flight until `seconds` have passed; its
    reads, seconds and thread CPU seconds. The ring's queue drains once per batch waited for
    call, so after a first call of FIRST_DEPTHS x qd reads (which gives the rate) the
    second is sized to fill the rest of the time; with `burst`, every call is that many
    reads (burst_limit). The bytes read are never looked at:
    the reads share BUFFER_DEPTHS x qd places of memory."""

    def __init__(self, fds: np.ndarray, held: np.ndarray, block: int, qd: int, seed, burst: int | None = None):
        self.fds, self.held, self.block, self.qd, self.burst = fds, held, block, qd, burst
        self.rng = np.random.default_rng(seed)
        places = BUFFER_DEPTHS * qd
        raw = np.empty(places * block + 4096, dtype=np.uint8)
        self.buf = raw[-raw.ctypes.data % 4096:][:places * block]
        self.places = self.buf.ctypes.data + np.arange(places, dtype=np.int64) * block
        self.reads, self.seconds, self.cpu, self.error = 0, 0.0, 0.0, None

    def run(self, seconds: float) -> None:
        from tierstore.tiers.nvme.uring import Ring

        ring = Ring.open(RING_ENTRIES)
        try:
            if ring is None:
                raise OSError("io_uring was refused on the probe's thread")
            cum = np.cumsum(self.held)
            n = self.burst or FIRST_DEPTHS * self.qd
            c0, t0 = _thread_cpu(), time.perf_counter()
            while True:
                pick = self.rng.integers(0, int(cum[-1]), size=n)
                f = np.searchsorted(cum, pick, side="right")
                off = (pick - (cum[f] - self.held[f])) * self.block
                addrs = np.resize(self.places, n)
                res = ring.wait(ring.submit(self.fds[f], off, np.full(n, self.block, dtype=np.int64), addrs, depth=self.qd))
                if (res != self.block).any():
                    bad = int(res[res != self.block][0])
                    raise OSError(-bad if bad < 0 else 5, f"O_DIRECT read of {self.block} B returned {bad}")
                self.reads += n
                self.seconds = time.perf_counter() - t0
                if self.seconds >= seconds:
                    break
                if not self.burst:  # one call for the rest of the time: the queue drains once
                    n = max(FIRST_DEPTHS * self.qd, int(self.reads / self.seconds * (seconds - self.seconds)))
            self.cpu = _thread_cpu() - c0
        except BaseException as e:  # noqa: BLE001 - raised again by disk_limit on the caller's thread
            self.error = e
        finally:
            if ring is not None:
                ring.close()


def _thread_cpu() -> float:
    """This thread's user + system CPU seconds (the process's where the OS does not say)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
