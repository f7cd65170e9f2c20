"""Image transforms: RST resampling, random RST augmentation, Cutout, deformations D_tau.

Angles are counter-clockwise as the image is displayed (x right, y up, as in
``rstmodel.group``), in radians unless a name says degrees; rotation and scaling are about
the grid centre with zero fill. Interpolation is torchvision's (tensor path: nearest or
bilinear; PIL path, used for bicubic, in ``rstmodel.data.rs``) or ``grid_sample``'s.

The deformation of paper eq. 10 is ``[D_tau x](u) = x(u - tau(u))`` for a smooth
displacement field ``tau`` in pixels, ``tau[..., 0]`` along x (columns, right) and
``tau[..., 1]`` along y (up). Its size ``|grad tau|_inf = sup_u ||grad tau(u)||`` (operator
norm of the 2x2 Jacobian) is measured on the pixel grid by central differences (one-sided at
the border), the same grid and units the warp samples on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from torch import Tensor, nn
from torchvision.transforms import InterpolationMode

__all__ = [
    "rotate_scale",
    "RandomRST",
    "Cutout",
    "warp",
    "jacobian_sup_norm",
    "random_displacement",
    "deform",
]


def rotate_scale(
    image: Tensor,
    angle: float,
    scale: float,
    *,
    interpolation: InterpolationMode = InterpolationMode.BILINEAR,
) -> Tensor:
    """Rotate by ``angle`` rad and scale by ``scale`` about the centre, zero fill.
    ``[..., C, H, W] -> [..., C, H, W]`` (uint8 input is rounded back to uint8)."""
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    # torchvision's affine turns clockwise for a positive angle
    return TF.affine(
        image,
        angle=-math.degrees(angle),
        translate=[0.0, 0.0],
        scale=float(scale),
        shear=[0.0, 0.0],
        interpolation=interpolation,
    )


# interpolation modes that grid_sample shares with torchvision's tensor affine
GRID_SAMPLE_MODES = {InterpolationMode.NEAREST: "nearest", InterpolationMode.BILINEAR: "bilinear"}


def _uniform(low: float, high: float, generator: torch.Generator | None) -> float:
    return low + (high - low) * torch.rand((), generator=generator, dtype=torch.float64).item()


class RandomRST(nn.Module):
    """Random rotation by U[-degrees, degrees] and scale by U[scale_range] about the centre
    (the paper's "+" data: degrees=180, scale_range=(0.5, 2)). ``[..., C, H, W]`` -> same.

    Draws come from ``generator`` (torch's global generator when None).
    """

    def __init__(
        self,
        *,
        degrees: float = 180.0,
        scale_range: tuple[float, float] = (0.5, 2.0),
        interpolation: InterpolationMode = InterpolationMode.BILINEAR,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= degrees <= 180:
            raise ValueError(f"degrees must lie in [0, 180], got {degrees}")
        low, high = scale_range
        if not 0 < low <= high:
            raise ValueError(
                f"scale_range must be (low, high) with 0 < low <= high, got {scale_range}"
            )
        self.degrees = float(degrees)
        self.scale_range = (float(low), float(high))
        self.interpolation = interpolation
        self.generator = generator

    def draw(self) -> tuple[float, float]:
        """One (angle in rad, scale) draw."""
        angle = math.radians(_uniform(-self.degrees, self.degrees, self.generator))
        return angle, _uniform(*self.scale_range, self.generator)

    def forward(self, image: Tensor) -> Tensor:
        angle, scale = self.draw()
        return rotate_scale(image, angle, scale, interpolation=self.interpolation)

    def each(self, images: Tensor) -> Tensor:
        """Float ``[B, C, H, W]``, each image with its own draw: the draws and the result of
        ``torch.stack([self(x) for x in images])`` (to float rounding), in one resampling."""
        if images.ndim != 4 or not images.is_floating_point():
            raise ValueError(
                f"expected float images [B, C, H, W], got {images.dtype} {tuple(images.shape)}"
            )
        if self.interpolation not in GRID_SAMPLE_MODES:
            raise ValueError(
                f"RandomRST.each resamples with nearest or bilinear, not {self.interpolation.value}"
            )
        draws = torch.tensor([self.draw() for _ in range(images.shape[0])], dtype=torch.float64)
        angle, scale = draws[:, 0], draws[:, 1]
        height, width = images.shape[-2:]
        # output pixel p (centred, x right, y down) samples the input at R(angle) p / scale
        # (y down turns a displayed counter-clockwise rotation into this sign pattern);
        # affine_grid's coordinates are pixels divided by half the width / height
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        theta = torch.zeros(images.shape[0], 2, 3, dtype=torch.float64)
        theta[:, 0, 0], theta[:, 0, 1] = cos, -sin * height / width
        theta[:, 1, 0], theta[:, 1, 1] = sin * width / height, cos
        grid = F.affine_grid(theta.to(images.dtype), list(images.shape), align_corners=False)
        mode = GRID_SAMPLE_MODES[self.interpolation]
        return F.grid_sample(images, grid, mode=mode, padding_mode="zeros", align_corners=False)

    def extra_repr(self) -> str:
        return f"degrees={self.degrees}, scale_range={self.scale_range}"


class Cutout(nn.Module):
    """Zero a ``size x size`` square whose centre is uniform over the image, clipped at the
    border (DeVries & Taylor 2017); one square per call, so apply it per image.
    ``[..., C, H, W]`` -> same, a new tensor."""

    def __init__(self, size: int = 32, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"Cutout size must be a positive number of pixels, got {size}")
        self.size = int(size)
        self.generator = generator

    def forward(self, image: Tensor) -> Tensor:
        height, width = image.shape[-2:]
        cy = int(torch.randint(height, (), generator=self.generator))
        cx = int(torch.randint(width, (), generator=self.generator))
        y0, x0 = max(cy - self.size // 2, 0), max(cx - self.size // 2, 0)
        y1, x1 = (
            min(cy - self.size // 2 + self.size, height),
            min(cx - self.size // 2 + self.size, width),
        )
        out = image.clone()
        out[..., y0:y1, x0:x1] = 0
        return out

    def extra_repr(self) -> str:
        return f"size={self.size}"


# ---------------------------------------------------------------- deformations


def warp(images: Tensor, tau: Tensor) -> Tensor:
    """``[D_tau x](u) = x(u - tau(u))``, bilinear, zero fill.
    images ``[B, C, H, W]``, tau ``[B, 2, H, W]`` in pixels (x right, y up) -> ``[B, C, H, W]``."""
    if images.dim() != 4 or tau.shape != (images.shape[0], 2, *images.shape[-2:]):
        raise ValueError(
            f"expected images [B, C, H, W] and tau [B, 2, H, W], got {tuple(images.shape)} "
            f"and {tuple(tau.shape)}"
        )
    height, width = images.shape[-2:]
    tau = tau.to(torch.float64)
    rows = torch.arange(height, dtype=torch.float64)[:, None]  # [H, 1]
    cols = torch.arange(width, dtype=torch.float64)[None, :]  # [1, W]
    src_col = cols - tau[:, 0]  # [B, H, W]; x grows with the column
    src_row = rows + tau[:, 1]  # y grows upwards, rows downwards
    # grid_sample, align_corners=True: -1 and +1 are the centres of the first and last pixel
    grid = torch.stack([2 * src_col / (width - 1) - 1, 2 * src_row / (height - 1) - 1], dim=-1)
    return F.grid_sample(
        images,
        grid.to(images.dtype),  # [B, H, W, 2]
        mode="bilinear",
        padding_mode="zeros",
        align_corners=True,
    )


def jacobian_sup_norm(tau: Tensor) -> Tensor:
    """``sup_u ||grad tau(u)||`` over the grid, operator norm, central differences (one-sided
    at the border) in pixel units. tau ``[..., 2, H, W]`` (x right, y up) -> ``[...]``."""
    d_row, d_col = torch.gradient(tau, dim=(-2, -1))  # each [..., 2, H, W]
    a, c = d_col[..., 0, :, :], d_col[..., 1, :, :]  # d tau_x / dx, d tau_y / dx
    b, d = -d_row[..., 0, :, :], -d_row[..., 1, :, :]  # d / dy = -d / d row
    # largest singular value of [[a, b], [c, d]]
    sigma = 0.5 * (torch.hypot(a + d, c - b) + torch.hypot(a - d, b + c))  # [..., H, W]
    return sigma.flatten(-2).amax(-1)


def random_displacement(
    batch: int,
    height: int,
    width: int,
    *,
    generator: torch.Generator,
    num_modes: int = 4,
    max_cycles: float = 2.0,
) -> Tensor:
    """A smooth random field, a sum of ``num_modes`` plane waves per component with
    frequencies of 0.5 to ``max_cycles`` cycles over the longer image side, random
    directions, phases and N(0, 1) amplitudes. -> float64 ``[batch, 2, H, W]`` (unnormalised)."""
    if num_modes < 1 or max_cycles < 0.5:
        raise ValueError(
            f"need num_modes >= 1 and max_cycles >= 0.5, got {num_modes}, {max_cycles}"
        )
    shape = (batch, num_modes)

    def rand(*extra: int) -> Tensor:
        return torch.rand(*shape, *extra, generator=generator, dtype=torch.float64)

    radius = 0.5 + (max_cycles - 0.5) * rand()  # [B, M] cycles per side
    direction = 2 * math.pi * rand()
    phase = 2 * math.pi * rand(2)  # [B, M, 2]
    amplitude = torch.randn(*shape, 2, generator=generator, dtype=torch.float64)
    side = max(height, width)
    x = torch.arange(width, dtype=torch.float64) - (width - 1) / 2
    y = (height - 1) / 2 - torch.arange(height, dtype=torch.float64)
    kx = (2 * math.pi / side * radius * torch.cos(direction))[..., None, None]  # [B, M, 1, 1]
    ky = (2 * math.pi / side * radius * torch.sin(direction))[..., None, None]
    arg = kx * x[None, None, None, :] + ky * y[None, None, :, None]  # [B, M, H, W]
    waves = torch.cos(arg[:, :, None] + phase[..., None, None])  # [B, M, 2, H, W]
    return (amplitude[..., None, None] * waves).sum(1)  # [B, 2, H, W]


def deform(
    images: Tensor,
    jacobian_norm: float,
    generator: torch.Generator,
    *,
    num_modes: int = 4,
    max_cycles: float = 2.0,
) -> tuple[Tensor, Tensor]:
    """Random deformations ``D_tau x`` with ``|grad tau|_inf`` equal to ``jacobian_norm``
    for every image (paper eq. 10; assumption A3 asks for < 1/5).

    images ``[B, C, H, W]`` -> (warped ``[B, C, H, W]``, tau float64 ``[B, 2, H, W]`` in pixels).
    """
    if not 0 <= jacobian_norm < 1:
        raise ValueError(
            f"jacobian_norm must lie in [0, 1) for u - tau(u) to stay invertible, got {jacobian_norm}"
        )
    if images.dim() != 4:
        raise ValueError(f"expected images [B, C, H, W], got {tuple(images.shape)}")
    batch, _, height, width = images.shape
    tau = random_displacement(
        batch, height, width, generator=generator, num_modes=num_modes, max_cycles=max_cycles
    )
    tau = tau * (jacobian_norm / jacobian_sup_norm(tau))[:, None, None, None]
    return warp(images, tau), tau
