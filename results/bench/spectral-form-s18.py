"""Eighteenth session, issue 13: a whole-network spectral form of rst_cnn_fb for onnxruntime,
timed against the shipped int8 file, in turns, at batch 1 and 8.

The form (random weights, the shipped model's shapes; its logits checked against the same
module in torch): the quarter-turned copies of each image as the batch, the lifting layer as
one direct conv per (scale, base rotation) followed by the pool, then every map kept
spatial-major [H, W, S, R/4, ...] through both group convolutions, so no transpose is
needed between layers: GEMM DFTs along H and W on one grid per layer (H + 7 for the 15x15
kernel), the per-frequency complex products, the inverse DFTs, bias, pool, ReLU, the batch
norms as per-channel Mul/Add, then the max over the group and the FC head. Two layouts of
the products:

    grouped  [H, W, S, R/4, C, N]: one grouped 1x1 Conv (a group per frequency and branch,
             rows = real and imaginary parts of the N = 4 B copies) against [Re W | Im W]
    batched  [H, W, S, R/4, N, C]: two batched MatMuls of [Re X | Im X] against
             [Re W; -Im W] and [Im W; Re W]

    python results/bench/spectral-form-s18.py   (jemalloc with MALLOC_CONF, as the CLIs run)
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

KS, S, R4, CH, SIDE = (5, 7, 11, 15), 4, 2, (69, 135, 204), 56


def _t(a):
    return torch.tensor(np.ascontiguousarray(a), dtype=torch.float32)


def dft_matrices(side: int, n: int) -> dict:
    """Forward (full along H, half along W) and inverse real DFT matrices, grid n."""
    x, k, half = np.arange(side), np.arange(n), np.arange(n // 2 + 1)
    fh, fw = 2 * np.pi * np.outer(k, x) / n, 2 * np.pi * np.outer(half, x) / n
    c = np.full(n // 2 + 1, 2.0)
    c[0] = 1
    if n % 2 == 0:
        c[-1] = 1
    return {
        "ch": np.cos(fh),
        "sh": -np.sin(fh),
        "cw": np.cos(fw),
        "sw": -np.sin(fw),
        "ich": np.cos(fh).T / n,
        "ish": np.sin(fh).T / n,
        "icw": (c * np.cos(fw).T) / n,
        "isw": -(c * np.sin(fw).T) / n,
    }


class Spectral(nn.Module):
    def __init__(self, layout: str):
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        c1 = CH[0]
        self.lift = nn.ModuleList(
            nn.Conv2d(1, c1, k, padding=k // 2) for k in KS for _ in range(R4)
        )
        self.shapes = []
        for i, (cin, cout, side) in enumerate(
            ((CH[0], CH[1], SIDE // 2), (CH[1], CH[2], SIDE // 4))
        ):
            n = side + max(KS) // 2
            fw = n // 2 + 1
            for name, m in dft_matrices(side, n).items():
                self.register_buffer(f"l{i}_{name}", _t(m))
            g = n * fw * S * R4
            if layout == "grouped":
                self.register_buffer(f"l{i}_w", torch.randn(g * 2 * cout, cin, 1, 1) * 0.01)
            else:
                self.register_buffer(f"l{i}_wre", torch.randn(g, 2 * cin, cout) * 0.01)
                self.register_buffer(f"l{i}_wim", torch.randn(g, 2 * cin, cout) * 0.01)
            shape = (cout, 1) if layout == "grouped" else (cout,)
            self.register_buffer(f"l{i}_b", torch.randn(shape))
            self.register_buffer(f"l{i}_bn", torch.randn(2, cin, *shape[1:]))
            self.shapes.append((side, n, fw, cin, cout, g))
        self.register_buffer("bn3", torch.randn(2, CH[2], *((1,) if layout == "grouped" else ())))
        self.fc1, self.fc2 = nn.Linear(CH[2], 256), nn.Linear(256, 10)

    def group(self, i: int, x: torch.Tensor) -> torch.Tensor:
        side, n, fw, cin, cout, g = self.shapes[i]
        p = lambda name: getattr(self, f"l{i}_{name}")  # noqa: E731
        x = x * p("bn")[0] + p("bn")[1]
        xm = x.reshape(side, -1)
        a_re, a_im = (p("ch") @ xm).reshape(n, side, -1), (p("sh") @ xm).reshape(n, side, -1)
        x_re = p("cw") @ a_re - p("sw") @ a_im  # [n, fw, ...]
        x_im = p("cw") @ a_im + p("sw") @ a_re
        if self.layout == "grouped":
            rows = x.shape[-1]
            xx = torch.cat([x_re.reshape(g, cin, rows), x_im.reshape(g, cin, rows)], dim=2)
            y = F.conv2d(xx.reshape(1, g * cin, 2 * rows, 1), p("w"), groups=g)
            y = y.reshape(g, 2, cout, 2, rows)
            y_re = (y[:, 0, :, 0] - y[:, 1, :, 1]).reshape(n, -1)
            y_im = (y[:, 1, :, 0] + y[:, 0, :, 1]).reshape(n, -1)
        else:
            xx = torch.cat([x_re.reshape(g, -1, cin), x_im.reshape(g, -1, cin)], dim=2)
            y_re = torch.matmul(xx, p("wre")).reshape(n, -1)
            y_im = torch.matmul(xx, p("wim")).reshape(n, -1)
        z_re = (p("ich") @ y_re - p("ish") @ y_im).reshape(side, fw, -1)
        z_im = (p("ish") @ y_re + p("ich") @ y_im).reshape(side, fw, -1)
        out = p("icw") @ z_re + p("isw") @ z_im
        if self.layout == "grouped":
            return out.reshape(side, side, S, R4, cout, -1) + p("b")
        return out.reshape(side, side, S, R4, -1, cout) + p("b")

    @staticmethod
    def pool(x):
        h, w = x.shape[:2]
        return torch.relu(x.reshape(h // 2, 2, w // 2, 2, *x.shape[2:]).amax(dim=(1, 3)))

    def forward(self, x):
        b, h = x.shape[0], SIDE // 2
        q = torch.cat([torch.rot90(x, k, (2, 3)) for k in range(4)])
        ys = [torch.relu(F.max_pool2d(conv(q), 2)) for conv in self.lift]  # [4B, C1, 28, 28]
        y = torch.stack(ys).reshape(S, R4, 4 * b, CH[0], h * h)
        if self.layout == "grouped":
            y = y.permute(4, 0, 1, 3, 2).reshape(h, h, S, R4, CH[0], 4 * b)
        else:
            y = y.reshape(-1, h * h).t().reshape(h, h, S, R4, 4 * b, CH[0])
        y = self.pool(self.group(0, y))
        y = self.pool(self.group(1, y))
        y = y * self.bn3[0] + self.bn3[1]
        if self.layout == "grouped":
            y = y.reshape(-1, CH[2], 4, b).amax(dim=(0, 2)).t()
        else:
            y = y.reshape(-1, 4, b, CH[2]).amax(dim=(0, 1))
        return self.fc2(torch.relu(self.fc1(y)))


def session(model: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def main() -> None:
    files = {
        "shipped rst_cnn_fb.int8.onnx (basis form)": Path(
            "models/rst_cnn_fb.int8.onnx"
        ).read_bytes()
    }
    for layout in ("grouped", "batched"):
        m = Spectral(layout).eval()
        x = torch.randn(2, 1, SIDE, SIDE)
        prog = torch.onnx.export(
            m,
            (x,),
            dynamo=True,
            input_names=["x"],
            output_names=["y"],
            external_data=False,
            verbose=False,
            dynamic_shapes=({0: torch.export.Dim("batch")},),
        )
        model = prog.model_proto.SerializeToString()
        with torch.no_grad():
            diff = np.abs(session(model).run(None, {"x": x.numpy()})[0] - m(x).numpy()).max()
        print(f"spectral, {layout}: max |onnxruntime - torch| {diff:.1e}", flush=True)
        files[f"spectral form, {layout} products"] = model
    sessions = {k: session(v) for k, v in files.items()}
    rng = np.random.default_rng(0)
    for batch, rounds in ((1, 9), (8, 5)):
        x = rng.random((batch, 1, SIDE, SIDE), dtype=np.float32)
        times = {k: [] for k in sessions}
        for s in sessions.values():
            s.run(None, {s.get_inputs()[0].name: x})
        for _ in range(rounds):  # in turns
            for k, s in sessions.items():
                start = time.perf_counter()
                s.run(None, {s.get_inputs()[0].name: x})
                times[k].append(time.perf_counter() - start)
        base = statistics.median(times[next(iter(times))])
        for k, t in times.items():
            med = statistics.median(t)
            print(
                f"batch {batch}: {k:44s} {1e3 * med:8.1f} ms ({1e3 * med / batch:6.1f} per image), "
                f"{med / base:.2f}x the shipped file",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
