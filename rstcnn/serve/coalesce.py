"""Join concurrent calls of a one-at-a-time backend into one batch.

The eager torch engine (``serve.eager``) runs one call at a time, and its cost per image
falls with the batch (on this project's CPU, in bfloat16: ~90 ms for one image, ~40 ms per
image in a batch of eight; BENCHMARKS.md). So when eight clients each ask for one image, it
pays to run their images together rather than one after another. ``Coalescer(run)`` is a
drop-in for ``run``: a call that finds the backend busy waits, and the first waiting caller
to find it free runs every call waiting by then, oldest first, as one batch of up to
``max_images`` images, and hands each caller its own rows. No thread of its own, no timer:
a lone caller runs at once, as before.

A call larger than ``max_images`` (a stability sweep, say) runs alone. When a joined batch
fails, each of its calls runs again alone, so an error reaches only the caller it belongs to.
"""

from __future__ import annotations

import threading
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

    def __init__(self, run: Callable[[np.ndarray], np.ndarray], max_images: int = 16):
        if max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {max_images}")
        self._run, self.max_images = run, max_images
        self._cond = threading.Condition()
        self._waiting: deque[_Call] = deque()
        self._busy = False
        self.batches: list[int] = []  # calls per backend run, for tests and the log

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        call = _Call(batch)
        with self._cond:
            self._waiting.append(call)
            while True:
                while self._busy and not call.done:
                    self._cond.wait()
                if call.done:
                    return self._outcome(call)
                self._busy = True
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
                    self._busy = False
                    self._cond.notify_all()

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
