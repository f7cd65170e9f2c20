"""Issue 13, session of 2026-12-06: can the exported basis form's single-channel banks run
as GEMMs? Layer 2 of the shipped ``rst_cnn_fb`` at batch 1 with quarter turns (552 planes of
28x28, the K = 12 basis of one rotation and scale), in onnxruntime, two exact forms:

- conv: what the exporter writes, a Conv with one input channel and K outputs;
- two GEMMs: every filter row lies in one row space V (``[k, p]``, SVD of all K filters'
  rows, p the rank at 1e-7), so a bank is a MatMul along W by the Toeplitz matrix of V
  (``[W, p*W]``) and one along H by the Toeplitz matrix of each filter's coefficients in V
  (``[K*H, H*p]``, shared by every plane). Both are plain MatMuls.

Prints each filter set's singular values (relative) and the two forms' times, taking turns.

    python results/bench/bank-gemms-2026-12-06.py
"""
import time
import numpy as np
import onnxruntime as ort
from onnx import helper, numpy_helper, TensorProto
from rstmodel.models.registry import create_model

m = create_model("rst_cnn_fb").eval()
layer = m.blocks[1][0]
P, H = 552, 28
rng = np.random.default_rng(0)
x = rng.standard_normal((P, 1, H, H)).astype(np.float32)

def sess(model):
    o = ort.SessionOptions(); o.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])

def timed(s, feed, n=7):
    s.run(None, feed); t = []
    for _ in range(n):
        a = time.perf_counter(); s.run(None, feed); t.append(time.perf_counter() - a)
    return np.median(t)

for s_idx in range(4):
    B = layer.windowed_basis(s_idx)[:, 0].double().numpy()  # [K, k, k] rotation 0
    K, k, _ = B.shape; pad = k // 2
    # conv form
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[pad]*4)], "c",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(B[:, None].astype(np.float32), "w")])
    sc = sess(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    yc = sc.run(None, {"x": x})[0]
    # row space of all filters' rows
    rows = B.reshape(K * k, k)
    u, sv, vt = np.linalg.svd(rows, full_matrices=False)
    p = int((sv > sv[0] * 1e-7).sum())
    print(f"k={k:2d} singular values of the rows: {np.round(sv / sv[0], 4).tolist()}")
    V = vt[:p].T  # [k, p]
    C = B @ V      # [K, k(dh), p]
    M1 = np.zeros((H, p, H))  # [w, i, w']
    for wp in range(H):
        for dw in range(k):
            w = wp + dw - pad
            if 0 <= w < H: M1[w, :, wp] = V[dw]
    M1 = M1.reshape(H, p * H)
    A = np.zeros((K, H, H, p))  # [k, h', h, i]
    for hp in range(H):
        for dh in range(k):
            h = hp + dh - pad
            if 0 <= h < H: A[:, hp, h, :] = C[:, dh, :]
    A = A.reshape(K * H, H * p)
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["x3"]),
        helper.make_node("MatMul", ["x3", "m1"], ["z"]),
        helper.make_node("Reshape", ["z", "s2"], ["z2"]),
        helper.make_node("MatMul", ["a", "z2"], ["y2"]),
        helper.make_node("Reshape", ["y2", "s3"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             [("s1", [P, H, H]), ("s2", [P, H * p, H]), ("s3", [P, K, H, H])]]
    inits += [numpy_helper.from_array(M1.astype(np.float32), "m1"), numpy_helper.from_array(A.astype(np.float32), "a")]
    g2 = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    st = sess(helper.make_model(g2, opset_imports=[helper.make_opsetid("", 17)]))
    yt = st.run(None, {"x": x})[0]
    err = np.abs(yt - yc).max() / np.abs(yc).max()
    tc, tt = [], []
    for _ in range(3):
        tc.append(timed(sc, {"x": x})); tt.append(timed(st, {"x": x}))
    tc, tt = min(tc), min(tt)
    macs_c = P * K * k * k * H * H; macs_t = P * H * H * p * H + P * K * H * H * p * H
    print(f"k={k:2d} rank p={p:2d} conv {tc*1e3:6.1f} ms ({macs_c/tc/1e9:5.1f} G/s)  toeplitz {tt*1e3:6.1f} ms ({macs_t/tt/1e9:5.1f} G/s, {macs_t/macs_c:.2f}x MACs)  ratio {tc/tt:.2f}x  rel err {err:.1e}", flush=True)
