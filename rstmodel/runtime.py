"""Process set-up for the command-line entry points.

The RST models allocate GB-sized activations every step. glibc serves such blocks with
mmap and unmaps them on free, so every step the kernel faults in and zeroes tens of GB of
fresh pages: on 2 cores that was 3/4 of a training step (48.9 s vs 11.9 s at batch 64 for
``rst_cnn_fb``; see BENCHMARKS.md). With ``RSTCNN_ALLOCATOR=retain``,
``use_retaining_allocator`` re-executes the process once with glibc told to keep freed
memory for reuse. It is opt-in because the heap then fragments: at batch 128 the same
model outgrew 24 GB, where the default allocator peaks at 16 GB.
"""

from __future__ import annotations

import logging
import os
import platform
import sys

__all__ = ["use_retaining_allocator", "RETAINING_TUNABLES"]

log = logging.getLogger(__name__)

# no mmap for large blocks (they come from the heap and stay there after free), no trimming
RETAINING_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


def use_retaining_allocator() -> None:
    """With ``RSTCNN_ALLOCATOR=retain``, re-exec this process (same interpreter and
    arguments) with ``GLIBC_TUNABLES`` set, unless already set or not on glibc. Call it
    first thing in a CLI's main."""
    if os.environ.get("RSTCNN_ALLOCATOR", "").lower() != "retain":
        return
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    current = os.environ.get("GLIBC_TUNABLES", "")
    if RETAINING_TUNABLES in current:
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(part for part in (current, RETAINING_TUNABLES) if part)
    log.debug("re-executing with GLIBC_TUNABLES=%s", env["GLIBC_TUNABLES"])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
