"""The FFT path's per-frequency products in float32 eval, all of a layer's frequencies at once
(rst_cnn_fb's layers 2 and 3, quarter turns shared: 4 rows per image): the Gauss form's three
batched GEMMs (kernels._GaussProduct) against the compiled kernel on packed spectra
(rstmodel.layers.native), taking turns (alternate_s13.run). Usage (jemalloc preloaded):
python results/bench/rows-s14.py [ROWS ...]  (default 4 8 32 128 512)"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from alternate_s13 import run  # noqa: E402

from rstmodel.layers import native  # noqa: E402
from rstmodel.layers.kernels import _GaussProduct  # noqa: E402

torch.manual_seed(0)
counts = [int(a) for a in sys.argv[1:]] or [4, 8, 32, 128, 512]
for name, freqs, cin, cout in (("layer 2", 4334, 69, 135), ("layer 3", 1436, 135, 204)):
    g_re, g_im = torch.randn(2, freqs, cin, cout).unbind(0)
    packed, gauss = native.pack_joined(g_re, g_im), (g_re, g_im - g_re, g_re + g_im)
    for rows in counts:
        x_re, x_im = torch.randn(2, freqs, rows, cin).unbind(0)
        ref = _GaussProduct.apply(x_re, x_im, *gauss, None, 0, 1.0)
        got = native.joined_rows_product(x_re, x_im, packed, cout)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        t = run(
            {
                "gauss": lambda: _GaussProduct.apply(x_re, x_im, *gauss, None, 0, 1.0),
                "kernel": lambda: native.joined_rows_product(x_re, x_im, packed, cout),
            },
            rounds=5,
        )
        print(
            f"{name}, {rows} rows: Gauss {t['gauss'] * 1e3:.1f} ms, kernel "
            f"{t['kernel'] * 1e3:.1f} ms, kernel / Gauss {t['kernel'] / t['gauss']:.2f}, "
            f"relative difference {err:.1e}"
        )
