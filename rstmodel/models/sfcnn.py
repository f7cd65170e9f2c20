"""The paper's steerable-filter peers SFCNN and SFCNN+ (Weiler, Hamprecht, Storath 2018;
"RESN" in the paper's text): rotation-equivariant CNNs on the cyclic group C8 with regular
feature fields, built on the ``e2cnn`` library (an optional extra: ``pip install
'rstcnn[peers]'``).

The skeleton is the plain CNN's (three 7x7 conv layers, each conv -> ReLU -> 2x2 max-pool ->
batch norm, then the same classifier head), with every layer an ``e2cnn`` ``R2Conv`` between
regular fields of ``Rot2dOnR2(8)`` (the input a trivial field), pointwise ReLU and max-pool,
and batch norm shared by the 8 channels of a field; a group max-pool after the last layer
(over each field's 8 rotations and over space, as the RST models' ``GroupMaxPool(spatial=
True)``) makes the features rotation invariant. A regular-field convolution already couples all 8 rotations (inter-rotation
correlation L_theta = Nr), so SFCNN+ differs from SFCNN only in width: ~1.6M parameters
against ~500K, as the paper's "+" models. ``plain()`` is the eval-mode copy in plain torch
(``e2cnn``'s own export of each layer) that the exporter bakes.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, replace
from types import ModuleType

from torch import Tensor, nn

from .cnn import classifier_head
from .registry import check_images, register_model

__all__ = ["SFCNNConfig", "SFCNN", "FieldMaxPool"]

_DERIVED = ("filter", "expanded_bias")  # e2cnn's eval-mode caches, not state
PEERS_EXTRA = "pip install 'rstcnn[peers]' (or: pip install e2cnn)"


def _e2cnn() -> ModuleType:
    try:
        return importlib.import_module("e2cnn")
    except ImportError as err:
        raise ImportError(
            f"the steerable-filter peers (sfcnn, sfcnn_plus) need the e2cnn package: {PEERS_EXTRA}"
        ) from err


@dataclass(frozen=True)
class SFCNNConfig:
    in_channels: int = 1
    num_classes: int = 10
    input_size: int = 56
    channels: tuple[int, ...] = (21, 41, 62)  # regular fields per layer (x8 channels)
    rotations: int = 8
    kernel_size: int = 7
    hidden: int = 256
    dropout: float = 0.7
    head_pool: int = 1  # global max-pool after the group max-pool: rotation invariant

    def __post_init__(self) -> None:
        object.__setattr__(self, "channels", tuple(self.channels))
        if self.kernel_size % 2 == 0 or self.kernel_size < 1:
            raise ValueError(f"kernel_size must be odd and positive, got {self.kernel_size}")
        if not self.channels or min(self.channels) < 1 or self.rotations < 1:
            raise ValueError(f"channels and rotations must be positive, got {self}")
        if self.input_size % 2 ** len(self.channels):
            raise ValueError(
                f"input_size {self.input_size} must be divisible by 2**{len(self.channels)}"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class FieldMaxPool(nn.Module):
    """Group max-pool: the maximum over each regular field's ``size`` rotation channels.
    x [B, C*size, H, W] -> [B, C, H, W]."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        return x.view(b, c // self.size, self.size, h, w).amax(dim=2)


class SFCNN(nn.Module):
    """x [B, Cin, H, W] -> logits [B, classes]; invariant to the input's rotations by
    multiples of 360/``rotations`` degrees where the grid allows (exactly for quarter turns)."""

    def __init__(self, config: SFCNNConfig):
        super().__init__()
        e2 = _e2cnn()
        enn = e2.nn
        self.config = config
        gspace = e2.gspaces.Rot2dOnR2(config.rotations)
        ftype = enn.FieldType(gspace, config.in_channels * [gspace.trivial_repr])
        self.in_type = ftype
        layers = []
        k = config.kernel_size
        for c in config.channels:
            out = enn.FieldType(gspace, c * [gspace.regular_repr])
            layers += [
                enn.R2Conv(ftype, out, k, padding=k // 2),
                enn.ReLU(out, inplace=True),
                enn.PointwiseMaxPool(out, 2),
                enn.InnerBatchNorm(out),
            ]
            ftype = out
        for conv in layers[::4]:
            # e2cnn shares one sampled basis module between every layer (and model) of the
            # same field types: own copies, so that .to(dtype / device) of this model cannot
            # change another's
            conv._basisexpansion = copy.deepcopy(conv._basisexpansion)
        self.features = enn.SequentialModule(*layers)
        self.pool = FieldMaxPool(config.rotations)
        self.head = classifier_head(
            config.channels[-1],
            config.hidden,
            config.dropout,
            config.num_classes,
            pool=config.head_pool,
        )
        self._geometric = enn.GeometricTensor

    def check_input(self, x: Tensor) -> None:
        check_images(x, self.config.in_channels, self.config.input_size)

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        return self.logits(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """The last layer's regular fields, x [B, Cin, H, W] -> [B, C, R, h, w] (R = the
        rotations: a field's channels, which a rotation of the input shifts cyclically)."""
        self.check_input(x)
        return self._fields(x).unflatten(1, (-1, self.config.rotations))

    def logits(self, x: Tensor) -> Tensor:
        """``forward`` without the input check."""
        return self.head(self.pool(self._fields(x)))

    def _fields(self, x: Tensor) -> Tensor:
        return self.features(self._geometric(x, self.in_type)).tensor

    def state_dict(self, *args, **kwargs):
        """Without ``e2cnn``'s derived buffers (each layer's expanded filter and bias, there
        in eval mode only, recomputed from the weights): the same keys in either mode."""
        state = super().state_dict(*args, **kwargs)
        for key in [k for k in state if k.rsplit(".", 1)[-1] in _DERIVED]:
            del state[key]
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        state = {k: v for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in _DERIVED}
        result = super().load_state_dict(state, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k.rsplit(".", 1)[-1] not in _DERIVED]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Error(s) in loading state_dict for SFCNN: missing {missing}, "
                f"unexpected {result.unexpected_keys}"
            )
        if not self.training:
            self.train(False)  # e2cnn expands the filters again from the loaded weights
        return result

    def __deepcopy__(self, memo: dict) -> SFCNN:
        """A new model with this one's state: in eval mode ``e2cnn`` keeps each layer's
        expanded filter with its autograd history, which ``copy.deepcopy`` refuses."""
        twin = type(self)(self.config).to(next(self.parameters()))  # same dtype and device
        twin.load_state_dict(self.state_dict())
        return twin.train(self.training)

    def plain(self) -> nn.Sequential:
        """An eval-mode copy in plain torch (Conv2d, ReLU, MaxPool2d, BatchNorm2d, the group
        max-pool, the head) with the same logits: what ``export.bake`` traces."""
        twin = copy.deepcopy(self).eval()
        like = next(self.parameters())  # e2cnn exports its batch norms in float32
        return nn.Sequential(twin.features.export().to(like), twin.pool, twin.head).eval()


@register_model
def sfcnn(**overrides) -> SFCNN:
    """SFCNN peer (steerable filters, e2cnn): C8 regular fields, 3 conv 7x7, ~510K params;
    needs the peers extra."""
    return SFCNN(replace(SFCNNConfig(), **overrides))


@register_model
def sfcnn_plus(**overrides) -> SFCNN:
    """SFCNN+ peer: SFCNN at ~1.58M params (the '+' models' size); needs the peers extra."""
    return SFCNN(replace(SFCNNConfig(channels=(37, 73, 110)), **overrides))
