"""Checkpoints: data, not code (no pickled classes or code are loaded).

A checkpoint is one ``torch.save`` file holding a dict of tensors and plain Python values
only (str, int, float, bool, None, and lists, tuples and dicts of them), so it loads with
``torch.load(..., weights_only=True)``, which refuses to build arbitrary objects and so
never runs code from the file:

    format          "rstcnn-checkpoint"      format_version  int (FORMAT_VERSION)
    rstcnn_version  str                      torch_version   str
    model_name      registered name          config          the model's config, plain values
    state_dict      {name: Tensor}           class_names     [str] * num_classes
    input_size      int (pixels, square)     in_channels     int
    normalization   {"mean": [float] * C, "std": [float] * C}   x -> (x / 255 - mean) / std
    metrics         {str: plain}             extra           {str: plain or Tensor}

``load_checkpoint`` validates the dict before building anything from it and rebuilds the
model with ``create_model(model_name, **config)``; every problem raises ``CheckpointError``
with what the file is and what to do about it. Writes are atomic: a temporary file in the
same folder, flushed and fsynced, then renamed over the target.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor, nn

from .models import create_model, list_models

__all__ = [
    "FORMAT_TAG",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointMeta",
    "atomic_write",
    "config_to_dict",
    "save_checkpoint",
    "load_checkpoint",
    "upgrade_record",
]

log = logging.getLogger(__name__)

FORMAT_TAG = "rstcnn-checkpoint"
FORMAT_VERSION = 1

# keys of a training record (a checkpoint's ``extra["run"]``, a run's summary.json) renamed
# since: records written before still spell them the old way
RECORD_KEY_RENAMES = {"realization": "realisation"}


def upgrade_record(record: dict[str, Any]) -> dict[str, Any]:
    """A training record in today's keys (``load_checkpoint`` does this to ``extra["run"]``)."""
    return {RECORD_KEY_RENAMES.get(key, key): value for key, value in record.items()}


_REQUIRED = (
    "format",
    "format_version",
    "rstcnn_version",
    "model_name",
    "config",
    "state_dict",
    "class_names",
    "input_size",
    "in_channels",
    "normalization",
    "metrics",
    "extra",
)
_SCALARS = (str, int, float, bool, type(None))
_MAPPINGS = (dict, OrderedDict, Counter)  # exactly these: torch's weights_only loader knows them


class CheckpointError(ValueError):
    """A file that is not a valid rstcnn checkpoint (corrupt, truncated or foreign)."""


@dataclass(frozen=True)
class CheckpointMeta:
    """Everything in a checkpoint besides the weights."""

    path: Path
    model_name: str
    config: dict[str, Any]  # plain values, as passed to create_model
    class_names: tuple[str, ...]
    input_size: int
    in_channels: int
    mean: tuple[float, ...]  # per channel, for inputs scaled to [0, 1]
    std: tuple[float, ...]
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    rstcnn_version: str = ""
    format_version: int = FORMAT_VERSION


def _package_version() -> str:
    from . import __version__  # the package imports this module: resolve at call time

    return __version__


def _plain(value: Any) -> Any:
    """Enums -> their values, recursively through lists, tuples and dicts."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """A frozen config dataclass as a dict of plain values (enums as their values, tuples
    kept as tuples), ready for ``create_model(name, **config_to_dict(config))``."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"expected a config dataclass instance, got {type(config).__name__}")
    return dataclasses.asdict(config, dict_factory=lambda items: {k: _plain(v) for k, v in items})


