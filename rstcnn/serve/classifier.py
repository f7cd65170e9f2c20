"""Inference on exported models: onnxruntime (or TensorRT), numpy and Pillow, no torch.

``Classifier.from_onnx(path)`` reads the model and its ``rstcnn.*`` metadata (written by
``export/to_onnx.py``): class names, input size ``[C, H, W]`` and normalisation, so one
client serves every exported model. Images go through

    prepare    any accepted image(s) -> float32 [N, C, H, W] in [0, 1] at the model's size
    normalize  (x - mean) / std, per channel
    run_logits one backend call per chunk of ``max_batch`` images -> [N, classes]

and ``predict_proba`` (softmax) / ``predict`` (top-k ``Prediction`` lists) chain them.

Accepted images, alone or in a list (one list may mix them, and sizes may differ):
PIL images of any mode (1, L, P, RGB, RGBA, LA, CMYK, 16-bit grey, ...), file paths
(``str`` / ``Path``), and arrays ``H x W``, ``H x W x 1``, ``H x W x 3``, ``H x W x 4``
that are uint8 (0..255), uint16 (0..65535) or float in [0, 1]; a 4-D array is a batch of
``H x W x C`` images. Files and PIL images are read by ``serve.images.pixels``, the rules the
HTTP API and the web app use too (transparency flattened on black, the data sets'
background; over ``WORKING_SIDE`` pixels on a side box-reduced first); then grey <-> RGB
(ITU-R 601 luma), a bicubic resize that keeps the aspect
ratio and black padding of the short side to the model's size. Files are opened by
``serve.images.open_image`` (accepted formats only, size bounded from the header). Anything
else (an empty batch, an unreadable or non-image file, more than ``MAX_PIXELS`` pixels, NaN
or inf, other shapes or dtypes) raises ``ValueError`` with a message, before the model runs.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .images import MAX_PIXELS, check_size, open_image, pixels

__all__ = ["MAX_PIXELS", "MAX_BATCH", "MAX_MODEL_BYTES", "Classifier", "Prediction"]

log = logging.getLogger(__name__)

# images per backend call; longer inputs run in chunks, so that memory is bounded by the
# chunk (rst_cnn_fb: ~25 MB per image in onnxruntime on the CPU), not by the input's length
MAX_BATCH = 32
EAGER_MAX_BATCH = 11  # measured: a sweep's 22 distinct images in two passes (BENCHMARKS.md)
MAX_MODEL_BYTES = 1 << 30  # an ONNX file larger than this is refused unread

_PREFIX = "rstcnn."
_JSON_KEYS = (
    "class_names",
    "input_size",
    "normalization",
    "group",
    "accuracy",
    "calibration",
    "gate",
    "quarter_turn_invariant",
)
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R 601-2, as PIL's "L"
_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


@dataclass(frozen=True)
class Prediction:
    """One class of one image: its label, index into ``class_names`` and probability."""

    label: str
    index: int
    score: float

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "index": self.index, "score": self.score}


def _decode_metadata(props: dict[str, str]) -> dict[str, Any]:
    """``rstcnn.*`` metadata, JSON values decoded; refuses a model without it."""
    out: dict[str, Any] = dict(props)
    for key in _JSON_KEYS:
        name = _PREFIX + key
        if name in out:
            try:
                out[name] = json.loads(out[name])
            except json.JSONDecodeError as err:
                raise ValueError(f"metadata {name} is not valid JSON: {err}") from None
    missing = [
        _PREFIX + k
        for k in ("class_names", "input_size", "normalization")
        if _PREFIX + k not in out
    ]
    if missing:
        raise ValueError(
            f"not an rstcnn model: no {', '.join(missing)} metadata (export it with "
            "`python export/to_onnx.py CHECKPOINT`)"
        )
    return out


class Classifier:
    """An exported rstcnn model and its preprocessing.

    Attributes: ``name`` (model name), ``class_names``, ``input_size`` (C, H, W),
    ``normalization`` ({"mean", "std"}, per channel, on [0, 1] inputs), ``metadata`` (all
    of the model's metadata, JSON decoded) and ``providers`` (the backends actually used).
    """

    def __init__(
        self,
        run: Callable[[np.ndarray], np.ndarray],
        metadata: dict[str, str],
        providers: Sequence[str],
        *,
        max_batch: int = MAX_BATCH,
    ):
        self.metadata = _decode_metadata(metadata)
        try:
            self._read_metadata()
        except (TypeError, KeyError, AttributeError) as err:
            raise ValueError(f"malformed rstcnn metadata ({type(err).__name__}: {err})") from None
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.providers = list(providers)
        self.max_batch = max_batch
        self.source: str | None = None  # the file it was loaded from, if any
        self._run = run

    def _read_metadata(self) -> None:
        self.name = str(self.metadata.get(_PREFIX + "model", "model"))
        self.class_names = [str(c) for c in self.metadata[_PREFIX + "class_names"]]
        size = self.metadata[_PREFIX + "input_size"]
        norm = self.metadata[_PREFIX + "normalization"]
        if len(size) != 3 or size[0] not in (1, 3) or min(size) < 1:
            raise ValueError(f"metadata input_size must be [C, H, W] with C 1 or 3, got {size}")
        self.input_size = tuple(int(v) for v in size)
        self.normalization = {"mean": list(norm["mean"]), "std": list(norm["std"])}
        channels = self.input_size[0]
        self._mean = np.asarray(norm["mean"], dtype=np.float32).reshape(1, -1, 1, 1)
        self._std = np.asarray(norm["std"], dtype=np.float32).reshape(1, -1, 1, 1)
        if self._mean.size != channels or self._std.size != channels or (self._std <= 0).any():
            raise ValueError(f"metadata normalization needs {channels} means and positive stds")

    def __repr__(self) -> str:
        return (
            f"Classifier({self.name!r}, {len(self.class_names)} classes, "
            f"input {'x'.join(map(str, self.input_size))}, providers={self.providers})"
        )

    # ------------------------------------------------------------ construction

    @classmethod
    def from_onnx(
        cls,
        path: str | Path,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        *,
        memory_arena: bool = False,
        max_batch: int = MAX_BATCH,
        optimization: str = "all",
    ) -> Classifier:
        """Load an ONNX file written by ``export/to_onnx.py``.

        ``providers``: onnxruntime execution providers in order of preference; by default
        CUDA when this onnxruntime has it (the ``gpu`` extra), then the CPU. A requested
        GPU provider that onnxruntime could not start is logged as a warning (it falls
        back to the CPU silently). ``threads``: intra-op threads (default: onnxruntime's).
        ``memory_arena``: onnxruntime's CPU memory arena, which keeps the largest run's
        memory for later runs (off: each run's memory goes back to the system, so a
        process's size returns to where it was after a large batch). ``max_batch``:
        images per backend call. ``optimization``: onnxruntime's graph optimisation level,
        "none", "basic", "extended" or "all" (default; includes the CPU's blocked conv
        layout). The defaults are the fastest settings measured by ``python -m
        serve.session_bench`` (BENCHMARKS.md).
        """
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no ONNX model at {path}")
        if path.stat().st_size > MAX_MODEL_BYTES:
            raise ValueError(f"{path} is larger than {MAX_MODEL_BYTES >> 20} MiB: not loaded")
        available = ort.get_available_providers()
        if providers is None:
            providers = [p for p in ("CUDAExecutionProvider",) if p in available]
            providers.append("CPUExecutionProvider")
        options = ort.SessionOptions()
        options.enable_cpu_mem_arena = bool(memory_arena)
        levels = {
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }
        if optimization not in levels:
            raise ValueError(
                f"optimization must be one of {', '.join(levels)}, got {optimization!r}"
            )
        options.graph_optimization_level = levels[optimization]
        if threads is not None:
            if threads < 1:
                raise ValueError(f"threads must be >= 1, got {threads}")
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        usable = [p for p in providers if p in available] or ["CPUExecutionProvider"]
        try:
            session = ort.InferenceSession(str(path), options, providers=usable)
        except Exception as err:  # onnxruntime raises its own exception types
            raise ValueError(f"{path} is not a loadable ONNX model: {err}") from None
        used = session.get_providers()
        lost = [p for p in providers if p in _GPU_PROVIDERS and p not in used]
        if lost:
            log.warning(
                "%s: %s requested but not usable (not in this onnxruntime, no GPU, or its "
                "libraries are missing); onnxruntime runs on %s",
                path.name,
                ", ".join(lost),
                ", ".join(used),
            )
        props = session.get_modelmeta().custom_metadata_map
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise ValueError(f"{path}: expected one input and one output")
        input_name, output_name = inputs[0].name, outputs[0].name

        def run(batch: np.ndarray) -> np.ndarray:
            return session.run([output_name], {input_name: batch})[0]

        classifier = cls(run, props, used, max_batch=max_batch)
        classifier._check_graph(path.name, inputs[0].shape, outputs[0].shape)
        classifier.source = str(path)
        return classifier

    def _check_graph(self, name: str, input_shape: Sequence[Any], output_shape: Sequence[Any]):
        """The metadata's input size and class count must be the graph's (where the graph
        fixes them): a contradiction would only fail later, inside a run."""
        fixed = [d if isinstance(d, int) else None for d in input_shape]
        if len(fixed) != 4 or any(
            got is not None and got != want
            for got, want in zip(fixed[1:], self.input_size, strict=True)
        ):
            raise ValueError(
                f"{name}: metadata input_size {list(self.input_size)} contradicts the graph's "
                f"input {list(input_shape)} (re-export the checkpoint)"
            )
        classes = output_shape[-1] if output_shape else None
        if len(output_shape) != 2 or (
            isinstance(classes, int) and classes != len(self.class_names)
        ):
            raise ValueError(
                f"{name}: {len(self.class_names)} class names in the metadata, but the graph's "
                f"output is {list(output_shape)} (re-export the checkpoint)"
            )

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        precision: str = "auto",
        threads: int | None = None,
        *,
        max_batch: int = EAGER_MAX_BATCH,
    ) -> Classifier:
        """Serve a checkpoint (``.pt``) by eager torch (``serve.eager``; needs torch):
        ``precision`` "fp32" (exact), "bf16" (autocast), "int8" (autocast with int8
        per-frequency products) or "int16" (float32 with 16-bit integer per-frequency
        products, AVX2 CPUs), each servable only with its recorded accuracy check, or "auto"
        (int8, else bf16, else int16, where the CPU has it and its check passed).
        ``threads``: torch's intra-op threads. ``max_batch``: images per forward pass
        (the eager peak grows with it), a larger call in chunks; concurrent calls are
        joined into passes of up to as many images (``serve.coalesce``)."""
        from .eager import load

        run, metadata, providers = load(path, precision, threads, max_batch)
        classifier = cls(run, metadata, providers, max_batch=max_batch)
        classifier.source = str(path)
        return classifier

    @classmethod
    def from_tensorrt(cls, plan: str | Path) -> Classifier:
        """Load a TensorRT engine written by ``export/to_tensorrt.py`` (metadata from the
        ``.json`` beside it). Needs TensorRT, a CUDA GPU and torch (for device buffers)."""
        from .tensorrt_backend import load_engine

        run, metadata = load_engine(plan)
        return cls(run, metadata, ["TensorRT"])

    # ------------------------------------------------------------ pipeline

    def prepare(self, images: Any) -> np.ndarray:
        """Image(s) -> float32 ``[N, C, H, W]`` in [0, 1] at the model's size."""
        items = _as_list(images)
        channels, height, width = self.input_size
        out = np.empty((len(items), channels, height, width), dtype=np.float32)
        for i, item in enumerate(items):
            try:
                out[i] = _prepare_one(item, channels, height, width)
            except ValueError as err:
                if len(items) == 1:
                    raise
                raise ValueError(f"image {i}: {err}") from None
        return out

    def normalize(self, batch: np.ndarray) -> np.ndarray:
        """``(x - mean) / std`` per channel. float32 ``[N, C, H, W]`` in [0, 1] -> same."""
        batch = self._check_batch(batch)
        return ((batch - self._mean) / self._std).astype(np.float32, copy=False)

    def run_logits(self, batch: np.ndarray) -> np.ndarray:
        """Logits ``[N, classes]`` of an already normalised float32 ``[N, C, H, W]``."""
        batch = self._check_batch(batch)
        step = self.max_batch
        parts = [
            np.asarray(self._run(np.ascontiguousarray(batch[i : i + step])))
            for i in range(0, batch.shape[0], step)
        ]
        return np.concatenate(parts).astype(np.float32, copy=False)

    def predict_proba(self, images: Any) -> np.ndarray:
        """Class probabilities (softmax), float32 ``[N, classes]``."""
        return softmax(self.run_logits(self.normalize(self.prepare(images)))).astype(np.float32)

    def predict(self, images: Any, top_k: int = 5) -> list[list[Prediction]]:
        """The ``top_k`` most probable classes of each image, most probable first."""
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        probs = self.predict_proba(images)
        k = min(int(top_k), probs.shape[1])
        order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        return [
            [Prediction(self.class_names[j], int(j), float(row[j])) for j in idx]
            for row, idx in zip(probs, order, strict=True)
        ]

    def _check_batch(self, batch: Any) -> np.ndarray:
        if not isinstance(batch, np.ndarray):
            raise ValueError(f"expected a numpy array [N, C, H, W], got {type(batch).__name__}")
        if batch.dtype.kind != "f":
            raise ValueError(f"expected a float array, got {batch.dtype}")
        shape = tuple(self.input_size)
        if batch.ndim != 4 or batch.shape[1:] != shape:
            raise ValueError(
                f"expected a batch [N, {', '.join(map(str, shape))}], got shape {batch.shape}"
            )
        if batch.shape[0] == 0:
            raise ValueError("empty batch: give at least one image")
        batch = batch.astype(np.float32, copy=False)
        if not np.isfinite(batch).all():
            raise ValueError("the batch holds NaN or infinite values")
        return batch


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities of logits ``[N, classes]``, computed in float64 -> float64."""
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=1, keepdims=True)
    weights = np.exp(shifted)
    return weights / weights.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------- image handling


def _as_list(images: Any) -> list[Any]:
    if isinstance(images, np.ndarray) and images.ndim == 4:
        if images.shape[1] in (1, 3, 4) and images.shape[-1] not in (1, 3, 4):
            raise ValueError(
                f"array batches are N x H x W x C (channels last), got shape {images.shape}: "
                "channels first? pass array.transpose(0, 2, 3, 1)"
            )
        items: list[Any] = list(images)
    elif isinstance(images, (list, tuple)):
        items = list(images)
    else:
        items = [images]
    if not items:
        raise ValueError("empty batch: give at least one image")
    return items


def _prepare_one(item: Any, channels: int, height: int, width: int) -> np.ndarray:
    """One image -> float32 ``[C, H, W]`` in [0, 1]."""
    if isinstance(item, (str, os.PathLike)):
        values = _channels_last(pixels(open_image(Path(item))))
    elif isinstance(item, Image.Image):
        check_size(*item.size)
        values = _channels_last(pixels(item))
    elif isinstance(item, np.ndarray):
        values = _array_pixels(item)
    else:
        raise ValueError(
            f"unsupported image type {type(item).__name__}: give a PIL image, a file path "
            "or a numpy array"
        )
    return _fit(_to_channels(values, channels), height, width)


def _channels_last(values: np.ndarray) -> np.ndarray:
    """``serve.images.pixels``' ``[H, W]`` or ``[H, W, 3]`` -> ``[H, W, 1 or 3]``."""
    return values[..., None] if values.ndim == 2 else values


def _float_pixels(array: np.ndarray) -> np.ndarray:
    if not np.isfinite(array).all():
        raise ValueError("the image holds NaN or infinite values")
    low, high = float(array.min()), float(array.max())
    if low < 0 or high > 1:
        raise ValueError(
            f"float images must lie in [0, 1], got values in [{low:g}, {high:g}] "
            "(uint8 data: pass it as uint8, or divide by 255)"
        )
    return array.astype(np.float32, copy=False)


def _array_pixels(array: np.ndarray) -> np.ndarray:
    """An array image -> float32 ``[H, W, 1 or 3]`` in [0, 1], alpha on black."""
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        hint = ""
        if array.ndim == 3 and array.shape[0] in (1, 3, 4):
            hint = " (channels first? pass array.transpose(1, 2, 0))"
        elif array.ndim == 3:
            hint = f" (a stack of {array.shape[0]} grey images? pass array[..., None])"
        raise ValueError(
            f"array images must be H x W, H x W x 1, H x W x 3 or H x W x 4, got shape "
            f"{array.shape}{hint}; a batch is a list of images or an array N x H x W x C"
        )
    check_size(array.shape[1], array.shape[0])
    if array.dtype == np.uint8:
        pixels = array.astype(np.float32) / 255
    elif array.dtype == np.uint16:
        pixels = array.astype(np.float32) / 65535
    elif array.dtype.kind == "f":
        pixels = _float_pixels(array)
    else:
        raise ValueError(
            f"unsupported dtype {array.dtype}: give uint8 (0..255), uint16 or float in [0, 1]"
        )
    if pixels.shape[-1] == 4:
        pixels = pixels[..., :3] * pixels[..., 3:]
    return pixels


def _to_channels(pixels: np.ndarray, channels: int) -> np.ndarray:
    """``[H, W, 1 or 3]`` -> ``[H, W, channels]``."""
    if pixels.shape[-1] == channels:
        return pixels
    if channels == 1:
        return (pixels @ _LUMA)[..., None]
    return np.repeat(pixels, channels, axis=-1)


def _fit(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize (bicubic) to fit the model's size with the aspect ratio kept, then pad the
    short side with black. ``[h, w, C]`` -> ``[C, height, width]``. Resizing first keeps
    the cost bounded by the input, whatever its aspect ratio."""
    h, w = pixels.shape[:2]
    scale = min(height / h, width / w)
    th, tw = min(height, max(1, round(h * scale))), min(width, max(1, round(w * scale)))
    planes = np.moveaxis(pixels, -1, 0)
    if (th, tw) != (h, w):
        planes = np.stack(
            [
                np.asarray(Image.fromarray(np.ascontiguousarray(p)).resize((tw, th), Image.BICUBIC))
                for p in planes
            ]
        )
        planes = np.clip(planes, 0, 1)
    if (th, tw) == (height, width):
        return np.ascontiguousarray(planes, dtype=np.float32)
    out = np.zeros((planes.shape[0], height, width), dtype=np.float32)
    top, left = (height - th) // 2, (width - tw) // 2
    out[:, top : top + th, left : left + tw] = planes
    return out
