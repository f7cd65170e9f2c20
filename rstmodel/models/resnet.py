"""Wide ResNet-16 for STL-10 (3x96x96) and its RST version (paper Section 5.3).

Pre-activation blocks, two per stage, three stages; stages 2 and 3 halve the resolution
with a 2x2 max-pool (symmetric, so 90-degree turns stay exact, unlike a stride-2 conv).
The RST version swaps every 3x3 conv for an RST group conv, batch norm for the equivariant
one, and group-max-pools over R, S and space after the last residual block only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor, nn

from ..basis import BasisFamily, BasisSpec
from ..layers import (
    ConvMethod,
    GroupMaxPool,
    GroupRSTConv,
    LiftingRSTConv,
    RSTBatchNorm,
    RSTMaxPool,
    RSTPointwise,
)
from .registry import check_images, register_model

__all__ = ["ResNetConfig", "ResNet16", "RSTResNet16"]


@dataclass(frozen=True)
class ResNetConfig:
    in_channels: int = 3
    num_classes: int = 10
    input_size: int = 96
    widths: tuple[int, int, int] = (64, 128, 256)
    dropout: float = 0.0
    # RST only
    basis: BasisFamily = BasisFamily.FOURIER_BESSEL
    num_funcs: int = 12
    rotations: int = 8
    num_scales: int = 2
    base_radius: float = 2.5
    scale_ratio: float = 2**0.5
    method: ConvMethod = ConvMethod.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))
        object.__setattr__(self, "basis", BasisFamily(self.basis))
        object.__setattr__(self, "method", ConvMethod(self.method))
        if len(self.widths) != 3 or min(self.widths) < 1:
            raise ValueError(f"widths must be three positive ints, got {self.widths}")
        if self.input_size % 4:
            raise ValueError(f"input_size must be divisible by 4, got {self.input_size}")

    def basis_spec(self) -> BasisSpec:
        radii = tuple(self.base_radius * self.scale_ratio**s for s in range(self.num_scales))
        return BasisSpec(self.basis, self.num_funcs, self.rotations, radii)


class _Block(nn.Module):
    """Pre-activation residual block: BN-ReLU-conv-(pool)-BN-ReLU-conv + shortcut."""

    def __init__(
        self, cin: int, cout: int, downsample: bool, make_conv, make_norm, make_pool, shortcut
    ):
        super().__init__()
        self.norm1 = make_norm(cin)
        self.conv1 = make_conv(cin, cout)
        self.pool = make_pool() if downsample else nn.Identity()
        self.norm2 = make_norm(cout)
        self.conv2 = make_conv(cout, cout)
        self.relu = nn.ReLU()
        self.shortcut = shortcut(cin, cout, downsample)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv1(self.relu(self.norm1(x)))
        y = self.conv2(self.relu(self.norm2(self.pool(y))))
        return y + self.shortcut(x)


class _Shortcut(nn.Module):
    def __init__(self, project: nn.Module | None, pool: nn.Module | None):
        super().__init__()
        self.pool = pool if pool is not None else nn.Identity()
        self.project = project if project is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.project(self.pool(x))


def _check(x: Tensor, config: ResNetConfig) -> None:
    check_images(x, config.in_channels, config.input_size)


def _stages(config: ResNetConfig, stem_out: int, make_conv, make_norm, make_pool, project):
    def shortcut(cin: int, cout: int, downsample: bool) -> nn.Module:
        proj = project(cin, cout) if cin != cout else None
        return _Shortcut(proj, make_pool() if downsample else None)

    blocks = []
    cin = stem_out
    for stage, width in enumerate(config.widths):
        for i in range(2):
            down = stage > 0 and i == 0
            blocks.append(_Block(cin, width, down, make_conv, make_norm, make_pool, shortcut))
            cin = width
    return nn.Sequential(*blocks)


class ResNet16(nn.Module):
    """Wide ResNet-16 baseline.  x [B, 3, 96, 96] -> logits [B, classes]."""

    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        stem = config.widths[0] // 4
        self.stem = nn.Conv2d(config.in_channels, stem, 3, padding=1, bias=False)
        self.stages = _stages(
            config,
            stem,
            lambda i, o: nn.Conv2d(i, o, 3, padding=1, bias=False),
            nn.BatchNorm2d,
            lambda: nn.MaxPool2d(2),
            lambda i, o: nn.Conv2d(i, o, 1, bias=False),
        )
        self.out = nn.Sequential(nn.BatchNorm2d(config.widths[-1]), nn.ReLU())
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(config.dropout),
            nn.Linear(config.widths[-1], config.num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        _check(x, self.config)
        return self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        return self.head(self.out(self.stages(self.stem(x))))


class RSTResNet16(nn.Module):
    """RST Wide ResNet-16.  x [B, 3, 96, 96] -> logits [B, classes] (90-degree invariant)."""

    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        spec = config.basis_spec()
        self.spec = spec
        stem = config.widths[0] // 4
        self.stem = LiftingRSTConv(config.in_channels, stem, spec, bias=False, method=config.method)
        self.stages = _stages(
            config,
            stem,
            lambda i, o: GroupRSTConv(i, o, spec, bias=False, method=config.method),
            RSTBatchNorm,
            lambda: RSTMaxPool(),
            RSTPointwise,
        )
        self.out = nn.Sequential(RSTBatchNorm(config.widths[-1]), nn.ReLU())
        self.pool = GroupMaxPool(spatial=True)
        self.head = nn.Sequential(
            nn.Dropout(config.dropout), nn.Linear(config.widths[-1], config.num_classes)
        )

    def forward_features(self, x: Tensor) -> Tensor:
        """The last equivariant map.  x [B, 3, N, N] -> [B, C, R, S, N/4, N/4]."""
        _check(x, self.config)
        return self.out(self.stages(self.stem(x)))

    def forward(self, x: Tensor) -> Tensor:
        _check(x, self.config)
        return self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.out(self.stages(self.stem(x)))))


@register_model
def resnet16(**overrides) -> ResNet16:
    """Wide ResNet-16 (widths 64/128/256) for STL-10 3x96x96."""
    return ResNet16(replace(ResNetConfig(), **overrides))


@register_model
def rst_resnet16(**overrides) -> RSTResNet16:
    """RST Wide ResNet-16 for STL-10: Nr=8, Ns=2, K=12 FB, group max-pool after the last block."""
    return RSTResNet16(replace(ResNetConfig(widths=(32, 64, 128)), **overrides))
