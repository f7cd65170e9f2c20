"""Eighteenth session: the float32 training step's per-frequency products (torch.bmm, the
step's largest share in a torch.profiler run: 11.5 of 21.7 s) at the shipped model's
training shapes (batch 128: 512 rows = the quarter turns of 128 images), forward and both
gradients, against one large sgemm and the same products in bfloat16.

    python results/bench/train-products-rate-s18.py   (jemalloc, retaining MALLOC_CONF)
"""

import time

import torch


def best(fn, n: int = 3) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    print(f"sgemm 4096^3: {4096**3 / best(lambda: a @ b) / 1e9:.1f} G multiply-adds/s")
    a, b = a.bfloat16(), b.bfloat16()
    print(f"bf16 gemm 4096^3: {4096**3 / best(lambda: a @ b) / 1e9:.1f} G multiply-adds/s")
    for f, m, k, n in ((5040, 512, 69, 135), (1848, 512, 135, 204)):  # layer 2, layer 3
        x, w, g = torch.randn(f, m, k), torch.randn(f, k, n), torch.randn(f, m, n)
        xb, wb = x.bfloat16(), w.bfloat16()
        cases = {
            "forward x @ w": lambda: torch.bmm(x, w),
            "grad x: g @ w^T": lambda: torch.bmm(g, w.transpose(1, 2)),
            "grad w: x^T @ g": lambda: torch.bmm(x.transpose(1, 2), g),
            "forward, bfloat16": lambda: torch.bmm(xb, wb),
        }
        for name, fn in cases.items():
            sec = best(fn)
            print(
                f"[{f}, {m}, {k}] x [{k}, {n}] {name:18s} {1e3 * sec:7.1f} ms "
                f"{f * m * k * n / sec / 1e9:6.1f} G/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
