"""One byte of a stored row damaged on disk, as the corruption tests need it."""
from __future__ import annotations


def flip_row_byte(data_dir, tv, row: int, byte: int = 3, mask: int = 0x40) -> None:
    """XOR `mask` into byte `byte` of row `row`'s record in version `tv`'s segment file."""
    seg = data_dir / tv.segments[row // tv.segment_rows]
    with open(seg, "r+b") as f:
        f.seek((row % tv.segment_rows) * tv.record_bytes + byte)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ mask]))
