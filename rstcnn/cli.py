"""The console commands (``[project.scripts]`` in pyproject.toml). Each first re-executes
itself with the retaining heap (``RSTCNN_ALLOCATOR``, ``rstcnn.train.runtime``), then imports
what it runs: this module imports nothing heavy, so the re-exec costs one Python start, not
a second import of torch."""

from __future__ import annotations

import os

from rstcnn.train.runtime import JEMALLOC_CONF, run_main

__all__ = ["train", "reproduce", "export", "serve"]


def train() -> None:
    """``rstcnn-train`` (and ``python train/run.py``); under torchrun, whose agent watches the
    process, no re-exec."""
    run_main("rstcnn.train.run", reexec="WORLD_SIZE" not in os.environ)


def reproduce() -> None:
    """``rstcnn-reproduce`` (and ``python train/reproduce.py``): the paper's protocol, hours
    of training; on glibc's heap a bfloat16 epoch's training took 1.7x as long."""
    run_main("rstcnn.train.reproduce")


def export() -> None:
    """``rstcnn-export`` (and ``python export/to_onnx.py``)."""
    run_main("rstcnn.export.to_onnx")


def serve() -> None:
    """``rstcnn-serve`` (and ``python serve/app.py``): a server's working set is one sweep's,
    and a sweep that reuses its memory instead of faulting in fresh pages is ~1.2x faster
    (BENCHMARKS.md); jemalloc with two arenas, as glibc was told before it (the app gives
    back what it keeps after start-up and after its gallery sweeps: ``serve.memory``)."""
    run_main("rstcnn.serve.app", jemalloc_conf=JEMALLOC_CONF + ",narenas:2")
