"""Eager inference in bfloat16 (or int8, or int16) against exact float32, on a checkpoint's
own test images.

    python train/precision_check.py models/rst_cnn_fb.pt --limit 1024
    python train/precision_check.py runs/x/best.pt --device cuda
    python train/precision_check.py models/rst_cnn_fb.pt --record   (for the app, see below)
    python train/precision_check.py models/rst_cnn_fb.pt --precision int8 --record
    python train/precision_check.py models/rst_cnn_fb.pt --precision int16 --record  (AVX2)

Runs the checkpoint on the first ``--limit`` images of its RS test split (its realisation,
N_tr and validation size: none seen in training) in float32 and at ``--precision``
(``rstmodel.precision.inference``: ``bf16`` autocast, or ``int8``, the same with the FFT
path's per-frequency products in int8, on a CPU with AVX512-VNNI, or ``int16``, float32
with those products on 16-bit integers, on a CPU with AVX2), and prints accuracy of
each, how often the two agree on the top class, the largest logit change relative to the
largest float32 logit, the time of each pass (same process, same batches) and whether the
reduced precision passes the gate: accuracy within ``--tolerance`` points of float32 (0.5,
as the exported int8 / fp16 files' gate). Exit status 0 when it passes, 1 when it does not,
2 when it cannot run.

``--record`` writes the result beside the checkpoint (``NAME.bf16-gate.json``,
``NAME.int8-gate.json`` or ``NAME.int16-gate.json``, tied to the checkpoint file's SHA-256): the accuracy check that
lets ``serve/app.py --model NAME.pt`` serve the checkpoint at that precision
(``serve.eager``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms import v2

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.export.precision import accuracy_drop_points
from rstcnn.train.resampling import rs_run, test_images
from rstcnn.train.runtime import use_retaining_allocator, user_errors
from rstmodel import load_checkpoint
from rstmodel.precision import bf16_supported, inference, int8_supported, int16_supported

# each precision: whether a device runs it, and what it lacks where it does not
_SUPPORT = {
    "bf16": (bf16_supported, "has no native bfloat16 (AVX512-BF16 or AMX on a CPU)"),
    "int8": (
        int8_supported,
        "cannot run int8 products (a CPU with AVX512-BF16 and AVX512-VNNI, a C compiler)",
    ),
    "int16": (
        int16_supported,
        "cannot run int16 products (a CPU with AVX2 but no AVX-512, a C compiler)",
    ),
}


def logits_of(
    model, x: torch.Tensor, precision: str, device, batch: int
) -> tuple[torch.Tensor, float]:
    """float32 logits of every image and the seconds the passes took (after one warm-up
    batch, which fills caches and picks kernels)."""
    with inference(precision, device):
        model(x[:batch].to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = [model(x[i : i + batch].to(device)).float().cpu() for i in range(0, len(x), batch)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return torch.cat(out), time.perf_counter() - start


def check(
    path: Path,
    limit: int,
    batch: int,
    device: str,
    tolerance: float,
    data_root=None,
    precision: str = "bf16",
) -> dict:
    device = torch.device(device)
    model, meta = load_checkpoint(path, map_location=device)
    images, labels = test_images(rs_run(path, meta), "bicubic", limit, data_root)
    x = v2.Normalize(meta.mean, meta.std)(torch.from_numpy(images[:, None]).float() / 255)
    exact, t32 = logits_of(model, x, "fp32", device, batch)
    reduced, t_reduced = logits_of(model, x, precision, device, batch)
    y = torch.from_numpy(labels.astype(np.int64))
    acc32 = float((exact.argmax(1) == y).float().mean())
    acc = float((reduced.argmax(1) == y).float().mean())
    return {
        "checkpoint": str(path),
        "model": meta.model_name,
        "device": str(device),
        "precision": precision,
        "images": int(len(y)),
        "batch": batch,
        "fp32_acc": acc32,
        "reduced_acc": acc,
        "top1_agreement": float((exact.argmax(1) == reduced.argmax(1)).float().mean()),
        "max_logit_change": float((reduced - exact).abs().max() / exact.abs().max()),
        "fp32_s": t32,
        "reduced_s": t_reduced,
        "speedup": t32 / t_reduced,
        "passes": accuracy_drop_points(acc32, acc) <= tolerance,
        "tolerance_points": tolerance,
    }


@user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--limit", type=int, default=1024, help="test images (the first N)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tolerance", type=float, default=0.5, help="accuracy points")
    parser.add_argument("--data-root", type=Path, default=None, help="folder of RS source files")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument(
        "--precision",
        choices=tuple(_SUPPORT),
        default="bf16",
        help="what to check against float32 (int8: bf16 with int8 per-frequency products; "
        "int16: float32 with 16-bit integer per-frequency products)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="write the gate beside the checkpoint (NAME.PRECISION-gate.json) for serve/app.py",
    )
    args = parser.parse_args(argv)
    if args.limit < 1 or args.batch < 1:
        parser.error("--limit and --batch must be positive")
    supported, needs = _SUPPORT[args.precision]
    if not supported(args.device):
        print(f"error: {args.device} here {needs}; nothing to check", file=sys.stderr)
        return 2
    r = check(
        args.checkpoint,
        args.limit,
        args.batch,
        args.device,
        args.tolerance,
        args.data_root,
        args.precision,
    )
    print(
        f"{r['model']} on {r['images']} test images ({r['device']}, batch {r['batch']}):\n"
        f"  float32  accuracy {100 * r['fp32_acc']:.2f} %  {r['fp32_s']:.2f} s\n"
        f"  {r['precision']:8} accuracy {100 * r['reduced_acc']:.2f} %  {r['reduced_s']:.2f} s  "
        f"({r['speedup']:.2f}x)\n"
        f"  top-1 agreement {100 * r['top1_agreement']:.2f} %, largest logit change "
        f"{r['max_logit_change']:.3f} of the largest logit\n"
        f"  gate (within {r['tolerance_points']} points): {'pass' if r['passes'] else 'FAIL'}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    if args.record:
        from rstcnn.export.onnx_export import file_sha256
        from rstcnn.serve.eager import write_gate

        gate = {
            "passes": r["passes"],
            "precision": r["precision"],
            "images": r["images"],
            "accuracy": r["reduced_acc"],
            "reference_accuracy": r["fp32_acc"],
            "drop_points": accuracy_drop_points(r["fp32_acc"], r["reduced_acc"]),
            "limit_points": r["tolerance_points"],
            "top1_agreement": r["top1_agreement"],
            "device": r["device"],
        }
        digest = file_sha256(args.checkpoint)
        print(f"  recorded: {write_gate(args.checkpoint, digest, gate, r['precision'])}")
    return 0 if r["passes"] else 1


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    sys.exit(main())
