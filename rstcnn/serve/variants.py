"""Several exported files of one model (float32, int8 and float16 copies of one checkpoint):
serve the fastest one that may be served.

A file may be served when it computes in float32 (``rstcnn.precision`` absent or ``fp32``) or
when its ``rstcnn.gate`` metadata, written by ``export/to_onnx.py --precision P --check N``,
says it kept its accuracy on N real test images within the gate (0.5 points of float32). A
reduced-precision file without a passing gate is left out, with a log line saying why.

Files of the same checkpoint (the same ``rstcnn.checkpoint_sha256``) compete: each runs one
image (a classification) and the batch a stability request sends it (all sweep steps at
once), once to warm up and then ``repeats`` times each. Before the sweep's batch each runs
a screening batch of ``sqrt(batch)`` images once (after a warm-up), and a file
``CONTENDER_MARGIN`` (1.5x) slower there than the fastest is not run at the sweep's batch:
it cannot win within start-up noise (the eager engine's time per image falls by ~10 % from
6 images to 43, a file's not at all), and on this project's AVX2 CPU the int8 file's sweep
batch costs ~9 s a run against ~2 s for the eager engine. Where one file is left, it is
served without the sweep's batch (the start-up's longest wait); among several, one whose
first timed run there is again 1.5x slower stops there. The one with the smallest median
time at the sweep's batch is served; when another is faster at one image by more than
``ROUTE_MARGIN`` (1.25x), the two are served together (``routed``): calls of up to
``sqrt(batch)`` images go to the one-image winner, larger ones to the sweep's. (On this
project's CPU the eager engine, ``serve.eager``, has won sweeps since the fifth session and
single images too since the tenth, in bfloat16 and since the seventeenth with int8 products,
BENCHMARKS.md.) Files of different checkpoints
are all served, in the order given. With one file per checkpoint nothing is timed.

    python serve/app.py --model m.onnx --model m.int8.onnx --model m.fp16.onnx
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ROUTE_MARGIN", "CONTENDER_MARGIN", "servable", "fastest_variants", "routed"]

# A copy other than the sweep's winner serves single images only when it is this much faster
# at one image. Start-up timings on a shared CPU move by 10-20 %, and the sweep's winner is
# the better choice under concurrent load when it joins concurrent calls into one pass
# (serve.coalesce): in the tenth session a start-up that timed the int8 file 89 ms alone against
# eager bf16's 97 ms routed classifications to the file and served 9.7 req/s, against 24.8
# when eager took them (BENCHMARKS.md, "Issue 13, tenth session").
ROUTE_MARGIN = 1.25
# A copy this much slower than the fastest at the screening batch (sqrt of the sweep's) is not
# run at the sweep's batch, nor one whose first timed run there is this much slower than the
# fastest first run: start-up timings move by 10-20 %, so it cannot be the faster one.
CONTENDER_MARGIN = 1.5

log = logging.getLogger("serve.variants")

_PREFIX = "rstcnn."


def _meta(clf: Any) -> dict[str, Any]:
    meta = getattr(clf, "metadata", None)
    return meta if isinstance(meta, dict) else {}


def servable(clf: Any) -> tuple[bool, str]:
    """Whether ``clf`` may be served, and in words why (or why not)."""
    meta = _meta(clf)
    precision = str(meta.get(_PREFIX + "precision", "fp32"))
    if precision == "fp32":
        return True, "float32"
    gate = meta.get(_PREFIX + "gate")
    if not isinstance(gate, dict):
        return False, f"{precision} without an accuracy check (export it with --check N)"
    drop = gate.get("drop_points", 0.0 if gate.get("passes") else float("nan"))
    change = 0.0 - drop  # not -drop: no change reads "+0.00", not "-0.00"
    if not gate.get("passes"):
        return False, (
            f"{precision} failed its accuracy check: {change:+.2f} "
            f"points on {gate.get('images')} test images (limit -{gate.get('limit_points')})"
        )
    return True, (
        f"{precision}, accuracy check passed ({change:+.2f} points on "
        f"{gate.get('images')} test images)"
    )


def _seconds(classifiers: Sequence[Any], batch: int, repeats: int) -> dict[int, float]:
    """Median seconds of a call of ``batch`` images, per ``id`` of each classifier: each warms
    up (the session's first run allocates and plans) and runs once; those within
    ``CONTENDER_MARGIN`` of the fastest first run run ``repeats - 1`` times more."""

    def timed(clf: Any, x: np.ndarray) -> float:
        start = time.perf_counter()
        clf.run_logits(x)
        return time.perf_counter() - start

    inputs = {id(c): np.zeros((batch, *c.input_size), dtype=np.float32) for c in classifiers}
    runs = {}
    for clf in classifiers:
        clf.run_logits(inputs[id(clf)])  # warm-up
        runs[id(clf)] = [timed(clf, inputs[id(clf)])]
    fastest = min(times[0] for times in runs.values())
    for clf in classifiers:
        if repeats > 1 and runs[id(clf)][0] <= CONTENDER_MARGIN * fastest:
            runs[id(clf)] += [timed(clf, inputs[id(clf)]) for _ in range(repeats - 1)]
    return {key: statistics.median(times) for key, times in runs.items()}


def fastest_variants(
    classifiers: Sequence[Any], batch: int, repeats: int = 3
) -> tuple[list[Any], list[str]]:
    """The classifiers to serve (see the module docstring) and one line per decision.
    Objects without rstcnn metadata (e.g. test doubles) are kept as they are."""
    groups: dict[Any, list[Any]] = {}
    for i, clf in enumerate(classifiers):
        key = _meta(clf).get(_PREFIX + "checkpoint_sha256") or ("unkeyed", i)
        groups.setdefault(key, []).append(clf)
    kept, lines = [], []
    for members in groups.values():
        allowed = []
        for clf in members:
            ok, why = servable(clf)
            if ok:
                allowed.append(clf)
            else:
                lines.append(f"{_label(clf)}: not served, {why}")
        if not allowed:
            lines.append(f"{_label(members[0])}: no servable file of this checkpoint")
            continue
        if len(allowed) == 1:
            kept.append(allowed[0])
            continue
        screen, ones = _seconds(allowed, _small(batch), 1), _seconds(allowed, 1, repeats)
        fastest = min(screen.values())
        contenders = [c for c in allowed if screen[id(c)] <= CONTENDER_MARGIN * fastest]
        times = _seconds(contenders, batch, repeats) if len(contenders) > 1 else {}
        best = min(contenders, key=lambda c: times.get(id(c), 0.0))
        best_one = min(allowed, key=lambda c: ones[id(c)])
        if ones[id(best_one)] * ROUTE_MARGIN > ones[id(best)]:
            best_one = best  # not clearly faster alone: the sweep's winner takes every call
        for clf in allowed:
            verdict = "served" if clf is best else "slower"
            if clf is best_one and best_one is not best:
                verdict = f"served for up to {_small(batch)} images"
            swept = (
                f", {times[id(clf)] * 1e3:.1f} ms per batch of {batch}" if id(clf) in times else ""
            )
            lines.append(
                f"{_label(clf)}: {servable(clf)[1]}, {screen[id(clf)] * 1e3:.1f} ms per batch of "
                f"{_small(batch)}{swept}, {ones[id(clf)] * 1e3:.1f} ms per image alone, {verdict}"
            )
        kept.append(best if best_one is best else routed(best_one, best, _small(batch)))
    for line in lines:
        log.info("%s", line)
    return kept, lines


def _small(batch: int) -> int:
    return max(1, math.isqrt(batch))


def routed(small: Any, large: Any, up_to: int) -> Any:
    """One classifier that runs calls of up to ``up_to`` images with ``small`` and larger
    ones with ``large`` (two files of one checkpoint). It is a copy of ``large`` (its
    metadata, preprocessing and chunking) with the dispatch as its backend."""
    both = copy.copy(large)
    run_small, run_large = small._run, large._run
    both._run = lambda batch: (run_small if len(batch) <= up_to else run_large)(batch)
    both.providers = list(dict.fromkeys([*large.providers, *small.providers]))
    both.source = f"{large.source} (batches over {up_to}), {small.source} (up to {up_to})"
    return both


def _label(clf: Any) -> str:
    source = getattr(clf, "source", None)
    return (
        f"{getattr(clf, 'name', 'model')} ({source})" if source else getattr(clf, "name", "model")
    )
