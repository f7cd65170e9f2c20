"""Eighteenth session: the training-mode batch norm (``_RowBatchNorm``, forward and backward)
at rst_cnn_fb's three training shapes (batch 128: [H W R S B, C] rows), its statistics by
the compiled one-pass kernel (``native.column_stats``) and by the chunked torch form, taking
turns in one process; float32 and bfloat16.

    python results/bench/batch-norm-s18.py   (jemalloc, retaining MALLOC_CONF)
"""

import time

import torch

from rstmodel.layers import native, norm

SHAPES = ((28 * 28 * 4096, 69), (14 * 14 * 4096, 135), (7 * 7 * 4096, 204))


def best(fn, n: int = 3) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    available = native.column_stats_available
    totals = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rows, c in SHAPES:
            x = torch.randn(rows, c).to(dtype).requires_grad_(True)
            w, b = torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)
            g = torch.randn(rows, c).to(dtype)

            def step(x=x, w=w, b=b, g=g):
                y, _, _ = norm._RowBatchNorm.apply(x, w, b, 1e-5)
                y.backward(g)

            ms = {}
            for form, avail in (("compiled", available), ("torch form", lambda *_: False)):
                native.column_stats_available = avail
                ms[form] = best(step)
                totals[dtype, form] = totals.get((dtype, form), 0) + ms[form]
            native.column_stats_available = available
            print(
                f"[{rows}, {c}] {str(dtype)[6:]:8s} forward + backward: compiled "
                f"{ms['compiled']:6.1f} ms, torch form {ms['torch form']:6.1f} ms",
                flush=True,
            )
    for (dtype, form), ms in totals.items():
        print(f"all three, {str(dtype)[6:]}, {form}: {ms:.0f} ms")


if __name__ == "__main__":
    main()
