"""The experiments' budgets and what every experiment runner shares: the paper's models in
run order, the reduced widths, a budget's image size, epochs and batch (``Budget``,
``BUDGETS``), its training config (``budget_config``), its data (``load_data``: train/run.py's
RS data, reduced to the budget's image size) and one trial trained in its folder
(``train_trial``). ``train/reproduce.py`` and ``train/ood.py`` are command lines over this.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from rstcnn.train import engine
from rstcnn.train.config import TrainConfig
from rstmodel.data import CLASS_NAMES, ArrayDataset, RandomRST, RSConfig, load_rs

# in the order the runs are made (the paper's central comparison first)
MODELS = (
    "cnn",
    "rst_cnn_fb",
    "rst_cnn_sl",
    "rot_cnn",
    "scale_cnn",
    "rst_cnn_plus_fb",
    "rst_cnn_plus_sl",
    "rdcf_plus",
    "sesn",
    "sfcnn",
    "sfcnn_plus",
    "sevf",
)
# ~12K parameters each at 32x32 with a 48-unit FC layer (channels ~(c, 2c, 3c), c fitted)
REDUCED_WIDTHS = {
    "cnn": (4, 9, 14),
    "rot_cnn": (10, 20, 30),
    "scale_cnn": (10, 20, 30),
    "rst_cnn_fb": (10, 20, 30),
    "rst_cnn_sl": (12, 24, 36),
    "rst_cnn_plus_fb": (5, 10, 16),
    "rst_cnn_plus_sl": (6, 13, 20),
    "rdcf_plus": (5, 10, 16),
    "sesn": (11, 22, 33),
    # regular fields of C8 (8 channels each); SFCNN+ differs from SFCNN only in width, so at
    # an equal parameter budget it is the same network (its reduced row repeats SFCNN's)
    "sfcnn": (3, 6, 9),
    "sfcnn_plus": (3, 6, 9),
    "sevf": (7, 15, 22),
}
# the basis-size sweep (speed against accuracy), by K and the rotation grid Nr; not in
# reproduce.py's default run
# (``train/k_sweep.py`` runs them through train/reproduce.py)
SWEEP_MODELS = (
    "rst_cnn_fb_k6",
    "rst_cnn_fb_k9",
    "rst_cnn_fb",
    "rst_cnn_fb_k17",
    "rst_cnn_fb_ref",
    "rst_cnn_fb_nr4",
)
REDUCED_WIDTHS |= {
    "rst_cnn_fb_k6": (14, 28, 42),
    "rst_cnn_fb_k9": (11, 22, 33),
    "rst_cnn_fb_k17": (8, 16, 24),
    "rst_cnn_fb_ref": (5, 10, 15),
    "rst_cnn_fb_nr4": (10, 20, 30),
}
ALL_MODELS = MODELS + tuple(m for m in SWEEP_MODELS if m not in MODELS)  # tables' row order
SMOKE_WIDTHS = dict.fromkeys(ALL_MODELS, (2, 3, 4))
# training time per image relative to rst_cnn_fb at the reduced widths, from
# `train/reproduce.py --measure` on the 2-core CPU (1 thread; RESULTS.md); only the ETA uses it
RELATIVE_COST = {
    "cnn": 0.012,
    "rot_cnn": 0.2,
    "scale_cnn": 0.12,
    "rst_cnn_fb": 1.0,
    "rst_cnn_sl": 1.11,
    "rst_cnn_plus_fb": 0.84,
    "rst_cnn_plus_sl": 1.06,
    "rdcf_plus": 0.2,  # not measured: taken as rot_cnn's
    "sesn": 0.12,  # not measured: taken as scale_cnn's
    "sfcnn": 0.2,  # not measured: taken as rot_cnn's
    "sfcnn_plus": 0.2,
    "sevf": 0.12,  # not measured: taken as scale_cnn's
    # the sweep: not measured, taken as rst_cnn_fb's scaled by Cin*K (the basis responses)
    "rst_cnn_fb_k6": 0.7,
    "rst_cnn_fb_k9": 0.85,
    "rst_cnn_fb_k17": 1.4,
    "rst_cnn_fb_ref": 1.2,
    "rst_cnn_fb_nr4": 0.5,  # half the branches
}


@dataclass(frozen=True)
class Budget:
    """How much of the paper's protocol to run."""

    image_size: int  # 56: as prepared; less: 2x reduced (28) and zero-padded to this size
    epochs: dict[int, int]  # per N_tr
    trials: int
    val_size: int
    test_size: int | None  # None: every image not used for training or validation
    widths: dict[str, tuple[int, ...]] | None  # None: the registered models
    hidden: int | None = None
    train_sizes: tuple[int, ...] = (2000, 5000)
    batch_size: int = 128


