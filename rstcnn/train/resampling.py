"""Has a model learned the objects or our resampling? Test accuracy of checkpoints on the same
RS test images rendered by each resampling pipeline (``rstmodel.data.RESAMPLINGS``): the
paper's bicubic one the models train on, and independent ones (Pillow's antialiased Lanczos
with uint8 rounding, ``pillow``, is held out of ``--train-resampling`` augmentation).

    python train/resampling.py models/rst_cnn_fb.pt models/cnn.pt --limit 2000
    python train/resampling.py runs/x/best.pt --pipelines bicubic pillow --device cuda

The test split is the checkpoint's own (its realisation, N_tr and validation size), so no
image was seen in training. Prints a markdown table (accuracy per pipeline and the gap to
bicubic in points) and writes it, with a JSON copy, to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train.runtime import user_errors
from rstmodel import load_checkpoint
from rstmodel.data import (
    HELD_OUT_RESAMPLING,
    RESAMPLINGS,
    ArrayDataset,
    RSConfig,
    collate,
    load_rs,
)


def rs_run(path: Path, meta) -> dict:
    """The run settings of a checkpoint trained on RS data (realisation, N_tr, validation
    size: what fixes its test split); exits with a message for any other checkpoint."""
    run = meta.extra.get("run", {})
    if not str(run.get("data", "")).startswith("rs-"):
        raise SystemExit(f"{path}: not trained on RS data (run settings: {run or 'none'})")
    return run


def test_images(run: dict, resampling: str, limit: int | None, data_root: Path | None):
    """uint8 [n, 56, 56] and labels of the run's test split, rendered by ``resampling``."""
    config = RSConfig(run["data"], realisation=run["realisation"], resampling=resampling)
    data = load_rs(config, data_root=data_root, progress=True)
    test = data.split(run["train_size"], num_val=run["val_size"]).test
    return test.images[:limit], test.labels[:limit]


@torch.inference_mode()
def accuracy(model, images: np.ndarray, labels: np.ndarray, meta, device, batch: int) -> float:
    dataset = ArrayDataset(images, labels, v2.Normalize(meta.mean, meta.std))
    correct = 0
    loader = DataLoader(dataset, batch_size=batch, collate_fn=collate)
    for x, y in tqdm(loader, desc=meta.path.name, unit="batch", leave=False):
        correct += int((model(x.to(device)).argmax(1).cpu() == y).sum())
    return correct / len(dataset)


def measure(
    paths: list[Path],
    pipelines: list[str],
    limit: int | None,
    device: str = "cpu",
    batch: int = 256,
    data_root: Path | None = None,
) -> list[dict]:
    """One row per checkpoint: its accuracy (0..1) on each pipeline's rendering."""
    rows = []
    for path in paths:
        model, meta = load_checkpoint(path, map_location=device)
        run = rs_run(path, meta)
        row = {"checkpoint": str(path), "model": meta.model_name}
        for name in pipelines:
            images, labels = test_images(run, name, limit, data_root)
            row[name] = accuracy(model, images, labels, meta, device, batch)
            row["images"] = int(labels.shape[0])
        rows.append(row)
    return rows


def table(rows: list[dict], pipelines: list[str]) -> str:
    base = pipelines[0]
    others = pipelines[1:]
    head = ["checkpoint", "model", "images", *pipelines, *(f"{p} - {base}" for p in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["checkpoint"], r["model"], f"{r['images']:,}"]
        cells += [f"{100 * r[p]:.2f} %" for p in pipelines]
        cells += [f"{100 * (r[p] - r[base]):+.2f}" for p in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument(
        "--pipelines",
        nargs="+",
        default=["bicubic", HELD_OUT_RESAMPLING],
        choices=list(RESAMPLINGS),
        help="the first is the reference the gaps are taken to",
    )
    parser.add_argument("--limit", type=int, default=None, help="the first N test images")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--data-root", type=Path, default=None, help="folder of RS source files")
    parser.add_argument("--out", type=Path, default=None, help="write table.md and rows.json")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be positive, got {args.limit}")
    rows = measure(
        args.checkpoints, args.pipelines, args.limit, args.device, args.batch, args.data_root
    )
    text = table(rows, args.pipelines)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text, encoding="utf-8")
        (args.out / "rows.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
