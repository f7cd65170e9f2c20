"""Issue 13, session of 2026-12-06: the FFT form's per-frequency products at batch 1 with the
filter spectra as the left operand. onnxruntime's float32 MatMul packs its right operand, so
``x rows [F, 8, Cin] @ W [F, Cin, 2 Cout]`` (the layout ``export.floor_bench --products``
times) packs every weight once per image, while ``W^T [F, 2 Cout, Cin] @ x columns [F, Cin,
8]`` packs only the image's 8 rows (4 quarter turns, real and imaginary). Random values at
the shipped model's shapes; the two forms' results are compared, and timed taking turns.

    python results/bench/products-transposed-2026-12-06.py
"""
import time, numpy as np, onnxruntime as ort
from onnx import helper, numpy_helper, TensorProto
def sess(nodes, xs, inits):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    o = ort.SessionOptions(); o.intra_op_num_threads = 2
    return ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(), o, providers=["CPUExecutionProvider"])
def timed(s, x, n=7):
    s.run(None, {"x": x}); t=[]
    for _ in range(n):
        a=time.perf_counter(); s.run(None, {"x": x}); t.append(time.perf_counter()-a)
    return np.median(t)
rng = np.random.default_rng(0)
for name, F, cin, cout in [("layer 2", 5040, 69, 135), ("layer 3", 1848, 135, 204)]:
    W = (0.05*rng.standard_normal((F, cin, 2*cout))).astype(np.float32)
    X = rng.standard_normal((F, 8, cin)).astype(np.float32)
    s_rows = sess([helper.make_node("MatMul", ["x", "w"], ["y"])], X.shape, [numpy_helper.from_array(W, "w")])
    WT = np.ascontiguousarray(W.transpose(0, 2, 1)); XT = np.ascontiguousarray(X.transpose(0, 2, 1))
    s_cols = sess([helper.make_node("MatMul", ["w", "x"], ["y"])], XT.shape, [numpy_helper.from_array(WT, "w")])
    y1 = s_rows.run(None, {"x": X})[0]; y2 = s_cols.run(None, {"x": XT})[0]
    assert np.allclose(y1, y2.transpose(0, 2, 1), atol=1e-4)
    a, b = [], []
    for _ in range(3):
        a.append(timed(s_rows, X)); b.append(timed(s_cols, XT))
    mb = W.nbytes/1e6
    print(f"{name}: weights {mb:.0f} MB; x rows against W {min(a)*1e3:.1f} ms ({mb/min(a)/1e3:.1f} GB/s); W^T against x columns {min(b)*1e3:.1f} ms ({mb/min(b)/1e3:.1f} GB/s)", flush=True)
