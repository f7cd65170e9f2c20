"""The training engine behind ``train/run.py``: data loading, the training loop (one
``Trial`` per seed), several processes (DDP), atomic checkpoints and resume. It is given a
``train.config.TrainConfig``; what a run writes and how it resumes is told in
``train/run.py``'s docstring.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import random
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision.transforms import v2
from tqdm import tqdm

import rstmodel
from rstcnn.train.config import RESULT_SETTINGS, SETTING_DEFAULTS, TrainConfig, settings_of
from rstmodel import create_model
from rstmodel.checkpoint import (
    CheckpointError,
    atomic_write,
    config_to_dict,
    load_checkpoint,
    save_checkpoint,
)
from rstmodel.data import (
    CLASS_NAMES,
    STL10,
    ArrayDataset,
    RandomRST,
    RotatedScaledDataset,
    RSConfig,
    SourceNotFoundError,
    VariantDataset,
    collate,
    load_rs,
    load_stl10,
    ood_parameters,
    stl10_train_transform,
)
from rstmodel.precision import bf16_supported

try:
    import fcntl
except ImportError:  # not POSIX: runs in one folder are not guarded against each other
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("train")

HEARTBEAT_S = 300.0  # a progress line this often where no bar is drawn


def logged(bar: tqdm, desc: str, show: bool = True) -> Iterator:
    """Iterate ``bar`` (drawn as ``desc``). Where it draws nothing because the output is not a terminal (nohup, a
    log file) and ``show``, log the progress every ``HEARTBEAT_S`` seconds instead: batches
    done and the time left at the rate so far (a test split can take most of an hour on a
    CPU, and a run stopped by its deadline in there starts it again)."""
    if not (show and bar.disable):
        yield from bar
        return
    try:
        total = len(bar.iterable)
    except TypeError:
        total = None
    start = last = time.monotonic()
    for done, item in enumerate(bar.iterable, 1):
        yield item  # resumes when the caller has finished with the batch
        now = time.monotonic()
        if now - last < HEARTBEAT_S:
            continue
        last, spent = now, (now - start) / 60
        if total:
            left = spent / done * (total - done)
            log.info(
                "%s: %d of %d batches, %.1f min, ~%.1f min left", desc, done, total, spent, left
            )
        else:
            log.info("%s: %d batches, %.1f min", desc, done, spent)


class SetupError(Exception):
    """A problem found before training; the message says what to change."""


class TrainingError(Exception):
    """Training cannot go on (e.g. the loss diverged)."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; raised at the next batch boundary."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopRequest:
    """SIGINT / SIGTERM set a flag that the loops check between batches; a second Ctrl-C
    raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def check(self) -> None:
        if self.signal_name is not None:
            raise Interrupted(self.signal_name)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)


# ---------------------------------------------------------------- processes


@dataclass(frozen=True)
class Distributed:
    """This process's place among the ``torchrun`` processes (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Distributed:
        """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def init(self, device: torch.device) -> None:
        """Join the process group (gloo on the CPU, nccl on CUDA) when there are several."""
        if self.enabled and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, *values: torch.Tensor) -> None:
        """Sum each tensor over the ranks, in place."""
        if self.enabled:
            for value in values:
                dist.all_reduce(value)

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on some rank."""
        if not self.enabled:
            return flag
        value = torch.tensor(int(flag), device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def on_main(self, fn: Any) -> Any:
        """``fn()`` on rank 0; its result (or its SetupError / TrainingError, raised again)
        on every rank, so that no rank waits for one that failed."""
        if not self.enabled:
            return fn()
        box: list[Any] = [None]
        if self.main:
            try:
                box[0] = ("ok", fn())
            except (SetupError, TrainingError) as err:
                box[0] = (type(err).__name__, str(err))
                dist.broadcast_object_list(box, src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "ok":
            return value
        raise (SetupError if status == "SetupError" else TrainingError)(value)


class ShardSampler(Sampler[int]):
    """Rank ``rank``'s indices (rank, rank + N, ...) of a permutation drawn from
    ``set_seed``'s seed, the same on every rank; padded by wrapping round to a multiple of N
    so that every rank takes the same number of batches."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.seed = 0

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def __len__(self) -> int:
        return math.ceil(self.size / self.world_size)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed))
        total = len(self) * self.world_size
        if total > self.size:
            order = torch.cat([order, order.repeat(math.ceil(total / self.size))])[:total]
        return iter(order[self.rank : total : self.world_size].tolist())


# ---------------------------------------------------------------- arguments


def command_line() -> str:
    return shlex.join(["python", *sys.argv])


# ---------------------------------------------------------------- data


@dataclass(frozen=True, eq=False)
class TrainData:
    """Datasets of one run; images come out normalised, float32 [C, H, W]."""

    train: Dataset
    evals: dict[str, Dataset]  # "val" (if any), "test", and "test_ood" for STL-10
    class_names: tuple[str, ...]
    in_channels: int
    input_size: int
    mean: tuple[float, ...]  # per channel, images in [0, 1]
    std: tuple[float, ...]
    description: str


def channel_stats(
    images: np.ndarray, chunk: int = 256
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std in [0, 1] units, accumulated in float64 over chunks of
    images (no full float copy). uint8 [N, H, W] or [N, C, H, W]."""
    planes = images[:, None] if images.ndim == 3 else images  # [N, C, H, W]
    total = np.zeros(planes.shape[1])
    squares = np.zeros(planes.shape[1])
    for start in range(0, planes.shape[0], chunk):
        block = planes[start : start + chunk].astype(np.float64) / 255
        total += block.sum(axis=(0, 2, 3))
        squares += np.square(block).sum(axis=(0, 2, 3))
    count = planes.shape[0] * planes.shape[2] * planes.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0.0))
    return tuple(float(m) for m in mean), tuple(float(s) if s > 0 else 1.0 for s in std)


