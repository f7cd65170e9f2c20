"""serve.coalesce: concurrent calls of a one-at-a-time backend joined into batches."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rstcnn.serve.coalesce import Coalescer


class SlowBackend:
    """Doubles its input; one call at a time (asserted), each taking ``seconds``."""

    def __init__(self, seconds: float = 0.05, fail_on: float | None = None):
        self.seconds, self.fail_on = seconds, fail_on
        self.sizes: list[int] = []
        self._inside = threading.Lock()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        assert self._inside.acquire(blocking=False), "two calls ran at once"
        try:
            self.sizes.append(len(batch))
            time.sleep(self.seconds)
            if self.fail_on is not None and (batch == self.fail_on).any():
                raise ValueError(f"cannot take {self.fail_on}")
            return batch * 2
        finally:
            self._inside.release()


def call_together(run, batches):
    """Each batch from its own thread, all started at once; (results, errors) in order."""
    results, errors = [None] * len(batches), [None] * len(batches)
    start = threading.Barrier(len(batches))

    def one(i):
        start.wait()
        try:
            results[i] = run(batches[i])
        except Exception as err:  # noqa: BLE001 - the test inspects it
            errors[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    return results, errors


def test_a_lone_call_runs_at_once_and_unchanged():
    backend = SlowBackend(0.0)
    run = Coalescer(backend, max_images=8)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.testing.assert_array_equal(run(x), x * 2)
    assert backend.sizes == [3] and list(run.batches) == [1]


def test_concurrent_calls_are_joined_and_each_caller_gets_its_own_rows():
    backend = SlowBackend(0.05)
    run = Coalescer(backend, max_images=16)
    batches = [np.full((1, 3), i, dtype=np.float32) for i in range(8)]
    results, errors = call_together(run, batches)
    assert errors == [None] * 8
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got, batches[i] * 2)
    # the first call runs alone; the seven that arrived meanwhile join into fewer runs
    assert sum(backend.sizes) == 8 and len(backend.sizes) < 8
    assert max(backend.sizes) > 1


def test_joined_batches_never_exceed_max_images_and_large_calls_run_alone():
    backend = SlowBackend(0.03)
    run = Coalescer(backend, max_images=4)
    batches = [np.full((n, 2), i, dtype=np.float32) for i, n in enumerate([1, 3, 2, 6, 1, 1])]
    results, errors = call_together(run, batches)
    assert errors == [None] * 6
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got, batches[i] * 2)
    assert sum(backend.sizes) == 14
    assert all(size <= 4 for size in backend.sizes if size != 6)  # 6 > 4 ran on its own
    assert 6 in backend.sizes


def test_an_error_reaches_only_its_own_caller():
    backend = SlowBackend(0.05, fail_on=-1.0)
    run = Coalescer(backend, max_images=16)
    batches = [np.full((1, 2), v, dtype=np.float32) for v in (0, 1, -1, 2, 3)]
    results, errors = call_together(run, batches)
    assert isinstance(errors[2], ValueError) and results[2] is None
    for i in (0, 1, 3, 4):
        assert errors[i] is None
        np.testing.assert_array_equal(results[i], batches[i] * 2)
    with pytest.raises(ValueError, match="cannot take"):
        run(np.full((1, 2), -1.0, dtype=np.float32))
    np.testing.assert_array_equal(run(np.ones((2, 2), np.float32)), 2 * np.ones((2, 2)))


def test_max_images_must_be_positive_and_linger_not_negative():
    with pytest.raises(ValueError, match="max_images"):
        Coalescer(lambda b: b, max_images=0)
    with pytest.raises(ValueError, match="linger"):
        Coalescer(lambda b: b, linger=-1.0)


def closed_loop(run, clients: int, calls: int, think: float) -> None:
    """``clients`` threads, each sending its next one-image call ``think`` s after the
    answer to its last, as HTTP clients under a steady load do."""

    def client(i):
        for _ in range(calls):
            run(np.full((1, 2), i, dtype=np.float32))
            time.sleep(think)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_linger_gathers_a_steady_load_into_fuller_batches():
    sizes = {}
    for linger in (0.0, 0.05):
        backend = SlowBackend(0.03)
        run = Coalescer(backend, max_images=4, linger=linger)
        closed_loop(run, clients=4, calls=6, think=0.005)
        assert sum(backend.sizes) == 24
        sizes[linger] = backend.sizes
    # without lingering, a caller answered first finds the engine idle and runs alone
    assert len(sizes[0.05]) < len(sizes[0.0])
    assert sum(s == 4 for s in sizes[0.05]) > sum(s == 4 for s in sizes[0.0])


def test_a_lone_call_on_an_idle_engine_does_not_linger():
    run = Coalescer(SlowBackend(0.0), max_images=4, linger=0.5)
    run(np.ones((1, 2), np.float32))
    time.sleep(0.6)  # longer than linger since the last run: idle
    start = time.perf_counter()
    run(np.ones((1, 2), np.float32))
    assert time.perf_counter() - start < 0.25


def test_linger_ends_when_the_last_runs_callers_are_back():
    """Three steady clients and room for eight: each run waits for the three, not out the
    linger (1 s a run, 5 s or more in all, if it waited for eight); only the last calls,
    whose partners have stopped, wait it out once."""
    backend = SlowBackend(0.01)
    run = Coalescer(backend, max_images=8, linger=1.0)
    start = time.perf_counter()
    closed_loop(run, clients=3, calls=6, think=0.002)
    assert time.perf_counter() - start < 3.5
    assert sum(backend.sizes) == 18 and backend.sizes.count(3) >= 4
