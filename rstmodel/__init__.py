"""rstcnn: roto-scale-translation equivariant CNNs (RST-CNN)."""

from .basis import BasisFamily, BasisSpec, reference_spec, sample_basis
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .group import RSTElement, act_on_features, act_on_image, fold, unfold
from .layers import (
    ConvMethod,
    GroupMaxPool,
    GroupRSTConv,
    LiftingRSTConv,
    RotationTaps,
    RSTBatchNorm,
    RSTMaxPool,
)
from .models import create_model, list_models, register_model

__version__ = "0.1.0"

__all__ = [
    "BasisFamily",
    "BasisSpec",
    "CheckpointError",
    "ConvMethod",
    "GroupMaxPool",
    "GroupRSTConv",
    "LiftingRSTConv",
    "RSTBatchNorm",
    "RSTElement",
    "RSTMaxPool",
    "RotationTaps",
    "act_on_features",
    "act_on_image",
    "create_model",
    "fold",
    "list_models",
    "load_checkpoint",
    "reference_spec",
    "register_model",
    "sample_basis",
    "save_checkpoint",
    "unfold",
]
