"""Data: offline sources, RS-MNIST / RS-Fashion, STL-10, RST and deformation transforms."""

from .cache import default_cache_dir
from .classes import CLASS_NAMES, STL10
from .datasets import ArrayDataset, Batch, RotatedScaledDataset, VariantDataset, collate
from .rs import (
    HELD_OUT_RESAMPLING,
    NUM_REALISATIONS,
    NUM_VAL,
    RESAMPLINGS,
    TRAIN_RESAMPLINGS,
    TRAIN_SIZES,
    RSConfig,
    RSData,
    RSDataset,
    RSSplits,
    Split,
    load_rs,
    split_indices,
)
from .sources import BaseDataset, SourceInfo, SourceNotFoundError, find_source, load_source
from .stl10 import (
    STL10Data,
    load_stl10,
    ood_parameters,
    stl10_ood_transform,
    stl10_train_transform,
)
from .transforms import Cutout, RandomRST, deform, jacobian_sup_norm, rotate_scale, warp

__all__ = [
    "CLASS_NAMES",
    "STL10",
    "HELD_OUT_RESAMPLING",
    "NUM_REALISATIONS",
    "NUM_VAL",
    "RESAMPLINGS",
    "TRAIN_RESAMPLINGS",
    "TRAIN_SIZES",
    "ArrayDataset",
    "BaseDataset",
    "Batch",
    "Cutout",
    "RSConfig",
    "RSData",
    "RSDataset",
    "RSSplits",
    "RandomRST",
    "RotatedScaledDataset",
    "STL10Data",
    "SourceInfo",
    "SourceNotFoundError",
    "Split",
    "VariantDataset",
    "collate",
    "default_cache_dir",
    "deform",
    "find_source",
    "jacobian_sup_norm",
    "load_rs",
    "load_source",
    "load_stl10",
    "ood_parameters",
    "rotate_scale",
    "split_indices",
    "stl10_ood_transform",
    "stl10_train_transform",
    "warp",
]
