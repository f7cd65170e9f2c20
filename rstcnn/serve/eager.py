"""A checkpoint served by eager torch: ``Classifier.from_checkpoint`` (and ``serve/app.py
--model CHECKPOINT.pt``).

Where the CPU runs bfloat16 natively, the library model's own fast paths under bfloat16
autocast evaluate a stability sweep's batch of the RST-CNN faster than its exported file
does in onnxruntime (BENCHMARKS.md, "Issue 13, fifth pass"), at the price of torch in the
server and more memory. It is opt-in, and the same rules hold as for the exported files:

- ``precision="fp32"`` runs the checkpoint exactly;
- ``precision="bf16"`` (bfloat16 autocast), ``precision="int8"`` (the same with the FFT
  path's per-frequency products in int8) and ``precision="int16"`` (float32 with those
  products on 16-bit integers, for CPUs with AVX2 but no AVX-512: ``rstmodel.precision``)
  may be served only with a passing accuracy check of this very checkpoint file at that
  precision, written beside it by ``python train/precision_check.py CKPT --precision P
  --record`` (``CKPT`` with the suffix ``.P-gate.json``); without one ``serve.variants``
  leaves it out, as it does an unchecked int8 file;
- ``precision="auto"`` (the app's choice) is the first of ``int8``, ``bf16`` and ``int16``
  that the CPU runs and whose check passed, ``fp32`` otherwise.

The metadata is the exported files' (``export.onnx_export.onnx_metadata``) plus the
precision, the gate and whether quarter turns keep the logits (measured at load, in
float32), so the app, ``serve.variants`` and ``export.split_check`` treat it like a file.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .coalesce import Coalescer

__all__ = ["PRECISIONS", "gate_path", "load", "read_gate", "write_gate"]

log = logging.getLogger("serve.eager")

PRECISIONS = ("auto", "fp32", "bf16", "int8", "int16")
REDUCED = ("int8", "bf16", "int16")  # what "auto" tries, fastest first
LINGER = float(os.environ.get("RSTCNN_LINGER", "0.02"))  # s; serve.coalesce


def gate_path(checkpoint: str | Path, precision: str = "bf16") -> Path:
    """Where the accuracy check of ``checkpoint`` at ``precision`` is kept: beside it,
    ``NAME.PRECISION-gate.json``."""
    if precision not in REDUCED:
        raise ValueError(f"no accuracy check for precision {precision!r}")
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(f"{checkpoint.stem}.{precision}-gate.json")


def write_gate(checkpoint: str | Path, digest: str, record: dict, precision: str = "bf16") -> Path:
    """Write ``record`` (``passes``, ``images``, ``accuracy``, ``reference_accuracy``,
    ``drop_points``, ``limit_points``, ...) as the check at ``precision`` of the checkpoint
    whose file has the SHA-256 ``digest``. Atomic."""
    path = gate_path(checkpoint, precision)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({**record, "checkpoint_sha256": digest}, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_gate(checkpoint: str | Path, digest: str, precision: str = "bf16") -> dict | None:
    """The recorded check at ``precision`` of this very checkpoint file, or None (none,
    unreadable, or made for another version of the file; logged)."""
    path = gate_path(checkpoint, precision)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        passes, made_for = record["passes"], record["checkpoint_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("%s: unreadable accuracy check (%s); ignored", path, err)
        return None
    if made_for != digest:
        log.warning("%s: made for another version of %s; ignored", path, Path(checkpoint).name)
        return None
    return {**record, "passes": bool(passes)}


def load(
    checkpoint: str | Path,
    precision: str = "auto",
    threads: int | None = None,
    max_batch: int = 16,
) -> tuple[Callable[[np.ndarray], np.ndarray], dict[str, str], list[str]]:
    """``(run, metadata, providers)`` for ``Classifier``: ``run`` maps a normalised float32
    ``[N, C, H, W]`` batch to float32 logits with the checkpoint's model in eval mode; calls
    made while one runs are joined into batches of up to ``max_batch`` images
    (``serve.coalesce``). ``threads``: torch's intra-op threads (process-wide; default:
    torch's). Raises ``ValueError`` for a missing or unreadable checkpoint or an unknown
    precision."""
    import torch

    from rstcnn.export.onnx_export import (
        QUARTER_TURNS,
        file_sha256,
        logits_keep_under_quarter_turns,
        onnx_metadata,
    )
    from rstmodel.checkpoint import CheckpointError, load_checkpoint
    from rstmodel.precision import bf16_supported, inference, int8_supported, int16_supported

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    checkpoint = Path(checkpoint)
    try:
        model, meta = load_checkpoint(checkpoint)
    except (FileNotFoundError, CheckpointError) as err:
        raise ValueError(str(err)) from None  # the message names the file
    model = model.float().eval()
    digest = file_sha256(checkpoint)
    runs = {"int8": int8_supported, "bf16": bf16_supported, "int16": int16_supported}
    if precision in runs and not runs[precision]():
        raise ValueError(
            f"this CPU does not run {precision} natively (bf16: AVX512-BF16 or AMX; int8: "
            "AVX512-BF16 and AVX512-VNNI; int16: AVX2 without AVX-512): use precision 'auto' "
            "or 'fp32'"
        )
    gates = {p: read_gate(checkpoint, digest, p) for p in REDUCED if runs[p]()}
    if precision == "auto":
        passed = [p for p, gate in gates.items() if gate and gate["passes"]]
        precision = passed[0] if passed else "fp32"
    gate = gates.get(precision)
    metadata = onnx_metadata(model, meta, digest)
    metadata["rstcnn.precision"] = precision
    if precision != "fp32" and gate is not None:
        metadata["rstcnn.gate"] = json.dumps(gate)
    lock = threading.Lock()  # one call at a time: the eval caches fill on the first

    def logits(batch: np.ndarray, at: str) -> np.ndarray:
        with lock, inference(at):
            return model(torch.from_numpy(np.ascontiguousarray(batch))).float().numpy()

    size = [meta.in_channels, meta.input_size, meta.input_size]
    invariant = logits_keep_under_quarter_turns(lambda x: logits(x, "fp32"), size)
    metadata[QUARTER_TURNS] = json.dumps(invariant)
    if precision != "fp32":
        model.eval()  # drops the float32 filters that check cached (~1 GiB for rst_cnn_fb)
    # concurrent calls (the API's classifications) join into one batch: per image the
    # engine costs less the larger the batch (serve.coalesce)
    run = Coalescer(lambda batch: logits(batch, precision), max_images=max_batch, linger=LINGER)
    return run, metadata, [f"torch-{precision}"]
