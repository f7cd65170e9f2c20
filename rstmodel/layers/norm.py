"""Equivariant batch norm: one statistic per channel over rotations, scales and space."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import native
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
        """Batch norm of a [N, C] view (channels innermost). Statistics on the CPU by
        ``_RowBatchNorm`` (chunked float64 column sums, 11x ``torch.var_mean``'s speed there),
        elsewhere by ``torch.var_mean``: the channels-last batch_norm kernel loses digits on
        large N."""
        batch_stats = self.training or not self.track_running_stats
        if batch_stats and x.device.type == "cpu":
            y, mean, var = _RowBatchNorm.apply(x, self.weight, self.bias, self.eps)
            self._track(mean, var, x.shape[0])
            return y
        if batch_stats:
            var, mean = torch.var_mean(x, dim=0, correction=0)
            if x.dtype in (torch.bfloat16, torch.float16):  # autocast: statistics in float
                var, mean = var.float(), mean.float()
            self._track(mean, var, x.shape[0])
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

    def _track(self, mean: Tensor, var: Tensor, n: int) -> None:
        """The running statistics' update from a training batch's (biased) ones."""
        if not (self.training and self.track_running_stats):
            return
        self.num_batches_tracked.add_(1)
        f = self.momentum if self.momentum is not None else 1 / self.num_batches_tracked.item()
        with torch.no_grad():
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), f)
            self.running_var.lerp_((var * n / max(n - 1, 1)).to(self.running_var.dtype), f)


# Rows per chunk of ``_RowBatchNorm``'s column sums: each chunk's sum is one GEMV, whose
# passes over the chunk stay in cache. ``torch.var_mean`` over a [N, C] map with C
# innermost runs at ~1 GB/s on the CPU (a 1.6M x 69 float32 map: 435 ms, in chunks 39 ms;
# BENCHMARKS.md, "Issue 13, twelfth session").
STAT_CHUNK_ROWS = 16384
# Rows whose mean shifts the compiled one-pass statistics (``native.column_stats``): close
# enough to the batch's mean that the variance's shifted sums lose no digits.
SHIFT_ROWS = 4096


def _column_sums(term, *maps: Tensor) -> Tensor:
    """float64 ``[C]``: the sum over rows of ``term(*chunks)`` for row chunks of the [N, C]
    ``maps``, each chunk's sum a GEMV in float32 (float64 for float64 maps) added up in
    float64. ``term`` gets the chunks in that dtype and must not write to them."""
    x = maps[0]
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    total = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    ones = torch.ones(min(STAT_CHUNK_ROWS, x.shape[0]), dtype=wide, device=x.device)
    with torch.autocast(x.device.type, enabled=False):  # the GEMVs in float32, not bf16
        for chunks in zip(*(m.split(STAT_CHUNK_ROWS) for m in maps), strict=True):
            part = term(*(c.to(wide) for c in chunks))
            total += ones[: part.shape[0]] @ part
    return total


class _RowBatchNorm(torch.autograd.Function):
    """Training-mode batch norm of [N, C] rows (channels innermost): y = (x - mean) rstd
    weight + bias with the batch's biased statistics, returned beside y (float32; float64
    for float64 x; not differentiable). Statistics in two chunked passes (mean, then the
    centred squares: no cancellation), or on the CPU in float32 and bfloat16 in one compiled
    pass of sums shifted by the first rows' mean (``native.column_stats``); y in x's dtype;
    the backward reduces the gradient the same way (its two sums in one pass) and writes the
    input's gradient in one expression, per channel ``A g + B x + C``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float):
        n = x.shape[0]
        stat = torch.float64 if x.dtype == torch.float64 else torch.float32
        if native.column_stats_available(x):  # compiled: one pass, a shift near the mean
            shift = x[:SHIFT_ROWS].float().mean(0)
            s1, s2 = native.column_stats(x, shift)
            d = s1 / n
            mean, var = shift.double() + d, (s2 / n - d * d).clamp_min(0)
        else:
            mean = _column_sums(lambda c: c, x) / n
            centre = mean.to(stat)
            var = _column_sums(lambda c: (c - centre).square(), x) / n
        mean, var = mean.to(stat), var.to(stat)
        rstd = torch.rsqrt(var + eps)
        scale = rstd if weight is None else rstd * weight.to(stat)
        shift = -mean * scale if bias is None else bias.to(stat) - mean * scale
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(mean, var)
        return torch.addcmul(shift.to(x.dtype), x, scale.to(x.dtype)), mean, var

    @staticmethod
    def backward(ctx, g: Tensor, _mean, _var):
        x, mean, rstd, weight = ctx.saved_tensors
        n = x.shape[0]
        stat = mean.dtype
        if native.column_stats_available(x, g):  # compiled: both sums in one pass
            sum_g, sum_gxc = native.column_stats(x, mean, g)
            sum_g, sum_gxc = sum_g.to(stat), sum_gxc.to(stat)
        else:
            sum_g = _column_sums(lambda c: c, g).to(stat)
            sum_gxc = _column_sums(lambda gc, xc: gc * (xc - mean), g, x).to(stat)
        sum_gx = sum_gxc * rstd  # sum of g times the normalised input: the weight's gradient
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            a = rstd if weight is None else rstd * weight.to(stat)
            b = -a * rstd * sum_gx / n
            c = -b * mean - a * sum_g / n
            grad_x = torch.addcmul(c.to(g.dtype), g, a.to(g.dtype))
            grad_x.addcmul_(x.to(g.dtype), b.to(g.dtype))
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_gx.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = sum_g.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None
