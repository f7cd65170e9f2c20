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

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

import rstmodel
from export.bake import bake, check_quarter_turns
from export.precision import GATE_POINTS, PRECISIONS, convert, gate, record_gate
from rstmodel.checkpoint import CheckpointMeta, load_checkpoint
from rstmodel.layers import GroupRSTConv, LiftingRSTConv
from train.runtime import use_retaining_allocator

__all__ = [
    "TOLERANCE",
    "CheckResult",
    "ExportError",
    "check_onnx",
    "export_model",
    "export_onnx",
    "group_metadata",
    "onnx_metadata",
    "data_sample",
    "main",
]

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # max |logit difference| accepted by --check
INPUT, OUTPUT = "images", "logits"
EXIT_CHECK, EXIT_SETUP = 1, 2


class ExportError(RuntimeError):
    """Export cannot go on (missing data, a model the exporter cannot handle)."""


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def group_metadata(model: nn.Module) -> dict | None:
    """The group configuration of an RST model (None for a plain one)."""
    convs = [m for m in model.modules() if isinstance(m, (LiftingRSTConv, GroupRSTConv))]
    if not convs:
        return None
    spec = convs[0].spec
    group = next((m for m in convs if isinstance(m, GroupRSTConv)), None)
    return {
        "rotations": spec.rotations,
        "scales": spec.num_scales,
        "radii": [float(r) for r in spec.scales],
        "kernel_sizes": list(spec.kernel_sizes),
        "basis": spec.family.value,
        "K": spec.num_funcs,
        "taps": None
        if group is None
        else {
            "rotation": group.rotation_taps,
            "scale": group.scale_taps,
            "mode": group.tap_mode.value,
        },
    }


def onnx_metadata(model: nn.Module, meta: CheckpointMeta, checkpoint_sha256: str) -> dict[str, str]:
    """``metadata_props`` for a model loaded from a checkpoint (see the module docstring)."""
    accuracy = {k: v for k, v in meta.metrics.items() if k.endswith("acc") or k == "epoch"}
    if not any(k.endswith("acc") for k in accuracy):
        accuracy = None
    size = meta.input_size
    return {
        "rstcnn.model": meta.model_name,
        "rstcnn.class_names": json.dumps(list(meta.class_names)),
        "rstcnn.input_size": json.dumps([meta.in_channels, size, size]),
        "rstcnn.normalization": json.dumps({"mean": list(meta.mean), "std": list(meta.std)}),
        "rstcnn.group": json.dumps(group_metadata(model)),
        "rstcnn.checkpoint_sha256": checkpoint_sha256,
        "rstcnn.version": rstmodel.__version__,
        "rstcnn.accuracy": json.dumps(accuracy),
    }


def export_model(
    model: nn.Module,
    path: str | Path,
    *,
    input_shape: tuple[int, int, int],
    metadata: Mapping[str, str] | None = None,
    opset: int | None = None,
    form: Any = None,
    quarter_turns: bool = False,
) -> Path:
    """Bake ``model`` and write it to ``path`` as one ONNX file (dynamic batch axis),
    with ``metadata`` as ``metadata_props``. ``input_shape`` is (C, H, W); ``form``: the
    baking's per-scale form rule, ``quarter_turns`` its quarter-turn form (``export.bake.bake``;
    default its own rule, no quarter turns)."""
    path = Path(path)
    model = copy.deepcopy(model).float().cpu()
    rule = {} if form is None else {"form": form}
    baked = bake(model, torch.zeros(1, *input_shape), quarter_turns=quarter_turns, **rule)
    example = torch.zeros(2, *input_shape)
    with tempfile.TemporaryDirectory() as tmp:
        program = torch.onnx.export(
            baked,
            (example,),
            dynamo=True,
            input_names=[INPUT],
            output_names=[OUTPUT],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            external_data=False,
            opset_version=opset,
            verbose=False,
        )
        raw = Path(tmp) / "model.onnx"
        program.save(raw, external_data=False)
        proto = onnx.load(raw)
    batch = proto.graph.input[0].type.tensor_type.shape.dim[0]
    if not batch.dim_param:
        raise ExportError(f"the exported graph fixed the batch axis to {batch.dim_value}")
    del proto.metadata_props[:]
    metadata = {**(metadata or {}), QUARTER_TURNS: json.dumps(quarter_turn_invariant(proto))}
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, str(value)
    proto.doc_string = "rstcnn model exported by export/to_onnx.py"
    onnx.checker.check_model(proto)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f".{path.name}.tmp")
    onnx.save(proto, tmp_path)
    tmp_path.replace(path)
    return path


QUARTER_TURNS = "rstcnn.quarter_turn_invariant"


def quarter_turn_invariant(proto: onnx.ModelProto, tolerance: float = 1e-4) -> bool:
    """Whether the graph's logits stay the same (within ``tolerance`` of their scale) when
    random inputs are turned by a quarter turn, measured through onnxruntime. Recorded in
    the metadata, so a server may reuse one prediction for an image's four turns."""
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim[1:]]
    if len(dims) != 3 or dims[1] != dims[2]:
        return False
    x = np.random.default_rng(0).standard_normal((2, *dims)).astype(np.float32)
    plain = session.run([OUTPUT], {INPUT: x})[0]
    limit = tolerance * max(1.0, float(np.abs(plain).max()))
    for turns in (1, 2, 3):
        turned = np.ascontiguousarray(np.rot90(x, turns, axes=(2, 3)))
        if np.abs(session.run([OUTPUT], {INPUT: turned})[0] - plain).max() > limit:
            return False
    return True