def _check_plain(value: Any, where: str, *, tensors: bool) -> None:
    """Raise TypeError unless ``value`` is made of plain values (and tensors if allowed)."""
    if isinstance(value, Tensor):
        if tensors:
            return
        raise TypeError(f"{where} is a tensor; only plain Python values are allowed there")
    if type(value) in _SCALARS:
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]", tensors=tensors)
        return
    if type(value) in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int")
            _check_plain(item, f"{where}[{key!r}]", tensors=tensors)
        return
    raise TypeError(
        f"{where} holds a {type(value).__name__}; a checkpoint stores only tensors and plain "
        "Python values (str, int, float, bool, None, lists, tuples, dicts), so convert it first"
    )


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file all at once or not at all: ``write(handle)`` fills a temporary file in
    the same folder, which is flushed, fsynced and renamed over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    try:  # make the rename itself durable
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    *,
    model_name: str,
    class_names: Sequence[str],
    input_size: int,
    in_channels: int,
    normalization: tuple[Sequence[float], Sequence[float]],
    metrics: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write ``model`` (built by ``create_model(model_name, ...)``, with a ``.config``
    dataclass) and what inference needs to ``path``, atomically.

    ``normalization`` is ``(mean, std)`` per input channel for images scaled to [0, 1].
    ``metrics`` must be plain values, ``extra`` plain values or tensors (e.g. optimizer
    state); anything else raises ``TypeError`` before the file is touched.
    """
    if model_name not in list_models():
        raise ValueError(f"unknown model {model_name!r}; available: {', '.join(list_models())}")
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no .config: build it with create_model")
    mean, std = (tuple(float(v) for v in part) for part in normalization)
    if len(mean) != in_channels or len(std) != in_channels or min(std) <= 0:
        raise ValueError(
            f"normalization needs {in_channels} means and {in_channels} positive stds, "
            f"got {mean} and {std}"
        )
    payload: dict[str, Any] = {
        "format": FORMAT_TAG,
        "format_version": FORMAT_VERSION,
        "rstcnn_version": _package_version(),
        "torch_version": str(torch.__version__),
        "model_name": model_name,
        "config": config_to_dict(config),
        "state_dict": _cpu_state_dict(model),
        "class_names": [str(name) for name in class_names],
        "input_size": int(input_size),
        "in_channels": int(in_channels),
        "normalization": {"mean": list(mean), "std": list(std)},
        "metrics": dict(metrics or {}),
        "extra": dict(extra or {}),
    }
    _check_plain(payload["config"], "config", tensors=False)
    _check_plain(payload["metrics"], "metrics", tensors=False)
    _check_plain(payload, "checkpoint", tensors=True)
    atomic_write(path, lambda handle: torch.save(payload, handle))
    log.debug("saved %s (%s)", path, model_name)


def _cpu_state_dict(model: nn.Module) -> OrderedDict[str, Tensor]:
    """The state dict on the CPU, keeping the per-module versions torch stores with it."""
    state = model.state_dict()
    out = OrderedDict((key, value.detach().cpu()) for key, value in state.items())
    out._metadata = getattr(state, "_metadata", OrderedDict())  # type: ignore[attr-defined]
    return out


def _describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        keys = list(obj)
        shown = ", ".join(repr(k) for k in keys[:6]) + (", ..." if len(keys) > 6 else "")
        return f"a mapping ({type(obj).__name__}) with keys [{shown}]"
    return f"an object of type {type(obj).__name__}"


def _unpickler_reason(err: Exception) -> str:
    """The informative line of torch's long weights-only error message."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            rest = line.split("WeightsUnpickler error:", 1)[-1].strip()
            return rest or (lines[i + 1] if i + 1 < len(lines) else line)
    for line in lines:
        if line.startswith(("Unsupported", "Trying to load")):
            return line
    return lines[0] if lines else type(err).__name__


def _read(path: Path, map_location: Any) -> dict[str, Any]:
    """torch.load with weights_only, turning every failure into a CheckpointError."""
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        reason = _unpickler_reason(err)
        if "global" in reason.lower():
            raise CheckpointError(
                f"{path} holds Python objects other than tensors and plain values ({reason}), "
                "so it was refused unread: nothing in it was executed. It is not an rstcnn "
                "checkpoint; if you trust its source, load it with torch yourself and re-save "
                "the model with rstmodel.save_checkpoint"
            ) from err
        raise CheckpointError(
            f"{path} is not a readable checkpoint: the safe (weights-only) loader could not "
            f"parse it ({reason}). It is corrupt, or a pickle of arbitrary Python objects "
            "(refused unread: nothing in it was executed). Use another checkpoint "
            "(best.pt / last.pt) or train again"
        ) from err
    except Exception as err:  # torch.load raises many types for damaged files
        raise CheckpointError(
            f"{path} is not a readable checkpoint: the file is truncated, corrupt or not a "
            f"torch file ({type(err).__name__}: {err}). If a run was killed while writing it, "
            "use the other checkpoint (best.pt / last.pt) or train again"
        ) from err
    if not isinstance(obj, Mapping) or obj.get("format") != FORMAT_TAG:
        hint = ""
        if isinstance(obj, Mapping) and obj and all(isinstance(v, Tensor) for v in obj.values()):
            hint = (
                " It looks like a bare state dict: build the model with "
                "rstmodel.create_model(name, ...) and call model.load_state_dict(...) instead."
            )
        raise CheckpointError(
            f"{path} is not an rstcnn checkpoint: it holds {_describe(obj)} without the "
            f"format tag {FORMAT_TAG!r}.{hint} Checkpoints are written by "
            "rstmodel.save_checkpoint (python train/run.py writes best.pt and last.pt)"
        )
    return dict(obj)


