"""Fixtures shared by the tier tests."""
import os

import pytest


def direct_io_refused(path) -> str | None:
    """None when the filesystem holding directory `path` takes O_DIRECT, else why not."""
    probe = os.path.join(path, ".odirect-probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return None
    except OSError as e:
        return f"{path} refuses O_DIRECT ({e.strerror})"
    finally:
        os.unlink(probe)


@pytest.fixture
def odirect():
    """odirect(path) -> None if O_DIRECT works under `path`, else the reason (to skip with)."""
    return direct_io_refused
