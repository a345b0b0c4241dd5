"""InProcessTable: the in-process RowSource (slot == id, rows bit-exact)."""
import numpy as np
import pytest
import torch

from tierstore.client.model.in_process_table import InProcessTable
from tierstore.client.model.source import PlanHandle, RowSource
from tierstore.table.spec import EngramSpec
from tierstore.errors import IdOutOfRange, InvalidArgument, SpecMismatch, TableNotFound
from tierstore.table.formats import decode_rows, encode_rows

SPEC = EngramSpec(name="t", layer_ids=(1, 3), max_ngram=3, n_heads=2, engram_vocab_size=300,
                  compressed_vocab_size=50, row_dim=32, row_format="fp8-e4m3-ue8m0",
                  hidden_size=16, hc_mult=2)


def test_is_a_row_source_with_slot_equal_id():
    src = InProcessTable.synthetic(SPEC, seed=3)
    assert isinstance(src, RowSource)
    h = src.plan("l1", np.array([[5, 7], [5, 0]]))
    assert isinstance(h, PlanHandle)
    np.testing.assert_array_equal(h.slots(), [5, 7, 5, 0])
    assert h.arena.dtype == torch.uint8 and h.arena.shape == (SPEC.rows(1), SPEC.row_bytes)
    h.release()
    h.release()  # idempotent


def test_synthetic_is_deterministic_and_in_spec_format():
    a, b = InProcessTable.synthetic(SPEC, seed=3), InProcessTable.synthetic(SPEC, seed=3)
    c = InProcessTable.synthetic(SPEC, seed=4)
    assert torch.equal(a.rows("l3"), b.rows("l3"))
    assert not torch.equal(a.rows("l3"), c.rows("l3"))
    assert not torch.equal(a.rows("l1"), a.rows("l3")[: SPEC.rows(1)])
    info = a.table_info("l3")
    assert info == {"rows": SPEC.rows(3), "row_bytes": SPEC.row_bytes, "row_format": SPEC.row_format,
                    "row_dim": 32, "spec": SPEC.to_dict(), "version": 1}


def test_float_values_are_encoded_bit_exact():
    vals = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    src = InProcessTable().add("x", vals, row_format="bf16", row_dim=8)
    np.testing.assert_array_equal(src.rows("x").numpy(), encode_rows(vals, "bf16"))
    np.testing.assert_allclose(decode_rows(src.rows("x").numpy(), "bf16", 8), vals, rtol=1e-2)


def test_load_npy(tmp_path):
    rows = encode_rows(np.ones((SPEC.rows(1), 32), np.float32), SPEC.row_format)
    np.save(tmp_path / "l1.npy", rows)
    src = InProcessTable(SPEC).load_npy("l1", tmp_path / "l1.npy")
    np.testing.assert_array_equal(src.rows("l1").numpy(), rows)


def test_bad_input_is_refused_with_the_fix():
    src = InProcessTable.synthetic(SPEC)
    n = SPEC.rows(1)
    with pytest.raises(IdOutOfRange, match=f"table 'l1' has {n} rows; id {n} is out of range"):
        src.plan("l1", np.array([0, n]))
    with pytest.raises(IdOutOfRange, match="id -1"):
        src.plan("l1", np.array([-1]))
    with pytest.raises(InvalidArgument, match="integers"):
        src.plan("l1", np.array([1.0]))
    with pytest.raises(TableNotFound, match=r"table 'l9' not found; tables are \['l1', 'l3'\]"):
        src.plan("l9", np.array([1]))
    with pytest.raises(SpecMismatch, match="says .* rows"):
        src.add("l1", np.zeros((n + 1, SPEC.row_bytes), np.uint8))
    with pytest.raises(SpecMismatch, match="bytes"):
        src.add("l1", np.zeros((n, SPEC.row_bytes + 1), np.uint8))
    with pytest.raises(InvalidArgument, match="row_format"):
        InProcessTable().add("x", np.zeros((2, 4), np.uint8))
