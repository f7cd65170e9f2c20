"""Out-of-distribution generalisation (the paper's STL-10 claim, Section 5.3, on data that is
available offline): train on upright, unscaled images, test on rotated and rescaled ones.

    python train/ood.py --budget reduced --jobs 2          # CNN vs RST-CNN(FB), Fashion-MNIST
    python train/ood.py --budget smoke                     # seconds (CI)
    python train/ood.py --stl10-root ~/datasets/stl10      # the paper's STL-10 protocol

Fashion-MNIST (or MNIST, ``--source mnist``) images are split by a seeded permutation (N_tr
train, then validation, then test) and made exactly like RS data (bicubic, upsized to 56x56)
but with no rotation or scaling for training, validation and the in-distribution (ID) test.
The same test images are then rotated by U[-pi/2, pi/2] and scaled by U[0.8, 1] (OOD, the
paper's STL-10 test transform) and by U[0, 2 pi) and U[0.3, 1] (RS, the full RS-data range).
Models and budgets are train/reproduce.py's (``reduced``: ~20K-parameter models at 32x32).
Writes ``ood.csv``, ``ood.png`` and ``ood.md`` into ``--out``; each run is a train/run.py
trial folder (resumable; finished runs are reused).

With ``--stl10-root`` it runs the paper's STL-10 experiment instead: train/run.py for
resnet16 and rst_resnet16 (1000 epochs, SGD, crop + flip + Cutout; ``--epochs`` to shorten),
ID and OOD test accuracy, and train/report.py's table beside the paper's Table 3.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import logging
import math
import multiprocessing
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rstcnn.train import engine, report
from rstcnn.train.budgets import BUDGETS, Budget, budget_config, shrink, train_trial
from rstcnn.train.config import TrainConfig, parse_model_arg
from rstcnn.train.experiments import plt, write_csv, write_json
from rstcnn.train.runtime import use_retaining_allocator
from rstmodel import load_checkpoint
from rstmodel.data import CLASS_NAMES, ArrayDataset, RandomRST, SourceNotFoundError, collate
from rstmodel.data.cache import default_cache_dir
from rstmodel.data.rs import rotate_scale_upsize
from rstmodel.data.sources import BaseDataset, find_source, load_source
from rstmodel.data.stl10 import OOD_ANGLE_RANGE, OOD_SCALE_RANGE

log = logging.getLogger("ood")

MODELS = ("cnn", "rst_cnn_fb")
STL10_MODELS = ("resnet16", "rst_resnet16")
RS_ANGLE_RANGE = (0.0, 2 * math.pi)
RS_SCALE_RANGE = (0.3, 1.0)
TESTS = {  # eval split -> (angle range, scale range)
    "test": ((0.0, 0.0), (1.0, 1.0)),
    "test_ood": (OOD_ANGLE_RANGE, OOD_SCALE_RANGE),
    "test_rs": (RS_ANGLE_RANGE, RS_SCALE_RANGE),
}
TEST_NAMES = {
    "test": "ID (upright)",
    "test_ood": "OOD (U[-pi/2, pi/2], U[0.8, 1])",
    "test_rs": "RS range (U[0, 2pi), U[0.3, 1])",
}


def transformed(images: np.ndarray, angles: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """RS-style images: rotate, scale (bicubic, 28x28) and upsize to 56. uint8 [N, 28, 28]
    -> uint8 [N, 56, 56]."""
    out = np.empty((images.shape[0], 56, 56), dtype=np.uint8)
    for i in range(images.shape[0]):
        out[i] = rotate_scale_upsize(images[i], float(angles[i]), float(scales[i]), 56)
    return out


def draw(rng: np.random.Generator, n: int, angles: tuple, scales: tuple):
    return rng.uniform(*angles, size=n), rng.uniform(*scales, size=n)


def load_data(args: TrainConfig, budget: Budget, opts: dict[str, Any]) -> engine.TrainData:
    """Upright train / validation images and the ID, OOD and RS-range test sets."""
    base = BaseDataset.FASHION if opts["source"] == "fashion" else BaseDataset.MNIST
    info = find_source(
        base, data_root=opts["data_root"], sources_dir=default_cache_dir() / "sources"
    )
    source = load_source(info)
    total = source.labels.shape[0]
    rng = np.random.default_rng([args.seed, args.realisation])
    order = rng.permutation(total)
    n_tr, n_val = args.train_size, args.val_size
    n_test = min(budget.test_size or total, total - n_tr - n_val)
    if n_test < 1:
        raise engine.SetupError(
            f"{total} images cannot hold {n_tr} train + {n_val} validation + a test set"
        )
    parts = np.split(order[: n_tr + n_val + n_test], [n_tr, n_tr + n_val])

    def make(idx: np.ndarray, angles: tuple, scales: tuple) -> np.ndarray:
        a, s = draw(rng, idx.shape[0], angles, scales)
        return shrink(transformed(source.images[idx], a, s), budget.image_size)

    upright = ((0.0, 0.0), (1.0, 1.0))
    train_images = make(parts[0], *upright)
    mean, std = engine.channel_stats(train_images)
    normalize = v2.Normalize(mean, std)
    train_transform = v2.Compose([RandomRST(), normalize]) if args.augment else normalize
    evals = {"val": ArrayDataset(make(parts[1], *upright), source.labels[parts[1]], normalize)}
    for name, ranges in TESTS.items():
        evals[name] = ArrayDataset(make(parts[2], *ranges), source.labels[parts[2]], normalize)
    return engine.TrainData(
        train=ArrayDataset(train_images, source.labels[parts[0]], train_transform),
        evals=evals,
        class_names=CLASS_NAMES["rs-fashion" if base is BaseDataset.FASHION else "rs-mnist"],
        in_channels=1,
        input_size=budget.image_size,
        mean=mean,
        std=std,
        description=f"upright {info.name}, {n_tr}/{n_val}/{n_test} images, {budget.image_size} px",
    )


@torch.inference_mode()
def accuracy(model: torch.nn.Module, dataset, batch_size: int = 256) -> float:
    model.eval()
    correct = seen = 0
    for images, labels in DataLoader(dataset, batch_size=batch_size, collate_fn=collate):
        correct += int((model(images).argmax(1) == labels).sum())
        seen += labels.shape[0]
    return correct / seen


def run_one(model: str, budget_name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Train one model on upright images; its ID / OOD / RS-range test accuracies."""
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    budget = BUDGETS[budget_name]
    n_tr = opts["train_size"] or max(budget.train_sizes)
    args = budget_config(
        model,
        n_tr,
        budget,
        data="rs-fashion",
        out=opts["root"] / model,
        device=opts["device"],
        data_label=f"{opts['source']}-upright",  # the images are upright, not RS
    )
    if opts["epochs"]:
        args = replace(args, epochs=opts["epochs"])
    holder: dict[str, engine.TrainData] = {}

    def data() -> engine.TrainData:
        holder["data"] = load_data(args, budget, opts)
        return holder["data"]

    trial, summary = train_trial(args, data)
    best, _ = load_checkpoint(trial.best_path)
    row = {
        "model": model,
        "params": summary["num_params"],
        "train_size": n_tr,
        "epochs": summary["epochs"],
        "input_size": budget.image_size,
    }
    for name in TESTS:
        row[f"{name}_acc"] = 100 * accuracy(best, holder["data"].evals[name])
    row["test_images"] = len(holder["data"].evals["test"])
    row["train_seconds"] = summary["train_seconds"]
    return row


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7, 4))
    width = 0.8 / len(TESTS)
    xs = np.arange(len(rows))
    for i, name in enumerate(TESTS):
        vals = [r[f"{name}_acc"] for r in rows]
        bars = ax.bar(xs + (i - 1) * width, vals, width, label=TEST_NAMES[name])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(xs, [f"{r['model']} ({r['params']:,} params)" for r in rows])
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"# {title}",
        "",
        "| model | params | N_tr | epochs | ID (%) | OOD (%) | RS range (%) | test images |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params']:,} | {r['train_size']} | {r['epochs']} | "
            f"{r['test_acc']:.2f} | {r['test_ood_acc']:.2f} | {r['test_rs_acc']:.2f} | "
            f"{r['test_images']} |"
        )
    return "\n".join(lines) + "\n"


