"""Random 256-B row gathers from a read-only map of one file per directory: what page size costs.

    python -m tierstore.bench.page_gather DIR [DIR ...]        (ROWS=N rows; default 16 Mi = 4 GiB)

For each directory: a file of ROWS x 256 B, filled through a writable map and
gathered (np.take of 1 Mi random rows into a preallocated buffer, best of 5)
through a second, read-only map, as a client maps an arena. Prints rows/s and
how much of the mappings sit on huge pages (/proc/self/smaps). Pair /dev/shm
with a tmpfs mounted huge=within_size to see what huge arenas buy on a table
past the TLB's reach.
"""
import mmap
import os
import sys
import time

import numpy as np

from tierstore.tiers.pages import huge_page_bytes

__all__ = ["gather_rate"]


def gather_rate(directory: str, rows: int, row_bytes: int = 256, picks: int = 1 << 20) -> tuple[float, int, int]:
    """(rows/s gathered, bytes mapped on huge pages, bytes mapped) for a table of `rows`
    rows in a file in `directory`, read through a read-only map; the file is removed after."""
    path = os.path.join(directory, f"page-gather.{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = rows * row_bytes
        os.posix_fallocate(fd, 0, size)
        with mmap.mmap(fd, size) as writable:
            np.frombuffer(writable, np.uint8)[:] = 7  # every page resident before timing
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as readonly:
            table = np.frombuffer(readonly, np.uint8).reshape(rows, row_bytes)
            ids = np.random.default_rng(1).integers(0, rows, picks)
            out = np.empty((picks, row_bytes), np.uint8)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                np.take(table, ids, axis=0, out=out)
                best = min(best, time.perf_counter() - t0)
            huge, mapped = huge_page_bytes(path)
            del table
        return picks / best, huge, mapped
    finally:
        os.close(fd)
        os.unlink(path)


def main(dirs) -> None:
    rows = int(os.environ.get("ROWS", 16 << 20))
    for d in dirs:
        rate, huge, mapped = gather_rate(d, rows)
        print(f"{d}: {rate / 1e6:.2f} M rows/s, {huge >> 20} of {mapped >> 20} MiB mapped on huge pages")


if __name__ == "__main__":
    main(sys.argv[1:])
