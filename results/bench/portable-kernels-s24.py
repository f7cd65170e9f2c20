"""The portable (AVX2) kernels against torch's forms at the shipped model's shapes, and the
register groups they are built with (twenty-fourth session, BENCHMARKS.md).

    python results/bench/portable-kernels-s24.py   # on a CPU with AVX2 and FMA

Builds ``_joined_rows_portable.c`` with GROUP (rows of the products) and HGROUP (halves of
the pooled mixing) of (2, 2), (3, 3) and (4, 2), and times, median of 20 calls, 2 threads:
``joined_rows_product`` against ``kernels.joined_complex_product`` (torch.bmm) at the
group convolutions' per-frequency shapes (F frequencies, M = 4 x batch rows, K inputs, N
outputs), and the lifting layer's pooled mixing at batch 1.
"""

import ctypes
import functools
import subprocess

import torch

from rstcnn.export.bench import time_call
from rstmodel.layers import native
from rstmodel.layers.kernels import joined_complex_product

torch.set_num_threads(2)
SRC = "rstmodel/layers/_joined_rows_portable.c"
libs = {}
for g, hg in [(2, 2), (3, 3), (4, 2)]:
    out = f"/tmp/portable-{g}{hg}.so"
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-fopenmp"]
    subprocess.run(["gcc", *flags, f"-DGROUP={g}", f"-DHGROUP={hg}", "-o", out, SRC], check=True)
    lib = ctypes.CDLL(out)
    lib.joined_rows_product.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
    lib.pooled_mix_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 8
    libs[(g, hg)] = lib


def ms(fn, n=20):
    """Median milliseconds of n calls after a warm-up (export.bench's timer)."""
    return time_call(fn, n) * 1e3


for f, m, k, n in [
    (1122, 4, 69, 135),
    (1122, 8, 69, 135),
    (1122, 16, 69, 135),
    (380, 32, 135, 204),
    (1122, 32, 69, 135),
]:
    x_re, x_im = torch.randn(2, f, m, k).unbind(0)
    g_re, g_im = torch.randn(2, f, k, n).unbind(0)
    packed, joined = native.pack_joined(g_re, g_im), torch.cat([g_re, g_im], 2)
    x = torch.cat([x_re, x_im], 1).contiguous()
    y = x.new_empty(2, f, m, n)
    torch_ms = ms(functools.partial(joined_complex_product, x_re, x_im, joined))
    row = [f"F{f} M{m} K{k} N{n}: torch {torch_ms:.2f} ms"]
    for (g, _), lib in libs.items():
        args = (x.data_ptr(), packed.data_ptr(), y.data_ptr(), f, m, k, n, 2)
        row.append(f"G{g} {ms(lambda lib=lib, args=args: lib.joined_rows_product(*args)):.2f}")
    print(", ".join(row))

h, w, kk, cout, sets = 56, 56, 12, 69, 8  # the lifting layer at batch 1 (8 rotations)
resp, a, bias = torch.randn(h, w * 4, kk), torch.randn(sets, cout, kk), torch.randn(cout)
row = []
real = native._library
for (_, hg), lib in libs.items():
    native._library = lambda lib=lib: lib
    row.append(f"HG{hg} {ms(lambda: native._pooled_mix(resp, a, bias, True, w, argmax=False)):.2f}")
native._library = real
print("pooled mix", tuple(resp.shape), ", ".join(row), "ms")
