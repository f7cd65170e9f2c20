"""Layers composed: conv -> pool+ReLU -> batch norm, with the lifting convolution's fused
pooled path where it applies."""

from __future__ import annotations

from torch import Tensor, fx, nn

from .conv import LiftingRSTConv
from .norm import RSTBatchNorm
from .pooling import RSTMaxPool

__all__ = ["ConvPoolNorm"]


class ConvPoolNorm(nn.Sequential):
    """conv -> ``RSTMaxPool`` (ReLU fused) -> ``RSTBatchNorm``. A lifting conv on its basis
    path runs fused with the pool (``LiftingRSTConv.forward_pooled``): the same values, a
    quarter of the memory. Traced by ``torch.fx`` (export, baking), the block is the plain
    sequence, so a graph sees the three layers."""

    def __init__(self, conv: nn.Module, channels: int):
        super().__init__(conv, RSTMaxPool(relu=True), RSTBatchNorm(channels))

    def forward(self, x: Tensor) -> Tensor:
        conv, pool, norm = self
        fused = isinstance(conv, LiftingRSTConv)
        if fused and not isinstance(x, fx.Proxy) and conv.pools_fused():
            return norm(conv.forward_pooled(x, relu=pool.relu))
        return super().forward(x)
