"""Reduced-precision copies of an exported float32 model, and the checks that gate them.

- ``int8``: onnxruntime's static quantization in QDQ form (QuantizeLinear /
  DequantizeLinear around each quantized op) of the convolutions that reduce over several
  channels (in the RST models the basis form's 1x1 channel mixing, which is most of the
  multiply-adds and runs ~5x faster in int8 here; the single-channel basis banks run no
  faster in int8 and stay float32), int8 weights per output channel, uint8 activations with
  min-max ranges calibrated on real training images of the model's data set and shared by
  the rotation and scale branches of a layer, so a quarter turn rounds on the same grid;
- ``fp16``: weights and activations in float16 for GPUs and TensorRT, the input and output
  kept float32.

Either way the graph keeps the float32 input ``images`` and output ``logits`` and the
``rstcnn.*`` metadata, so ``serve.Classifier`` runs every variant unchanged; the metadata
adds ``rstcnn.precision`` and, for int8, ``rstcnn.calibration`` (how many images, from
where, which method).

A converted file passes the gate (``gate``) when its top-1 accuracy on real test images is
within ``GATE_POINTS`` of the float32 model's on the same images.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

__all__ = [
    "GATE_POINTS",
    "PRECISIONS",
    "GateResult",
    "accuracy_drop_points",
    "convert",
    "gate",
    "record_gate",
    "quarter_turn_change",
    "current",
]

PRECISIONS = ("fp32", "int8", "fp16")
GATE_POINTS = 0.5  # accuracy points a reduced-precision file may lose against float32
INPUT, OUTPUT = "images", "logits"


def accuracy_drop_points(reference: float, accuracy: float) -> float:
    """Points of accuracy lost against ``reference`` (fractions in, points out), rounded
    to 1e-9 points so that a drop of whole images compares exactly with ``GATE_POINTS``
    (5 of 1,000 images is 0.5 points, not 0.5000000000000004)."""
    return round(100 * (reference - accuracy), 9)


def convert(
    src: str | Path,
    dst: str | Path,
    precision: str,
    *,
    calibration: np.ndarray | None = None,
    calibration_source: str = "",
) -> Path:
    """Write ``src`` (a float32 model from ``export/to_onnx.py``) at ``precision`` to
    ``dst``. ``calibration``: normalised float32 ``[N, C, H, W]`` images, needed for int8;
    ``calibration_source`` says where they came from (recorded in the metadata)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    src, dst = Path(src), Path(dst)
    source = onnx.load(str(src))
    metadata = {p.key: p.value for p in source.metadata_props}
    metadata["rstcnn.precision"] = precision
    with tempfile.TemporaryDirectory() as tmp:
        if precision == "int8":
            if calibration is None or len(calibration) == 0:
                raise ValueError("int8 needs calibration images")
            proto = _quantize_int8(src, Path(tmp), np.asarray(calibration, dtype=np.float32))
            metadata["rstcnn.calibration"] = json.dumps(
                {
                    "images": int(len(calibration)),
                    "source": calibration_source,
                    "method": "minmax",
                    "scope": "multi-channel convolutions",
                    "weights": "int8 per channel",
                    "activations": "uint8, one range per layer",
                    "format": "QDQ",
                }
            )
        elif precision == "fp16":
            from rstcnn.export.to_tensorrt import fp16_model  # the converter TensorRT builds use

            proto = fp16_model(source)
        else:
            proto = source
    _set_metadata(proto, metadata)
    onnx.checker.check_model(proto)
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = dst.with_name(f".{dst.name}.tmp")
    onnx.save(proto, str(partial))
    partial.replace(dst)
    return dst


def _quantized_convs(model: onnx.ModelProto) -> dict[tuple, list[onnx.NodeProto]]:
    """The convolutions int8 makes faster: those that reduce over more than one input
    channel per group. In this project's graphs these are the basis form's 1x1 channel
    mixing, the direct form's per-branch filters and the CNN's convolutions; a
    single-channel convolution (the basis banks, a first layer on grey images) is bound by
    unfolding its input, so onnxruntime runs it no faster in int8. Grouped by weight and
    input shape: the (rotation, scale) branches of one layer fall in one group."""
    model = onnx.shape_inference.infer_shapes(model)
    weights = {w.name: w for w in model.graph.initializer}
    shapes = {
        v.name: tuple(d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim)
        for v in [*model.graph.value_info, *model.graph.input]
    }
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "Conv" else None
        if weight is not None and weight.dims[1] > 1:
            key = (tuple(weight.dims), shapes.get(node.input[0]))
            groups.setdefault(key, []).append(node)
    return groups