def _validate(payload: dict[str, Any], path: Path) -> None:
    version = payload.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path}: bad format_version {version!r}; the file is damaged")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer rstcnn ({payload.get('rstcnn_version')}, format "
            f"{version}); this one reads format {FORMAT_VERSION}: upgrade rstcnn"
        )
    missing = [key for key in _REQUIRED if key not in payload]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}; the file is damaged")

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{path}: {what}; the file is damaged or not from rstcnn")

    name = payload["model_name"]
    need(isinstance(name, str), "model_name is not a string")
    if name not in list_models():
        raise CheckpointError(
            f"{path} holds model {name!r}, which this rstcnn ({_package_version()}) does not "
            f"know (available: {', '.join(list_models())}); the checkpoint was written by "
            f"rstcnn {payload.get('rstcnn_version')}: use a version that registers {name!r}"
        )
    config, state = payload["config"], payload["state_dict"]
    need(
        isinstance(config, dict) and all(isinstance(k, str) for k in config), "config is not a dict"
    )
    need(
        isinstance(state, Mapping)
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()),
        "state_dict is not a dict of tensors",
    )
    names = payload["class_names"]
    need(
        isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names),
        "class_names is not a list of strings",
    )
    size, channels = payload["input_size"], payload["in_channels"]
    need(isinstance(size, int) and size > 0, f"input_size {size!r} is not a positive int")
    need(isinstance(channels, int) and channels > 0, f"in_channels {channels!r} is not positive")
    norm = payload["normalization"]
    need(
        isinstance(norm, dict)
        and all(
            isinstance(norm.get(k), (list, tuple))
            and len(norm[k]) == channels
            and all(isinstance(v, (int, float)) for v in norm[k])
            for k in ("mean", "std")
        )
        and min(norm["std"]) > 0,
        f"normalization is not {{'mean': [{channels} floats], 'std': [{channels} positive floats]}}",
    )
    need(isinstance(payload["metrics"], dict), "metrics is not a dict")
    need(isinstance(payload["extra"], dict), "extra is not a dict")
    for key, value in (("in_channels", channels), ("input_size", size)):
        if key in config and config[key] != value:
            raise CheckpointError(f"{path}: config {key}={config[key]} but {key}={value}")
    if "num_classes" in config and config["num_classes"] != len(names):
        raise CheckpointError(
            f"{path}: {len(names)} class names for a model with {config['num_classes']} classes"
        )


def _build(payload: dict[str, Any], path: Path) -> nn.Module:
    name, config = payload["model_name"], payload["config"]
    written = payload["rstcnn_version"]
    try:
        model = create_model(name, **config)
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"{path}: model {name!r} cannot be rebuilt from the saved config ({err}). The "
            f"checkpoint was written by rstcnn {written} and its config no longer fits this "
            f"rstcnn ({_package_version()}): use the version that wrote it"
        ) from err
    rebuilt = config_to_dict(model.config)
    changed = sorted(k for k in config if rebuilt.get(k) != config[k])
    if changed:
        raise CheckpointError(
            f"{path}: rebuilding {name!r} changed config field(s) {', '.join(changed)}; the "
            f"model's factory differs from rstcnn {written}, which wrote the checkpoint"
        )
    added = sorted(set(rebuilt) - set(config))
    if added:
        log.info("%s: config fields %s not in the checkpoint, defaults used", path, added)
    try:
        model.load_state_dict(payload["state_dict"], strict=True)
    except RuntimeError as err:
        raise CheckpointError(
            f"{path}: the weights do not fit model {name!r} with the saved config ({err}); "
            "the file is damaged or was edited"
        ) from err
    return model


def _upgraded(extra: Any) -> Any:
    if isinstance(extra, dict) and isinstance(extra.get("run"), dict):
        return {**extra, "run": upgrade_record(extra["run"])}
    return extra


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[nn.Module, CheckpointMeta]:
    """Load, validate and rebuild a checkpoint written by ``save_checkpoint``.

    Returns the model (in eval mode, on ``map_location``) and its ``CheckpointMeta``.
    Raises ``FileNotFoundError`` for a missing file and ``CheckpointError`` for one that
    is corrupt, truncated, foreign, or does not fit the registered model.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    payload = _read(path, map_location)
    _validate(payload, path)
    model = _build(payload, path)
    model.to(map_location).eval()
    if payload["rstcnn_version"] != _package_version():
        log.info(
            "%s was written by rstcnn %s (this is %s)",
            path,
            payload["rstcnn_version"],
            _package_version(),
        )
    norm = payload["normalization"]
    meta = CheckpointMeta(
        path=path,
        model_name=payload["model_name"],
        config=payload["config"],
        class_names=tuple(payload["class_names"]),
        input_size=payload["input_size"],
        in_channels=payload["in_channels"],
        mean=tuple(float(v) for v in norm["mean"]),
        std=tuple(float(v) for v in norm["std"]),
        metrics=payload["metrics"],
        extra=_upgraded(payload["extra"]),
        rstcnn_version=payload["rstcnn_version"],
        format_version=payload["format_version"],
    )
    log.info("loaded %s: %s", path, meta.model_name)
    return model, meta