def _limit(array: np.ndarray, limit: int | None) -> np.ndarray:
    return array if limit is None else array[:limit]


def load_rs_data(args: TrainConfig) -> TrainData:
    """The realisation's splits; the training images of every --train-resampling pipeline
    (the first sets the normalisation) and the test images of every --test-resampling one
    (same poses, same indices)."""
    data = load_rs(
        RSConfig(args.data, realisation=args.realisation), data_root=args.data_root, progress=True
    )
    test_total = data.images.shape[0] - args.train_size - args.val_size
    num_test = None if args.limit_test is None else min(args.limit_test, max(test_total, 1))

    def splits_of(resampling: str):
        rendered = data
        if resampling != "bicubic":
            config = RSConfig(args.data, realisation=args.realisation, resampling=resampling)
            rendered = load_rs(config, data_root=args.data_root, progress=True)
        try:
            return rendered.split(args.train_size, num_val=args.val_size, num_test=num_test)
        except ValueError as err:
            raise SetupError(f"{err} (here: --train-size and --val-size)") from None

    splits = splits_of("bicubic")
    train_labels = _limit(splits.train.labels, args.limit_train)
    variants = [_limit(splits_of(r).train.images, args.limit_train) for r in args.train_resampling]
    train_images = variants[0]
    mean, std = channel_stats(train_images)
    normalize = v2.Normalize(mean, std)
    train_transform = v2.Compose([RandomRST(), normalize]) if args.augment else normalize
    evals: dict[str, Dataset] = {}
    if args.val_size:
        evals["val"] = ArrayDataset(
            _limit(splits.val.images, args.limit_test),
            _limit(splits.val.labels, args.limit_test),
            normalize,
        )
    evals["test"] = ArrayDataset(splits.test.images, splits.test.labels, normalize)
    for name in args.test_resampling:
        evals[f"test_{name}"] = ArrayDataset(
            splits_of(name).test.images, splits.test.labels, normalize
        )
    if len(variants) > 1:
        train: Dataset = VariantDataset(variants, train_labels, train_transform)
    else:
        train = ArrayDataset(train_images, train_labels, train_transform)
    resampled = (
        ""
        if args.train_resampling == ("bicubic",)
        else (f", training images rendered by {' / '.join(args.train_resampling)}")
    )
    return TrainData(
        train=train,
        evals=evals,
        class_names=CLASS_NAMES[args.data],
        in_channels=1,
        input_size=int(data.images.shape[-1]),
        mean=mean,
        std=std,
        description=f"{args.data} realisation {args.realisation} from {data.path}{resampled}",
    )


