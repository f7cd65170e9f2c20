"""int8 calibration variants of the shipped RST-CNN's file, against float32 on the gate's images.

    python export/to_onnx.py models/rst_cnn_fb.pt -o /tmp/rst/rst_cnn_fb.onnx
    python results/bench/int8-calibration-s21.py [CALIBRATION_IMAGES]
"""

import sys
import time

import numpy as np
import onnx

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
    def ranges(prepared, batches, groups):
        import onnxruntime as ort

        model = onnx.load(str(prepared))
        sides = [(n.input[0], n.output[0]) for nodes in groups.values() for n in nodes]
        names = sorted({name for pair in sides for name in pair})
        known = {o.name for o in model.graph.output}
        model.graph.output.extend(
            onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
            for n in names
            if n not in known
        )
        s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        lo = {n: [] for n in names}
        hi = {n: [] for n in names}
        for b in batches:
            for n, v in zip(names, s.run(names, {P.INPUT: b}), strict=True):
                a, c = np.quantile(v.ravel(), [q, 1 - q])
                lo[n].append(min(0.0, a))
                hi[n].append(max(0.0, c))
        out = {}
        for nodes in groups.values():
            for side in (0, 1):
                members = [(n.input[0], n.output[0])[side] for n in nodes]
                shared = {
                    "rmin": np.float32(min(np.mean(lo[m]) for m in members)),
                    "rmax": np.float32(max(np.mean(hi[m]) for m in members)),
                }
                out.update((m, [dict(shared)]) for m in members)
        return out

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
