"""The exported RST-CNN's batch-1 time against the structure of the group (issue 13's floor).

    python results/bench/structure-s22.py [--repeats 30] [--rounds 3]

The onnxruntime floors measured so far (BENCHMARKS.md) are set by the model's size: the
basis form's single-channel banks and its int8 1x1 mixing, or the FFT form's filter spectra.
Both scale with the number of (rotation, scale) branches and with the channel widths. This
script exports, with random weights (perturbed batch norms), the shipped structure and the
cheaper ones the group allows, float32 and int8 (the shipped QDQ recipe, calibrated on random
images: ranges do not change the time), and times each file at batch 1 through onnxruntime
with the serving defaults (2 threads, optimisation "all", no memory arena), the files taking
turns in one process, ``--rounds`` rounds of ``--repeats`` calls each (median per round).

    rst_cnn_fb            Nr 8, Ns 4, K 12, channels (69, 135, 204): the shipped structure
    rst_cnn_fb Nr4        Nr 4 (quarter turns only, exact on the grid), same widths/params
    rst_cnn_fb_ref        Nr 8, K 49, channels (35, 69, 104): the public code's basis
    rst_cnn_fb_ref Nr4    both
    cnn                   the denominator of the issue's ratio
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import rstmodel
from rstcnn.export.bench import perturb_norms
from rstcnn.export.onnx_export import export_model
from rstcnn.export.precision import convert

VARIANTS = {
    "rst_cnn_fb": ("rst_cnn_fb", {}),
    "rst_cnn_fb Nr4": ("rst_cnn_fb_nr4", {}),
    "rst_cnn_fb_ref": ("rst_cnn_fb_ref", {}),
    "rst_cnn_fb_ref Nr4": ("rst_cnn_fb_ref", {"rotations": 4}),
    "cnn": ("cnn", {}),
}


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 2
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    calibration = rng.standard_normal((32, 1, 56, 56)).astype(np.float32)
    image = rng.standard_normal((1, 1, 56, 56)).astype(np.float32)
    sessions: dict[str, ort.InferenceSession] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (name, overrides) in VARIANTS.items():
            model = perturb_norms(rstmodel.create_model(name, **overrides)).eval()
            params = sum(p.numel() for p in model.parameters())
            fp32 = export_model(model, Path(tmp) / f"{len(sessions)}.onnx", input_shape=(1, 56, 56))
            with torch.no_grad():
                eager = model(torch.from_numpy(image)).numpy()
            sessions[f"{label} fp32"] = session(fp32)
            got = sessions[f"{label} fp32"].run(None, {"images": image})[0]
            print(
                f"{label}: {params:,} parameters, onnx fp32 vs eager max |logit diff| "
                f"{np.abs(got - eager).max():.1e}",
                flush=True,
            )
            int8 = convert(fp32, fp32.with_suffix(".int8.onnx"), "int8", calibration=calibration)
            sessions[f"{label} int8"] = session(int8)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(args.rounds):
        for label, sess in sessions.items():
            for _ in range(3):  # warm-up
                sess.run(None, {"images": image})
            calls = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                sess.run(None, {"images": image})
                calls.append(time.perf_counter() - start)
            times[label].append(1000 * statistics.median(calls))
    cnn = statistics.median(times["cnn fp32"])
    print(f"\nbatch 1, ms (median of {args.repeats} calls per round; rounds)\n")
    print("| file | rounds (ms) | median ms | / cnn fp32 |")
    print("|---|---|---|---|")
    for label, rounds in times.items():
        mid = statistics.median(rounds)
        print(
            f"| {label} | {' / '.join(f'{t:.1f}' for t in rounds)} | {mid:.1f} | {mid / cnn:.1f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
