"""cpu_token: one computing plan at a time, none held while it waits."""
import threading
import time

from tierstore import cpu_token


def test_a_second_plan_computes_only_while_the_first_waits():
    order = []
    first_waiting, release_first = threading.Event(), threading.Event()

    def first():
        with cpu_token.hold():
            order.append("a computes")
            with cpu_token.hold():  # nested: no deadlock
                with cpu_token.waiting():
                    first_waiting.set()
                    release_first.wait(5)
            order.append("a computes again")

    t = threading.Thread(target=first)
    t.start()
    assert first_waiting.wait(5)
    got = threading.Event()

    def second():
        with cpu_token.hold():
            order.append("b computes")
            got.set()
            time.sleep(0.2)  # a cannot resume while b holds the token
            order.append("b done")

    u = threading.Thread(target=second)
    u.start()
    assert got.wait(5)  # a is waiting: b gets the token at once
    release_first.set()
    t.join(5)
    u.join(5)
    assert order == ["a computes", "b computes", "b done", "a computes again"]


def test_waiting_without_the_token_releases_nothing():
    # a thread that does not hold the token passes through waiting() and leaves the
    # holder's token held: no other thread may compute meanwhile
    held, done = threading.Event(), threading.Event()

    def holder():
        with cpu_token.hold():
            held.set()
            done.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    with cpu_token.waiting():
        pass
    third = []
    u = threading.Thread(target=lambda: third.append(cpu_token._TOKEN.acquire(timeout=0.2)))
    u.start()
    u.join(5)
    assert third == [False]  # still the holder's
    done.set()
    t.join(5)
    with cpu_token.hold():  # free once the holder is done
        assert cpu_token._TOKEN.locked()
    assert not cpu_token._TOKEN.locked()
