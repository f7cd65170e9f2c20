"""What narrower integer products would cost the shipped RST-CNN in accuracy, before any
kernel is built: ``train/precision_check.py --precision int16`` with the int16 products
replaced by the same computation in torch at ROWS levels for each frequency's rows and
SPECTRUM levels for the filter spectra (the integer products summed exactly, the scales as
the kernels apply them). 31 / 63 is what AVX2's byte multiply-add can sum four k pairs of in
16 bits (rows offset into 1 .. 63, |spectra| <= 63).

    python results/bench/int6-accuracy-s27.py ROWS SPECTRUM models/rst_cnn_fb.pt \\
        --precision int16 --limit 1000 --batch 50
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rstmodel.layers import native  # noqa: E402

ROWS, SPECTRUM = int(sys.argv.pop(1)), int(sys.argv.pop(1))


def pack(g_re, g_im):
    top = torch.maximum(g_re.abs(), g_im.abs()).amax(1, keepdim=True)
    (w_re, sg), (w_im, _) = native._quantize(g_re, top, SPECTRUM), native._quantize(g_im, top, SPECTRUM)
    return w_re, w_im, sg


def product(x_re, x_im, spectra, n, bias=None, dc_rows=0, dc_scale=1.0):
    w_re, w_im, sg = spectra
    top = torch.maximum(x_re.abs(), x_im.abs()).amax(2, keepdim=True)
    (q_re, sx), (q_im, _) = native._quantize(x_re, top, ROWS), native._quantize(x_im, top, ROWS)
    s = sx * sg  # integer sums below 2^24: exact in float32
    y = torch.stack([(q_re @ w_re - q_im @ w_im) * s, (q_im @ w_re + q_re @ w_im) * s])
    return native._with_bias(y, bias, dc_rows, dc_scale)


native.pack_words, native.word_rows_product = pack, product
from rstcnn.train.precision_check import main  # noqa: E402

sys.exit(main())
