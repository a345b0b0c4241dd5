"""The NVMe tier: a version's segment files read by row or by block.

reader.SegmentReader composes it by job: segment_files (the open files: segments,
format 1's row-sum file, O_DIRECT's descriptors), record_format (format 1 or 2: where
a row's sum lies, the one place the formats are told apart), the row path (misses
through the page cache, or with O_DIRECT (direct_io) through an io_uring (uring), each
row checked against its per-row sum (rowsum) as it is copied into place
(verified_copy)) and blocks (whole checksummed blocks: loading, publishing, scrubbing).
"""
