"""The twenty-seventh session's byte products (``native.byte_rows_product``: rows quantized to
6 bits, spectra to 7, AVX2's vpmaddubsw with four k pairs summed exactly in 16 bits) against
the int16 products (``native.word_rows_product``), on a CPU with the portable (AVX2) build;
runs at the commit that built them (``git checkout`` it: the next commit took them out):

1. the kernels at the shipped model's product shapes (F frequencies, M rows, K, N), the
   forms taking turns, medians of 9;
2. one thread, 64 frequencies of 88 rows and 69 input columns, N = 8 / 64 / 136 output
   columns: what a frequency costs besides its products (N = 8 is nearly all quantizing
   the rows and writing the outputs).

    python results/bench/byte-products-s27.py   (jemalloc preloaded, as the app runs)
"""

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alternate_s13 import run  # noqa: E402

from rstmodel.layers import native  # noqa: E402

SHAPES = [(960, 88, 69, 135), (462, 88, 135, 204), (960, 32, 69, 135), (960, 4, 69, 135)]


def kernels() -> None:
    print("| F x M x K x N | int16 ms | bytes ms | bytes / int16 | bytes G multiply-adds/s |")
    print("|---|---|---|---|---|")
    for f, m, k, n in SHAPES:
        torch.manual_seed(0)
        x_re, x_im = torch.randn(f, m, k), torch.randn(f, m, k)
        g_re, g_im = torch.randn(f, k, n), torch.randn(f, k, n)
        words, quads = native.pack_words(g_re, g_im), native.pack_bytes(g_re, g_im)
        t = run(
            {
                "i16": functools.partial(native.word_rows_product, x_re, x_im, words, n),
                "i6": functools.partial(native.byte_rows_product, x_re, x_im, quads, n),
            },
            rounds=9,
        )
        macs = 4 * f * m * k * n
        print(
            f"| {f} x {m} x {k} x {n} | {t['i16'] * 1e3:.2f} | {t['i6'] * 1e3:.2f} | "
            f"{t['i6'] / t['i16']:.2f} | {macs / t['i6'] / 1e9:.0f} |"
        )


def per_frequency() -> None:
    torch.set_num_threads(1)
    f, m, k = 64, 88, 69
    torch.manual_seed(0)
    x_re, x_im = torch.randn(f, m, k), torch.randn(f, m, k)
    print("\n| N (one thread) | int16 us per frequency | bytes us per frequency |")
    print("|---|---|---|")
    for n in (8, 64, 136):
        g_re, g_im = torch.randn(f, k, n), torch.randn(f, k, n)
        words, quads = native.pack_words(g_re, g_im), native.pack_bytes(g_re, g_im)
        cells = []
        for fn in (
            lambda: native.word_rows_product(x_re, x_im, words, n),
            lambda: native.byte_rows_product(x_re, x_im, quads, n),
        ):
            fn()
            start = time.perf_counter()
            for _ in range(50):
                fn()
            cells.append((time.perf_counter() - start) / 50 / f * 1e6)
        print(f"| {n} | {cells[0]:.1f} | {cells[1]:.1f} |")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {native.build_name()}")
    kernels()
    per_frequency()
