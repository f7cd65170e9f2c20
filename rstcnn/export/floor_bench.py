"""What sets the floor of the exported RST-CNN in onnxruntime: its two kinds of convolution
at their shapes, each alone in a one-node graph, in float32 and int8.

The basis form of a group convolution (``export.bake``) is a *bank* (every input plane
convolved with the K basis filters of one rotation and scale: a convolution with one input
channel and K outputs) and a *mixing* (a 1x1 convolution over the Cin*K responses: a GEMM).
For the shipped ``rst_cnn_fb`` at batch 1 (layer 2: 69 -> 135 channels at 28x28, layer 3:
135 -> 204 at 14x14; R = 8 rotations, kernels 5, 7, 11, 15 for the 4 scales) this prints,
for each op, the time for all of a layer's (rotation, scale) branches and the multiply-adds
per second, in float32 and in int8 (QLinearConv: uint8 activations, int8 weights).

It also times a form the exporter does not use, measured to say why: the *FFT form* of a
whole layer, the eager FFT path (``GroupRSTConv.forward_fft``: GEMM DFTs, the per-frequency
products in three real GEMMs, quarter turns sharing a spectrum) written as plain MatMuls and
exported to ONNX, at batch 1 and 8, beside the basis form's total for the same layer. Its
filter spectra are a MatMul of two constants in the graph (folded by onnxruntime at load), so
the file stays small.

``--products`` times what bounds the FFT form at batch 1: each layer's per-frequency products
alone (one MatMul batched over the frequencies of the R/4 base rotations and S scales, the 4
quarter-turned copies of the image as its rows, or a 1x1 Conv with a group per frequency),
in the layouts a graph can give them, beside
the machine's memory copy rate. Every weight there is read once per image, so at batch 1 these
products are bound by reading the filter spectra, not by their multiply-adds.

    python -m export.floor_bench [--repeats 5] [--no-fft] [--products]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

R, K = 8, 12
KERNELS = (5, 7, 11, 15)
LAYERS = {"layer 2": (69, 135, 28), "layer 3": (135, 204, 14)}  # Cin, Cout, map side


def _graph(
    node: onnx.NodeProto | list[onnx.NodeProto],
    x: np.ndarray,
    inits: list[onnx.TensorProto],
    outputs: Sequence[str] = ("y",),
    out_kind: int | None = None,
) -> bytes:
    kind = TensorProto.UINT8 if x.dtype == np.uint8 else TensorProto.FLOAT
    graph = helper.make_graph(
        node if isinstance(node, list) else [node],
        "op",
        [helper.make_tensor_value_info("x", kind, x.shape)],
        [helper.make_tensor_value_info(n, out_kind or kind, None) for n in outputs],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _seconds(model: bytes, x: np.ndarray, repeats: int) -> float:
    return _timed_run(model, x, repeats)[0]


def _timed_run(model: bytes, x: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    """Median seconds of ``repeats`` runs after a warm-up one, and the warm-up's output."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    out = session.run(None, {"x": x})[0]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def _conv(x: np.ndarray, w: np.ndarray, pad: int, group: int = 1) -> tuple[onnx.NodeProto, list]:
    """Conv (float32) or QLinearConv (uint8 x, int8 w) with 'same' padding."""
    if x.dtype != np.uint8:
        node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[pad] * 4, group=group)
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
    node = helper.make_node("QLinearConv", names, ["y"], pads=[pad] * 4, group=group)
    return node, inits


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


