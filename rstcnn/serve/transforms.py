"""The stability sweeps' image transforms in numpy and scipy, so serving needs no torch.

Conventions (the same as ``rstmodel.group.act_on_image`` and ``rstmodel.data.transforms``,
which the tests compare these with): pixel centres at ``x = col - (W-1)/2`` (right) and
``y = (H-1)/2 - row`` (up); a transform's output pixel ``u`` samples the input at
``g^{-1} u``, bilinearly, zero outside the image; quarter turns without scaling are exact
pixel permutations. A deformation ``D_tau x(u) = x(u - tau(u))`` uses a smooth random
field ``tau`` (pixels, x right, y up) scaled to a given largest slope ``|grad tau|_inf``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import ndimage

__all__ = ["rotate_scale", "smooth_field", "sup_slope", "warp"]

_EXACT = 1e-9


def rotate_scale(image: np.ndarray, degrees: float, factor: float = 1.0) -> np.ndarray:
    """``image [..., H, W]`` turned counter-clockwise by ``degrees`` and scaled by
    ``factor`` about its centre -> float32, same shape."""
    turns = degrees / 90.0
    k = round(turns)
    if abs(turns - k) < _EXACT and abs(math.log2(factor)) < _EXACT:  # a grid map
        if k % 2 and image.shape[-1] != image.shape[-2]:
            raise ValueError(f"a quarter turn of a non-square {image.shape[-2:]} grid")
        return np.ascontiguousarray(np.rot90(image, k % 4, axes=(-2, -1)), dtype=np.float32)
    height, width = image.shape[-2:]
    x = np.arange(width, dtype=np.float64)[None, :] - (width - 1) / 2  # [1, W]
    y = (height - 1) / 2 - np.arange(height, dtype=np.float64)[:, None]  # [H, 1]
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    src_x = (c * x + s * y) / factor  # g^{-1} u: turn back, then shrink back
    src_y = (-s * x + c * y) / factor
    rows = (height - 1) / 2 - src_y
    cols = src_x + (width - 1) / 2
    return _sample(image, rows, cols)


def smooth_field(
    height: int, width: int, seed: int, *, num_modes: int = 4, max_cycles: float = 2.0
) -> np.ndarray:
    """A smooth random displacement field: per component a sum of ``num_modes`` plane
    waves, 0.5 to ``max_cycles`` cycles over the longer side, random directions, phases
    and N(0, 1) amplitudes, from ``numpy.random.default_rng(seed)``.
    -> float64 ``[2, H, W]`` (unnormalised; see ``sup_slope``)."""
    rng = np.random.default_rng(seed)
    radius = rng.uniform(0.5, max_cycles, num_modes)  # [M] cycles per side
    direction = rng.uniform(0, 2 * math.pi, num_modes)
    phase = rng.uniform(0, 2 * math.pi, (num_modes, 2))
    amplitude = rng.standard_normal((num_modes, 2))
    side = max(height, width)
    x = np.arange(width, dtype=np.float64) - (width - 1) / 2
    y = (height - 1) / 2 - np.arange(height, dtype=np.float64)
    kx = (2 * math.pi / side * radius * np.cos(direction))[:, None, None]  # [M, 1, 1]
    ky = (2 * math.pi / side * radius * np.sin(direction))[:, None, None]
    arg = kx * x[None, None, :] + ky * y[None, :, None]  # [M, H, W]
    waves = np.cos(arg[:, None] + phase[..., None, None])  # [M, 2, H, W]
    return (amplitude[..., None, None] * waves).sum(0)


def sup_slope(tau: np.ndarray) -> float:
    """``|grad tau|_inf``: the largest operator norm of the Jacobian of ``tau [2, H, W]``
    over the grid (central differences, one-sided at the border, pixel units)."""
    d_row, d_col = np.gradient(tau, axis=(-2, -1))
    a, c = d_col[0], d_col[1]  # d tau_x / dx, d tau_y / dx
    b, d = -d_row[0], -d_row[1]  # d / dy = -d / d row
    sigma = 0.5 * (np.hypot(a + d, c - b) + np.hypot(a - d, b + c))
    return float(sigma.max())


def warp(image: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """``D_tau x(u) = x(u - tau(u))`` of ``image [..., H, W]`` with ``tau [2, H, W]`` in
    pixels (x right, y up) -> float32, same shape."""
    height, width = image.shape[-2:]
    rows = np.arange(height, dtype=np.float64)[:, None] + tau[1]  # y up, rows down
    cols = np.arange(width, dtype=np.float64)[None, :] - tau[0]
    return _sample(image, rows, cols)


def _sample(image: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Each ``[H, W]`` plane of ``image`` at (``rows``, ``cols``), bilinear, zero beyond
    the edge (interpolating towards it, as ``grid_sample``'s zero padding does)."""
    planes = np.asarray(image, dtype=np.float64).reshape(-1, *image.shape[-2:])
    out = np.stack(
        [
            ndimage.map_coordinates(p, [rows, cols], order=1, mode="grid-constant", cval=0.0)
            for p in planes
        ]
    )
    return out.reshape(*image.shape[:-2], *rows.shape).astype(np.float32)
