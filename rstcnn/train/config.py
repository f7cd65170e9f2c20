"""What one training run is given: ``TrainConfig``, frozen and validated, and the paper's
recipes that fill its defaults.

The command line (``train/run.py``) parses into a ``TrainConfig``; the experiment runners
(``reproduce.py``, ``ood.py``, ``bench.py``) build one directly and vary it with
``dataclasses.replace``. ``settings_of`` picks the fields that decide the weights: they are
stored in every checkpoint, and resuming with other values is refused.
"""

from __future__ import annotations

import argparse
import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rstmodel import list_models
from rstmodel.data import NUM_VAL, RESAMPLINGS, STL10, RSDataset

__all__ = [
    "DATA_CHOICES",
    "RESULT_SETTINGS",
    "RS_RECIPE",
    "SETTING_DEFAULTS",
    "STL10",
    "STL10_RECIPE",
    "Recipe",
    "TrainConfig",
    "parse_model_arg",
    "settings_of",
]

DATA_CHOICES = tuple(d.value for d in RSDataset) + (STL10,)
# settings that decide the weights; resuming with others is refused
RESULT_SETTINGS = (
    "model",
    "model_args",
    "data",
    "train_size",
    "val_size",
    "realisation",
    "seed",
    "augment",
    "epochs",
    "batch_size",
    "lr",
    "limit_train",
    "limit_test",
    "bf16",
    "train_resampling",
    "init",
)
# what a checkpoint written before a setting existed stands for
SETTING_DEFAULTS = {"bf16": False, "train_resampling": ["bicubic"], "init": None}


@dataclass(frozen=True)
class Recipe:
    """The paper's optimiser and schedule for a data set."""

    optimizer: str  # "adam" or "sgd"
    lr: float
    epochs: int
    batch_size: int
    decay_at: tuple[float, ...]  # fractions of the epochs after which lr drops tenfold
    val_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def milestones(self, epochs: int) -> list[int]:
        """Epochs after which the lr drops tenfold, the paper's fractions scaled to ``epochs``;
        an epoch listed twice drops it a hundredfold, so the total decay stays the paper's."""
        return sorted(max(1, math.floor(f * epochs + 0.5)) for f in self.decay_at)


RS_RECIPE = Recipe(
    "adam", lr=0.01, epochs=60, batch_size=128, decay_at=(30 / 60,), val_size=NUM_VAL
)
STL10_RECIPE = Recipe(
    "sgd",
    lr=0.1,
    epochs=1000,
    batch_size=64,
    decay_at=(300 / 1000, 400 / 1000, 600 / 1000, 800 / 1000),
    val_size=0,
    momentum=0.9,
    weight_decay=5e-4,
    nesterov=True,
)


