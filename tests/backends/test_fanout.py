"""fanout.Fanout: a batch's pages shared between its caller and one helper thread."""

import threading
import time

import pytest

from hicached.backends.fanout import MIN_BYTES, Fanout


@pytest.fixture
def fan():
    f = Fanout("test-fanout")
    yield f
    f.close()


def test_every_item_once_on_both_threads(fan):
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def work(i):
        time.sleep(0.002)  # long enough for the helper to wake and take some
        with lock:
            seen.append((i, threading.current_thread().name))

    fan.run(work, list(range(40)), MIN_BYTES)
    assert sorted(i for i, _ in seen) == list(range(40))
    names = {n for _, n in seen}
    assert threading.current_thread().name in names and len(names) == 2, names


@pytest.mark.parametrize(("n", "nbytes"), [(1, 1 << 30), (8, MIN_BYTES - 1)])
def test_small_batches_stay_on_the_caller(fan, n, nbytes):
    names = []
    fan.run(lambda i: names.append(threading.current_thread().name), list(range(n)), nbytes)
    assert names == [threading.current_thread().name] * n


def test_an_error_is_raised_after_both_threads_stopped(fan):
    done = []
    running = threading.Event()

    def work(i):
        if i == 3:
            raise ValueError("page 3")
        running.set()
        time.sleep(0.005)
        done.append(i)

    with pytest.raises(ValueError, match="page 3"):
        fan.run(work, list(range(100)), MIN_BYTES)
    finished = len(done)
    time.sleep(0.05)
    assert len(done) == finished < 100  # nothing runs on after run() returned


def test_a_busy_helper_is_not_waited_for(fan):
    release = threading.Event()
    started = threading.Event()

    def slow(i):
        started.set()
        release.wait(5)

    other = threading.Thread(target=fan.run, args=(slow, [0, 1], MIN_BYTES))
    other.start()  # the helper or its caller is stuck in ``slow`` ...
    started.wait(5)
    time.sleep(0.05)
    t = time.monotonic()
    out = []
    fan.run(out.append, list(range(10)), MIN_BYTES)  # ... this batch does not wait for them
    assert time.monotonic() - t < 1.0 and sorted(out) == list(range(10))
    release.set()
    other.join(5)
