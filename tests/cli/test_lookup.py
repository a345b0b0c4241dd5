"""`tierstore lookup` turns bad --ids into one line and exit 2, before connecting."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("ids,msg", [("99999999999999999999", "beyond int64"), ("1,x", "comma-separated integers")])
def test_bad_ids_are_a_clear_error(cli, tmp_path, ids, msg):
    code, _, err = cli("lookup", "--socket", tmp_path / "none.sock", "--table", "t", "--ids", ids)
    assert code == 2 and msg in err and "Traceback" not in err
