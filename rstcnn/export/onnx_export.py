"""A checkpoint's ONNX graph (the baked model and the metadata every exported file carries)
and its check against the eager model; ``export/to_onnx.py`` is the command line over it
(its docstring lists the metadata keys)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

import rstmodel
from rstcnn.export.bake import bake
from rstmodel.checkpoint import CheckpointMeta, load_checkpoint
from rstmodel.layers import GroupRSTConv, LiftingRSTConv

__all__ = [
    "TOLERANCE",
    "CheckResult",
    "ExportError",
    "check_onnx",
    "export_model",
    "export_onnx",
    "group_metadata",
    "logits_keep_under_quarter_turns",
    "onnx_metadata",
    "data_sample",
    "dataset_of",
]

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # max |logit difference| accepted by --check
INPUT, OUTPUT = "images", "logits"


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
    """Whether the graph's logits stay the same (``logits_keep_under_quarter_turns``),
    measured through onnxruntime. Recorded in the metadata, so a server may reuse one
    prediction for an image's four turns."""
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim[1:]]
    return logits_keep_under_quarter_turns(
        lambda x: session.run([OUTPUT], {INPUT: x})[0], dims, tolerance
    )


def logits_keep_under_quarter_turns(run: Any, dims: Sequence[int], tolerance: float = 1e-4) -> bool:
    """Whether ``run`` (float32 ``[N, C, H, W]`` -> logits) gives the same logits, within
    ``tolerance`` of their scale, for random inputs of size ``dims`` (C, H, W) turned by one,
    two and three quarter turns."""
    if len(dims) != 3 or dims[1] != dims[2]:
        return False
    x = np.random.default_rng(0).standard_normal((2, *dims)).astype(np.float32)
    plain = np.asarray(run(x))
    limit = tolerance * max(1.0, float(np.abs(plain).max()))
    for turns in (1, 2, 3):
        turned = np.ascontiguousarray(np.rot90(x, turns, axes=(2, 3)))
        if np.abs(np.asarray(run(turned)) - plain).max() > limit:
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
    """``top1_mismatches``: images whose top-1 class differs between onnxruntime and eager
    although eager's two best logits lie more than ``2 * TOLERANCE`` apart; ``ties``: top-1
    changes on images whose two best lie closer (a near-tie that round-off within the
    tolerance may turn either way). With every logit within TOLERANCE, a mismatch cannot
    happen: the count is the second, independent witness."""

    count: int
    max_abs_diff: float
    top1_mismatches: int
    ties: int = 0

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= TOLERANCE and self.top1_mismatches == 0


def dataset_of(meta: CheckpointMeta) -> str:
    run = meta.extra.get("run") if isinstance(meta.extra, dict) else None
    if isinstance(run, dict) and isinstance(run.get("data"), str):
        return run["data"]
    if tuple(meta.class_names) == tuple(str(d) for d in range(10)):
        return "rs-mnist"
    return "rs-fashion"


def data_sample(
    meta: CheckpointMeta,
    count: int | None,
    *,
    stl10_root: str | Path | None = None,
    split: str = "test",
    labels: bool = False,
):
    """``count`` uint8 images ``[N, C, H, W]`` (and their int64 labels with ``labels``) of
    the data set the checkpoint was trained on, read from the prepared cache (never prepared
    here). ``split``: "test" (the end of the RS permutation) or "train" (its start: the
    images a model was trained on, for calibration). ``count`` None: the run's whole split
    (RS data: the images after its ``train_size`` + ``val_size``, or its training images;
    STL-10: the whole test or training set)."""
    from rstmodel.data import NUM_VAL, RSConfig, default_cache_dir, load_stl10
    from rstmodel.data.cache import load_cached

    if split not in ("test", "train"):
        raise ValueError(f"split must be 'test' or 'train', got {split!r}")
    name = dataset_of(meta)
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
    if count is None:
        if "train_size" not in run:
            raise ExportError("the checkpoint does not record its train_size: pass a count")
        train, val = int(run["train_size"]), run.get("val_size")
        val = NUM_VAL if val is None else int(val)
        count = train if split == "train" else len(order) - train - val
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
    worst, mismatches, ties = 0.0, 0, 0
    for start in range(0, images.shape[0], batch):
        x = (images[start : start + batch].astype(np.float32) / 255 - m) / s
        with torch.no_grad():
            eager = model(torch.from_numpy(x).to(param)).float().cpu().numpy()
        onnx_out = session.run([OUTPUT], {INPUT: x})[0]
        worst = max(worst, float(np.abs(eager - onnx_out).max()))
        changed = eager.argmax(1) != onnx_out.argmax(1)
        best_two = np.sort(eager, axis=1)[:, -2:]
        tie = best_two[:, 1] - best_two[:, 0] <= 2 * TOLERANCE
        mismatches += int((changed & ~tie).sum())
        ties += int((changed & tie).sum())
    return CheckResult(int(images.shape[0]), worst, mismatches, ties)


# ---------------------------------------------------------------- CLI
