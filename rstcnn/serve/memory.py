"""The server's process memory: glibc told to hand large blocks back, and the pages a
retaining jemalloc keeps (the app's default heap, ``train/runtime.py``) purged after the
start-up, whose checks and timings peak higher than serving does."""

from __future__ import annotations

import ctypes

__all__ = ["release_free_memory", "return_memory_to_the_system"]


def return_memory_to_the_system() -> None:
    """glibc only: hand freed blocks of 1 MB and more straight back to the system, and keep
    two malloc arenas instead of one per thread, so that the server's size falls back
    after a large request instead of growing with every worker thread (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold, m_arena_max = -3, -8  # mallopt parameters, malloc.h
    libc.mallopt(m_mmap_threshold, 1 << 20)
    libc.mallopt(m_arena_max, 2)


def release_free_memory() -> bool:
    """Hand back to the kernel the free pages a retaining jemalloc holds (``mallctl
    arena.<all>.purge``): after a start-up whose peak the steady state does not reach
    again, say. True when it did; False when the process does not run on jemalloc."""
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return False
    mallctl.argtypes = [ctypes.c_char_p] + [ctypes.c_void_p] * 3 + [ctypes.c_size_t]
    return mallctl(b"arena.4096.purge", None, None, None, 0) == 0  # 4096: MALLCTL_ARENAS_ALL
