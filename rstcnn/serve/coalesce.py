"""Join concurrent calls of a one-at-a-time backend into one batch.

The eager torch engine (``serve.eager``) runs one call at a time, and its cost per image
falls with the batch (on this project's CPU, in bfloat16: ~90 ms for one image, ~40 ms per
image in a batch of eight; BENCHMARKS.md). So when eight clients each ask for one image, it
pays to run their images together rather than one after another. ``Coalescer(run)`` is a
drop-in for ``run``: a call that finds the backend busy waits, and the first waiting caller
to find it free runs every call waiting by then, oldest first, as one batch of up to
``max_images`` images, and hands each caller its own rows. No thread of its own. Under a
steady load the callers of one run send their next calls just after it ends, and the first of
them would find the engine idle and run alone; ``linger`` (seconds) lets a run that starts
within that time of the last one wait that long for more calls, until as many images wait
as were in flight when the last run ended (those waiting then, and the last run's, whose
callers are coming back; at most ``max_images``): eight steady clients run in eights without
waiting out the linger each time. A lone caller on an idle engine runs at once.

A call larger than ``max_images`` (a stability sweep, say) runs alone. When a joined batch
fails, each of its calls runs again alone, so an error reaches only the caller it belongs to.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

__all__ = ["Coalescer"]


class _Call:
    __slots__ = ("batch", "done", "error", "result")

    def __init__(self, batch: np.ndarray):
        self.batch = batch
        self.done = False
        self.result: np.ndarray | None = None
        self.error: BaseException | None = None


class Coalescer:
    """``run`` (a float32 ``[N, ...]`` batch -> ``[N, ...]`` outputs, one call at a time),
    with the calls that wait for it joined into batches of up to ``max_images`` images."""

    def __init__(
        self, run: Callable[[np.ndarray], np.ndarray], max_images: int = 16, linger: float = 0.0
    ):
        if max_images < 1 or linger < 0:
            raise ValueError(f"need max_images >= 1 and linger >= 0, got {max_images}, {linger}")
        self._run, self.max_images, self.linger = run, max_images, linger
        self._cond = threading.Condition()
        self._waiting: deque[_Call] = deque()
        self._busy = False
        self._last_end = -1e9  # when the last run ended (time.monotonic)
        self._in_flight = 0  # images waiting or just answered when the last run ended
        self.batches: deque[int] = deque(maxlen=1024)  # calls per recent run (tests, logs)

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        call = _Call(batch)
        with self._cond:
            self._waiting.append(call)
            self._cond.notify_all()  # a lingering runner may take it
            while True:
                while self._busy and not call.done:
                    self._cond.wait()
                if call.done:
                    return self._outcome(call)
                self._busy = True
                self._linger()
                group = self._take()
                self._cond.release()
                try:
                    self._run_group(group)
                finally:
                    for c in group:  # interrupted (KeyboardInterrupt, ...): nobody waits on
                        if not c.done:
                            c.error = RuntimeError("the batch this call was joined to stopped")
                            c.done = True
                    self._cond.acquire()
                    self._busy, self._last_end = False, time.monotonic()
                    # the callers answered now are likely to call again at once
                    self._in_flight = sum(len(c.batch) for c in (*self._waiting, *group))
                    self._cond.notify_all()

    def _linger(self) -> None:
        """Under load (a run ended within the last ``linger`` seconds, so its callers are
        likely sending their next calls now), wait up to ``linger`` seconds for more calls
        before running, while fewer images wait than were in flight when the last run ended
        (capped at ``max_images``). A lone caller on an idle engine runs at once. Called with
        the lock held."""
        if self.linger <= 0 or time.monotonic() - self._last_end > self.linger:
            return
        deadline = time.monotonic() + self.linger
        want = min(self.max_images, self._in_flight)
        while sum(len(c.batch) for c in self._waiting) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _take(self) -> list[_Call]:
        """The oldest waiting call and the ones after it while the images fit."""
        group = [self._waiting.popleft()]
        images = len(group[0].batch)
        while self._waiting and images + len(self._waiting[0].batch) <= self.max_images:
            images += len(self._waiting[0].batch)
            group.append(self._waiting.popleft())
        return group

    def _run_group(self, group: list[_Call]) -> None:
        self.batches.append(len(group))
        try:
            if len(group) == 1:
                outputs = [self._run(group[0].batch)]
            else:
                joined = self._run(np.concatenate([c.batch for c in group]))
                ends = np.cumsum([len(c.batch) for c in group])[:-1]
                outputs = np.split(joined, ends)
        except Exception as err:
            if len(group) == 1:
                group[0].error, group[0].done = err, True
            else:  # whose was it? each call again alone, so an error stays its caller's
                for c in group:
                    self._run_group([c])
            return
        for c, out in zip(group, outputs, strict=True):
            c.result, c.done = out, True

    @staticmethod
    def _outcome(call: _Call) -> np.ndarray:
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result