@dataclass(frozen=True)
class TrainConfig:
    """One training run (or ``trials`` runs with seeds ``seed``, ``seed + 1``, ...).

    ``None`` for ``epochs``, ``batch_size``, ``lr`` and ``val_size`` takes the data set's
    recipe (``recipe``), for ``train_size`` the paper's N_tr 5000 on RS data (STL-10: all
    5,000), for ``out`` ``runs/<model>-<data>-<size>[-aug]-r<realisation>-s<seed>``.
    ``data_label``: what the run records as its data when the images follow another
    protocol than the named data set's (``ood.py``: upright images). Invalid values raise
    ``ValueError`` naming the field.
    """

    model: str = "rst_cnn_fb"
    data: str = RSDataset.FASHION.value
    train_size: int | None = None
    val_size: int | None = None
    realisation: int = 0  # which RS realisation
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    augment: bool = False  # random RST augmentation (the paper's "+" data)
    train_resampling: tuple[str, ...] = ("bicubic",)
    test_resampling: tuple[str, ...] = ()
    init: str | None = None  # start from this checkpoint's weights
    out: Path | None = None
    resume: bool = False
    trials: int = 1
    device: str = "auto"
    data_root: Path | None = None
    stl10_root: Path | None = None
    model_args: Mapping[str, Any] = field(default_factory=dict)
    limit_train: int | None = None
    limit_test: int | None = None
    workers: int | None = None
    threads: int | None = None
    bf16: bool = False
    tf32: bool = True
    data_label: str | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.model not in list_models():
            raise ValueError(f"model {self.model!r} is not registered; choose from {list_models()}")
        if self.data not in DATA_CHOICES:
            raise ValueError(f"data {self.data!r}: choose from {', '.join(DATA_CHOICES)}")
        recipe = self.recipe
        for name in ("epochs", "batch_size", "lr", "val_size"):
            if getattr(self, name) is None:
                put(name, getattr(recipe, name))
        if self.train_size is None and self.data != STL10:
            put("train_size", 5000)
        put("model_args", dict(self.model_args))
        put("train_resampling", tuple(dict.fromkeys(self.train_resampling)))
        put("test_resampling", tuple(dict.fromkeys(self.test_resampling)))
        at_least_one = ("epochs", "batch_size", "trials", "limit_train", "limit_test")
        for name in (*at_least_one, "train_size", "threads"):
            self._at_least(name, 1)
        for name in ("val_size", "workers", "seed", "realisation"):
            self._at_least(name, 0)
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        unknown = set(self.train_resampling + self.test_resampling) - set(RESAMPLINGS)
        if unknown or not self.train_resampling:
            raise ValueError(
                f"train_resampling / test_resampling: choose from {', '.join(RESAMPLINGS)} "
                f"(got {sorted(unknown) or 'none for training'})"
            )
        if self.data == STL10:
            if self.stl10_root is None:
                raise ValueError(
                    "data stl10 needs stl10_root (--stl10-root DIR, the folder holding "
                    "stl10_binary/)"
                )
            if self.augment:
                raise ValueError(
                    "augment (random RST) is for RS data; STL-10 always uses the paper's "
                    "crop, flip and Cutout"
                )
            if self.train_resampling != ("bicubic",) or self.test_resampling:
                raise ValueError("train_resampling and test_resampling are for RS data")
        if self.init is not None:
            put("init", str(self.init))
        if self.out is None:
            size = "all" if self.train_size is None else self.train_size
            aug = "-aug" if self.augment else ""
            name = f"{self.model}-{self.data}-{size}{aug}-r{self.realisation}-s{self.seed}"
            put("out", Path("runs") / name)
        else:
            put("out", Path(self.out))

    def _at_least(self, name: str, low: int) -> None:
        value = getattr(self, name)
        if value is not None and (isinstance(value, bool) or value < low):
            raise ValueError(f"{name} must be at least {low}, got {value}")

    @property
    def recipe(self) -> Recipe:
        """The paper's optimiser and schedule for this data set."""
        return STL10_RECIPE if self.data == STL10 else RS_RECIPE


def settings_of(config: TrainConfig, seed: int) -> dict[str, Any]:
    """What decides a trial's weights (stored in its checkpoints, compared on --resume), as
    plain JSON values."""
    values = {key: getattr(config, key) for key in RESULT_SETTINGS}
    values["seed"] = seed
    values["data"] = config.data_label or config.data
    values["train_resampling"] = list(config.train_resampling)
    return values


def add_model_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """The repeatable ``--model-arg KEY=VALUE`` option (into ``args.model_args``, a list of
    pairs; later pairs win in ``dict(...)``)."""
    parser.add_argument(
        "--model-arg",
        dest="model_args",
        type=parse_model_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=help,
    )


def parse_model_arg(text: str) -> tuple[str, Any]:
    """``key=value`` with a Python literal value (``channels=(4,6,8)``); bare words are
    strings (``basis=sl``)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"expected key=value (e.g. channels=(4,6,8)), got {text!r}"
        )
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    if isinstance(value, (set, frozenset, bytes, complex)):
        raise argparse.ArgumentTypeError(f"{key}: use numbers, strings, tuples or lists, got {raw}")
    return key, value
