"""`tierstore serve --direct-io`: a cache-mode sidecar whose misses come from
O_DIRECT row reads serves the same bit-exact rows."""
import numpy as np
import pytest

from tierstore.client.client import Client
from tierstore.sidecar.launcher import SidecarProcess


def test_cache_mode_sidecar_with_direct_io_serves_bit_exact_rows(data_dir, make_table, odirect):
    data_dir.mkdir(parents=True, exist_ok=True)
    why = odirect(data_dir)
    if why:
        pytest.skip(why)
    _, data = make_table("t", rows=20_000, row_bytes=256)
    sc = SidecarProcess(data_dir, dram_budget="1MiB", extra_args=["--direct-io"]).start()
    try:
        with Client(sc.socket, timeout=30) as c:
            assert not c.table_info("t")["full_resident"]
            rng = np.random.default_rng(0)
            for _ in range(5):
                ids = rng.choice(20_000, 1500, replace=False)
                assert np.array_equal(c.lookup("t", ids), data[ids])
    finally:
        sc.cleanup()
