"""What sets the floor of the exported RST-CNN in onnxruntime: its two kinds of convolution
at their shapes, each alone in a one-node graph, in float32 and int8.

The basis form of a group convolution (``export.bake``) is a *bank* (every input plane
convolved with the K basis filters of one rotation and scale: a convolution with one input
channel and K outputs) and a *mixing* (a 1x1 convolution over the Cin*K responses: a GEMM).
For the shipped ``rst_cnn_fb`` at batch 1 (layer 2: 69 -> 135 channels at 28x28, layer 3:
135 -> 204 at 14x14; R = 8 rotations, kernels 5, 7, 11, 15 for the 4 scales) this prints,
for each op, the time for all of a layer's (rotation, scale) branches and the multiply-adds
per second, in float32 and in int8 (QLinearConv: uint8 activations, int8 weights).

    python -m export.floor_bench [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

R, K = 8, 12
KERNELS = (5, 7, 11, 15)
LAYERS = {"layer 2": (69, 135, 28), "layer 3": (135, 204, 14)}  # Cin, Cout, map side


def _graph(node: onnx.NodeProto, x: np.ndarray, inits: list[onnx.TensorProto]) -> bytes:
    kind = TensorProto.UINT8 if x.dtype == np.uint8 else TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "op",
        [helper.make_tensor_value_info("x", kind, x.shape)],
        [helper.make_tensor_value_info("y", kind, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _seconds(model: bytes, x: np.ndarray, repeats: int) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _conv(x: np.ndarray, w: np.ndarray, pad: int) -> tuple[onnx.NodeProto, list]:
    """Conv (float32) or QLinearConv (uint8 x, int8 w) with 'same' padding."""
    if x.dtype != np.uint8:
        node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[pad] * 4)
        return node, [numpy_helper.from_array(w, "w")]
    out = w.shape[0]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array(0.05, np.float32), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "xz"),
        numpy_helper.from_array(np.full(out, 0.01, np.float32), "ws"),
        numpy_helper.from_array(np.zeros(out, np.int8), "wz"),
        numpy_helper.from_array(np.array(0.1, np.float32), "ys"),
        numpy_helper.from_array(np.array(128, np.uint8), "yz"),
    ]
    names = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"]
    return helper.make_node("QLinearConv", names, ["y"], pads=[pad] * 4), inits


def _inputs(shape: Sequence[int], wshape: Sequence[int], int8: bool, rng) -> tuple:
    if int8:
        x = rng.integers(0, 256, shape, dtype=np.uint8)
        w = rng.integers(-127, 128, wshape, dtype=np.int8)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
        w = (0.05 * rng.standard_normal(wshape)).astype(np.float32)
    return x, w


def measure(repeats: int = 5) -> list[tuple[str, str, float, float, float]]:
    """Rows (layer, op, float32 ms, int8 ms, multiply-adds in G) for all R*S branches."""
    rng = np.random.default_rng(0)
    rows = []
    for layer, (cin, cout, side) in LAYERS.items():
        for k in KERNELS:  # one bank per scale: R*Cin planes -> K responses each
            macs = R * cin * K * k * k * side * side
            ms = []
            for int8 in (False, True):
                x, w = _inputs((R * cin, 1, side, side), (K, 1, k, k), int8, rng)
                node, inits = _conv(x, w, k // 2)
                ms.append(1e3 * _seconds(_graph(node, x, inits), x, repeats))
            rows.append((layer, f"bank {k}x{k}", ms[0], ms[1], macs / 1e9))
        # mixing: one 1x1 conv over all R*S branches (batch R*S), Cin*K -> Cout
        macs = R * len(KERNELS) * cin * K * cout * side * side
        ms = []
        for int8 in (False, True):
            x, w = _inputs(
                (R * len(KERNELS), cin * K, side, side), (cout, cin * K, 1, 1), int8, rng
            )
            node, inits = _conv(x, w, 0)
            ms.append(1e3 * _seconds(_graph(node, x, inits), x, repeats))
        rows.append((layer, "mixing 1x1", ms[0], ms[1], macs / 1e9))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.floor_bench", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = measure(args.repeats)
    print(
        "| layer | op (all 32 branches) | G multiply-adds | float32 ms | G/s | int8 ms | G/s | int8 speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layer, op, fp32, int8, gmacs in rows:
        print(
            f"| {layer} | {op} | {gmacs:.2f} | {fp32:.1f} | {gmacs / fp32 * 1e3:.0f} | "
            f"{int8:.1f} | {gmacs / int8 * 1e3:.0f} | {fp32 / int8:.2f}x |"
        )
    for kind, col in (("bank", 2), ("mixing", 2)):
        total = sum(r[col] for r in rows if r[1].startswith(kind))
        total8 = sum(r[3] for r in rows if r[1].startswith(kind))
        print(f"{kind}: float32 {total:.1f} ms, int8 {total8:.1f} ms in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
