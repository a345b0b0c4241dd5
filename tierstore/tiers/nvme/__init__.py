"""The NVMe tier: a version's segment files read by row (reader.SegmentReader),
through the page cache (mapped_rows) or with O_DIRECT (direct_io, through an
io_uring: uring), in whole checksummed blocks (segment_blocks), each row
checked against its per-row sum (rowsum).
"""
