"""RST layers (paper eq. 4-5, "Implementation Details"): lifting and joint group
convolutions, equivariant batch norm, pooling. One module per concern: ``common`` (method
choices, shared helpers), ``conv`` (the convolutions), ``kernels`` (their fast-path
autograd kernels), ``triton_ops`` (fused CUDA kernels for two of those stages, the
default on CUDA), ``norm``, ``pooling`` and ``blocks`` (conv -> pool -> norm, fused where
it applies).

Feature maps are ``[B, C, R, S, H, W]`` (see ``rstmodel.group``). Filters are expanded from
trainable coefficients over a fixed sampled basis ``[K, R, S, k, k]`` (``rstmodel.basis``):

    lifting  x1(u, r, s, o) = sum_i  x0(., i)      * F1[o, i, r, s]              + b[o]
    joint    xl(u, r, s, o) = sum_{i, lt, la} x(., i, r + shift(lt), s + la) * Fl[o, i, lt, la, r, s] + b[o]

with ``F[..., r, s] = sum_k a[..., k] basis[k, r, s]`` and ``*`` the cross-correlation of
``torch.nn.functional.conv2d`` ('same' size, zero padding). Rotation taps are circular,
scale taps read zeros past the truncated scale range (the paper's boundary leakage).

Each convolution has a direct reference path (per-scale grouped ``conv2d``) and fast
paths that compute the same operator: BASIS (convolve with the few basis functions, then
mix channels) and, for the joint convolution, FFT (channel mixing per frequency, three
real products per complex one, each scale on the smallest periodic grid its own kernel
allows, and one filter spectrum shared by the four output rotations a quarter turn apart,
which the sampled basis relates exactly).
``ConvMethod.AUTO`` picks the cheapest by a multiply-add count; ``ConvMethod.TUNED`` does that
in training and, in eval mode, times each path once per input shape and keeps the fastest
(the multiply-add count misjudges memory-bound small batches). Tests check the paths agree.
In eval mode the expanded filters are cached, keyed on the parameters' version counters, so
an optimiser step, ``train()`` or ``load_state_dict`` never leaves a stale cache behind.
"""

from .blocks import ConvPoolNorm
from .common import ConvMethod, RotationTaps, is_spatial_major
from .conv import GroupRSTConv, LiftingRSTConv, RSTPointwise
from .norm import RSTBatchNorm
from .pooling import GroupMaxPool, RSTMaxPool

__all__ = [
    "ConvMethod",
    "RotationTaps",
    "LiftingRSTConv",
    "GroupRSTConv",
    "RSTPointwise",
    "RSTBatchNorm",
    "RSTMaxPool",
    "GroupMaxPool",
    "ConvPoolNorm",
    "is_spatial_major",
]
