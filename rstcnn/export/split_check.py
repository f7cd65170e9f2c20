"""The file a server runs against the float32 eager model, on a whole test split.

    python -m export.split_check CHECKPOINT FILE.onnx [--out JSON] [--limit N]
        [--chunk 512] [--device cpu|cuda] [--threads N]
    python -m export.split_check CHECKPOINT CHECKPOINT   (the eager engine the app would serve)

``FILE.onnx`` (any precision ``export/to_onnx.py`` writes) runs through
``serve.Classifier.from_onnx`` with its defaults, as the app runs it (a ``.pt`` through
``Classifier.from_checkpoint``, precision "auto", as ``serve/app.py --model X.pt`` runs it); ``CHECKPOINT`` runs in
float32 eval mode (no autocast, no TF32 on a GPU). Both see the same uint8 images: the
checkpoint's own test split (RS data: every image after the run's training and validation
images; STL-10: the test set), or its last ``--limit`` images.

Prints and writes (``--out``, default ``FILE.split-check.json``, rewritten after every chunk)
both accuracies, the difference in points, top-1 agreement, the largest logit difference and
whether the difference is within the reduced-precision gate (``export.precision.GATE_POINTS``;
only a finished split can be).

A whole split is hours of CPU for the RST-CNN, so the run is resumable: each chunk's
predictions are written at once (atomically) to ``OUT.state.npz``, and a second call with the
same files and images runs only the images not yet done (whatever its chunk size); other
files or images start afresh. The float32 eager logits, the dearer half of the work, are kept
apart in ``--reference`` (default ``eager-logits-CHECKPOINT.npz`` beside ``--out``), so the
check of a second served copy of the same checkpoint (the int8 file, then the eager engine)
runs the eager model only on the images the first check has not reached.
Exit 0 when the file is within the gate, 1 when not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["EagerLogits", "SplitState", "check_split", "main"]


def _load_saved(path: Path, key: str, first: str, count: int) -> dict | None:
    """The arrays saved at ``path`` for ``key`` (``first`` holding ``count`` rows), or None
    (no file, another key or size; an unreadable file is said so)."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as saved:
            if str(saved["key"]) == key and len(saved[first]) == count:
                return {name: saved[name] for name in saved.files}
    except (OSError, ValueError, KeyError) as err:
        print(f"{path}: unreadable ({err}); starting afresh", file=sys.stderr)
    return None


def _save(path: Path, **arrays: np.ndarray | str) -> None:
    """``np.savez`` at ``path``, atomically."""
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


class EagerLogits:
    """The float32 eager model's logits on a split, shared by the checks of every served copy
    of one checkpoint: rows of NaN where not yet run, saved atomically after every chunk.
    ``key`` names the checkpoint and the images; logits of other inputs are never reused."""

    def __init__(self, path: Path, key: str, count: int, classes: int):
        self.path, self.key = path, key
        self.logits = np.full((count, classes), np.nan, np.float32)
        saved = _load_saved(path, key, "logits", count)
        if saved is not None and saved["logits"].shape == self.logits.shape:
            self.logits = saved["logits"].astype(np.float32)

    def missing(self, index: np.ndarray) -> np.ndarray:
        """Which of ``index`` have not been run (a mask over ``index``)."""
        return np.isnan(self.logits[index]).any(1)

    def record(self, index: np.ndarray, logits: np.ndarray) -> None:
        self.logits[index] = logits
        _save(self.path, key=self.key, logits=self.logits)


class SplitState:
    """Per-image results of a split check, saved after every chunk: the served file's and
    the eager model's top-1 class (-1 where not yet run), the labels and the largest
    |logit difference| per image. ``key`` names what they belong to (both files' digests
    and the images'), so a state of other inputs is never reused."""

    def __init__(self, path: Path, key: str, labels: np.ndarray):
        self.path, self.key = path, key
        self.labels = labels.astype(np.int64)
        count = len(labels)
        self.served = np.full(count, -1, np.int64)
        self.eager = np.full(count, -1, np.int64)
        self.diff = np.zeros(count, np.float32)
        saved = _load_saved(path, key, "served", count)
        if saved is not None:
            self.served, self.eager, self.diff = saved["served"], saved["eager"], saved["diff"]

    @property
    def done(self) -> int:
        return int((self.served >= 0).sum())

    def todo(self) -> np.ndarray:
        """Indices of the images not yet run, in order."""
        return np.flatnonzero(self.served < 0)

    def record(self, index: np.ndarray, served: np.ndarray, eager: np.ndarray) -> None:
        """Store the logits of the images at ``index`` and save the state atomically."""
        self.served[index] = served.argmax(1)
        self.eager[index] = eager.argmax(1)
        self.diff[index] = np.abs(served - eager).max(1)
        _save(self.path, key=self.key, served=self.served, eager=self.eager, diff=self.diff)

    def summary(self) -> dict:
        from rstcnn.export.precision import GATE_POINTS, accuracy_drop_points

        done = self.served >= 0
        n = int(done.sum())
        served = float((self.served[done] == self.labels[done]).mean()) if n else 0.0
        eager = float((self.eager[done] == self.labels[done]).mean()) if n else 0.0
        points = -accuracy_drop_points(eager, served)
        return {
            "images": n,
            "of": len(self.labels),
            "served_accuracy": served,
            "eager_accuracy": eager,
            "points": points,
            "top1_agreement": float((self.served[done] == self.eager[done]).mean()) if n else 0.0,
            "max_abs_logit_diff": float(self.diff[done].max()) if n else 0.0,
            "gate_points": GATE_POINTS,
            "within_gate": bool(n == len(self.labels) and points >= -GATE_POINTS),
        }