def _conv_activations(
    prepared: Path, batches: Iterable[np.ndarray], groups
) -> Iterator[dict[str, np.ndarray]]:
    """For each of the calibration ``batches``, every quantized conv's input and output
    (the convs of ``_quantized_convs``' ``groups``), by name, from one onnxruntime pass."""
    import onnxruntime as ort

    model = onnx.load(str(prepared))
    sides = [(n.input[0], n.output[0]) for nodes in groups.values() for n in nodes]
    names = sorted({name for pair in sides for name in pair})
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(
        onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
        for n in names
        if n not in known
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x in batches:
        yield dict(zip(names, session.run(names, {INPUT: x}), strict=True))


def _share_in_groups(groups, lo: Mapping[str, float], hi: Mapping[str, float]) -> dict[str, list]:
    """Quantization overrides giving every conv of a group one range for its inputs and one
    for its outputs: the widest of its members' ``lo`` / ``hi``."""
    overrides: dict[str, list] = {}
    for nodes in groups.values():
        for side in (0, 1):
            members = [(n.input[0], n.output[0])[side] for n in nodes]
            shared = {
                "rmin": np.float32(min(lo[m] for m in members)),
                "rmax": np.float32(max(hi[m] for m in members)),
            }
            overrides.update((m, [dict(shared)]) for m in members)
    return overrides


def _shared_ranges(prepared: Path, batches: Iterable[np.ndarray], groups) -> dict[str, list]:
    """Min-max ranges (widened to hold 0) of every quantized conv's input and output over
    the calibration ``batches``, made equal within each group of ``_quantized_convs``.
    In the group layout those convs are the (rotation, scale) branches of one layer: one
    range for all of them rounds a turned image's branches on the same grid as the
    original's (int8 weights are per output channel, and a turned filter has the same
    channel maxima), so quarter turns change the int8 logits only where a float32 round-off
    crosses a rounding boundary (per-branch ranges round each branch on its own grid)."""
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    for values in _conv_activations(prepared, batches, groups):
        for name, value in values.items():
            lo[name] = min(lo.get(name, 0.0), float(value.min()))
            hi[name] = max(hi.get(name, 0.0), float(value.max()))
    return _share_in_groups(groups, lo, hi)


def _quantize_int8(src: Path, tmp: Path, calibration: np.ndarray) -> onnx.ModelProto:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class OneBatch(CalibrationDataReader):
        """onnxruntime's own calibration pass: every range it would set is overridden, so
        one small batch is enough for it."""

        def __init__(self) -> None:
            self._batches = iter([{INPUT: np.ascontiguousarray(calibration[:1])}])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._batches, None)

    prepared, quantized = tmp / "prepared.onnx", tmp / "int8.onnx"
    quant_pre_process(str(src), str(prepared))  # shape inference and graph clean-up first
    groups = _quantized_convs(onnx.load(str(prepared)))
    if not groups:
        raise ValueError("int8: the model has no multi-channel convolution to quantize")
    batches = (np.ascontiguousarray(calibration[i : i + 8]) for i in range(0, len(calibration), 8))
    overrides = _shared_ranges(prepared, batches, groups)
    quantize_static(
        str(prepared),
        str(quantized),
        OneBatch(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        nodes_to_quantize=[n.name for nodes in groups.values() for n in nodes],
        extra_options={"TensorQuantOverrides": overrides},
    )
    return onnx.load(str(quantized))


def _set_metadata(proto: onnx.ModelProto, metadata: Mapping[str, str]) -> None:
    del proto.metadata_props[:]
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, str(value)


# ---------------------------------------------------------------- checks


def _session(path: str | Path) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _logits(session: Any, x: np.ndarray, batch: int = 32) -> np.ndarray:
    return np.concatenate(
        [session.run([OUTPUT], {INPUT: x[i : i + batch]})[0] for i in range(0, len(x), batch)]
    )


def quarter_turn_change(path: str | Path, x: np.ndarray, logits: np.ndarray | None = None):
    """max |logits(rot90 x) - logits(x)| through onnxruntime, for normalised float32
    ``x [N, C, H, W]`` (0 up to round-off for an exactly invariant float32 model);
    ``logits``: those of ``x`` when already computed."""
    session = _session(path)
    turned = np.ascontiguousarray(np.rot90(x, 1, axes=(2, 3)))
    plain = _logits(session, x) if logits is None else logits
    return float(np.abs(_logits(session, turned) - plain).max())


@dataclass(frozen=True)
class GateResult:
    """A reduced-precision file against its float32 model on ``count`` test images."""

    precision: str
    count: int
    accuracy: float  # of the converted file
    reference_accuracy: float  # of the float32 model
    top1_agreement: float
    max_abs_diff: float
    quarter_turn: float  # of the converted file
    reference_quarter_turn: float

    @property
    def drop_points(self) -> float:
        return accuracy_drop_points(self.reference_accuracy, self.accuracy)

    @property
    def ok(self) -> bool:
        return self.drop_points <= GATE_POINTS

    def report(self) -> str:
        return (
            f"gate {'ok' if self.ok else 'FAILED'} ({self.precision}, {self.count} test images): "
            f"accuracy {100 * self.accuracy:.2f} % against {100 * self.reference_accuracy:.2f} % "
            f"in float32 (drop {self.drop_points:+.2f} points, limit {GATE_POINTS}); top-1 "
            f"agreement {100 * self.top1_agreement:.1f} %, max |logit diff| "
            f"{self.max_abs_diff:.3g}; quarter turn max |logit change| {self.quarter_turn:.3g} "
            f"(float32 {self.reference_quarter_turn:.3g})"
        )


def record_gate(path: str | Path, result: GateResult) -> None:
    """Write ``result`` into the file's metadata as ``rstcnn.gate`` (JSON: passes, images,
    accuracy, reference_accuracy, drop_points, limit_points), so a server can tell a checked
    reduced-precision file from an unchecked one (``serve.variants``). Atomic rewrite."""
    path = Path(path)
    proto = onnx.load(str(path))
    metadata = {p.key: p.value for p in proto.metadata_props}
    metadata["rstcnn.gate"] = json.dumps(
        {
            "passes": result.ok,
            "images": result.count,
            "accuracy": result.accuracy,
            "reference_accuracy": result.reference_accuracy,
            "drop_points": result.drop_points,
            "limit_points": GATE_POINTS,
        }
    )
    _set_metadata(proto, metadata)
    tmp = path.with_name(f".{path.name}.tmp")
    onnx.save(proto, str(tmp))
    tmp.replace(path)


def gate(path: str | Path, reference: str | Path, x: np.ndarray, labels: np.ndarray) -> GateResult:
    """Compare the converted file ``path`` with the float32 file ``reference`` on
    normalised float32 test images ``x`` with their ``labels``."""
    converted, base = _session(path), _session(reference)
    out, ref = _logits(converted, x), _logits(base, x)
    named = converted.get_modelmeta().custom_metadata_map.get("rstcnn.precision", "fp32")
    return GateResult(
        precision=named,
        count=len(x),
        accuracy=float((out.argmax(1) == labels).mean()),
        reference_accuracy=float((ref.argmax(1) == labels).mean()),
        top1_agreement=float((out.argmax(1) == ref.argmax(1)).mean()),
        max_abs_diff=float(np.abs(out - ref).max()),
        quarter_turn=quarter_turn_change(path, x, out),
        reference_quarter_turn=quarter_turn_change(reference, x, ref),
    )


def current(path: str | Path, checkpoint: str | Path) -> tuple[bool, str]:
    """Whether the reduced-precision file ``path`` may stand in for ``checkpoint``: it
    exists, was exported from this very checkpoint file (``rstcnn.checkpoint_sha256``) and
    its recorded accuracy check passed. Also says why not."""
    import hashlib

    path = Path(path)
    if not path.is_file():
        return False, f"{path}: no such file"
    try:
        meta = {
            p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props
        }
        gate_record = json.loads(meta.get("rstcnn.gate", "{}"))
    except Exception as err:  # noqa: BLE001 - any unreadable file is simply not current
        return False, f"{path}: unreadable ({err})"
    digest = hashlib.sha256(Path(checkpoint).read_bytes()).hexdigest()
    if meta.get("rstcnn.checkpoint_sha256") != digest:
        return False, f"{path}: exported from another version of {checkpoint}"
    if not gate_record.get("passes"):
        return False, f"{path}: no passing accuracy check recorded"
    return True, f"{path}: current, accuracy check passed on {gate_record.get('images')} images"


def main(argv: list[str] | None = None) -> int:
    """``python -m export.precision current FILE CHECKPOINT``: exit 0 when FILE may stand in
    for CHECKPOINT (``current``), 1 with the reason on stderr otherwise."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m export.precision")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("current", help="is a reduced-precision file current for a checkpoint")
    check.add_argument("file")
    check.add_argument("checkpoint")
    args = parser.parse_args(argv)
    ok, why = current(args.file, args.checkpoint)
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
