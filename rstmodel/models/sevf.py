"""The paper's scale peer SEVF (Marcos, Kellenberger, Lobry, Tuia 2018, "Scale equivariance in
CNNs with vector fields"), on this code's layers.

Each layer applies one filter bank at the ``Ns`` scales of the FB basis (a scale-only
``LiftingRSTConv``: the same K coefficients expanded at every scale), and keeps, per channel
and pixel, the largest response over the scales (the magnitude) and which scale gave it. The
scale index is carried on as a direction: the next layer sees the vector field
``magnitude * (cos a_s, sin a_s)``, ``a_s = pi s / (Ns - 1)`` (the smallest and the largest
scale opposite each other), as two channels per feature. Like the other models: 7x7-scale
skeleton of the CNN (conv -> ReLU -> 2x2 max-pool -> batch norm per layer; the max-pool keeps
the magnitude's maximum and that pixel's scale), a global max-pool of the last magnitudes, and
the same classifier head. ~500K parameters. ``plain()`` is its plain-torch copy for the
exporter: each layer's scales as static convolutions with the layer's own expanded filters,
the vector-field steps as they are.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers import LiftingRSTConv
from .cnn import classifier_head
from .registry import check_images, register_model
from .rst_cnn import RSTCNNConfig

__all__ = ["SEVF", "ScaleVectorField", "StaticScales"]


class ScaleVectorField(nn.Module):
    """Responses at the scales -> (magnitude, scale) -> 2x2 max-pool -> batch norm of the
    magnitude -> the vector field, or the magnitude alone for the last layer.
    [B, C, 1, S, H, W] -> [B, 2C, H/2, W/2] (or [B, C, H/2, W/2] with ``last``)."""

    def __init__(self, channels: int, num_scales: int, *, last: bool = False):
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.last = last
        angles = torch.arange(num_scales, dtype=torch.float64) * math.pi / max(num_scales - 1, 1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, y: Tensor) -> Tensor:
        magnitude, scale = F.relu(y[:, :, 0]).max(dim=2)  # over the scales: [B, C, H, W]
        magnitude, where = F.max_pool2d(magnitude, 2, return_indices=True)
        scale = scale.flatten(2).gather(2, where.flatten(2)).view_as(magnitude)
        magnitude = self.norm(magnitude)
        if self.last:
            return magnitude
        return torch.cat([magnitude * self.cos[scale], magnitude * self.sin[scale]], dim=1)


class StaticScales(nn.Module):
    """A scale-only lifting convolution frozen into one ``Conv2d`` per scale (its own
    ``conv_weights``: the expanded filters at that scale's kernel size), in the layer's output
    layout. x [B, Cin, H, W] -> [B, Cout, 1, S, H, W]."""

    def __init__(self, conv: LiftingRSTConv):
        super().__init__()
        self.scales = nn.ModuleList()
        with torch.no_grad():
            for weight in conv.conv_weights():
                k = weight.shape[-1]
                static = nn.Conv2d(weight.shape[1], weight.shape[0], k, padding=k // 2)
                static = static.to(weight)
                static.weight.copy_(weight)
                if conv.bias is None:
                    static.bias = None
                else:
                    static.bias.copy_(conv.bias)
                self.scales.append(static)

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([conv(x) for conv in self.scales], dim=2).unsqueeze(2)


class SEVF(nn.Module):
    """x [B, Cin, H, W] -> logits [B, classes]. Its config is an ``RSTCNNConfig`` with one
    rotation (the basis, scales and widths; the tap settings are unused)."""

    def __init__(self, config: RSTCNNConfig):
        super().__init__()
        if config.rotations != 1:
            raise ValueError(f"SEVF is scale-only: rotations must be 1, got {config.rotations}")
        self.config = config
        spec = config.basis_spec()
        self.spec = spec
        convs, fields = [], []
        cin = config.in_channels
        for i, c in enumerate(config.channels):
            convs.append(LiftingRSTConv(cin, c, spec, method=config.method))
            last = i == len(config.channels) - 1
            fields.append(ScaleVectorField(c, spec.num_scales, last=last))
            cin = 2 * c  # the vector field's two components
        self.convs = nn.ModuleList(convs)
        self.fields = nn.ModuleList(fields)
        self.head = classifier_head(
            config.channels[-1], config.hidden, config.dropout, config.num_classes, pool=1
        )

    def check_input(self, x: Tensor) -> None:
        check_images(x, self.config.in_channels, self.config.input_size)

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        return self.logits(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """The last layer's magnitudes, [B, C, h, w]."""
        self.check_input(x)
        return self._magnitudes(x)

    def logits(self, x: Tensor) -> Tensor:
        """``forward`` without the input check."""
        return self.head(self._magnitudes(x))

    def _magnitudes(self, x: Tensor) -> Tensor:
        for conv, field in zip(self.convs, self.fields, strict=True):
            x = field(conv(x))
        return x

    def plain(self) -> SEVF:
        """An eval-mode copy whose convolutions are ``StaticScales`` (plain ``Conv2d``): the
        same logits, what ``export.bake`` traces."""
        twin = copy.deepcopy(self).eval()
        twin.convs = nn.ModuleList(StaticScales(conv) for conv in twin.convs)
        return twin


@register_model
def sevf(**overrides) -> SEVF:
    """SEVF peer (scale-equivariant vector fields): Ns=4 FB scales, K=12, max over scales with
    the scale carried as a direction, ~500K params."""
    return SEVF(replace(RSTCNNConfig(rotations=1, channels=(49, 98, 147)), **overrides))
