"""Export a checkpoint to one self-contained ONNX file, and check it against the eager model.

    python export/to_onnx.py CHECKPOINT [-o OUT.onnx] [--opset N] [--check N]
                             [--precision fp32|int8|fp16] [--calibration N] [--quarter-turns]

The model is baked first (``export.bake``: static convolutions, batch norms folded), so the
graph holds only standard ops (Conv, Relu, MaxPool, Reshape, ReduceMax, Gemm, ...). Input
``images`` float32 ``[N, C, H, W]``, normalised as ``(x / 255 - mean) / std``; output
``logits`` ``[N, classes]``; N is dynamic. ``metadata_props`` (all strings, JSON where
structured) carry what inference needs, so one client serves every exported model:

    rstcnn.model              registered model name
    rstcnn.class_names        JSON list of labels
    rstcnn.input_size         JSON [C, H, W]
    rstcnn.normalization      JSON {"mean": [...], "std": [...]} on x / 255
    rstcnn.group              JSON {rotations, scales, basis, K, taps, ...}, null for a CNN
    rstcnn.checkpoint_sha256  sha256 of the source checkpoint file
    rstcnn.quarter_turn_invariant  true when the graph's logits do not change under quarter
                                   turns of the input (measured at export)
    rstcnn.version            rstcnn package version
    rstcnn.accuracy           JSON of the checkpoint's accuracy metrics (null if none)

``--check N`` runs onnxruntime and the eager model on N test images of the checkpoint's
prepared data set and fails (exit 1) if any logit differs by more than 1e-4 or any top-1
prediction differs. ``--precision int8`` (calibrated on ``--calibration`` training images)
or ``fp16`` writes a reduced-precision copy of that graph (``export.precision``); with
``--check`` the float32 graph is checked as above and the copy must keep its accuracy
within ``GATE_POINTS`` of it on the same test images. A corrupt, foreign or missing
checkpoint, or data that is not prepared, exits with 2 and a one-line message.
"""

# ruff: noqa: E402  (as a script it re-executes before its imports: rstcnn.cli)
from __future__ import annotations

if __name__ == "__main__":  # re-exec with the retaining heap, then run as rstcnn.export.to_onnx
    from rstcnn.cli import export

    export()

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np

from rstcnn.export.bake import check_quarter_turns
from rstcnn.export.onnx_export import (
    TOLERANCE,
    ExportError,
    check_onnx,
    data_sample,
    dataset_of,
    export_model,
    file_sha256,
    onnx_metadata,
)
from rstcnn.export.precision import GATE_POINTS, PRECISIONS, convert, gate, record_gate
from rstmodel.checkpoint import CheckpointMeta, load_checkpoint

__all__ = ["main"]

EXIT_CHECK, EXIT_SETUP = 1, 2

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python export/to_onnx.py",
        description="Export an rstcnn checkpoint to a self-contained ONNX file.",
    )
    parser.add_argument("checkpoint", type=Path, help="a .pt file written by train/run.py")
    parser.add_argument("-o", "--out", type=Path, help="output .onnx (default: beside the input)")
    parser.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    parser.add_argument(
        "--check",
        type=int,
        metavar="N",
        default=0,
        help="compare onnxruntime with the eager model on N test images (exit 1 on failure)",
    )
    parser.add_argument("--stl10-root", type=Path, help="STL-10 folder, for --check on STL-10")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32 (default); int8: static quantization (QDQ, per-channel weights) of the "
        "multi-channel convolutions, calibrated on training images; fp16: for GPUs / TensorRT. With --check, a reduced "
        f"precision must keep accuracy within {GATE_POINTS} points of float32",
    )
    parser.add_argument(
        "--quarter-turns",
        action="store_true",
        help="the quarter-turn form: R/4 base rotations run on four turned copies of each "
        "image (same logits, a quarter of the rotation-specific weights; export.bake)",
    )
    parser.add_argument(
        "--calibration",
        type=int,
        metavar="N",
        default=256,
        help="int8: training images whose activation ranges set the scales (default 256)",
    )
    args = parser.parse_args(argv)
    if args.check < 0:
        parser.error("--check needs a non-negative number of images")
    if args.calibration < 1:
        parser.error("--calibration needs at least one image")
    return args


def check_writable(out: Path) -> None:
    """Create ``out``'s folder and a probe file in it, or raise ExportError saying so: before
    the export's minutes, not after."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.probe."):
            pass
    except OSError as err:
        raise ExportError(
            f"cannot write {out} ({err.strerror or err}); pass -o with a folder you can write to"
        ) from None


def _normalised(images: np.ndarray, meta: CheckpointMeta) -> np.ndarray:
    mean = np.asarray(meta.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(meta.std, dtype=np.float32).reshape(1, -1, 1, 1)
    return ((images.astype(np.float32) / 255 - mean) / std).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    args = parse_args(argv)
    reduced = args.precision != "fp32"
    out = args.checkpoint.with_suffix(".onnx") if args.out is None else args.out
    try:
        model, meta = load_checkpoint(args.checkpoint)
        check_writable(out)
        where = {"stl10_root": args.stl10_root}
        tests = data_sample(meta, args.check, labels=True, **where) if args.check else None
        calibration = (
            data_sample(meta, args.calibration, split="train", **where) if reduced else None
        )
        if args.quarter_turns:
            check_quarter_turns(model)
    except (ExportError, OSError, ValueError) as err:  # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return EXIT_SETUP
    shape = (meta.in_channels, meta.input_size, meta.input_size)
    metadata = onnx_metadata(model, meta, file_sha256(args.checkpoint))
    fp32 = out.with_name(f".{out.stem}.fp32.onnx") if reduced else out
    try:
        export_model(
            model,
            fp32,
            input_shape=shape,
            metadata=metadata,
            opset=args.opset,
            quarter_turns=args.quarter_turns,
        )
        if reduced:
            convert(
                fp32,
                out,
                args.precision,
                calibration=None if calibration is None else _normalised(calibration, meta),
                calibration_source=f"{dataset_of(meta)} training split, {args.calibration} "
                "images from the start of the data set's permutation",
            )
        log.info("wrote %s (%s, %.2f MB)", out, meta.model_name, out.stat().st_size / 1e6)
        if tests is None:
            return 0
        images, labels = tests
        result = check_onnx(fp32, model, images, meta.mean, meta.std)
        verdict = "ok" if result.ok else "FAILED"
        print(
            f"check {verdict}: {result.count} images, max |logit diff| {result.max_abs_diff:.2e} "
            f"(tolerance {TOLERANCE:.0e}), top-1 mismatches {result.top1_mismatches}"
            + (f" (and {result.ties} on near-ties)" if result.ties else "")
            + (" (float32 graph)" if reduced else "")
        )
        if not reduced:
            return 0 if result.ok else EXIT_CHECK
        gated = gate(out, fp32, _normalised(images, meta), labels)
        record_gate(out, gated)  # the server serves a reduced file only if this passed
        print(gated.report())
        return 0 if result.ok and gated.ok else EXIT_CHECK
    finally:
        if reduced:
            fp32.unlink(missing_ok=True)
