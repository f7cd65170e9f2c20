"""Pooling of RST feature maps: 2x2 spatial max-pool (with the ReLU fused, one pass
forward and backward) and the group max-pool over rotations and scales."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import native
from .common import is_spatial_major

__all__ = ["RSTMaxPool", "GroupMaxPool"]


def _check_even(h: int, w: int) -> None:
    if h % 2 or w % 2:
        raise ValueError(
            f"RSTMaxPool needs even spatial sizes to stay exact under 90-degree turns, "
            f"got {h}x{w}: resize the input"
        )


def _pool_quads(
    p0: Tensor,
    p1: Tensor,
    p2: Tensor,
    p3: Tensor,
    *,
    relu: bool,
    argmax: bool,
    out: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """relu(max of the four 2x2 window positions p0..p3 (views in scan order) + bias), into
    ``out`` if given; with ``argmax`` also the position that won, one byte per output, in
    scan order (the first of equal values wins), 4 where the ReLU clamps (no gradient)."""
    top, bottom = torch.maximum(p0, p1), torch.maximum(p2, p3)
    m = torch.maximum(top, bottom, out=out)
    if bias is not None:
        m.add_(bias)
    idx = None
    if argmax:
        # in byte arithmetic: torch.where and masked_fill_ on bytes ran ~4x slower than all
        # of it on the CPU (BENCHMARKS.md, "Issue 13, twelfth session")
        low = (bottom > top).view(torch.uint8)  # 1 where the bottom pair won
        right = ((p3 > p2).view(torch.uint8) & low) | ((p1 > p0).view(torch.uint8) & (low ^ 1))
        idx = (low << 1) | right
        if relu:
            idx |= (m <= 0).view(torch.uint8) << 2
            idx.clamp_max_(4)
    if relu:
        m.clamp_min_(0)
    return m, idx


def _unpool_quads(grad: Tensor, idx: Tensor, quads: list[Tensor] | tuple[Tensor, ...]) -> None:
    """The gradient of ``_pool_quads``: ``grad`` into the window position ``idx`` names,
    zeros into the other three (``quads``: the four positions' views, written whole). The
    masks in byte arithmetic, multiplied as bytes: on the CPU comparisons that give bools and
    bools cast to floats run at ~2 G values/s, shifts and byte products at memory speed (the
    unpooling 2-3.7x faster; BENCHMARKS.md, "Issue 13, thirteenth session")."""
    onehot = 1 << idx  # bit d set where position d won; code 4 (clamped) sets none of 0-3
    for d, quad in enumerate(quads):
        torch.mul(grad, (onehot >> d) & 1, out=quad)


def _spatial_rows(x: Tensor) -> Tensor | None:
    """A spatial-major feature map [B, C, R, S, H, W] as the [H, W, R*S*B*C] rows that
    ``native.pool2x2`` takes, where it takes them (else None)."""
    if not is_spatial_major(x):
        return None
    mem = x.permute(4, 5, 2, 3, 0, 1)
    rows = mem.reshape(mem.shape[0], mem.shape[1], -1)
    return rows if native.pool2x2_available(rows) else None


def _from_rows(rows: Tensor, like: Tensor) -> Tensor:
    """[H', W', R*S*B*C] rows back as a spatial-major [B, C, R, S, H', W'] map (a view)."""
    b, c, r, s = like.shape[:4]
    return rows.view(*rows.shape[:2], r, s, b, c).permute(4, 5, 2, 3, 0, 1)


class _MaxPoolReLU(torch.autograd.Function):
    """relu(max over 2x2 windows) of [N, H, W] planes; saves a uint8 argmax, not int64.
    Spatial-major feature maps on the CPU take one compiled pass each way
    (``native.pool2x2``, ``native.unpool2x2``: the same values and window codes)."""

    @staticmethod
    def forward(ctx, x: Tensor, relu: bool) -> Tensor:
        rows = _spatial_rows(x)
        if rows is not None:
            out, code = native.pool2x2(rows, relu, argmax=ctx.needs_input_grad[0])
            if code is not None:
                ctx.save_for_backward(code)
                ctx.rows = True
            return _from_rows(out, x)
        ctx.rows = False
        h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
        quads = [x[..., i:h:2, j:w:2] for i in (0, 1) for j in (0, 1)]
        m, idx = _pool_quads(*quads, relu=relu, argmax=ctx.needs_input_grad[0])
        if idx is None:
            return m
        ctx.save_for_backward(idx)
        # the gradient takes the input's layout when that is dense (spatial-major, say)
        dense = x.is_contiguous() or is_spatial_major(x)
        ctx.layout = (x.shape, x.stride() if dense else None)
        return m

    @staticmethod
    def backward(ctx, grad: Tensor):
        (idx,) = ctx.saved_tensors
        if ctx.rows:  # the compiled pool's codes, [H/2, W/2, R*S*B*C]
            g = grad.permute(4, 5, 2, 3, 0, 1).reshape(idx.shape)
            return _from_rows(native.unpool2x2(g, idx), grad), None
        shape, stride = ctx.layout
        h, w = idx.shape[-2] * 2, idx.shape[-1] * 2
        # the input's own memory layout; every 2x2 position is written, so no zero fill
        if stride is None:
            gx = grad.new_empty(shape)
        else:
            gx = torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device)
        if (shape[-2], shape[-1]) != (h, w):
            gx.zero_()
        _unpool_quads(grad, idx, [gx[..., i:h:2, j:w:2] for i in (0, 1) for j in (0, 1)])
        return gx, None


class RSTMaxPool(nn.Module):
    """2x2 spatial max-pool of feature maps, optionally fused with a ReLU before it
    (max commutes with ReLU, so pooling first touches a quarter of the data).

    Odd sizes are refused: a 2x2 grid that drops a row breaks the 90-degree symmetry.
    x [..., H, W] -> [..., H/2, W/2]."""

    def __init__(self, *, relu: bool = False):
        super().__init__()
        self.relu = relu

    def extra_repr(self) -> str:
        return f"relu={self.relu}"

    def forward(self, x: Tensor) -> Tensor:
        _check_even(*x.shape[-2:])
        return _MaxPoolReLU.apply(x, self.relu)


class GroupMaxPool(nn.Module):
    """Max over the group axes: R and S, and space too when ``spatial``.
    x [B, C, R, S, H, W] -> [B, C, H, W] or [B, C] (spatial)."""

    def __init__(self, *, spatial: bool = True):
        super().__init__()
        self.spatial = spatial

    def extra_repr(self) -> str:
        return f"spatial={self.spatial}"

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 6:
            raise ValueError(f"GroupMaxPool expects [B, C, R, S, H, W], got {tuple(x.shape)}")
        dims = (2, 3, 4, 5) if self.spatial else (2, 3)
        return x.amax(dim=dims)
