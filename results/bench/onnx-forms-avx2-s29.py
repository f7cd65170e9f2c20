# usage: export models/rst_cnn_fb.pt to /tmp/s29/rst_fp32.onnx (python export/to_onnx.py models/rst_cnn_fb.pt -o ...) and with --quarter-turns to /tmp/s29/rst_qt.onnx, then
# python results/bench/onnx-forms-avx2-s29.py (jemalloc preloaded): the exported forms through serve.Classifier at batches 1 and 6
import time, statistics, numpy as np
from rstcnn.serve import Classifier
cl = {"fp32": Classifier.from_onnx("/tmp/s29/rst_fp32.onnx"), "qt fp32": Classifier.from_onnx("/tmp/s29/rst_qt.onnx"), "int8": Classifier.from_onnx("models/rst_cnn_fb.int8.onnx"),
      "cnn int8": Classifier.from_onnx("models/cnn.int8.onnx")}
for b in (1, 6):
    x = np.random.default_rng(0).normal(size=(b, 1, 56, 56)).astype(np.float32)
    for name, c in cl.items():
        c.run_logits(x); ts = []
        for _ in range(5 if b == 1 else 3):
            s = time.perf_counter(); c.run_logits(x); ts.append(time.perf_counter() - s)
        print(f"batch {b} {name}: {statistics.median(ts)*1e3:.1f} ms")