BUDGETS = {
    "full": Budget(56, {2000: 60, 5000: 60}, 5, 2000, None, None),
    "reduced": Budget(
        32, {2000: 6, 5000: 3}, 1, 500, 3000, REDUCED_WIDTHS, hidden=48, batch_size=64
    ),
    "smoke": Budget(
        32, {64: 1}, 1, 32, 32, SMOKE_WIDTHS, hidden=8, train_sizes=(64,), batch_size=32
    ),
}


def shrink(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 [N, 56, 56] -> uint8 [N, size, size]: 2x2 means (28x28), zero-padded to ``size``."""
    if size == images.shape[-1]:
        return images
    half = images.shape[-1] // 2
    if size < half or (size - half) % 2:
        raise ValueError(f"image size {size} must be {images.shape[-1]} or >= {half}, even pad")
    small = F.avg_pool2d(torch.from_numpy(images[:, None]).float(), 2)  # [N, 1, 28, 28]
    pad = (size - half) // 2
    small = F.pad(small, (pad, pad, pad, pad))
    return small[:, 0].round().clamp(0, 255).to(torch.uint8).numpy()


def load_data(args: TrainConfig, budget: Budget, data_root: Path | None) -> engine.TrainData:
    """train/run.py's RS data (same splits, normalisation and augmentation) at the budget's
    image size and validation / test sizes."""
    if budget.image_size == 56 and budget.test_size is None:
        return engine.load_rs_data(args)
    rs = load_rs(RSConfig(args.data, realisation=args.realisation), data_root=data_root)
    rest = rs.images.shape[0] - args.train_size - args.val_size
    test_size = rest if budget.test_size is None else min(budget.test_size, rest)
    splits = rs.split(args.train_size, num_val=args.val_size, num_test=test_size)
    train_images = shrink(splits.train.images, budget.image_size)
    mean, std = engine.channel_stats(train_images)
    normalize = v2.Normalize(mean, std)
    train_transform = v2.Compose([RandomRST(), normalize]) if args.augment else normalize
    evals = {
        "val": ArrayDataset(
            shrink(splits.val.images, budget.image_size), splits.val.labels, normalize
        ),
        "test": ArrayDataset(
            shrink(splits.test.images, budget.image_size), splits.test.labels, normalize
        ),
    }
    return engine.TrainData(
        train=ArrayDataset(train_images, splits.train.labels, train_transform),
        evals=evals,
        class_names=CLASS_NAMES[args.data],
        in_channels=1,
        input_size=budget.image_size,
        mean=mean,
        std=std,
        description=(
            f"{args.data} realisation {args.realisation} from {rs.path}, "
            f"{budget.image_size}x{budget.image_size} (2x reduced, zero-padded)"
        ),
    )


def budget_config(model: str, train_size: int, budget: Budget, **fields: Any) -> TrainConfig:
    """A model's training config at a budget (its sizes, epochs, batch and widths); the
    other ``fields`` as given."""
    model_args: dict[str, Any] = {}
    if budget.widths is not None:
        model_args["channels"] = budget.widths[model]
    if budget.hidden is not None:
        model_args["hidden"] = budget.hidden
    model_args |= fields.pop("model_args", {})
    return TrainConfig(
        model=model,
        train_size=train_size,
        val_size=budget.val_size,
        epochs=budget.epochs[train_size],
        batch_size=budget.batch_size,
        limit_test=budget.test_size,
        resume=True,
        model_args=model_args,
        **fields,
    )


def train_trial(args: TrainConfig, data) -> tuple[engine.Trial, dict[str, Any]]:
    """One train/run.py trial on ``data()`` (an engine.TrainData, built under the folder lock)
    in ``args.out``, logged to its train.log; resumes from last.pt, returns the summary."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "train.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    train_log = logging.getLogger("train")
    level = train_log.level
    train_log.setLevel(logging.INFO)
    train_log.addHandler(handler)
    stop = engine.StopRequest()
    # Ctrl-C / SIGTERM (reproduce.py --deadline sends itself SIGINT) stop the trial at a batch
    # boundary; installed here, it also overrides the SIGINT a background job starts ignoring
    signals = (
        stop.installed()
        if threading.current_thread() is threading.main_thread()
        else (contextlib.nullcontext())
    )
    try:
        with engine.folder_lock(out), signals:
            device = engine.pick_device(args.device)
            engine.advise_precision(args.bf16, device)
            trial = engine.Trial(args, data(), seed=args.seed, out=out, device=device, stop=stop)
            return trial, trial.run()
    finally:
        train_log.removeHandler(handler)
        handler.close()
        train_log.setLevel(level)