def load_stl10_data(args: TrainConfig) -> TrainData:
    data = load_stl10(args.stl10_root)
    total = data.train_labels.shape[0]
    train_size = total - args.val_size if args.train_size is None else args.train_size
    if train_size < 1 or train_size + args.val_size > total:
        raise SetupError(
            f"STL-10 has {total} training images: --train-size {train_size} plus --val-size "
            f"{args.val_size} do not fit"
        )
    order = np.random.default_rng([0, args.realisation]).permutation(total)
    val_idx, train_idx = order[: args.val_size], order[args.val_size : args.val_size + train_size]
    if args.val_size == 0 and train_size == total:
        train_idx = np.arange(total)  # the paper's setting: the training set as it is
    train_idx = _limit(train_idx, args.limit_train)
    train_images = data.train_images[train_idx]
    mean, std = channel_stats(train_images)
    normalize = v2.Normalize(mean, std)
    angles, scales = ood_parameters(data.test_labels.shape[0], seed=0, realisation=args.realisation)
    test = slice(None) if args.limit_test is None else slice(args.limit_test)
    evals: dict[str, Dataset] = {}
    if args.val_size:
        val_idx = _limit(val_idx, args.limit_test)
        evals["val"] = ArrayDataset(
            data.train_images[val_idx], data.train_labels[val_idx], normalize
        )
    evals["test"] = ArrayDataset(data.test_images[test], data.test_labels[test], normalize)
    evals["test_ood"] = RotatedScaledDataset(
        data.test_images[test],
        data.test_labels[test],
        angles[test],
        scales[test],
        transform=normalize,
    )
    return TrainData(
        train=ArrayDataset(
            train_images,
            data.train_labels[train_idx],
            v2.Compose([stl10_train_transform(), normalize]),
        ),
        evals=evals,
        class_names=CLASS_NAMES[STL10],
        in_channels=3,
        input_size=int(data.train_images.shape[-1]),
        mean=mean,
        std=std,
        description=f"STL-10 from {data.folder} (OOD draws: realisation {args.realisation})",
    )


def load_data(args: TrainConfig) -> TrainData:
    try:
        return load_stl10_data(args) if args.data == STL10 else load_rs_data(args)
    except SourceNotFoundError as err:
        raise SetupError(str(err)) from None


# ---------------------------------------------------------------- randomness


def epoch_seed(seed: int, epoch: int) -> int:
    """A 32-bit seed for epoch ``epoch`` of the run seeded ``seed`` (epoch 0: initialisation)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's global generator and Python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """Every global random state, as tensors and plain values."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


# ---------------------------------------------------------------- output folder


def check_writable(out: Path) -> None:
    """Create ``out`` and write a probe file there, or raise SetupError."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe.{os.getpid()}"
        with open(probe, "wb") as handle:
            handle.write(b"ok")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as err:
        raise SetupError(
            f"--out {out} is not a writable folder ({type(err).__name__}: "
            f"{err.strerror or err}); pass --out with a folder you can write to"
        ) from None


def check_free_space(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out).free
    if free < needed:
        raise SetupError(
            f"only {free / 2**20:.1f} MiB free under {out}, and this run needs about "
            f"{needed / 2**20:.1f} MiB (best.pt, last.pt and a temporary copy while one is "
            "written): free some space or pass another --out"
        )


def checkpoint_bytes(model: nn.Module, optimizer: str) -> int:
    """Disk needed for best.pt + last.pt (weights, buffers, optimizer state) + one temporary
    copy of each, plus room for logs."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    per_param = 2 if optimizer == "adam" else 1  # Adam: two moments; SGD: momentum buffer
    return 2 * (2 * state + per_param * params) + 16 * 2**20