def run_stl10(args: argparse.Namespace) -> int:
    """The paper's STL-10 protocol through train/run.py, then its report."""
    outs = []
    for model in args.models or STL10_MODELS:
        out = args.out / "stl10" / model
        config = TrainConfig(
            model=model,
            data="stl10",
            stl10_root=args.stl10_root,
            out=out,
            resume=True,
            trials=args.trials or 3,
            device=args.device,
            epochs=args.epochs,
            batch_size=args.batch_size,
            threads=args.threads,
            model_args=dict(parse_model_arg(a) for a in args.model_args),
        )
        if config.threads:
            torch.set_num_threads(config.threads)
        stop = engine.StopRequest()
        with stop.installed():
            engine.run_trials(config, stop)
        outs.append(out)
    table = report.report(report.load_summaries(report.find_summaries(outs)))
    (args.out / "stl10" / "table.md").write_text(table, encoding="utf-8")
    print(table, end="")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --data (the other experiments' option) is not --data-root here
    )
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="reduced")
    parser.add_argument("--source", choices=("fashion", "mnist"), default="fashion")
    parser.add_argument(
        "--models", nargs="+", default=None, help=f"default {MODELS}; STL-10 {STL10_MODELS}"
    )
    parser.add_argument("--train-size", type=int, default=None, help="N_tr (budget's largest)")
    parser.add_argument("--epochs", type=int, default=None, help="override the budget's epochs")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-root", type=Path, default=None, help="folder of IDX files")
    parser.add_argument("--stl10-root", type=Path, default=None, help="run the STL-10 protocol")
    parser.add_argument("--trials", type=int, default=None, help="STL-10 trials (paper: 3)")
    parser.add_argument("--batch-size", type=int, default=None, help="STL-10 (paper: 64)")
    parser.add_argument(
        "--model-arg",
        dest="model_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="STL-10: a config override for every model (train/run.py --model-arg)",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/ood"))
    args = parser.parse_args(argv)
    if args.threads is None and args.jobs > 1:
        args.threads = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine.setup_cli()
    if args.stl10_root is not None:
        return run_stl10(args)
    models = args.models or list(MODELS)
    root = args.out / args.source / args.budget
    root.mkdir(parents=True, exist_ok=True)
    opts = {
        "root": root,
        "source": args.source,
        "device": args.device,
        "data_root": args.data_root,
        "threads": args.threads,
        "train_size": args.train_size,
        "epochs": args.epochs,
    }
    try:
        if args.jobs <= 1:
            rows = [run_one(m, args.budget, opts) for m in models]
        else:
            context = multiprocessing.get_context("spawn")
            with futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
                rows = list(
                    pool.map(run_one, models, [args.budget] * len(models), [opts] * len(models))
                )
    except (engine.SetupError, engine.TrainingError, SourceNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    title = (
        f"Trained on upright {args.source} (budget '{args.budget}'): tested upright (ID),\n"
        "rotated by U[-pi/2, pi/2] and scaled by U[0.8, 1] (OOD), and over the RS range"
    )
    write_csv(root / "ood.csv", rows)
    write_json(root / "ood.json", rows)
    plot(rows, root / "ood.png", title)
    text = markdown(rows, title)
    (root / "ood.md").write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    use_retaining_allocator()  # RSTCNN_ALLOCATOR (default: jemalloc): re-exec once
    sys.exit(main())
