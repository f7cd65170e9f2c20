"""Build a TensorRT engine from an exported ONNX model.

    python export/to_tensorrt.py MODEL.onnx -o MODEL.plan [--fp16] [--max-batch N]

Through the TensorRT Python API (imported lazily): ONNX parser, one optimisation profile
over the batch axis (1 .. N, tuned for N / 2), ``build_serialized_network``. ``--fp16``:
TensorRT 10 sets the builder's FP16 flag; TensorRT 11 dropped that flag (its networks are
strongly typed), so the engine is built from an FP16 copy of the graph (``fp16_model``:
weights in float16, float32 input and output through Casts). The model's ``rstcnn.*``
metadata goes to ``MODEL.plan.json`` beside the engine, for ``Classifier.from_tensorrt``.

An engine is built on, and for, the GPU it will run on: without TensorRT or a CUDA GPU
this exits with 2 and says which is missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["build_engine", "fp16_model", "metadata_path", "missing_requirements", "main"]

log = logging.getLogger(__name__)

EXIT_SETUP, EXIT_BUILD = 2, 1


def metadata_path(plan: str | Path) -> Path:
    """``MODEL.plan -> MODEL.plan.json``."""
    plan = Path(plan)
    return plan.with_name(plan.name + ".json")


def missing_requirements() -> list[str]:
    """What this machine lacks for building or running an engine (empty if nothing)."""
    missing = []
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        missing.append(
            "TensorRT's Python package (`pip install tensorrt`, served from NVIDIA's package "
            "index, or the project's `tensorrt` extra)"
        )
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if not gpu:
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    return missing


def fp16_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float16: float32 initializers and constants become
    float16, the input is cast to float16 and the output back to float32, so callers keep
    float32 buffers."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name)
            )
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(
                    numpy_helper.from_array(
                        numpy_helper.to_array(attr.t).astype(np.float16), attr.t.name
                    )
                )
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to" and attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.FLOAT16
    renames = {}
    for value in graph.input:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            renames[value.name] = f"{value.name}_fp16"
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
    casts_in = [
        helper.make_node("Cast", [name], [new], to=TensorProto.FLOAT16, name=f"cast_{new}")
        for name, new in renames.items()
    ]
    casts_out = []
    for value in graph.output:
        if value.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        half = f"{value.name}_fp16"
        for node in graph.node:
            node.output[:] = [half if name == value.name else name for name in node.output]
            node.input[:] = [half if name == value.name else name for name in node.input]
        casts_out.append(
            helper.make_node(
                "Cast", [half], [value.name], to=TensorProto.FLOAT, name=f"cast_{half}"
            )
        )
    nodes = casts_in + list(graph.node) + casts_out
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    onnx.checker.check_model(out)
    return out


def _trt_major(trt) -> int:
    return int(str(trt.__version__).split(".")[0])


def build_engine(
    onnx_path: str | Path, plan_path: str | Path, *, fp16: bool = False, max_batch: int = 128
) -> Path:
    """Build and write a serialized engine (and its metadata JSON). Raises RuntimeError
    with TensorRT's messages when parsing or building fails."""
    import tensorrt as trt

    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    model = onnx.load(onnx_path)
    metadata = {p.key: p.value for p in model.metadata_props}
    strongly_typed = fp16 and (_trt_major(trt) >= 11 or not hasattr(trt.BuilderFlag, "FP16"))
    if strongly_typed:
        model = fp16_model(model)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if fp16 and not strongly_typed:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        rest = tuple(tensor.shape)[1:]
        if min(rest) < 1:
            raise RuntimeError(f"input {tensor.name} has dynamic axes besides the batch: {rest}")
        opt = max(1, max_batch // 2)
        profile.set_shape(tensor.name, (1, *rest), (opt, *rest), (max_batch, *rest))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path} (see its log)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    metadata["rstcnn.tensorrt"] = json.dumps(
        {"version": str(trt.__version__), "fp16": fp16, "max_batch": max_batch}
    )
    metadata_path(plan_path).write_text(json.dumps(metadata, indent=2) + "\n")
    return plan_path


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    parser = argparse.ArgumentParser(
        prog="python export/to_tensorrt.py",
        description="Build a TensorRT engine from an ONNX model exported by export/to_onnx.py.",
    )
    parser.add_argument("onnx", type=Path, help="MODEL.onnx")
    parser.add_argument("-o", "--out", type=Path, help="engine file (default: MODEL.plan)")
    parser.add_argument("--fp16", action="store_true", help="half-precision engine")
    parser.add_argument("--max-batch", type=int, default=128, help="largest batch (default 128)")
    args = parser.parse_args(argv)
    if args.max_batch < 1:
        parser.error("--max-batch must be >= 1")
    if not args.onnx.is_file():
        print(f"error: no ONNX model at {args.onnx}", file=sys.stderr)
        return EXIT_SETUP
    missing = missing_requirements()
    if missing:
        print(
            "error: building a TensorRT engine needs " + " and ".join(missing) + "; "
            "this machine lacks them. The ONNX model runs without them (serve.Classifier).",
            file=sys.stderr,
        )
        return EXIT_SETUP
    out = args.out or args.onnx.with_suffix(".plan")
    try:
        build_engine(args.onnx, out, fp16=args.fp16, max_batch=args.max_batch)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BUILD
    log.info("wrote %s and %s", out, metadata_path(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
