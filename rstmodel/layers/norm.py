"""Equivariant batch norm: one statistic per channel over rotations, scales and space."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .common import is_spatial_major

__all__ = ["RSTBatchNorm"]


class RSTBatchNorm(nn.BatchNorm3d):
    """Batch norm with one statistic per channel, shared over R, S, H, W (equivariant).
    x [B, C, R, S, H, W] -> same shape."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() not in (2, 5):
            raise ValueError(f"expected a 2D or 5D input, got {input.dim()}D")

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 6 or x.shape[1] != self.num_features:
            raise ValueError(
                f"RSTBatchNorm expects [B, {self.num_features}, R, S, H, W], got {tuple(x.shape)}"
            )
        if is_spatial_major(x):
            mem = x.permute(4, 5, 2, 3, 0, 1)  # [H, W, R, S, B, C]
            y = self._forward_rows(mem.reshape(-1, self.num_features)).view(mem.shape)
            return y.permute(4, 5, 2, 3, 0, 1)
        return super().forward(x.flatten(2, 3)).view_as(x)

    def _forward_rows(self, x: Tensor) -> Tensor:
        """Batch norm of a [N, C] view (channels innermost), with statistics from
        ``torch.var_mean``: the channels-last batch_norm kernel loses digits on large N."""
        if self.training or not self.track_running_stats:
            var, mean = torch.var_mean(x, dim=0, correction=0)
            if x.dtype in (torch.bfloat16, torch.float16):  # autocast: statistics in float
                var, mean = var.float(), mean.float()
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)
                f = (
                    self.momentum
                    if self.momentum is not None
                    else 1 / self.num_batches_tracked.item()
                )
                n = x.shape[0]
                with torch.no_grad():
                    self.running_mean.lerp_(mean, f)
                    self.running_var.lerp_(var * n / max(n - 1, 1), f)
        else:
            mean, var = self.running_mean, self.running_var
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        shift = -mean * scale
        if self.bias is not None:
            shift = shift + self.bias
        # in x's dtype: under autocast a bfloat16 map stays bfloat16 (statistics, scale and
        # shift are float32 until here); float32 output would double the bytes this writes
        # and the next layer reads (14 GB of a bf16 training step of 128, train/step_cost.py)
        return torch.addcmul(shift.to(x.dtype), x, scale.to(x.dtype))
