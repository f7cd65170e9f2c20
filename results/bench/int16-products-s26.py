"""The twenty-sixth session's int16 products (``native.word_rows_product``) against the float32
kernel (``native.joined_rows_product``), on a CPU with the portable (AVX2) build:

1. the kernels alone at the shipped model's product shapes (F frequencies, M rows = 4 turned
   copies per image, K input and N output channels), the forms taking turns, medians;
2. the shipped model's eval forward in float32 and in ``inference("int16")``, taking turns in
   one process, at batches 1, 8 and 22 (22: a stability sweep's images per model), with the
   time the products took inside each (a timing wrapper around the two kernels) and the
   largest logit difference.

    python results/bench/int16-products-s26.py   (jemalloc preloaded, as the app runs)
"""

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alternate_s13 import run  # noqa: E402

from rstmodel import load_checkpoint  # noqa: E402
from rstmodel.layers import native  # noqa: E402
from rstmodel.precision import inference  # noqa: E402

SHAPES = [(960, 88, 69, 135), (462, 88, 135, 204), (960, 32, 69, 135), (960, 4, 69, 135)]


def kernels() -> None:
    print("| F x M x K x N | float32 ms | int16 ms | int16 / float32 | int16 G multiply-adds/s |")
    print("|---|---|---|---|---|")
    for f, m, k, n in SHAPES:
        torch.manual_seed(0)
        x_re, x_im = torch.randn(f, m, k), torch.randn(f, m, k)
        g_re, g_im = torch.randn(f, k, n), torch.randn(f, k, n)
        joined, words = native.pack_joined(g_re, g_im), native.pack_words(g_re, g_im)
        f32 = functools.partial(native.joined_rows_product, x_re, x_im, joined, n)
        i16 = functools.partial(native.word_rows_product, x_re, x_im, words, n)
        t = run({"f32": f32, "i16": i16}, rounds=9)
        macs = 4 * f * m * k * n
        print(
            f"| {f} x {m} x {k} x {n} | {t['f32'] * 1e3:.2f} | {t['i16'] * 1e3:.2f} | "
            f"{t['i16'] / t['f32']:.2f} | {macs / t['i16'] / 1e9:.0f} |"
        )


def model() -> None:
    net, meta = load_checkpoint(Path(__file__).resolve().parents[2] / "models" / "rst_cnn_fb.pt")
    net.eval()
    spent = {"products": 0.0}
    for name in ("joined_rows_product", "word_rows_product"):
        fn = getattr(native, name)

        def timed(*args, fn=fn, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent["products"] += time.perf_counter() - start
            return out

        setattr(native, name, timed)
    print(
        "\n| batch | float32 ms (products) | int16 ms (products) | int16 / float32 | max logit diff |"
    )
    print("|---|---|---|---|---|")
    for batch in (1, 8, 22):
        x = torch.randn(batch, meta.in_channels, meta.input_size, meta.input_size)
        out, prod = {}, {}

        def call(precision, x=x, out=out, prod=prod):
            spent["products"] = 0.0
            with inference(precision):
                out[precision] = net(x)
            prod.setdefault(precision, []).append(spent["products"])

        forms = {p: functools.partial(call, p) for p in ("fp32", "int16")}
        t = run(forms, rounds=5)
        p = {k: sorted(v)[len(v) // 2] for k, v in prod.items()}
        diff = (out["int16"] - out["fp32"]).abs().max().item()
        print(
            f"| {batch} | {t['fp32'] * 1e3:.0f} ({p['fp32'] * 1e3:.0f}) | "
            f"{t['int16'] * 1e3:.0f} ({p['int16'] * 1e3:.0f}) | {t['int16'] / t['fp32']:.2f} | "
            f"{diff:.4f} |"
        )


if __name__ == "__main__":
    if not native.word_rows_built():
        sys.exit(f"no int16 products here ({native.build_name()})")
    print(f"{native.build_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    kernels()
    model()
