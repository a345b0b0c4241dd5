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


def test_a_plan_waits_for_one_chunk_of_background_work_never_a_sequence():
    """Background work in chunks, each taking the token again at once: a plan that asks while
    a chunk runs computes as soon as that chunk ends, before the next one starts (a plain
    lock lets the chunks' thread, which releases it, take it back first)."""
    stop, started, chunks, seen = threading.Event(), threading.Event(), [0], []

    def bookkeeping():
        while not stop.is_set():
            with cpu_token.background():
                chunks[0] += 1
                started.set()
                time.sleep(0.05)  # one chunk's work, the token held

    t = threading.Thread(target=bookkeeping)
    t.start()
    try:
        for _ in range(5):
            started.clear()
            assert started.wait(5)
            asked = chunks[0]  # the chunk running now
            with cpu_token.hold():
                seen.append(chunks[0] - asked)  # chunks begun while the plan waited
            time.sleep(0.01)
    finally:
        stop.set()
        t.join(5)
    assert seen == [0] * 5, seen


def test_background_work_computes_only_once_no_plan_waits():
    """A chunk of background work waiting for the token before a plan asks for it still
    goes after that plan (a plain lock serves them in the order they came)."""
    held, release = threading.Event(), threading.Event()
    order = []

    def plan_a():
        with cpu_token.hold():
            held.set()
            release.wait(5)
            order.append("plan a")

    def chunk():
        with cpu_token.background():
            order.append("chunk")

    def plan_b():
        with cpu_token.hold():
            order.append("plan b")

    a = threading.Thread(target=plan_a)
    a.start()
    assert held.wait(5)
    c = threading.Thread(target=chunk)
    c.start()
    time.sleep(0.05)  # the chunk waits for the token first
    b = threading.Thread(target=plan_b)
    b.start()
    deadline = time.monotonic() + 5
    while not cpu_token._waiting and time.monotonic() < deadline:  # then plan b does
        time.sleep(0.001)
    release.set()
    for t in (a, b, c):
        t.join(5)
    assert order == ["plan a", "plan b", "chunk"]
