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
    assert not buffers.weight[0, 3:].any()  # rows past the step zeroed for the layer filled for it
    with pytest.raises(StagingError, match="slot 1 holds the rows of step 1, and the forward of step 2 reads it: "
                                           "that step's fill of this layer did not happen"):
        buffers.rows(1, 3, 2)
    with pytest.raises(StagingError, match="slot 0 holds the rows of step 2, and the forward of step 1 reads it: "
                                           "it was refilled for a later step"):
        buffers.rows(0, 3, 1)
    assert (buffers.weight.data_ptr(), buffers.scale.data_ptr()) == ptrs
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill(0, 9, lambda weight, scale: None)


def test_a_steps_later_layer_is_filled_and_published_after_its_first_from_another_thread():
    """Layer 1 of a step filled and published from a thread after layer 0 (the stagers' later layers,
    read while the forward runs the layers before them): until then layer 1 still refuses the step,
    afterwards each layer reads its own rows, zero past them; a layer published unfilled is not stamped."""
    import threading

    rng = np.random.default_rng(1)
    buffers = StagingBuffers(2, 8, 64, 32, "cpu")
    old = [rng.integers(1, 255, (7, 66), dtype=np.uint8) for _ in range(2)]
    for layer, rows in enumerate(old):
        _fill(buffers, layer, rows)
    buffers.publish(7, 1)
    new = [rng.integers(1, 255, (5, 66), dtype=np.uint8) for _ in range(2)]
    _fill(buffers, 0, new[0])
    buffers.publish(5, 2, layers=[0])
    assert np.array_equal(buffers.rows(0, 5, 2)[0].numpy(), new[0][:, :64])
    with pytest.raises(StagingError, match="slot 1 holds the rows of step 1, and the forward of step 2"):
        buffers.rows(1, 5, 2)

    def later():
        _fill(buffers, 1, new[1])
        buffers.publish(5, 2, layers=[1])

    t = threading.Thread(target=later)
    t.start()
    t.join()
    for layer in (0, 1):
        weight, scale = buffers.rows(layer, 8, 2)
        assert np.array_equal(weight[:5].numpy(), new[layer][:, :64])
        assert np.array_equal(scale[:5].numpy(), new[layer][:, 64:])
        assert not weight[5:].any() and not scale[5:].any()
    buffers.publish(5, 3, layers=[1])  # a layer whose fill did not happen keeps its step's stamp
    with pytest.raises(StagingError, match="slot 1 holds the rows of step 2, and the forward of step 3"):
        buffers.rows(1, 5, 3)
