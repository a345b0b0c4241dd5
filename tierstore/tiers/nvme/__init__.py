"""The NVMe tier: a version's segment files read by row or by block
(reader.SegmentReader: through the page cache, or with O_DIRECT (direct_io)
through an io_uring (uring)), each row checked against its per-row sum
(rowsum: carried in the row's record in segment format 2, in a row-sum file
in format 1) as it is copied into place (verified_copy).
"""
