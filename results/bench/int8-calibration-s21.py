"""int8 calibration variants of the shipped RST-CNN's file, against float32 on the gate's images.

    python export/to_onnx.py models/rst_cnn_fb.pt -o /tmp/rst/rst_cnn_fb.onnx
    python results/bench/int8-calibration-s21.py [CALIBRATION_IMAGES]
"""

import sys
import time
from collections import defaultdict

import numpy as np

import rstcnn.export.precision as P
from rstcnn.export.onnx_export import data_sample
from rstcnn.export.to_onnx import _normalised
from rstmodel.checkpoint import load_checkpoint

_, meta = load_checkpoint("models/rst_cnn_fb.pt")
x, y = data_sample(meta, 1000, labels=True)
x = _normalised(x, meta)
cal = _normalised(
    data_sample(meta, int(sys.argv[1]) if len(sys.argv) > 1 else 256, split="train"), meta
)
src = "/tmp/rst/rst_cnn_fb.onnx"
ref = P._logits(P._session(src), x)
print(f"float32 {100 * (ref.argmax(1) == y).mean():.2f} %", flush=True)
minmax = P._shared_ranges


def quantile_ranges(q):
    """Ranges from each batch's q and 1 - q quantiles (widened to hold 0), averaged over the
    batches, shared in groups as the min-max ranges are."""

    def ranges(prepared, batches, groups):
        lo, hi = defaultdict(list), defaultdict(list)
        for values in P._conv_activations(prepared, batches, groups):
            for n, v in values.items():
                a, c = np.quantile(v.ravel(), [q, 1 - q])
                lo[n].append(min(0.0, a))
                hi[n].append(max(0.0, c))
        mean = lambda d: {n: float(np.mean(v)) for n, v in d.items()}  # noqa: E731
        return P._share_in_groups(groups, mean(lo), mean(hi))

    return ranges


for name, fn in [
    ("minmax", minmax),
    ("q1e-5", quantile_ranges(1e-5)),
    ("q1e-4", quantile_ranges(1e-4)),
    ("q1e-3", quantile_ranges(1e-3)),
]:
    t = time.time()
    P._shared_ranges = fn
    dst = f"/tmp/calib/{name}.onnx"
    P.convert(src, dst, "int8", calibration=cal)
    out = P._logits(P._session(dst), x)
    print(
        f"{name}: {100 * (out.argmax(1) == y).mean():.2f} % agreement {100 * (out.argmax(1) == ref.argmax(1)).mean():.1f} % "
        f"max|d| {np.abs(out - ref).max():.3f} mean|d| {np.abs(out - ref).mean():.4f} ({time.time() - t:.0f} s)",
        flush=True,
    )
