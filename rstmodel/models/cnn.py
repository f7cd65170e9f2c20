"""The paper's plain CNN baseline (Section 5.2): 3 conv layers 7x7, ~495K parameters."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor, nn

from .registry import check_images, register_model

__all__ = ["CNNConfig", "CNN"]


@dataclass(frozen=True)
class CNNConfig:
    in_channels: int = 1
    num_classes: int = 10
    input_size: int = 56
    channels: tuple[int, ...] = (32, 63, 95)
    kernel_size: int = 7
    hidden: int = 256
    dropout: float = 0.7
    head_pool: int = 2  # the last map is max-pooled to head_pool x head_pool before the FC

    def __post_init__(self) -> None:
        object.__setattr__(self, "channels", tuple(self.channels))
        if self.kernel_size % 2 == 0 or self.kernel_size < 1:
            raise ValueError(f"kernel_size must be odd and positive, got {self.kernel_size}")
        if not self.channels or min(self.channels) < 1:
            raise ValueError(f"channels must be positive, got {self.channels}")
        if self.input_size % 2 ** len(self.channels):
            raise ValueError(
                f"input_size {self.input_size} must be divisible by 2**{len(self.channels)}"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def classifier_head(cin: int, hidden: int, dropout: float, classes: int, *, pool: int):
    """The paper's head on a [B, cin, h, w] map: max-pool to ``pool`` x ``pool``, FC(hidden)
    -> BN -> ReLU -> dropout -> FC(classes)."""
    return nn.Sequential(
        nn.AdaptiveMaxPool2d(pool),
        nn.Flatten(),
        nn.Linear(cin * pool**2, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, classes),
    )


class CNN(nn.Module):
    """conv -> ReLU -> max-pool -> BN per layer, then FC(hidden) -> BN -> ReLU -> dropout -> FC.
    x [B, Cin, H, W] -> logits [B, classes]."""

    def __init__(self, config: CNNConfig):
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        cin = config.in_channels
        for c in config.channels:
            layers += [
                nn.Conv2d(cin, c, config.kernel_size, padding=config.kernel_size // 2),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
                nn.BatchNorm2d(c),
            ]
            cin = c
        self.features = nn.Sequential(*layers)
        self.head = classifier_head(
            cin, config.hidden, config.dropout, config.num_classes, pool=config.head_pool
        )

    def check_input(self, x: Tensor) -> None:
        check_images(x, self.config.in_channels, self.config.input_size)

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        return self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        """``forward`` without the input check."""
        return self.head(self.features(x))


@register_model
def cnn(**overrides) -> CNN:
    """Plain CNN baseline of the paper (3 conv 7x7, ~495K params)."""
    return CNN(replace(CNNConfig(), **overrides))
