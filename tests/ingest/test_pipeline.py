"""The bounded pipeline under write_version: order, the in-flight bound, errors."""
import threading
import time

import pytest

from tierstore.ingest.pipeline import Pipeline


def test_items_come_out_in_order_through_every_stage():
    with Pipeline(range(500), [lambda x: x * 2, lambda x: x + 1], in_flight=4) as pipe:
        assert list(pipe) == [2 * i + 1 for i in range(500)]


def test_never_more_than_in_flight_items_out():
    out, peak, lock = [0], [0], threading.Lock()

    def source():
        for i in range(200):
            with lock:
                out[0] += 1
                peak[0] = max(peak[0], out[0])
            yield i

    def slow(x):
        time.sleep(0.001)
        return x

    with Pipeline(source(), [slow, slow], in_flight=3) as pipe:
        for _ in pipe:
            time.sleep(0.001)
            with lock:
                out[0] -= 1
    assert peak[0] <= 3


@pytest.mark.parametrize("where", ["source", "stage"])
def test_the_first_error_reaches_the_caller_and_every_thread_stops(where):
    def source():
        for i in range(1000):
            if where == "source" and i == 50:
                raise KeyboardInterrupt  # e.g. the shard's reader was interrupted
            yield i

    def stage(x):
        if where == "stage" and x == 50:
            raise OSError(28, "No space left on device")
        return x

    before = threading.active_count()
    got = []
    with pytest.raises(KeyboardInterrupt if where == "source" else OSError):
        with Pipeline(source(), [stage], in_flight=4) as pipe:
            got.extend(pipe)
    assert got == list(range(len(got))) and len(got) <= 50
    assert threading.active_count() == before