class FFTForm(nn.Module):
    """``layer.forward_fft`` (one tap, quarter turns shared) in plain, exportable torch ops,
    all scales on the largest kernel's grid (the same values as the eager path's per-scale
    grids).
    x [B, Cin, R, S, H, W] -> [B, Cout, R, S, H, W]."""

    def __init__(self, layer, h: int):
        from rstmodel.layers.kernels import _dft_matrices, _fft_rows

        super().__init__()
        if layer.quarter_turns(h, h) != 4 or layer.taps != 1:
            raise ValueError("FFTForm covers one-tap layers with R divisible by 4")
        nh, nw = layer._grid(h, h)
        self.h, self.nh, self.fw = h, nh, nw // 2 + 1
        self.rot, self.nsc = layer.spec.rotations, layer.spec.num_scales
        self.cin, self.cout = layer.in_channels, layer.out_channels
        dft = _dft_matrices(h, h, nh, nw, torch.float32, torch.device("cpu"))
        for name, matrix in dft.separate().items():  # cos_h, msin_h, ..., inv_sin_w
            self.register_buffer(name, matrix.clone())
        (index,) = _fft_rows(h, h, self.rot, 4, (0, self.nsc), torch.device("cpu"))
        self.register_buffer("index", index.clone())
        self.register_buffer("inverse", torch.argsort(index))
        k = layer.spec.num_funcs
        spectrum = layer._basis_spectrum(nh, nw, self.rot // 4, range(self.nsc))
        self.register_buffer("basis", spectrum.float().clone())
        weight = layer.weight.detach().float().permute(3, 1, 2, 0).reshape(k, -1)
        self.register_buffer("weight", weight.clone())  # [K, Cin*Cout]
        self.register_buffer("bias", layer.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, nh, fw = x.shape[0], self.h, self.nh, self.fw
        g = torch.matmul(self.basis, self.weight).view(3, -1, self.cin, self.cout)
        xs = x.permute(4, 5, 2, 3, 0, 1).reshape(-1, b * self.cin)[self.index]
        xm = xs.reshape(h, -1)
        a_re = (self.cos_h @ xm).reshape(nh, h, -1)
        a_im = (self.msin_h @ xm).reshape(nh, h, -1)
        x_re = (self.cos_w @ a_re + self.sin_w @ a_im).reshape(-1, 4 * b, self.cin)
        x_im = (self.cos_w @ a_im - self.sin_w @ a_re).reshape(-1, 4 * b, self.cin)
        m = torch.matmul(x_re + x_im, g[0])
        y_re = (m - torch.matmul(x_im, g[2])).reshape(nh, -1)
        y_im = (m + torch.matmul(x_re, g[1])).reshape(nh, -1)
        z_re = (self.inv_cos_h @ y_re - self.inv_sin_h @ y_im).reshape(h, fw, -1)
        z_im = (self.inv_sin_h @ y_re + self.inv_cos_h @ y_im).reshape(h, fw, -1)
        y = (self.inv_cos_w @ z_re + self.inv_sin_w @ z_im).reshape(-1, b * self.cout)
        y = y[self.inverse].reshape(h, h, self.rot, self.nsc, b, self.cout) + self.bias
        return y.permute(4, 5, 2, 3, 0, 1)


def fft_layer(cin: int, cout: int, seed: int = 0):
    """A GroupRSTConv of the shipped model's basis and the given widths, random weights."""
    from rstmodel import create_model
    from rstmodel.layers import GroupRSTConv

    torch.manual_seed(seed)
    spec = create_model("rst_cnn_fb", channels=(2, 2, 2)).config.basis_spec()
    layer = GroupRSTConv(cin, cout, spec).eval()
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def measure_fft(repeats: int = 5, batches: Sequence[int] = (1, 8)) -> list[tuple]:
    """Rows (layer, batch, ms per image, max |difference| from ``forward_fft``) of the FFT
    form of each layer in ``LAYERS`` through onnxruntime."""
    rows = []
    for name, (cin, cout, side) in LAYERS.items():
        layer = fft_layer(cin, cout)
        form = FFTForm(layer, side).eval()
        example = torch.randn(2, cin, R, len(KERNELS), side, side)
        program = torch.onnx.export(
            form,
            (example,),
            dynamo=True,
            input_names=["x"],
            output_names=["y"],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            external_data=False,
            verbose=False,
        )
        model = program.model_proto.SerializeToString()
        for batch in batches:
            x = torch.randn(batch, cin, R, len(KERNELS), side, side)
            with torch.no_grad():
                expected = layer.forward_fft(x, bias=layer.bias).numpy()
            seconds, got = _timed_run(model, x.numpy(), repeats)
            diff = float(np.abs(got - expected).max())
            rows.append((name, batch, 1e3 * seconds / batch, diff))
    return rows


PRODUCT_LAYOUTS = (
    "float32, three real products (as FFTForm)",
    "float32, real and imaginary rows",
    "int8, real and imaginary rows",
    "float32, grouped 1x1 Conv",
    "int8, grouped QLinearConv",
)


def products_graph(layout: str, x: np.ndarray, ws: list[np.ndarray]) -> tuple[bytes, np.ndarray]:
    """The one-op graph of ``layout`` for rows ``x`` [F, M, Cin] against ``ws`` (each
    [F, Cin, N]), and its input: a MatMul (MatMulInteger in int8) batched over the F
    frequencies, or a 1x1 Conv with a group per frequency (QLinearConv in int8), its input
    [1, F*Cin, M, 1] and weight [F*N, Cin, 1, 1]."""
    if "grouped" in layout:
        (w,) = ws
        f, m, cin = x.shape
        xg = np.ascontiguousarray(x.transpose(0, 2, 1)).reshape(1, f * cin, m, 1)
        wg = np.ascontiguousarray(w.transpose(0, 2, 1)).reshape(-1, cin, 1, 1)
        node, inits = _conv(xg, wg, 0, group=f)
        return _graph(node, xg, inits), xg
    int8 = x.dtype == np.uint8
    op, out_kind = ("MatMulInteger", TensorProto.INT32) if int8 else ("MatMul", TensorProto.FLOAT)
    nodes = [helper.make_node(op, ["x", f"w{i}"], [f"y{i}"]) for i in range(len(ws))]
    inits = [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(ws)]
    return _graph(nodes, x, inits, [f"y{i}" for i in range(len(ws))], out_kind), x


def copy_rate(megabytes: int = 256, repeats: int = 5) -> float:
    """This machine's memory copy rate in GB/s (bytes read plus bytes written)."""
    a = np.ones(megabytes << 18, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - start)
    return 2 * a.nbytes / min(times) / 1e9


def measure_products(repeats: int = 5, layers: dict | None = None) -> list[tuple]:
    """Rows (layer, layout, frequencies, weight MB, ms) for each layer's per-frequency
    products at batch 1, in each of ``PRODUCT_LAYOUTS``.

    The products take a [4, Cin] complex block (the image's quarter turns) to [4, Cout] at
    each frequency of the R/4 base rotations and S scales. As FFTForm writes them (three real
    GEMMs, one multiplication saved per complex product) they read three real weight sets;
    with the real and imaginary parts of the block as 8 rows against [Re W | Im W] they read
    two; int8 (MatMulInteger, uint8 rows) reads the two at a quarter of the bytes. The
    grouped layouts compute the same as the rows ones with a 1x1 Conv per frequency
    (onnxruntime's grouped convolution streams its weights faster than its batched MatMul)."""
    rng = np.random.default_rng(0)
    rows = []
    for name, (cin, cout, side) in (layers or LAYERS).items():
        nh, nw = fft_layer(2, 2)._grid(side, side)
        freqs = nh * (nw // 2 + 1) * (R // 4) * len(KERNELS)
        for layout in PRODUCT_LAYOUTS:
            int8 = layout.startswith("int8")
            sets = 3 if "three" in layout else 1
            m, n = (4, cout) if sets == 3 else (8, 2 * cout)
            if int8:
                x = rng.integers(0, 256, (freqs, m, cin), dtype=np.uint8)
                ws = [rng.integers(-127, 128, (freqs, cin, n), dtype=np.int8)]
            else:
                x = rng.standard_normal((freqs, m, cin)).astype(np.float32)
                ws = [rng.standard_normal((freqs, cin, n)).astype(np.float32) for _ in range(sets)]
            model, feed = products_graph(layout, x, ws)
            mb = sum(w.nbytes for w in ws) / 1e6
            rows.append((name, layout, freqs, mb, 1e3 * _seconds(model, feed, repeats)))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.floor_bench", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-fft", action="store_true", help="skip the FFT form")
    parser.add_argument(
        "--products",
        action="store_true",
        help="only the FFT form's per-frequency products at batch 1, and the copy rate",
    )
    args = parser.parse_args(argv)
    if args.products:
        print(f"memory copy rate (read + write): {copy_rate():.1f} GB/s")
        print("| layer | products layout | frequencies | weights MB | ms | weights GB/s |")
        print("|---|---|---|---|---|---|")
        for layer, layout, freqs, mb, ms in measure_products(args.repeats):
            print(f"| {layer} | {layout} | {freqs} | {mb:.0f} | {ms:.1f} | {mb / ms:.1f} |")
        return 0
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
    if args.no_fft:
        return 0
    print()
    print(
        "| layer | basis form, float32 (ms) | basis form, int8 mixing (ms) | FFT form, batch | ms per image | max diff from eager |"
    )
    print("|---|---|---|---|---|---|")
    for layer, batch, ms, diff in measure_fft(args.repeats):
        banks = sum(r[2] for r in rows if r[0] == layer and r[1].startswith("bank"))
        mixing = next(r for r in rows if r[0] == layer and r[1] == "mixing 1x1")
        print(
            f"| {layer} | {banks + mixing[2]:.1f} | {banks + mixing[3]:.1f} | {batch} | "
            f"{ms:.1f} | {diff:.1e} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
