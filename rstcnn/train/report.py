"""Test accuracy over trials (mean +- std) beside the paper's numbers, as a markdown table.

    python train/report.py runs/*
    python train/report.py runs/rst_cnn_fb-rs-fashion-5000-r0-s0 --out results.md

Every summary.json under the given folders (searched recursively) is one trial; trials are
grouped by model, data set, N_tr and augmentation. The std is numpy's default (ddof=0).
Groups trained on a reduced budget (--limit-train / --limit-test, or not the paper's number
of epochs) are marked: their numbers are not comparable with the paper's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstmodel.checkpoint import upgrade_record

log = logging.getLogger("report")

# Paper Tables 1-2 (RS-MNIST, RS-Fashion): test accuracy in %, mean and std of 5 trials, in
# the order N_tr = 2000, 5000, then with RST augmentation ("+" data) N_tr = 2000, 5000.
PAPER_RS: dict[tuple[str, str], tuple[tuple[float, float], ...]] = {
    ("cnn", "rs-mnist"): ((80.63, 0.11), (87.41, 0.32), (89.52, 0.21), (93.08, 0.04)),
    ("rst_cnn_fb", "rs-mnist"): ((89.16, 0.32), (93.19, 0.29), (92.58, 0.35), (96.33, 0.26)),
    ("rst_cnn_sl", "rs-mnist"): ((88.97, 0.17), (93.03, 0.20), (92.30, 0.19), (96.04, 0.11)),
    ("rst_cnn_plus_fb", "rs-mnist"): ((89.53, 0.27), (93.40, 0.26), (93.99, 0.07), (96.53, 0.25)),
    ("rst_cnn_plus_sl", "rs-mnist"): ((90.26, 0.37), (93.59, 0.06), (93.82, 0.25), (96.76, 0.11)),
    ("cnn", "rs-fashion"): ((62.71, 0.37), (67.91, 0.28), (67.92, 0.12), (72.41, 0.46)),
    ("rst_cnn_fb", "rs-fashion"): ((73.31, 0.16), (78.64, 0.60), (76.43, 0.59), (81.93, 0.04)),
    ("rst_cnn_sl", "rs-fashion"): ((72.90, 0.34), (78.37, 0.22), (76.06, 0.13), (80.81, 0.29)),
    ("rst_cnn_plus_fb", "rs-fashion"): (
        (74.37, 0.08),
        (79.19, 0.36),
        (80.65, 0.31),
        (84.37, 0.19),
    ),
    ("rst_cnn_plus_sl", "rs-fashion"): (
        (74.68, 0.29),
        (79.81, 0.06),
        (80.65, 0.46),
        (84.09, 0.09),
    ),
}
# RDCF and SDCF (the rotation-only and scale-only peers on the FB basis: this project's
# ``rot_cnn`` and ``scale_cnn``, the RST construction with one scale or one rotation), Tables 1-2
PAPER_RS[("rot_cnn", "rs-mnist")] = ((86.79, 0.12), (90.46, 0.33), (90.40, 0.31), (94.84, 0.15))
PAPER_RS[("rot_cnn", "rs-fashion")] = ((70.72, 0.10), (73.96, 0.19), (73.46, 0.10), (77.53, 0.11))
PAPER_RS[("scale_cnn", "rs-mnist")] = ((85.62, 0.51), (90.40, 0.09), (90.14, 0.16), (93.47, 0.05))
PAPER_RS[("scale_cnn", "rs-fashion")] = ((66.29, 0.23), (72.24, 0.23), (68.40, 0.05), (75.11, 0.18))
# RDCF+ (the rotation-only peer with L_theta = 4, here ``rdcf_plus``), Tables 1-2
PAPER_RS[("rdcf_plus", "rs-mnist")] = ((87.68, 0.52), (91.74, 0.37), (92.49, 0.28), (95.81, 0.11))
PAPER_RS[("rdcf_plus", "rs-fashion")] = ((71.27, 0.34), (75.94, 0.35), (76.87, 0.57), (80.66, 0.48))
# SESN (the scale-only peer on the Hermite-Gaussian basis, here ``sesn``), Tables 1-2
PAPER_RS[("sesn", "rs-mnist")] = ((84.58, 0.29), (90.19, 0.39), (90.33, 0.30), (93.40, 0.29))
PAPER_RS[("sesn", "rs-fashion")] = ((66.28, 0.14), (72.19, 0.05), (69.43, 0.07), (75.85, 0.26))
# SFCNN and SFCNN+ (the steerable-filter peers, here ``sfcnn`` / ``sfcnn_plus``), Tables 1-2
PAPER_RS[("sfcnn", "rs-mnist")] = ((85.71, 0.18), (89.69, 0.40), (90.86, 0.20), (93.78, 0.35))
PAPER_RS[("sfcnn_plus", "rs-mnist")] = ((87.96, 0.05), (92.29, 0.10), (92.20, 0.09), (95.32, 0.09))
PAPER_RS[("sfcnn", "rs-fashion")] = ((70.80, 0.41), (75.80, 0.11), (74.10, 0.46), (77.76, 0.16))
PAPER_RS[("sfcnn_plus", "rs-fashion")] = (
    (71.59, 0.71),
    (76.32, 0.26),
    (76.80, 0.55),
    (80.89, 0.41),
)
# SEVF (the scale-equivariant vector-field peer, here ``sevf``), Tables 1-2
PAPER_RS[("sevf", "rs-mnist")] = ((85.76, 0.38), (90.29, 0.37), (89.97, 0.42), (93.47, 0.18))
PAPER_RS[("sevf", "rs-fashion")] = ((66.57, 0.32), (71.03, 0.31), (68.83, 0.52), (73.25, 0.22))
# The paper's name for a model whose row it reports under another name (the table's note).
PAPER_NAMES = {"rot_cnn": "RDCF", "scale_cnn": "SDCF", "rdcf_plus": "RDCF+"}
# Paper Table 3 (STL-10, 3 trials): ID and OOD test accuracy in %.
PAPER_STL10: dict[str, dict[str, tuple[float, float]]] = {
    "resnet16": {"test": (82.66, 0.53), "test_ood": (37.63, 1.95)},
    "rst_resnet16": {"test": (84.08, 0.11), "test_ood": (58.31, 3.62)},
}
PAPER_EPOCHS = {"rs-mnist": 60, "rs-fashion": 60, "stl10": 1000}
SPLIT_NAMES = {"test": "ID", "test_ood": "OOD"}


def paper_accuracy(
    model: str, data: str, train_size: int | None, augment: bool, split: str
) -> tuple[float, float] | None:
    """The paper's (mean, std) in % for this setting, or None if it reports none."""
    if data == "stl10":
        return PAPER_STL10.get(model, {}).get(split) if not augment else None
    row = PAPER_RS.get((model, data))
    if row is None or split != "test" or train_size not in (2000, 5000):
        return None
    return row[(2 if augment else 0) + (train_size == 5000)]


