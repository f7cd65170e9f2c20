"""The batch-1 complex products of rst_cnn_fb's two group layers (quarter turns shared: 4 rows
per frequency), torch's joined form (cat, bmm, combine) against the compiled kernel on packed
spectra, taking turns (alternate_s13.run), float32, torch's threads. Usage (jemalloc
preloaded): python results/bench/products-s14.py"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from alternate_s13 import run  # noqa: E402

from rstmodel.layers import native  # noqa: E402
from rstmodel.layers.kernels import joined_complex_product  # noqa: E402

torch.manual_seed(0)
# frequencies: the four scales' grids (30, 31, 33, 35 for layer 2 at 28x28; 16, 17, 19, 21
# for layer 3 at 14x14), half-plane along W, two base rotations
for name, freqs, cin, cout in (("layer 2", 4334, 69, 135), ("layer 3", 1436, 135, 204)):
    x_re, x_im = torch.randn(2, freqs, 4, cin).unbind(0)
    g_re, g_im = torch.randn(2, freqs, cin, cout).unbind(0)
    joined, packed = torch.cat([g_re, g_im], 2), native.pack_joined(g_re, g_im)
    diff = (
        joined_complex_product(x_re, x_im, joined)
        - native.joined_rows_product(x_re, x_im, packed, cout)
    ).abs().max().item()
    t = run(
        {
            "torch": lambda: joined_complex_product(x_re, x_im, joined),
            "kernel": lambda: native.joined_rows_product(x_re, x_im, packed, cout),
        },
        rounds=9,
    )
    mb = joined.numel() * 4 / 1e6
    print(
        f"{name}: spectra {mb:.0f} MB; torch {t['torch'] * 1e3:.1f} ms "
        f"({mb / t['torch'] / 1e3:.1f} GB/s), kernel {t['kernel'] * 1e3:.1f} ms "
        f"({mb / t['kernel'] / 1e3:.1f} GB/s), kernel / torch {t['kernel'] / t['torch']:.2f}, "
        f"max |diff| {diff:.1e}"
    )
