"""What one version's records are, and where their row sums lie: the one place a reader tells
segment format 1 from format 2 (tierstore.store.version.TableVersion).

- Format 2 (written by default): a record is the row, zero padding to whole 8-byte words,
  then its row sum (rowsum.records). A miss reads its record and checks the row against
  the sum it carries (verified_copy.place_records): nothing per row is held in memory.
- Format 1 (older versions): a record is the row alone, and the sums are a separate
  row-sum file of one uint64 a row (SegmentFiles.sums_fd), read beside the rows, 8 B a
  row; the row is checked against that (verified_copy.place_verified).
- A format 1 version without a usable row-sum file (written before row sums, or the file
  damaged) has no row sums: `verifies_rows` is False and its rows verify by their block
  (blocks.py).
"""
from __future__ import annotations

import numpy as np

from tierstore.store.version import TableVersion
from tierstore.tiers.nvme import rowsum
from tierstore.tiers.nvme.direct_io import Spans, give_back, read_now, spare_buffer
from tierstore.tiers.nvme.segment_files import PAGE_CACHE_GAP, SUM_BYTES, SegmentFiles
from tierstore.tiers.nvme.verified_copy import place_records, place_verified

__all__ = ["RecordFormat"]


class RecordFormat:
    """The records of `version`, whose files are `files` (format 1's row-sum file among them).

    `sums_in_records`: format 2. `key`: what the row sums are keyed by (rowsum.RowKey).
    `verifies_rows`: each row is checked against its own sum (format 2, or format 1 with
    a usable row-sum file); else rows verify by their block. `records_are_rows`: a record
    is the row alone (format 1), so a block read lands as rows."""

    def __init__(self, version: TableVersion, files: SegmentFiles, key: rowsum.RowKey):
        self.version, self.files, self.key = version, files, key
        self.row_bytes, self.record_bytes = version.row_bytes, version.record_bytes
        self.sums_in_records = version.segment_format == 2
        self.records_are_rows = not self.sums_in_records
        self.verifies_rows = self.sums_in_records or files.sums_fd is not None

    # ---- the row path (the read pipeline): a part's sums, and its rows verified as they are placed ----
    def sum_spans(self, ids: np.ndarray) -> Spans | None:
        """The reads of the row sums of sorted `ids`, made to be read beside their records
        (format 1: from the row-sum file, through the page cache); None in format 2, whose
        records carry them."""
        if self.sums_in_records:
            return None
        return Spans(self.files.sums_fd, ids, SUM_BYTES, 1, spare_buffer, give_back, PAGE_CACHE_GAP)

    def sums_short(self, row: int) -> str:
        """Why the stored sum of `row` could not be read (a read of it came back short)."""
        if not self.sums_in_records:
            return f"the row checksum file {self.files.sums_path} is truncated"
        return self.files.gone(row)

    def place(self, src: np.ndarray, at: np.ndarray, ids: np.ndarray, dest: np.ndarray, slots: np.ndarray,
              sums: np.ndarray | None = None) -> int:
        """Place records src[at] (as read from a segment) into dest[slots], each row verified:
        against the sum its record carries (format 2) or sums[i] (format 1: the rows' sums
        as read from the row-sum file, in the rows' order). The index of the first row that
        fails, or -1."""
        if self.sums_in_records:
            return place_records(src, at, ids, dest, slots, self.key)
        return place_verified(src, at, ids, dest, slots, sums, self.key, np.arange(ids.size))

    # ---- stored sums, read for rows someone else read (place_rows) and for whole blocks ----
    def read_sums(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """(the stored row sums of sorted, unique `ids`, uint64 [n]; the index of the first whose
        file is not there or ends before it, or -1: the sums from there on are undefined),
        read through the page cache: format 1's row-sum file, or format 2's records' last words."""
        out = np.empty((ids.size, SUM_BYTES), dtype=np.uint8)
        if not self.sums_in_records:
            _, short = read_now(self.files.sums_fd, ids, SUM_BYTES, out, PAGE_CACHE_GAP)
            return out.view("<u8").reshape(-1), short
        # a record's sum is its last 8-B word, and records are whole words: word k of its segment
        seg, at = self.files.segment_of(ids)
        words = self.record_bytes // SUM_BYTES
        fds = self.files.page_fds[seg]
        gone = np.flatnonzero(fds < 0)
        n = int(gone[0]) if gone.size else ids.size
        short = -1
        if n:
            _, short = read_now(fds[:n], at[:n] * words + words - 1, SUM_BYTES, out, PAGE_CACHE_GAP)
        return out.view("<u8").reshape(-1), short if short >= 0 or n == ids.size else n

    def stored_sums(self, ids: np.ndarray) -> np.ndarray:
        """read_sums, or ChecksumError for a file that is not there or ends before one of them."""
        got, short = self.read_sums(ids)
        if short >= 0:
            raise self.files.error(int(ids[short]), self.sums_short(int(ids[short])))
        return got

    def rows_wrong(self, recs: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """bool [n]: which of records uint8 [n, record_bytes] as stored for rows `ids` (in
        order, consecutive or not) do not hold their row as written: its sum does not match
        (or cannot be read), or format 2's zero padding is not zero."""
        if self.sums_in_records:
            want = np.ascontiguousarray(recs[:, -SUM_BYTES:]).view("<u8")[:, 0]
            wrong = recs[:, self.row_bytes:self.record_bytes - SUM_BYTES].any(axis=1)
        else:
            want, short = self.read_sums(ids)
            wrong = np.zeros(ids.size, dtype=bool)
            if short >= 0:  # the row-sum file ends before these rows' sums: they cannot speak for themselves
                wrong[short:] = True
        return wrong | (rowsum.row_sums(self.rows_of(recs), ids, self.key) != want)

    def rows_of(self, recs: np.ndarray) -> np.ndarray:
        """The rows of records uint8 [n, record_bytes]: a strided view, no copy."""
        return recs[:, :self.row_bytes]

    def carried_records(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The format 2 records (row, padding, row sum) of verified rows uint8 [n, row_bytes]
        stored as `ids` (int64 [n]) under this version's key."""
        return rowsum.records(rows, ids, self.key)
