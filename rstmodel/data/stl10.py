"""STL-10 (paper Section 5.1) from the official binary files, and the paper's transforms.

The official ``stl10_binary`` folder holds ``{train,test}_X.bin`` (uint8, 3 x 96 x 96 per
image, each channel stored column-major: red plane first, its pixels running down the
columns) and ``{train,test}_y.bin`` (one uint8 label 1..10 per image). STL-10 is in no
package registry: users download and unpack it and pass its folder.

- ID test: the test set as is. OOD test: each test image rotated by U[-pi/2, pi/2] and
  scaled by U[0.8, 1] about the centre (bilinear, zero fill); the draws are seeded per
  ``(seed, realisation)`` and applied when an image is read (``RotatedScaledDataset``).
- Training augmentation (no rotation or scaling): random crop of the 12-px zero-padded
  image, random horizontal flip, Cutout 32.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms import v2

from .sources import SourceNotFoundError, file_sha256
from .transforms import Cutout, RandomRST

__all__ = [
    "STL10_SIZE",
    "STL10Data",
    "find_stl10",
    "read_stl10_images",
    "read_stl10_labels",
    "load_stl10",
    "ood_parameters",
    "stl10_train_transform",
    "stl10_ood_transform",
]

log = logging.getLogger(__name__)

STL10_SIZE = 96
_IMAGE_BYTES = 3 * STL10_SIZE * STL10_SIZE
_SPLITS = ("train", "test")
OOD_ANGLE_RANGE = (-math.pi / 2, math.pi / 2)
OOD_SCALE_RANGE = (0.8, 1.0)


def find_stl10(root: str | Path) -> Path:
    """The folder holding ``train_X.bin`` etc.: ``root`` itself or ``root/stl10_binary``."""
    root = Path(root)
    for folder in (root, root / "stl10_binary"):
        if all((folder / f"{split}_{part}.bin").is_file() for split in _SPLITS for part in "Xy"):
            return folder
    raise SourceNotFoundError(
        f"no STL-10 binary files in {root} or {root / 'stl10_binary'} (need train_X.bin, "
        "train_y.bin, test_X.bin, test_y.bin). STL-10 is in no package registry: download "
        "stl10_binary.tar.gz from https://cs.stanford.edu/~acoates/stl10/, unpack it with "
        "`tar xzf stl10_binary.tar.gz -C DIR` and pass --stl10-root DIR"
    )


def read_stl10_images(path: str | Path) -> np.ndarray:
    """uint8 [N, 3, 96, 96] (row-major planes) from an official ``*_X.bin`` file."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % _IMAGE_BYTES:
        raise ValueError(f"{path} holds {raw.size} bytes, not a multiple of 3 * 96 * 96")
    # [N, C, column, row] as stored -> [N, C, row, column]
    planes = raw.reshape(-1, 3, STL10_SIZE, STL10_SIZE).transpose(0, 1, 3, 2)
    return np.ascontiguousarray(planes)


def read_stl10_labels(path: str | Path) -> np.ndarray:
    """int64 [N] in 0..9 from an official ``*_y.bin`` file (labels 1..10 there)."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size and (raw.min() < 1 or raw.max() > 10):
        raise ValueError(f"{path}: STL-10 labels must lie in 1..10, got {raw.min()}..{raw.max()}")
    return raw.astype(np.int64) - 1


@dataclass(frozen=True, eq=False)
class STL10Data:
    """Train and test images uint8 [N, 3, 96, 96] with labels int64 [N] in 0..9."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    folder: Path
    sha256: str  # of the four files, train_X, train_y, test_X, test_y


def load_stl10(root: str | Path) -> STL10Data:
    """Read the train and test splits of the STL-10 binary files under ``root``."""
    folder = find_stl10(root)
    arrays = {}
    for split in _SPLITS:
        images = read_stl10_images(folder / f"{split}_X.bin")
        labels = read_stl10_labels(folder / f"{split}_y.bin")
        if labels.shape[0] != images.shape[0]:
            raise ValueError(
                f"{folder}: {images.shape[0]} {split} images but {labels.shape[0]} labels"
            )
        arrays[split] = (images, labels)
    files = [folder / f"{split}_{part}.bin" for split in _SPLITS for part in "Xy"]
    log.info(
        "STL-10 from %s: %d train, %d test images",
        folder,
        arrays["train"][0].shape[0],
        arrays["test"][0].shape[0],
    )
    return STL10Data(*arrays["train"], *arrays["test"], folder=folder, sha256=file_sha256(files))


def ood_parameters(
    num_images: int, *, seed: int, realisation: int
) -> tuple[np.ndarray, np.ndarray]:
    """OOD test draws: angles float64 [N] in U[-pi/2, pi/2) (rad) then scales float64 [N] in
    U[0.8, 1), from ``np.random.default_rng([seed, realisation])``."""
    rng = np.random.default_rng([seed, realisation])
    angles = rng.uniform(*OOD_ANGLE_RANGE, size=num_images)
    scales = rng.uniform(*OOD_SCALE_RANGE, size=num_images)
    return angles, scales


def stl10_train_transform(*, padding: int = 12, cutout: int = 32) -> v2.Compose:
    """The paper's STL-10 augmentation on ``[3, 96, 96]`` tensors: random crop of the
    zero-padded image, horizontal flip, Cutout. Uses torch's global generator."""
    return v2.Compose(
        [
            v2.RandomCrop(STL10_SIZE, padding=padding, fill=0),
            v2.RandomHorizontalFlip(),
            Cutout(cutout),
        ]
    )


def stl10_ood_transform(*, generator: torch.Generator | None = None) -> RandomRST:
    """A random OOD transform: rotation U[-90, 90] degrees, scale U[0.8, 1]. For a fixed,
    seeded OOD test set use ``ood_parameters`` with ``RotatedScaledDataset`` instead."""
    return RandomRST(degrees=90.0, scale_range=OOD_SCALE_RANGE, generator=generator)