@contextlib.contextmanager
def folder_lock(out: Path) -> Iterator[None]:
    """Hold ``out/.lock`` so that two runs never write the same folder. A POSIX record
    lock: owned by this process alone (data loader workers forked from it do not hold
    it), and released by the kernel when the process dies, even by SIGKILL."""
    if fcntl is None:
        yield
        return
    with open(out / ".lock", "a+b") as handle:
        try:
            fcntl.lockf(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SetupError(
                f"another run is writing {out}; wait for it or pass another --out"
            ) from None
        try:
            yield
        finally:
            fcntl.lockf(handle.fileno(), fcntl.LOCK_UN)


def append_line(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_json(path: Path, data: dict[str, Any]) -> None:
    text = json.dumps(data, indent=2) + "\n"
    atomic_write(path, lambda handle: handle.write(text.encode()))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The epoch records of metrics.jsonl; a torn last line (killed mid-write) is skipped."""
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s line %d is incomplete; dropped", path, number)
    return records


# ---------------------------------------------------------------- training


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} (torch threads: {torch.get_num_threads()})"


def pick_device(name: str, procs: Distributed | None = None) -> torch.device:
    """``name`` as a device; under torchrun, CUDA means GPU LOCAL_RANK."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError as err:
            raise SetupError(f"--device {name!r}: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SetupError(
            f"--device {name} asked for CUDA, but torch sees no CUDA device; use --device cpu"
        )
    if device.type == "cuda" and procs is not None and procs.enabled:
        device = torch.device("cuda", procs.local_rank)
        torch.cuda.set_device(device)
    return device


def use_tf32(device: torch.device, enabled: bool) -> None:
    """On CUDA, float32 GEMMs (the frequency-wise mixing of the FFT path) on TF32 tensor
    cores (``--tf32``); cuDNN's convolutions already use them by default."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled


class Trial:
    """One training run (one seed) in one folder."""

    def __init__(
        self,
        args: TrainConfig,
        data: TrainData,
        *,
        seed: int,
        out: Path,
        device: torch.device,
        stop: StopRequest,
        procs: Distributed | None = None,
    ):
        self.args, self.data, self.seed, self.out = args, data, seed, out
        self.device, self.stop = device, stop
        self.procs = procs = procs or Distributed()
        if args.batch_size % procs.world_size:
            raise SetupError(
                f"--batch-size {args.batch_size} (the global batch) must be a multiple of the "
                f"{procs.world_size} processes"
            )
        self.settings = settings_of(args, seed)
        self.recipe = args.recipe
        self.milestones = self.recipe.milestones(args.epochs)
        self.best_path, self.last_path = out / "best.pt", out / "last.pt"
        self.metrics_path, self.summary_path = out / "metrics.jsonl", out / "summary.json"

        seed_everything(epoch_seed(seed, 0))
        overrides = {
            "in_channels": data.in_channels,
            "num_classes": len(data.class_names),
            "input_size": data.input_size,
            **args.model_args,
        }
        try:
            self.model = create_model(args.model, **overrides).to(device)
        except (TypeError, ValueError) as err:
            raise SetupError(f"cannot build {args.model} with {overrides}: {err}") from None
        if args.init is not None:
            self.start_from(args.init)
        config = self.model.config
        wanted = (data.in_channels, len(data.class_names), data.input_size)
        got = tuple(getattr(config, k, None) for k in ("in_channels", "num_classes", "input_size"))
        if got != wanted:
            raise SetupError(
                f"{args.data} needs in_channels, num_classes, input_size = {wanted}; "
                "drop the --model-arg that changes them"
            )
        params = self.model.parameters()
        if self.recipe.optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(params, lr=args.lr)
        else:
            self.optimizer = torch.optim.SGD(
                params,
                lr=args.lr,
                momentum=self.recipe.momentum,
                nesterov=self.recipe.nesterov,
                weight_decay=self.recipe.weight_decay,
            )
        self.scheduler = torch.optim.lr_scheduler.MultiStepLR(
            self.optimizer, milestones=self.milestones, gamma=0.1
        )
        workers = args.workers if args.workers is not None else (8 if device.type == "cuda" else 0)
        self.workers = min(workers, os.cpu_count() or 1)
        self.generator = torch.Generator()
        pin = device.type == "cuda"
        # the model that trains: DDP around self.model (checkpoints hold self.model's state)
        self.train_model: nn.Module = self.model
        self.sampler: ShardSampler | None = None
        if procs.enabled:
            self.train_model = DistributedDataParallel(
                self.model, device_ids=[device] if device.type == "cuda" else None
            )
            self.sampler = ShardSampler(len(data.train), procs.rank, procs.world_size)
        self.train_loader = DataLoader(
            data.train,
            batch_size=args.batch_size // procs.world_size,
            shuffle=self.sampler is None,
            sampler=self.sampler,
            generator=self.generator,
            num_workers=self.workers,
            pin_memory=pin,
            collate_fn=collate,
        )
        self.eval_loaders = {
            name: DataLoader(
                Subset(dataset, range(procs.rank, len(dataset), procs.world_size))
                if procs.enabled
                else dataset,
                batch_size=args.batch_size,
                num_workers=self.workers,
                pin_memory=pin,
                collate_fn=collate,
            )
            for name, dataset in data.evals.items()
        }
        self.best_epoch = 0
        self.best_val: float | None = None

    # -------------------------------------------------------- checkpoints

    def environment(self) -> dict[str, Any]:
        env = {
            "device": self.device.type,
            "threads": torch.get_num_threads(),
            "workers": self.workers,
        }
        if self.procs.enabled:
            env["processes"] = self.procs.world_size
        return env

    def _save(self, path: Path, metrics: dict[str, Any], extra: dict[str, Any]) -> None:
        save_checkpoint(
            path,
            self.model,
            model_name=self.args.model,
            class_names=self.data.class_names,
            input_size=self.data.input_size,
            in_channels=self.data.in_channels,
            normalization=(self.data.mean, self.data.std),
            metrics=metrics,
            extra={"run": self.settings, "env": self.environment(), **extra},
        )

    def save_last(self, epoch: int, metrics: dict[str, Any]) -> None:
        self._save(
            self.last_path,
            metrics,
            {
                "epoch": epoch,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(),
                "best": {"epoch": self.best_epoch, "val_acc": self.best_val},
            },
        )

    def restore(self) -> int:
        """Load last.pt into the model, optimizer, scheduler and RNGs; the completed epoch."""
        try:
            saved, meta = load_checkpoint(self.last_path, map_location="cpu")
        except CheckpointError as err:
            raise SetupError(f"cannot resume: {err}") from None
        missing = {"run", "epoch", "optimizer", "scheduler", "rng", "best"} - set(meta.extra)
        if missing:
            raise SetupError(
                f"{self.last_path} is a model checkpoint without the training state "
                f"({', '.join(sorted(missing))}), not a last.pt of train/run.py: pass another --out"
            )
        run = meta.extra["run"]
        stored = {k: run.get(k, SETTING_DEFAULTS.get(k)) for k in RESULT_SETTINGS}
        changed = [k for k in RESULT_SETTINGS if stored[k] != self.settings[k]]
        if changed:
            diff = ", ".join(f"{k}: {stored[k]!r} -> {self.settings[k]!r}" for k in changed)
            raise SetupError(
                f"{self.last_path} belongs to a run with other settings ({diff}); resume with "
                f"the same options, or pass another --out for a new run"
            )
        if meta.config != config_to_dict(self.model.config):
            raise SetupError(
                f"{self.last_path}: the model config changed since it was written "
                f"({meta.config} -> {config_to_dict(self.model.config)}); pass another --out"
            )
        if (meta.mean, meta.std) != (self.data.mean, self.data.std):
            log.warning(
                "the training images' mean/std (%s, %s) differ from last.pt's (%s, %s): "
                "the data changed since the run began",
                self.data.mean,
                self.data.std,
                meta.mean,
                meta.std,
            )
        env = meta.extra.get("env", {})
        if env != self.environment():
            log.warning(
                "resuming with %s, the run began with %s: the result can differ in the last "
                "bits from an uninterrupted run",
                self.environment(),
                env,
            )
        self.model.load_state_dict(saved.state_dict())
        self.optimizer.load_state_dict(meta.extra["optimizer"])
        self.scheduler.load_state_dict(meta.extra["scheduler"])
        set_rng_state(meta.extra["rng"])
        self.best_epoch = meta.extra["best"]["epoch"]
        self.best_val = meta.extra["best"]["val_acc"]
        return int(meta.extra["epoch"])

    # -------------------------------------------------------- loops

    def train_epoch(self, epoch: int) -> tuple[float, float]:
        """One pass over the training set; mean loss and accuracy."""
        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        seen = 0
        bar_desc = f"epoch {epoch}/{self.args.epochs}"
        bar = tqdm(
            self.train_loader,
            desc=bar_desc,
            unit="batch",
            leave=False,
            dynamic_ncols=True,
            disable=None if self.procs.main else True,
        )
        for step, (images, labels) in enumerate(logged(bar, bar_desc, self.procs.main), 1):
            self.check_stop()
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            logits, loss = self.forward_loss(images, labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            loss_sum += loss.detach().to(torch.float64) * labels.shape[0]
            correct += (logits.detach().argmax(1) == labels).sum()
            seen += labels.shape[0]
            if not bar.disable and (step % 10 == 0 or step == len(self.train_loader)):
                bar.set_postfix(
                    loss=f"{loss_sum.item() / seen:.4f}", acc=f"{correct.item() / seen:.4f}"
                )
        self.check_stop()
        return self._mean(loss_sum, correct, seen)

    def forward_loss(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training step's logits and cross-entropy (in bfloat16 autocast with --bf16)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.bf16):
            logits = self.train_model(images)
            return logits, F.cross_entropy(logits, labels)

    def check_stop(self) -> None:
        """Raise Interrupted once a signal arrived (on any rank: all stop at the same batch)."""
        if self.procs.any(self.stop.signal_name is not None, self.device):
            raise Interrupted(self.stop.signal_name or "SIGTERM")

    def _mean(
        self, loss_sum: torch.Tensor, correct: torch.Tensor, seen: int
    ) -> tuple[float, float]:
        """Mean loss and accuracy, summed over the ranks."""
        count = torch.tensor(seen, dtype=torch.int64, device=self.device)
        self.procs.sum(loss_sum, correct, count)
        return loss_sum.item() / count.item(), correct.item() / count.item()

    @torch.inference_mode()
    def evaluate(self, model: nn.Module, name: str) -> tuple[float, float]:
        """Mean loss and accuracy of ``model`` on the eval set ``name``."""
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        seen = 0
        loader = self.eval_loaders[name]
        bar = tqdm(
            loader, desc=name, unit="batch", leave=False, disable=None if self.procs.main else True
        )
        for images, labels in logged(bar, name, self.procs.main):
            self.stop.check()
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            logits = model(images)
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").to(torch.float64)
            correct += (logits.argmax(1) == labels).sum()
            seen += labels.shape[0]
        self.check_stop()
        return self._mean(loss_sum, correct, seen)

    # -------------------------------------------------------- the run

    def prepare(self) -> int:
        """Check the folder and return the last completed epoch (0 for a new run); with
        several processes rank 0 does it, the others then load last.pt if it resumed."""
        done = self.procs.on_main(self._prepare)
        if not self.procs.main and done > 0:
            self.restore()
        self.procs.barrier()
        return done

    def _prepare(self) -> int:
        check_free_space(self.out, checkpoint_bytes(self.model, self.recipe.optimizer))
        for stale in self.out.glob(".*.tmp"):  # left by a run killed while writing
            stale.unlink(missing_ok=True)
        if self.args.resume and self.last_path.is_file():
            done = self.restore()
            kept = [r for r in read_metrics(self.metrics_path) if r.get("epoch", 0) <= done]
            write_json_lines(self.metrics_path, kept)
            log.info("resuming %s after epoch %d of %d", self.out, done, self.args.epochs)
            return done
        if self.args.resume:
            log.warning("nothing to resume in %s (no last.pt): starting a new run", self.out)
        existing = [
            p.name for p in (self.last_path, self.best_path, self.summary_path) if p.exists()
        ]
        if existing and not self.args.resume:
            raise SetupError(
                f"{self.out} already holds a run ({', '.join(existing)}); pass --resume to "
                "continue it, or another --out for a new run"
            )
        self.metrics_path.write_text("", encoding="utf-8")
        self.save_last(0, {})
        return 0

    def fit(self, start: int) -> None:
        for epoch in range(start + 1, self.args.epochs + 1):
            seed = epoch_seed(self.seed, epoch)
            if self.sampler is not None:  # one permutation for all; own augmentation draws
                self.sampler.set_seed(seed)
                seed = int(
                    np.random.SeedSequence([self.seed, epoch, self.procs.rank]).generate_state(1)[0]
                )
            seed_everything(seed)
            self.generator.manual_seed(seed)
            lr = self.optimizer.param_groups[0]["lr"]
            began = time.perf_counter()
            train_loss, train_acc = self.train_epoch(epoch)
            if not math.isfinite(train_loss):
                raise TrainingError(
                    f"epoch {epoch}: the training loss is {train_loss}; lower --lr (now "
                    f"{self.args.lr}). last.pt holds epoch {epoch - 1}"
                )
            trained = time.perf_counter()
            val_loss, val_acc = (
                self.evaluate(self.model, "val") if "val" in self.eval_loaders else (None, None)
            )
            ended = time.perf_counter()
            self.scheduler.step()
            record = {
                "epoch": epoch,
                "lr": lr,
                "train_loss": train_loss,
                "train_acc": train_acc,
                "val_loss": val_loss,
                "val_acc": val_acc,
                "time_s": round(ended - began, 3),
                "train_time_s": round(trained - began, 3),
                "val_time_s": round(ended - trained, 3),
            }
            self.procs.barrier()
            if val_acc is None or self.best_val is None or val_acc > self.best_val:
                self.best_epoch, self.best_val = epoch, val_acc
                if self.procs.main:
                    self._save(self.best_path, record, {"epoch": epoch})
            record["best_epoch"] = self.best_epoch
            if self.procs.main:
                append_line(self.metrics_path, record)
                self.save_last(epoch, record)
            self.procs.barrier()
            log.info(
                "epoch %d/%d  lr %.3g  train loss %.4f acc %.4f  val %s  %.1f s%s",
                epoch,
                self.args.epochs,
                lr,
                train_loss,
                train_acc,
                "-" if val_acc is None else f"loss {val_loss:.4f} acc {val_acc:.4f}",
                ended - began,
                "  (best)" if self.best_epoch == epoch else "",
            )

    def start_from(self, path: str) -> None:
        """--init: this run's model takes the weights of the checkpoint ``path``, which must
        hold the same model with the same configuration."""
        try:
            source, meta = load_checkpoint(path)
        except (CheckpointError, FileNotFoundError) as err:
            raise SetupError(f"--init: {err}") from None
        mine = config_to_dict(self.model.config)
        # the convolution method decides how the layers compute, not what
        if meta.model_name != self.args.model or {**meta.config, "method": None} != {
            **mine,
            "method": None,
        }:
            raise SetupError(
                f"--init {path} holds {meta.model_name} with {meta.config}; this run builds "
                f"{self.args.model} with {mine}: pass the same --model and --model-arg"
            )
        self.model.load_state_dict(source.state_dict())
        log.info("starting from the weights of %s", path)

    def finish(self, started: float) -> dict[str, Any]:
        """Evaluate best.pt on the test split(s) and write summary.json."""
        began = time.perf_counter()
        try:
            best, meta = load_checkpoint(self.best_path, map_location=self.device)
        except (CheckpointError, FileNotFoundError) as err:
            raise TrainingError(f"cannot evaluate the best checkpoint: {err}") from None
        if meta.metrics.get("epoch") != self.best_epoch:
            log.warning(
                "best.pt holds epoch %s, last.pt says %s",
                meta.metrics.get("epoch"),
                self.best_epoch,
            )
        results: dict[str, Any] = {}
        for name in [n for n in self.eval_loaders if n.startswith("test")]:
            loss, acc = self.evaluate(best, name)
            results |= {f"{name}_acc": acc, f"{name}_loss": loss}
            results[f"{name}_size"] = len(self.data.evals[name])
            log.info(
                "%s accuracy of best.pt (epoch %s): %.4f", name, meta.metrics.get("epoch"), acc
            )
        if self.procs.main and results:
            # the checkpoint carries its test accuracy too (shown by export metadata and the app)
            save_checkpoint(
                self.best_path,
                best,
                model_name=meta.model_name,
                class_names=meta.class_names,
                input_size=meta.input_size,
                in_channels=meta.in_channels,
                normalization=(meta.mean, meta.std),
                metrics={**meta.metrics, **results},
                extra=meta.extra,
            )
        records = read_metrics(self.metrics_path)
        train_seconds = sum(r.get("time_s", 0.0) for r in records)
        summary = {
            **self.settings,
            "train_images": len(self.data.train),
            "val_images": len(self.data.evals["val"]) if "val" in self.data.evals else 0,
            "optimizer": self.recipe.optimizer,
            "milestones": self.milestones,
            "num_params": sum(p.numel() for p in self.model.parameters()),
            "config": config_to_dict(self.model.config),
            "best_epoch": meta.metrics.get("epoch"),
            "best_val_acc": meta.metrics.get("val_acc"),
            "best_val_loss": meta.metrics.get("val_loss"),
            **results,
            "train_seconds": round(train_seconds, 3),
            "seconds_per_epoch": round(train_seconds / max(len(records), 1), 3),
            "test_seconds": round(time.perf_counter() - began, 3),
            "session_seconds": round(time.perf_counter() - started, 3),
            "device": describe_device(self.device),
            "command": command_line(),
            "data_description": self.data.description,
            "rstcnn_version": rstmodel.__version__,
            "torch_version": str(torch.__version__),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if self.procs.enabled:
            summary["processes"] = self.procs.world_size
        if self.procs.main:
            write_json(self.summary_path, summary)
            log.info("wrote %s", self.summary_path)
        self.procs.barrier()
        return summary

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        done = self.prepare()
        finished = self.summary_path.is_file()
        self.procs.barrier()  # every rank has looked before anything is written
        if done >= self.args.epochs and finished:
            log.info("%s is finished already (summary.json)", self.out)
            return json.loads(self.summary_path.read_text(encoding="utf-8"))
        log.info(
            "training %s (%d parameters) on %s, %d train images, device %s",
            self.args.model,
            sum(p.numel() for p in self.model.parameters()),
            self.args.data,
            len(self.data.train),
            describe_device(self.device),
        )
        try:
            self.fit(done)
        except Interrupted:
            epoch = len(read_metrics(self.metrics_path))
            log.warning(
                "stopped during epoch %d; %s holds epoch %d", epoch + 1, self.last_path, epoch
            )
            raise
        return self.finish(started)


def write_json_lines(path: Path, records: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in records)
    atomic_write(path, lambda handle: handle.write(text.encode()))


# ---------------------------------------------------------------- main


def trial_dirs(args: TrainConfig) -> list[tuple[int, Path]]:
    if args.trials == 1:
        return [(args.seed, args.out)]
    return [(args.seed + i, args.out / f"trial{i}") for i in range(args.trials)]


def _log_to_file(path: Path) -> logging.Handler:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def advise_precision(bf16: bool, device: torch.device) -> None:
    """Log what ``--bf16`` costs on this CPU: a warning where bfloat16 is emulated (no
    AVX512-BF16 or AMX), a tip where jemalloc is not preloaded. Every way of training
    (train/run.py, train/reproduce.py's shards) calls it before its first step."""
    if not bf16 or device.type != "cpu":
        return
    if not bf16_supported(device):
        log.warning(
            "this CPU has no native bfloat16 (AVX512-BF16 or AMX): --bf16 is emulated here, "
            "14x slower than float32 for the rst_cnn_fb training step on an AVX2 CPU "
            "(BENCHMARKS.md); drop --bf16 unless you want bfloat16's rounding itself"
        )
    elif "jemalloc" not in os.environ.get("LD_PRELOAD", ""):
        log.info(
            "tip: on jemalloc (RSTCNN_ALLOCATOR=jemalloc, the default of train/run.py where "
            "libjemalloc2 is installed) --bf16 made the rst_cnn_fb step 2.7x faster at "
            "float32's memory peak (BENCHMARKS.md)"
        )


def run_trials(
    args: TrainConfig, stop: StopRequest, procs: Distributed | None = None
) -> list[dict[str, Any]]:
    procs = procs or Distributed()
    trials = trial_dirs(args)
    device = pick_device(args.device, procs)
    use_tf32(device, args.tf32)
    procs.init(device)

    def check_folders() -> None:
        for _, out in trials:  # fail before any data is loaded
            check_writable(out)

    procs.on_main(check_folders)
    log.info("device: %s", describe_device(device))
    advise_precision(args.bf16, device)
    if procs.enabled:
        log.info(
            "process %d of %d, %d images per batch each",
            procs.rank,
            procs.world_size,
            args.batch_size // procs.world_size,
        )
    data = load_data(args)
    log.info("data: %s", data.description)
    summaries = []
    for seed, out in trials:
        with contextlib.ExitStack() as stack:
            # the lock and train.log belong to rank 0, the process that writes the folder
            procs.on_main(lambda: stack.enter_context(folder_lock(out)))  # noqa: B023
            handler = _log_to_file(out / "train.log") if procs.main else None
            try:
                log.info("trial seed %d in %s: %s", seed, out, command_line())
                trial = Trial(args, data, seed=seed, out=out, device=device, stop=stop, procs=procs)
                summaries.append(trial.run())
            finally:
                if handler is not None:
                    logging.getLogger().removeHandler(handler)
                    handler.close()
    return summaries


def setup_cli(threads: int | None = None) -> None:
    """What every training and experiment CLI does first: timestamped INFO logging and,
    if given, the torch CPU thread count."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    if threads is not None:
        torch.set_num_threads(threads)


def describe_os_error(err: OSError) -> str:
    """A file-system error as one line that says what to do. Checkpoints are written
    atomically, so the last complete one is intact and ``--resume`` continues from it."""
    where = f" ({err.filename})" if err.filename else ""
    advice = {
        errno.ENOSPC: "the disk is full: free space (or write elsewhere with --out), then "
        "run again with --resume",
        errno.EDQUOT: "the disk quota is used up: free space, then run again with --resume",
        errno.EROFS: "the folder is on a read-only file system: choose a writable one "
        "(--out for runs, RSTCNN_DATA or --data-root for the data cache)",
        errno.EACCES: "no permission to write there: choose a writable folder (--out for "
        "runs, RSTCNN_DATA or --data-root for the data cache)",
        errno.EPERM: "no permission to write there: choose a writable folder",
    }.get(err.errno, "check the path and the disk, then run again (with --resume to continue)")
    return f"{err.strerror or err}{where}: {advice}"
