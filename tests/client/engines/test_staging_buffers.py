"""client/engines/staging_buffers.py: each layer's buffer carries the step it was filled for, and a
read for another step raises instead of serving zeros or another step's rows (CPU device)."""
from __future__ import annotations

import numpy as np
import pytest

from tierstore.client.engines import StagingError
from tierstore.client.engines.staging_buffers import StagingBuffers


def _fill(buffers: StagingBuffers, layer: int, rows: np.ndarray) -> None:
    def write(weight, scale):
        weight[...] = rows[:, :buffers.dim]
        scale[...] = rows[:, buffers.dim:]

    buffers.fill(layer, rows.shape[0], write)


def test_a_layer_reads_only_the_rows_of_the_step_it_was_filled_for():
    rng = np.random.default_rng(0)
    buffers = StagingBuffers(2, 8, 64, 32, "cpu")
    ptrs = (buffers.weight.data_ptr(), buffers.scale.data_ptr())
    with pytest.raises(StagingError, match="slot 0 holds the rows of step none, and the forward of step 1"):
        buffers.rows(0, 4, 1)
    first = [rng.integers(1, 255, (6, 66), dtype=np.uint8) for _ in range(2)]
    for layer, rows in enumerate(first):
        _fill(buffers, layer, rows)
    buffers.publish(6, 1)
    for layer, rows in enumerate(first):
        weight, scale = buffers.rows(layer, 8, 1)  # a padded read: the step's rows, then zeros
        assert np.array_equal(weight[:6].numpy(), rows[:, :64]) and np.array_equal(scale[:6].numpy(), rows[:, 64:])
        assert not weight[6:].any() and not scale[6:].any()
    second = rng.integers(1, 255, (3, 66), dtype=np.uint8)
    _fill(buffers, 0, second)  # layer 1's fill skipped
    buffers.publish(3, 2)
    assert np.array_equal(buffers.rows(0, 3, 2)[0].numpy(), second[:, :64])
    assert not buffers.weight[:, 3:].any()  # rows past the step zeroed for every layer, the skipped one too
    with pytest.raises(StagingError, match="slot 1 holds the rows of step 1, and the forward of step 2 reads it: "
                                           "that step's fill of this layer did not happen"):
        buffers.rows(1, 3, 2)
    with pytest.raises(StagingError, match="slot 0 holds the rows of step 2, and the forward of step 1 reads it: "
                                           "it was refilled for a later step"):
        buffers.rows(0, 3, 1)
    assert (buffers.weight.data_ptr(), buffers.scale.data_ptr()) == ptrs
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill(0, 9, lambda weight, scale: None)
