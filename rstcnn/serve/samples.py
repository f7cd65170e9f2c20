"""A gallery of real test images for the app: PNG files and a ``samples.json`` listing them.

The app ships one (``GALLERY``: 12 images of the RS-Fashion test split, realisation 0, one
per class first), read without torch. ``write_samples`` makes one in another folder (and
made the shipped one: ``python -m serve.samples FOLDER``); it needs the training side
(``rstmodel``) and a source, in order: the RS-Fashion test split of realisation 0 when its
data cache exists (``python train/prepare_data.py --data rs-fashion``); else the
Fashion-MNIST test images of the Debian package ``dataset-fashion-mnist``, rotated and
scaled by the RS protocol with a fixed seed.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["GALLERY", "Sample", "load_samples", "write_samples"]

log = logging.getLogger(__name__)

GALLERY = Path(__file__).resolve().parent / "gallery"  # shipped with the app
MANIFEST = "samples.json"
NUM_SAMPLES = 12
_FASHION_TEST = 10_000  # the last 10,000 of the 70,000 IDX images are Fashion-MNIST's test set


@dataclass(frozen=True)
class Sample:
    path: Path
    label: int  # true class index
    source: str


def load_samples(folder: Path) -> list[Sample]:
    """The samples listed in ``folder/samples.json`` whose files exist; [] if none."""
    try:
        entries = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    samples = [
        Sample(folder / entry["file"], int(entry["label"]), str(entry["source"]))
        for entry in entries
        if (folder / entry["file"]).is_file()
    ]
    return samples if len(samples) == len(entries) else []


def write_samples(
    folder: Path, *, count: int = NUM_SAMPLES, cache_dir: Path | None = None
) -> list[Sample]:
    """Samples already in ``folder``, else ``count`` real test images written there (one
    per class first). [] when no source is installed."""
    existing = load_samples(folder)
    if existing:
        return existing
    try:
        from rstmodel.data import default_cache_dir
    except ImportError as err:  # a serving-only install: the shipped gallery or none
        log.warning("no gallery in %s and none can be made here (%s)", folder, err)
        return []
    found = _from_rs_cache(cache_dir or default_cache_dir()) or _from_debian(count)
    if found is None:
        log.warning(
            "no test images for the gallery: prepare RS-Fashion "
            "(python train/prepare_data.py --data rs-fashion) or install dataset-fashion-mnist"
        )
        return []
    images, labels, source = found
    picks = _one_per_class_first(labels, count)
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for n, i in enumerate(picks):
        name = f"sample_{n:02d}_class{int(labels[i])}.png"
        Image.fromarray(images[i]).save(folder / name)
        entries.append({"file": name, "label": int(labels[i]), "source": source})
    (folder / MANIFEST).write_text(json.dumps(entries, indent=1))
    log.info("wrote %d gallery images from %s to %s", len(entries), source, folder)
    return load_samples(folder)


def _one_per_class_first(labels: np.ndarray, count: int) -> list[int]:
    """Indices into ``labels``: the first image of each class in order, then the next ones."""
    first = [int(np.flatnonzero(labels == c)[0]) for c in np.unique(labels)]
    taken = set(first)
    rest = (i for i in range(len(labels)) if i not in taken)
    return (first + [next(rest) for _ in range(max(count - len(first), 0))])[:count]


def _from_rs_cache(cache_dir: Path) -> tuple[np.ndarray, np.ndarray, str] | None:
    from rstmodel.data import RSConfig, load_rs
    from rstmodel.data.rs import RSDataset

    config = RSConfig(RSDataset.FASHION)
    if not config.cache_path(cache_dir).is_file():
        return None
    try:
        data = load_rs(config, cache_dir=cache_dir)
        test = data.split(5000).test
    except Exception as err:  # a damaged cache only costs the gallery its preferred source
        log.warning("RS-Fashion cache unusable for the gallery (%s)", err)
        return None
    head = slice(0, 2000)
    return test.images[head], test.labels[head], "RS-Fashion test split (realisation 0)"


def _from_debian(count: int) -> tuple[np.ndarray, np.ndarray, str] | None:
    from rstmodel.data import RSConfig
    from rstmodel.data.rs import RSDataset, rotate_scale_upsize
    from rstmodel.data.sources import DEBIAN_FASHION_DIR, read_idx_folder

    if not DEBIAN_FASHION_DIR.is_dir():
        return None
    try:
        images, labels = read_idx_folder(DEBIAN_FASHION_DIR)
    except (OSError, ValueError) as err:
        log.warning("Fashion-MNIST files unreadable for the gallery (%s)", err)
        return None
    picks = _one_per_class_first(labels[-_FASHION_TEST:], count)
    images, labels = images[-_FASHION_TEST:][picks], labels[-_FASHION_TEST:][picks]
    config = RSConfig(RSDataset.FASHION)
    rng = np.random.default_rng(config.seed)
    angles = rng.uniform(*config.angle_range, size=len(images))
    scales = rng.uniform(*config.scale_range, size=len(images))
    out = np.stack(
        [
            rotate_scale_upsize(im, a, s, config.out_size)
            for im, a, s in zip(images, angles, scales, strict=True)
        ]
    )
    return out, labels, "Fashion-MNIST test images (Debian), RS protocol, seed 0"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a gallery of real test images.")
    parser.add_argument("folder", type=Path, help="where to write it (kept if already there)")
    parser.add_argument("--count", type=int, default=NUM_SAMPLES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not write_samples(args.folder, count=args.count):
        raise SystemExit("no source of test images: see the warning above")


if __name__ == "__main__":
    main()