def find_summaries(folders: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for folder in folders:
        if folder.is_file() and folder.name == "summary.json":
            found.append(folder)
        elif folder.is_dir():
            found.extend(sorted(folder.rglob("summary.json")))
        else:
            log.warning("%s: no such folder", folder)
    return sorted(set(found))


def load_summaries(paths: Iterable[Path]) -> list[dict[str, Any]]:
    summaries = []
    for path in paths:
        try:
            summary = upgrade_record(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as err:
            log.warning("skipping %s: %s", path, err)
            continue
        if not {"model", "data", "test_acc"} <= set(summary):
            log.warning("skipping %s: not a train/run.py summary", path)
            continue
        summaries.append(summary)
    return summaries


def _reduced(summary: dict[str, Any]) -> bool:
    limited = summary.get("limit_train") is not None or summary.get("limit_test") is not None
    return limited or summary.get("epochs") != PAPER_EPOCHS.get(summary["data"])


def mean_std(values: list[float]) -> str:
    """``mean ± std`` over trials; the mean alone for one trial (it has no spread to show)."""
    mean = float(np.mean(values))
    return f"{mean:.2f}" if len(values) < 2 else f"{mean:.2f} ± {float(np.std(values)):.2f}"


def report(summaries: list[dict[str, Any]]) -> str:
    """A markdown table: one row per (model, data, N_tr, augmentation, test split)."""
    groups: dict[tuple[str, str, Any, bool], list[dict[str, Any]]] = defaultdict(list)
    for s in summaries:
        groups[(s["model"], s["data"], s.get("train_size"), bool(s.get("augment")))].append(s)
    lines = [
        "| model | data | N_tr | + | split | trials | test accuracy (%) | paper (%) | diff | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, data, size, augment), trials in sorted(groups.items(), key=lambda kv: str(kv[0])):
        for split in ("test", "test_ood"):
            accs = [100 * t[f"{split}_acc"] for t in trials if t.get(f"{split}_acc") is not None]
            if not accs:
                continue
            mean = float(np.mean(accs))
            paper = paper_accuracy(model, data, size, augment, split)
            paper_text = "-" if paper is None else f"{paper[0]:.2f} ± {paper[1]:.2f}"
            diff = "-" if paper is None else f"{mean - paper[0]:+.2f}"
            notes = ["reduced budget"] if any(_reduced(t) for t in trials) else []
            if paper is not None and model in PAPER_NAMES:
                notes.append(f"paper: {PAPER_NAMES[model]}")
            note = "; ".join(notes)
            lines.append(
                f"| {model} | {data} | {'all' if size is None else size} | "
                f"{'yes' if augment else 'no'} | {SPLIT_NAMES[split]} | {len(accs)} | "
                f"{mean_std(accs)} | {paper_text} | {diff} | {note} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (or summary.json files)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    summaries = load_summaries(find_summaries(args.runs))
    if not summaries:
        print(
            "error: no summary.json under the given folders (finished runs write one)",
            file=sys.stderr,
        )
        return 1
    table = report(summaries)
    print(table, end="")
    if args.out is not None:
        args.out.write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
