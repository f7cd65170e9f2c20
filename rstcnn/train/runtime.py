"""Process set-up for the command-line entry points.

The RST models allocate GB-sized activations every step. glibc serves such blocks with
mmap and unmaps them on free, so every step the kernel faults in and zeroes tens of GB of
fresh pages: on 2 cores that was 3/4 of a training step (48.9 s vs 11.9 s at batch 64 for
``rst_cnn_fb``; see BENCHMARKS.md). ``RSTCNN_ALLOCATOR`` picks a heap that keeps freed
memory for reuse; ``use_retaining_allocator`` then re-executes the process once with it:

- ``jemalloc`` (the default where the library is found): preload jemalloc (Debian
  ``libjemalloc2``, which ``scripts/setup.sh`` installs; ``RSTCNN_JEMALLOC`` may name the
  library file) with page purging off (``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1``
  unless ``MALLOC_CONF`` is set). ``python -m rstcnn.train.model_bench`` for ``rst_cnn_fb``
  at batch 128 (2 cores; BENCHMARKS.md, "Issue 13, twelfth session"): training step 22.3 s instead of 36.9 s, eval 6.8 s
  instead of 11.5 s, at an 11.6 GiB peak instead of 8.8 GiB (the plain CNN: 0.58 s against
  0.67 s and 0.98 GiB both ways).
- ``hugepages`` (the fallback without jemalloc): glibc is asked to back its large blocks with
  transparent huge pages (``glibc.malloc.hugetlb=1``, glibc >= 2.35, THP in ``madvise`` or
  ``always`` mode; elsewhere the tunable is ignored): the pages are still faulted in fresh
  every step, but 512x fewer of them, at the default allocator's peak. The choice where
  memory is tighter than time.
- ``retain``: glibc told not to mmap or trim. As fast as jemalloc, but its heap fragments:
  at batch 128 the full model outgrew 24 GB.
- ``system`` leaves the process alone.

The retaining heap was opt-in for training while the full step peaked at 21.1 GiB with it
(15.8 GiB without); the step's temporaries have shrunk since, and the 1.6x it buys now
costs 2.8 GiB, so it is the default of every CLI. The web app (``serve/app.py``) asks for it
with two arenas and ``serve.memory.release_free_memory`` once its start-up checks are done
and again after its gallery sweeps: a server's working set is one sweep's, bounded.
"""

from __future__ import annotations

import ctypes.util
import functools
import importlib
import logging
import os
import platform
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "use_retaining_allocator",
    "run_main",
    "RETAINING_TUNABLES",
    "HUGEPAGE_TUNABLES",
    "JEMALLOC_CONF",
    "find_jemalloc",
    "user_errors",
]

log = logging.getLogger(__name__)

# no mmap for large blocks (they come from the heap and stay there after free), no trimming
RETAINING_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
# never give dirty pages back to the kernel
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
# large malloc blocks on transparent huge pages (madvise)
HUGEPAGE_TUNABLES = "glibc.malloc.hugetlb=1"


def find_jemalloc() -> str | None:
    """The jemalloc library to preload: ``$RSTCNN_JEMALLOC`` if set (a path, which must
    exist), else what the dynamic loader finds (e.g. ``libjemalloc.so.2``), else None."""
    explicit = os.environ.get("RSTCNN_JEMALLOC")
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    return ctypes.util.find_library("jemalloc")


def _reexec(env: dict[str, str]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def use_retaining_allocator(default: str = "jemalloc", jemalloc_conf: str = JEMALLOC_CONF) -> None:
    """Per ``RSTCNN_ALLOCATOR`` (unset: ``default``), re-exec this process (same interpreter
    and arguments) once: ``jemalloc`` or ``retain`` with a retaining heap, ``hugepages`` with
    glibc's huge-page tunable; ``system`` (or anything else): nothing. No re-exec when the
    process already runs that way or the platform lacks it; a jemalloc the user preloaded
    gets ``jemalloc_conf`` unless a ``MALLOC_CONF`` is set. Where jemalloc is asked for and
    missing: a warning when the user asked, else (a CLI's default) the huge-page tunable.
    Call it first thing in a CLI, best before its heavy imports (``run_main``)."""
    asked = os.environ.get("RSTCNN_ALLOCATOR", "").lower()
    mode = asked or default
    if mode not in ("retain", "jemalloc", "hugepages") or platform.system() != "Linux":
        return
    env = dict(os.environ)
    if mode == "jemalloc":
        if "jemalloc" in env.get("LD_PRELOAD", ""):
            # preloaded by the user: without a MALLOC_CONF jemalloc would hand freed pages
            # back and fault them in again (a training step 1.7x slower here)
            if "MALLOC_CONF" not in env:
                env["MALLOC_CONF"] = jemalloc_conf
                log.debug("re-executing with MALLOC_CONF=%s", jemalloc_conf)
                _reexec(env)
            return
        lib = find_jemalloc()
        if lib is None and not asked:
            log.info("no jemalloc library found: glibc's huge-page tunable instead")
            mode = "hugepages"
        elif lib is None:
            log.warning(
                "RSTCNN_ALLOCATOR=jemalloc but no jemalloc library was found: running with "
                "the default allocator (install it: apt-get install libjemalloc2, or set "
                "RSTCNN_JEMALLOC=/path/to/libjemalloc.so.2)"
            )
            return
        else:
            env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
            env.setdefault("MALLOC_CONF", jemalloc_conf)
            log.debug("re-executing with LD_PRELOAD=%s", env["LD_PRELOAD"])
            _reexec(env)
    if platform.libc_ver()[0] != "glibc":
        return
    tunables = RETAINING_TUNABLES if mode == "retain" else HUGEPAGE_TUNABLES
    current = env.get("GLIBC_TUNABLES", "")
    if tunables in current:
        return
    env["GLIBC_TUNABLES"] = ":".join(part for part in (current, tunables) if part)
    log.debug("re-executing with GLIBC_TUNABLES=%s", env["GLIBC_TUNABLES"])
    _reexec(env)


def run_main(module: str, reexec: bool = True, **allocator: str) -> NoReturn:
    """A command's whole life: re-exec with the retaining heap (``use_retaining_allocator``,
    its keywords ``allocator``; not when ``reexec`` is false), then import ``module`` and exit
    with what its ``main()`` returns. Called before anything heavy is imported (from the
    console commands in ``rstcnn.cli``, and at the top of a command's own file when it runs as
    a script), the re-exec costs one Python start instead of a second import of torch and
    the rest (~6 s of a 13 s ``rstcnn-train --help`` on the project's CPU)."""
    if reexec:
        use_retaining_allocator(**allocator)
    sys.exit(importlib.import_module(module).main())


def user_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command's ``main(argv)``: what a user can mend (a missing or unreadable
    checkpoint, a missing data source or folder) ends it with one ``error: ...`` line that
    says what to do, and exit status 2, instead of a traceback."""

    @functools.wraps(main)
    def guarded(argv: list[str] | None = None) -> int:
        from rstmodel.checkpoint import CheckpointError
        from rstmodel.data.sources import SourceNotFoundError

        try:
            return main(argv)
        except (FileNotFoundError, CheckpointError, SourceNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return guarded