def check_split(
    checkpoint: Path,
    served_file: Path,
    state_path: Path,
    *,
    limit: int | None = None,
    chunk: int = 512,
    eager_batch: int = 32,
    device: str = "cpu",
    threads: int | None = None,
    progress: bool = True,
    summary_path: Path | None = None,
    reference_path: Path | None = None,
) -> dict:
    """Run (or go on with) the check; returns ``SplitState.summary()`` plus what was run,
    also written to ``summary_path`` (JSON) after every chunk when given. The eager logits
    are read from and added to ``reference_path`` (default: ``eager-logits-CHECKPOINT.npz``
    beside the state)."""
    import torch
    from tqdm import tqdm

    from rstcnn.export.onnx_export import data_sample, file_sha256
    from rstcnn.serve.classifier import Classifier
    from rstmodel.checkpoint import load_checkpoint

    model, meta = load_checkpoint(checkpoint, map_location=device)
    model = model.float().to(device).eval()
    images, labels = data_sample(meta, limit, labels=True)
    eager = served_file.suffix == ".pt"  # a checkpoint served by eager torch (serve.eager)
    load = Classifier.from_checkpoint if eager else Classifier.from_onnx
    served = load(served_file, threads=threads)
    what = {
        "checkpoint": file_sha256(checkpoint),
        "served": file_sha256(served_file),
        "images": len(images),
        "first_label_digest": int(np.asarray(labels, np.int64).sum()),
    }
    if eager:  # one file, several precisions
        what["precision"] = str(served.metadata.get("rstcnn.precision", "fp32"))
    key = json.dumps(what)
    state = SplitState(state_path, key, np.asarray(labels))
    reference_path = reference_path or state_path.with_name(f"eager-logits-{checkpoint.stem}.npz")
    reference_key = {k: v for k, v in what.items() if k not in ("served", "precision")}
    classes = len(served.class_names)
    reference = EagerLogits(reference_path, json.dumps(reference_key), len(images), classes)
    mean = np.asarray(meta.mean, np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(meta.std, np.float32).reshape(1, -1, 1, 1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    start_time = time.perf_counter()

    def summarise() -> dict:
        summary = state.summary()
        summary.update(
            checkpoint=str(checkpoint),
            served_file=str(served_file),
            precision=str(served.metadata.get("rstcnn.precision", "fp32")),
            eager_device=device,
            providers=list(served.providers),
            seconds_this_call=round(time.perf_counter() - start_time, 1),
        )
        return summary

    bar = tqdm(total=len(images), initial=state.done, unit="img", disable=not progress)
    todo = state.todo()  # exactly the images not yet run, whatever chunks an earlier call used
    for first in range(0, len(todo), chunk):
        index = todo[first : first + chunk]
        batch = images[index].astype(np.float32) / 255
        served_logits = served.run_logits(served.normalize(batch))
        missing = reference.missing(index)
        if missing.any():
            x = torch.from_numpy((batch[missing] - mean) / std)
            with torch.no_grad():  # in slices: the RST-CNN's eval peak grows with the batch
                logits = [
                    model(x[i : i + eager_batch].to(device)).float().cpu().numpy()
                    for i in range(0, len(x), eager_batch)
                ]
            reference.record(index[missing], np.concatenate(logits))
        state.record(index, served_logits, reference.logits[index])
        bar.update(len(batch))
        if summary_path is not None:  # a call cut off leaves the summary of what it did
            write_json(summary_path, summarise())
    bar.close()
    return summarise()


def write_json(path: Path, summary: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.split_check", description=__doc__)
    parser.add_argument("checkpoint", type=Path, help="the float32 reference (.pt)")
    parser.add_argument("served", type=Path, help="the ONNX file (or .pt) the app serves")
    parser.add_argument("--out", type=Path, help="JSON result (default FILE.split-check.json)")
    parser.add_argument("--limit", type=int, help="only the last N test images")
    parser.add_argument("--chunk", type=int, default=512, help="images per saved step")
    parser.add_argument("--device", default="cpu", help="the eager model's device")
    parser.add_argument(
        "--eager-batch",
        type=int,
        default=32,
        help="images per eager call (the full-width RST-CNN needs ~0.12 GiB per image)",
    )
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads")
    parser.add_argument(
        "--reference",
        type=Path,
        help="float32 eager logits shared by the checks of one checkpoint "
        "(default: eager-logits-CHECKPOINT.npz beside --out)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit needs a positive number of images")
    if args.chunk < 1 or args.eager_batch < 1:
        parser.error("--chunk and --eager-batch need a positive number of images")
    out = args.out or args.served.with_suffix(".split-check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        summary = check_split(
            args.checkpoint,
            args.served,
            out.with_suffix(".state.npz"),
            limit=args.limit,
            chunk=args.chunk,
            eager_batch=args.eager_batch,
            device=args.device,
            threads=args.threads,
            progress=not args.no_progress,
            summary_path=out,
            reference_path=args.reference,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"split_check: {err}", file=sys.stderr)
        return 2
    write_json(out, summary)
    verdict = "within" if summary["within_gate"] else "NOT within"
    print(
        f"{summary['images']} of {summary['of']} images: served {100 * summary['served_accuracy']:.2f} %, "
        f"float32 eager {100 * summary['eager_accuracy']:.2f} % ({summary['points']:+.2f} points, "
        f"{verdict} the {summary['gate_points']} gate{'' if summary['images'] == summary['of'] else ': unfinished'}), "
        f"top-1 agreement {100 * summary['top1_agreement']:.2f} %, "
        f"max |logit diff| {summary['max_abs_logit_diff']:.3g}  ({out})"
    )
    return 0 if summary["within_gate"] else 1


if __name__ == "__main__":
    from rstcnn.train.runtime import use_retaining_allocator

    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    raise SystemExit(main())
