"""The roto-scale-translation group RST = (SO(2) x R) x| R^2 and its actions (paper eq. 1-3).

An element ``g = (eta, beta, v)`` rotates by ``eta`` (counter-clockwise), scales by
``2**beta`` and then translates by ``v``:

    g . u = R_eta 2**beta u + v,        (eta, beta, v) . (theta, alpha, u)
                                          = (eta + theta, beta + alpha, v + R_eta 2**beta u)

Images (eq. 1): ``[D_g x](u) = x(g^{-1} u) = x(R_{-eta} 2**(-beta) (u - v))``.
Feature maps (eq. 3, regular representation), one layout everywhere::

    x: [B, C, R, S, H, W]       R = Nr rotations (cyclic), S = Ns scales (truncated)
    [D_g x](u, theta, alpha) = x(g^{-1} u, theta - eta, alpha - beta)

i.e. a spatial warp, a cyclic shift of R by ``eta Nr / 2 pi`` and a shift of S by
``beta / scale_step`` that drops what leaves the truncated range and fills zeros.

Pixel coordinates: x to the right, y up, origin at the grid centre ``((W-1)/2, (H-1)/2)``,
so ``torch.rot90(img, 1, dims=(-2, -1))`` is exactly ``D_(pi/2, 0, 0)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["RSTElement", "act_on_image", "act_on_features", "fold", "unfold", "quarter_turns"]

_EXACT_TOL = 1e-9


@dataclass(frozen=True)
class RSTElement:
    """``g = (angle, log2_scale, shift)``: rotate by ``angle`` rad (counter-clockwise),
    scale by ``2**log2_scale``, translate by ``shift = (x, y)`` pixels (x right, y up)."""

    angle: float = 0.0
    log2_scale: float = 0.0
    shift: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def identity(cls) -> RSTElement:
        return cls()

    def __matmul__(self, other: RSTElement) -> RSTElement:
        """Group product ``self . other`` (apply ``other`` first)."""
        ox, oy = _rotate(other.shift, self.angle)
        k = 2.0**self.log2_scale
        return RSTElement(
            self.angle + other.angle,
            self.log2_scale + other.log2_scale,
            (self.shift[0] + k * ox, self.shift[1] + k * oy),
        )

    def inverse(self) -> RSTElement:
        k = 2.0 ** (-self.log2_scale)
        vx, vy = _rotate(self.shift, -self.angle)
        return RSTElement(-self.angle, -self.log2_scale, (-k * vx, -k * vy))

    def matrix(self) -> Tensor:
        """3x3 homogeneous matrix of ``u -> g . u`` (float64)."""
        k = 2.0**self.log2_scale
        c, s = math.cos(self.angle), math.sin(self.angle)
        return torch.tensor(
            [[k * c, -k * s, self.shift[0]], [k * s, k * c, self.shift[1]], [0.0, 0.0, 1.0]],
            dtype=torch.float64,
        )

    def is_close(self, other: RSTElement, tol: float = 1e-9) -> bool:
        return bool(torch.allclose(self.matrix(), other.matrix(), atol=tol, rtol=0))


def _rotate(v: tuple[float, float], angle: float) -> tuple[float, float]:
    c, s = math.cos(angle), math.sin(angle)
    return (c * v[0] - s * v[1], s * v[0] + c * v[1])


def quarter_turns(g: RSTElement) -> int | None:
    """``k`` if g is an exact grid map (a rotation by k * 90 degrees, no scale or shift)."""
    if abs(g.log2_scale) > _EXACT_TOL or max(abs(g.shift[0]), abs(g.shift[1])) > _EXACT_TOL:
        return None
    turns = g.angle / (math.pi / 2)
    k = round(turns)
    return k % 4 if abs(turns - k) < _EXACT_TOL else None


def act_on_image(x: Tensor, g: RSTElement, *, mode: str = "bilinear") -> Tensor:
    """``D_g x`` for images ``[..., H, W]``: exact pixel permutation for quarter turns,
    otherwise resampling (``mode``: nearest, bilinear or bicubic) with zero fill."""
    k = quarter_turns(g)
    if k is not None:
        if k % 2 and x.shape[-1] != x.shape[-2]:
            raise ValueError(
                f"a quarter turn of a non-square {tuple(x.shape[-2:])} grid is not a grid map"
            )
        return torch.rot90(x, k, dims=(-2, -1))
    h, w = x.shape[-2:]
    lead = x.shape[:-2]
    flat = x.reshape(-1, 1, h, w)
    # Output pixel u samples the input at g^{-1} u; in grid_sample's normalised coordinates
    # (align_corners=False) u = S n with S = diag(W/2, -H/2).
    inv = g.inverse().matrix()
    scale = torch.tensor([[w / 2, 0.0], [0.0, -h / 2]], dtype=torch.float64)
    a = torch.linalg.solve(scale, inv[:2, :2] @ scale)
    t = torch.linalg.solve(scale, inv[:2, 2:])
    theta = torch.cat([a, t], dim=1).to(x.dtype)[None].expand(flat.shape[0], 2, 3)
    grid = F.affine_grid(theta, list(flat.shape), align_corners=False)
    out = F.grid_sample(flat, grid, mode=mode, padding_mode="zeros", align_corners=False)
    return out.reshape(*lead, h, w)


def _integer_steps(value: float, step: float, what: str) -> int:
    if value == 0:
        return 0
    if step == 0:
        raise ValueError(f"{what} {value:g} cannot act on a single-element axis")
    n = value / step
    if abs(n - round(n)) > 1e-6:
        raise ValueError(
            f"{what} {value:g} is not a multiple of the grid step {step:g}: "
            "feature maps only carry the discrete group"
        )
    return round(n)


def act_on_features(
    x: Tensor, g: RSTElement, *, scale_step: float, mode: str = "bilinear"
) -> Tensor:
    """``D_g x`` for feature maps ``[B, C, R, S, H, W]``: spatial warp (about the grid
    centre, shift in this map's pixels), cyclic R shift, truncated S shift with zero fill.

    ``g.angle`` must be a multiple of ``2 pi / R`` and ``g.log2_scale`` of ``scale_step``.
    """
    if x.dim() != 6:
        raise ValueError(f"expected a feature map [B, C, R, S, H, W], got shape {tuple(x.shape)}")
    rotations, scales = x.shape[2], x.shape[3]
    r_shift = _integer_steps(g.angle, 2 * math.pi / rotations, "angle")
    s_shift = (
        _integer_steps(g.log2_scale, scale_step, "log2_scale") if scales > 1 or g.log2_scale else 0
    )
    y = act_on_image(x, g, mode=mode)
    y = torch.roll(y, r_shift % rotations, dims=2)
    if s_shift:
        shifted = torch.zeros_like(y)
        if abs(s_shift) < scales:
            if s_shift > 0:
                shifted[:, :, :, s_shift:] = y[:, :, :, : scales - s_shift]
            else:
                shifted[:, :, :, : scales + s_shift] = y[:, :, :, -s_shift:]
        y = shifted
    return y


def fold(x: Tensor) -> Tensor:
    """``[B, C, R, S, H, W] -> [B, C*R*S, H, W]`` (C slowest, S fastest)."""
    return x.flatten(1, 3)


def unfold(x: Tensor, rotations: int, scales: int) -> Tensor:
    """``[B, C*R*S, H, W] -> [B, C, R, S, H, W]``, the inverse of ``fold``."""
    return x.unflatten(1, (-1, rotations, scales))