def export_onnx(
    checkpoint: str | Path, out: str | Path | None = None, *, opset: int | None = None
) -> tuple[Path, nn.Module, CheckpointMeta]:
    """Load ``checkpoint`` and export it (default ``out``: beside it, ``.onnx``).
    Raises ``CheckpointError`` / ``FileNotFoundError`` for a bad checkpoint."""
    checkpoint = Path(checkpoint)
    model, meta = load_checkpoint(checkpoint)
    out = checkpoint.with_suffix(".onnx") if out is None else Path(out)
    shape = (meta.in_channels, meta.input_size, meta.input_size)
    metadata = onnx_metadata(model, meta, file_sha256(checkpoint))
    export_model(model, out, input_shape=shape, metadata=metadata, opset=opset)
    return out, model, meta


# ---------------------------------------------------------------- parity check


@dataclass(frozen=True)
class CheckResult:
    count: int
    max_abs_diff: float
    top1_mismatches: int

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= TOLERANCE and self.top1_mismatches == 0


def _dataset_of(meta: CheckpointMeta) -> str:
    run = meta.extra.get("run") if isinstance(meta.extra, dict) else None
    if isinstance(run, dict) and isinstance(run.get("data"), str):
        return run["data"]
    if tuple(meta.class_names) == tuple(str(d) for d in range(10)):
        return "rs-mnist"
    return "rs-fashion"


def data_sample(
    meta: CheckpointMeta,
    count: int,
    *,
    stl10_root: str | Path | None = None,
    split: str = "test",
    labels: bool = False,
):
    """``count`` uint8 images ``[N, C, H, W]`` (and their int64 labels with ``labels``) of
    the data set the checkpoint was trained on, read from the prepared cache (never prepared
    here). ``split``: "test" (the end of the RS permutation) or "train" (its start: the
    images a model was trained on, for calibration)."""
    from rstmodel.data import RSConfig, default_cache_dir, load_stl10
    from rstmodel.data.cache import load_cached

    if split not in ("test", "train"):
        raise ValueError(f"split must be 'test' or 'train', got {split!r}")
    name = _dataset_of(meta)
    if name == "stl10":
        if stl10_root is None:
            raise ExportError("--check and int8 calibration on an STL-10 model need --stl10-root")
        data = load_stl10(stl10_root)
        images, targets = (
            (data.test_images, data.test_labels)
            if split == "test"
            else (data.train_images, data.train_labels)
        )
        return (images[:count], targets[:count]) if labels else images[:count]
    run = meta.extra.get("run", {}) if isinstance(meta.extra, dict) else {}
    config = RSConfig(name, realisation=int(run.get("realisation", 0) or 0))
    path = config.cache_path(default_cache_dir())
    cached = load_cached(path, {"dataset": config.dataset.value, "params": config.params()})
    if cached is None:
        raise ExportError(
            f"no prepared {name} data at {path}: run `python train/prepare_data.py --data {name}`"
        )
    arrays, _ = cached
    order = arrays["order"]
    # the start of the permutation is training data, its end test data
    chosen = order[:count] if split == "train" else order[len(order) - count :]
    picked = np.sort(chosen)
    images = arrays["images"][picked][:, None]
    return (images, arrays["labels"][picked]) if labels else images


def check_onnx(
    path: str | Path,
    model: nn.Module,
    images: np.ndarray,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    *,
    batch: int = 16,
) -> CheckResult:
    """onnxruntime against the eager ``model`` (eval mode) on uint8 ``images [N, C, H, W]``."""
    import onnxruntime as ort

    if model.training:
        raise ValueError("check_onnx compares eval-mode outputs: call model.eval() first")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    param = next(model.parameters())
    worst, mismatches = 0.0, 0
    for start in range(0, images.shape[0], batch):
        x = (images[start : start + batch].astype(np.float32) / 255 - m) / s
        with torch.no_grad():
            eager = model(torch.from_numpy(x).to(param)).float().cpu().numpy()
        onnx_out = session.run([OUTPUT], {INPUT: x})[0]
        worst = max(worst, float(np.abs(eager - onnx_out).max()))
        mismatches += int((eager.argmax(1) != onnx_out.argmax(1)).sum())
    return CheckResult(int(images.shape[0]), worst, mismatches)


# ---------------------------------------------------------------- CLI


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


def _normalised(images: np.ndarray, meta: CheckpointMeta) -> np.ndarray:
    mean = np.asarray(meta.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(meta.std, dtype=np.float32).reshape(1, -1, 1, 1)
    return ((images.astype(np.float32) / 255 - mean) / std).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    args = parse_args(argv)
    reduced = args.precision != "fp32"
    try:
        model, meta = load_checkpoint(args.checkpoint)
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
    out = args.checkpoint.with_suffix(".onnx") if args.out is None else args.out
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
                calibration_source=f"{_dataset_of(meta)} training split, {args.calibration} "
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


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: huge pages): re-exec once
    sys.exit(main())
