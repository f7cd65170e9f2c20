"""What the RST layers share: the method and rotation-tap choices, timing a
path, the memory-layout test and the feature-map check."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

import torch
from torch import Tensor

__all__ = ["ConvMethod", "RotationTaps", "is_spatial_major"]


class ConvMethod(str, Enum):
    AUTO = "auto"
    TUNED = "tuned"  # eval: time every path once per input shape, keep the fastest
    DIRECT = "direct"  # reference: per-scale grouped conv2d
    FFT = "fft"  # joint conv: per-frequency channel mixing (kernel-size independent)
    BASIS = "basis"  # lifting: convolve with the basis, then mix (K << channels * R)


class RotationTaps(str, Enum):
    COARSE = "coarse"  # paper: taps on a grid of L_theta points, shift l * Nr / L_theta
    ADJACENT = "adjacent"  # public code: L_theta neighbouring rotations, shift l


def _time_path(path: Callable[[Tensor], Tensor], x: Tensor) -> float:
    """Seconds of one call of ``path(x)``, after one untimed call."""

    def call() -> float:
        start = time.perf_counter()
        path(x)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        return time.perf_counter() - start

    call()
    return call()


def is_spatial_major(x: Tensor) -> bool:
    """Whether a feature map [B, C, R, S, H, W] lies in memory as [H, W, R, S, B, C], the
    layout of the FFT path (like channels_last, a memory format, not a shape)."""
    return x.dim() == 6 and x.permute(4, 5, 2, 3, 0, 1).is_contiguous()


def _check_features(x: Tensor, channels: int, rotations: int, scales: int, name: str) -> None:
    expected = f"[B, {channels}, {rotations}, {scales}, H, W]"
    if x.dim() != 6 or tuple(x.shape[1:4]) != (channels, rotations, scales):
        raise ValueError(f"{name} expects a feature map {expected}, got shape {tuple(x.shape)}")
