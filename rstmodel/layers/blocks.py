"""Layers composed: conv -> pool+ReLU -> batch norm, with the lifting convolution's fused
pooled path where it applies."""

from __future__ import annotations

from torch import Tensor, fx, nn

from .conv import GroupRSTConv, LiftingRSTConv
from .norm import RSTBatchNorm
from .pooling import RSTMaxPool

__all__ = ["ConvPoolNorm"]


class ConvPoolNorm(nn.Sequential):
    """conv -> ``RSTMaxPool`` (ReLU fused) -> ``RSTBatchNorm``. A lifting conv on its basis
    path runs fused with the pool (``LiftingRSTConv.forward_pooled``): the same values, a
    quarter of the memory; so does a group conv on its FFT path without a gradient
    (``GroupRSTConv.forward_pooled``: the pooled quarter of each map, not the whole, goes
    back to the feature layout). A conv watched by forward hooks runs unfused, so that they
    see its call and its output. Traced by ``torch.fx`` (export, baking), the block is the plain
    sequence, so a graph sees the three layers."""

    def __init__(self, conv: nn.Module, channels: int):
        super().__init__(conv, RSTMaxPool(relu=True), RSTBatchNorm(channels))

    def forward(self, x: Tensor) -> Tensor:
        conv, pool, norm = self
        if isinstance(x, fx.Proxy) or _hooked(conv):  # a hooked conv runs as itself
            return super().forward(x)
        if isinstance(conv, (LiftingRSTConv, GroupRSTConv)) and conv.pools_fused(x):
            return norm(conv.forward_pooled(x, relu=pool.relu))
        return super().forward(x)


def _hooked(module: nn.Module) -> bool:
    """Whether forward hooks watch ``module`` (its own or global ones): they must see its
    call and its own output, so the fused paths, which skip both, are not taken."""
    glob = nn.modules.module
    return bool(
        module._forward_pre_hooks
        or module._forward_hooks
        or getattr(glob, "_global_forward_pre_hooks", None)
        or getattr(glob, "_global_forward_hooks", None)
    )
