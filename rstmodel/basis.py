"""Fixed spatial filter bases, sampled at every rotation and scale of the group grid.

Two families from the paper (eq. 6, Remark 1), both eigenfunctions of a Dirichlet Laplacian
and ordered by eigenvalue, so that keeping the K first modes keeps the K smoothest ones:

- Fourier-Bessel (FB) on the unit disk:
  ``psi_kq(r, phi) = c_kq J_k(j_kq r) {1, sqrt2 cos k phi, sqrt2 sin k phi}``, eigenvalue
  ``j_kq**2``, ``c_kq = 1 / (sqrt(pi) |J_{k+1}(j_kq)|)`` (unit L2 norm on the disk).
- Sturm-Liouville (SL) on the square [-1, 1]^2:
  ``psi_nm(x, y) = sin(n pi (x + 1) / 2) sin(m pi (y + 1) / 2)``, eigenvalue
  ``(pi / 2)**2 (n**2 + m**2)`` (unit L2 norm on the square).

Scales are support radii in pixels, ``rho_s = rho_0 2**alpha_s``. The copy of mode k at
rotation ``theta_r = 2 pi r / Nr`` and scale s is sampled analytically (the sample points
are rotated, not the image), so a quarter turn of a sampled filter is an exact pixel
permutation:

    basis[k, r, s](u) = (rho_0 / rho_s)**2 / rho_0 * psi_k(R_{-theta_r} u / rho_s)

The factor ``(rho_0 / rho_s)**2`` is the paper's ``2**(-2 alpha)``; ``1 / rho_0`` makes
the sampled norm at the smallest scale close to 1. FB fills the disk of radius rho_s; the
SL square is inscribed in it (half side ``rho_s / sqrt 2``) so every rotated copy fits the
same kernel. The kernel at scale s is the smallest odd square holding the disk:
``2 ceil(rho_s) - 1`` pixels.

Pixel coordinates: ``u = (x, y)`` with x to the right and y up, origin at the kernel
centre; row ``i`` and column ``j`` of a ``k x k`` kernel sit at
``x = j - (k - 1) / 2``, ``y = (k - 1) / 2 - i``.

A third family, Hermite-Gaussian (HG), is the basis of the scale-equivariant steerable
network SESN (Sosnovik, Szmaja, Smeulders, ICLR 2020), for the ``sesn`` peer:

- ``psi_nm(x, y) = c_nm H_n(2 x) H_m(2 y) exp(-4 (x**2 + y**2))`` on the unit disk (H the
  physicists' Hermite polynomials; the Gaussian's sigma is half the support radius, so the
  envelope is e**-4 at the rim), ordered by degree ``n + m`` (then n), "eigenvalue"
  ``n + m + 1``, ``c_nm`` giving the copy at the smallest scale and rotation 0 unit norm.
  Not a Dirichlet eigenbasis: its scaled copies are related only through the sampling.

A fourth family reproduces the public code's basis (``reference_spec``) for like-for-like
comparison with published numbers; it is not the paper's construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cache, lru_cache

import numpy as np
from scipy import special

__all__ = [
    "BasisFamily",
    "BasisSpec",
    "Mode",
    "fb_modes",
    "sl_modes",
    "hg_modes",
    "max_modes",
    "sample_basis",
    "steering",
    "reference_spec",
    "pixel_grid",
]


class BasisFamily(str, Enum):
    FOURIER_BESSEL = "fb"
    STURM_LIOUVILLE = "sl"
    HERMITE_GAUSSIAN = "hg"  # SESN's basis
    REFERENCE = "reference"  # the public code's multi-dilation FB basis, K = 49


@dataclass(frozen=True)
class Mode:
    """One basis function. FB: (k, q, part); SL and HG: (n, m, part=0)."""

    family: BasisFamily
    a: int  # FB angular order k / SL x-frequency n / HG x-degree n
    b: int  # FB radial index q / SL y-frequency m / HG y-degree m
    part: int  # FB: 0 = radial (k = 0), 1 = cos, 2 = sin; SL: 0
    eigenvalue: float  # mu: -Laplacian eigenvalue on the unit domain


# The paper's public code's reference basis (15 FB modes at 4 dilations).
_REF_MODES_PER_DILATION = 15
_REF_DILATIONS = 4
_REF_DILATION_FACTOR = 1.5
_REF_RADIUS_PER_SIGMA = 3.5
# HG: t = 2 u / radius, so the Gaussian exp(-t^2) has sigma = radius / 2 (e^-4 at the rim)
_HG_T_PER_RADIUS = 2.0


@dataclass(frozen=True)
class BasisSpec:
    """What fixes a sampled basis; hashable, so bases are cached per spec.

    ``scales`` are support radii in pixels for FB / SL and the Gaussian-like sigmas of the
    public code for REFERENCE. Use ``reference_spec()`` for the latter.
    """

    family: BasisFamily
    num_funcs: int  # K: lowest-eigenvalue modes kept
    rotations: int  # Nr
    scales: tuple[float, ...]  # ascending, geometric (a uniform grid in alpha)
    kernel_sizes: tuple[int, ...] | None = None  # None: derived from the support radius

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", BasisFamily(self.family))
        object.__setattr__(self, "scales", tuple(float(s) for s in self.scales))
        if self.rotations < 1:
            raise ValueError(f"rotations (Nr) must be >= 1, got {self.rotations}")
        if not self.scales:
            raise ValueError("scales must hold at least one support radius")
        if any(s <= 0 for s in self.scales):
            raise ValueError(f"scales must be positive radii in pixels, got {self.scales}")
        if any(b <= a for a, b in zip(self.scales, self.scales[1:], strict=False)):
            raise ValueError(f"scales must be strictly ascending, got {self.scales}")
        if len(self.scales) > 2:
            steps = np.diff(np.log2(self.scales))
            if np.ptp(steps) > 1e-6 * max(1.0, abs(steps[0])):
                raise ValueError(
                    f"scales must be geometric (uniform in log2), got {self.scales}: "
                    "use scales = rho_0 * q**s"
                )
        if self.num_funcs < 1:
            raise ValueError(f"num_funcs (K) must be >= 1, got {self.num_funcs}")
        sizes = self.kernel_sizes
        if sizes is None:
            sizes = tuple(_support_kernel(self.family, r) for r in self.scales)
            object.__setattr__(self, "kernel_sizes", sizes)
        else:
            object.__setattr__(self, "kernel_sizes", tuple(int(k) for k in sizes))
        if len(self.kernel_sizes) != len(self.scales):
            raise ValueError("kernel_sizes needs one odd size per scale")
        if any(k < 1 or k % 2 == 0 for k in self.kernel_sizes):
            raise ValueError(f"kernel sizes must be odd and positive, got {self.kernel_sizes}")
        if any(b < a for a, b in zip(self.kernel_sizes, self.kernel_sizes[1:], strict=False)):
            raise ValueError(f"kernel sizes must not shrink with scale: {self.kernel_sizes}")
        if self.family is BasisFamily.REFERENCE:
            total = _REF_MODES_PER_DILATION * _REF_DILATIONS
            if self.num_funcs > total:
                raise ValueError(
                    f"the reference basis has {total} functions, asked for K={self.num_funcs}"
                )
            return
        kmax = max_modes(self.family, self.scales[0])
        if self.num_funcs > kmax:
            raise ValueError(
                f"K={self.num_funcs} {self.family.value.upper()} modes alias at the smallest scale "
                f"(radius {self.scales[0]:g} px holds at most {kmax} modes below the Nyquist "
                f"frequency): lower num_funcs to <= {kmax} or raise the smallest scale"
            )

    @property
    def num_scales(self) -> int:
        return len(self.scales)

    @property
    def kernel_size(self) -> int:
        """Size of the common (largest) kernel that every scale is padded to."""
        return self.kernel_sizes[-1]

    @property
    def log2_scales(self) -> tuple[float, ...]:
        """alpha_s = log2(rho_s / rho_0)."""
        return tuple(math.log2(s / self.scales[0]) for s in self.scales)

    @property
    def scale_step(self) -> float:
        """Delta alpha between neighbouring scales (0 for a single scale)."""
        return self.log2_scales[1] if self.num_scales > 1 else 0.0

    def modes(self) -> tuple[Mode, ...]:
        if self.family is BasisFamily.FOURIER_BESSEL:
            return fb_modes(self.num_funcs)
        if self.family is BasisFamily.STURM_LIOUVILLE:
            return sl_modes(self.num_funcs)
        if self.family is BasisFamily.HERMITE_GAUSSIAN:
            return hg_modes(self.num_funcs)
        return _reference_modes()[: self.num_funcs]

    def eigenvalues(self) -> np.ndarray:
        """mu_k of the kept modes (for the FB norm of assumption A2). [K]"""
        return np.array([m.eigenvalue for m in self.modes()])


def reference_spec(rotations: int = 8, num_scales: int = 4, num_funcs: int = 49) -> BasisSpec:
    """The public code's configuration: sigma = 1.7 * 3**(s/3), supports 5, 7, 11, 15 px."""
    sigmas = tuple(1.7 * 3 ** (s / 3) for s in range(num_scales))
    sizes = tuple((5, 7, 11, 15, 21, 29)[:num_scales])
    return BasisSpec(BasisFamily.REFERENCE, num_funcs, rotations, sigmas, sizes)


def _support_kernel(family: BasisFamily, radius: float) -> int:
    """Smallest odd kernel holding every pixel strictly inside the disk of ``radius``."""
    if family is BasisFamily.REFERENCE:
        raise ValueError("the reference basis needs explicit kernel_sizes: use reference_spec()")
    return max(1, 2 * math.ceil(radius - 1e-9) - 1)


@cache
def fb_modes(count: int) -> tuple[Mode, ...]:
    """The ``count`` FB modes with the smallest Bessel roots j_kq (cos before sin).

    Orders 0..count-1 at q = 1 already hold >= count functions, and j_kq grows with k and
    q, so orders and radial indices below ``count`` cover the ``count`` smallest roots.
    """
    candidates = [
        (float(j), k, q, part)
        for k in range(count)
        for q, j in enumerate(special.jn_zeros(k, count), start=1)
        for part in ((0,) if k == 0 else (1, 2))
    ]
    candidates.sort()
    return tuple(
        Mode(BasisFamily.FOURIER_BESSEL, k, q, p, j * j) for j, k, q, p in candidates[:count]
    )


@cache
def sl_modes(count: int) -> tuple[Mode, ...]:
    """The ``count`` SL modes with the smallest n^2 + m^2 (ties: smaller n first)."""
    side = int(math.isqrt(count)) + 2
    pairs = sorted(
        ((n * n + m * m, n, m) for n in range(1, side + count) for m in range(1, side + count)),
    )[:count]
    return tuple(
        Mode(BasisFamily.STURM_LIOUVILLE, n, m, 0, (math.pi / 2) ** 2 * e) for e, n, m in pairs
    )


@cache
def hg_modes(count: int) -> tuple[Mode, ...]:
    """The ``count`` HG modes of lowest degree n + m (ties: smaller n first)."""
    degree = 0
    out: list[Mode] = []
    while len(out) < count:
        out += [
            Mode(BasisFamily.HERMITE_GAUSSIAN, n, degree - n, 0, float(degree + 1))
            for n in range(degree + 1)
        ]
        degree += 1
    return tuple(out[:count])


def max_modes(family: BasisFamily, radius: float) -> int:
    """How many lowest modes a disk of ``radius`` px samples below Nyquist (pi rad/px).

    FB mode (k, q) oscillates at up to j_kq / radius rad/px; SL mode (n, m) on the inscribed
    square of half side radius / sqrt 2 at max(n, m) pi / (2 * half side) rad/px.
    """
    family = BasisFamily(family)
    if family is BasisFamily.FOURIER_BESSEL:
        limit = math.pi * radius + 1e-12
        count = 0
        for k in range(math.ceil(limit) + 1):  # j_k1 > k, so higher orders are above the limit
            roots = special.jn_zeros(k, math.ceil(limit / math.pi) + 1)
            count += int((roots <= limit).sum()) * (1 if k == 0 else 2)
        return count
    if family is BasisFamily.STURM_LIOUVILLE:
        nmax = math.floor(2 * radius / math.sqrt(2) + 1e-12)
        # modes in eigenvalue order; stop at the first one past the limit
        count = 0
        for mode in sl_modes((nmax + 1) ** 2 + 1):
            if max(mode.a, mode.b) > nmax:
                return count
            count += 1
        return count
    if family is BasisFamily.HERMITE_GAUSSIAN:
        # H_n(t) e^(-t^2) oscillates at up to ~sqrt(2 n + 1) rad per unit of t, t = 2 u / radius
        nmax = math.floor(((math.pi * radius / _HG_T_PER_RADIUS) ** 2 - 1) / 2 + 1e-12)
        count = 0
        for mode in hg_modes(2 * (nmax + 2) ** 2):
            if max(mode.a, mode.b) > nmax:
                return count
            count += 1
        return count
    raise ValueError("max_modes is defined for the FB, SL and HG families")


@lru_cache(maxsize=1)
def _reference_modes() -> tuple[Mode, ...]:
    base = fb_modes(_REF_MODES_PER_DILATION)
    return tuple(
        Mode(BasisFamily.REFERENCE, m.a, m.b, m.part + 3 * d, m.eigenvalue)
        for d in range(_REF_DILATIONS)
        for m in base
    )


def pixel_grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Math coordinates (x right, y up) of the pixels of a centred ``size x size`` kernel."""
    c = (size - 1) / 2
    idx = np.arange(size, dtype=np.float64) - c
    x = np.broadcast_to(idx[None, :], (size, size))
    y = np.broadcast_to(-idx[:, None], (size, size))
    return x, y


def evaluate(mode: Mode, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The continuous mode on the unit domain at points (x, y); zero outside it."""
    if mode.family is BasisFamily.HERMITE_GAUSSIAN:
        tx, ty = _HG_T_PER_RADIUS * x, _HG_T_PER_RADIUS * y
        v = special.eval_hermite(mode.a, tx) * special.eval_hermite(mode.b, ty)
        return np.where(np.hypot(x, y) < 1, v * np.exp(-(tx * tx + ty * ty)), 0.0)
    if mode.family is BasisFamily.STURM_LIOUVILLE:
        inside = (np.abs(x) <= 1) & (np.abs(y) <= 1)
        v = np.sin(mode.a * np.pi * (x + 1) / 2) * np.sin(mode.b * np.pi * (y + 1) / 2)
        return np.where(inside, v, 0.0)
    k, _q = mode.a, mode.b
    j = math.sqrt(mode.eigenvalue)
    r = np.hypot(x, y)
    phi = np.arctan2(y, x)
    c = 1.0 / (math.sqrt(math.pi) * abs(special.jv(k + 1, j)))
    radial = c * special.jv(k, j * r)
    part = mode.part % 3
    if part == 0:
        angular = np.ones_like(phi)
    elif part == 1:
        angular = math.sqrt(2) * np.cos(k * phi)
    else:
        angular = math.sqrt(2) * np.sin(k * phi)
    return np.where(r < 1, radial * angular, 0.0)


def _sample(spec: BasisSpec) -> np.ndarray:
    size = spec.kernel_size
    x, y = pixel_grid(size)
    modes = spec.modes()
    out = np.zeros((len(modes), spec.rotations, spec.num_scales, size, size))
    # With Nr divisible by 4, rotations past a quarter turn are exact rot90 copies.
    quarter = spec.rotations // 4 if spec.rotations % 4 == 0 else spec.rotations
    for r in range(quarter):
        theta = 2 * math.pi * r / spec.rotations
        # R_{-theta} u: rotate the sample points clockwise.
        ct, st = math.cos(theta), math.sin(theta)
        xr = ct * x + st * y
        yr = -st * x + ct * y
        for s, (radius, ks) in enumerate(zip(spec.scales, spec.kernel_sizes, strict=False)):
            crop = (size - ks) // 2
            window = np.zeros((size, size), dtype=bool)
            window[crop : size - crop, crop : size - crop] = True
            for i, mode in enumerate(modes):
                out[i, r, s] = _sample_one(spec, mode, s, radius, xr, yr) * window
    for r in range(quarter, spec.rotations):
        out[:, r] = np.rot90(out[:, r - quarter], 1, axes=(-2, -1))
    if spec.family in (BasisFamily.REFERENCE, BasisFamily.HERMITE_GAUSSIAN):
        # Each function normalised by its L2 norm at theta = 0, smallest scale.
        norms = np.sqrt((out[:, 0, 0] ** 2).sum(axis=(-2, -1)))
        out /= norms[:, None, None, None, None]
    return out


def _sample_one(
    spec: BasisSpec, mode: Mode, s: int, radius: float, xr: np.ndarray, yr: np.ndarray
) -> np.ndarray:
    rho0 = spec.scales[0]
    if spec.family is BasisFamily.FOURIER_BESSEL:
        return (rho0 / radius) ** 2 / rho0 * evaluate(mode, xr / radius, yr / radius)
    if spec.family is BasisFamily.HERMITE_GAUSSIAN:  # normalised in _sample
        return (rho0 / radius) ** 2 * evaluate(mode, xr / radius, yr / radius)
    if spec.family is BasisFamily.STURM_LIOUVILLE:
        half = radius / math.sqrt(2)
        # 1 / half normalises the inscribed square like 1 / rho_0 does the disk.
        norm = (rho0 / radius) ** 2 * math.sqrt(2) / rho0
        return norm * evaluate(mode, xr / half, yr / half)
    dilation = mode.part // 3
    extent = _REF_RADIUS_PER_SIGMA * radius / _REF_DILATION_FACTOR**dilation
    base = Mode(BasisFamily.FOURIER_BESSEL, mode.a, mode.b, mode.part % 3, mode.eigenvalue)
    return (rho0 / radius) ** 2 * evaluate(base, xr / extent, yr / extent)


@lru_cache(maxsize=32)
def _cached(spec: BasisSpec) -> np.ndarray:
    arr = _sample(spec)
    arr.setflags(write=False)
    return arr


def sample_basis(spec: BasisSpec) -> np.ndarray:
    """The sampled basis ``[K, Nr, Ns, k, k]`` (float64, read-only, cached per spec).

    Scale s occupies the centred ``kernel_sizes[s]`` window; the rest is zero.
    """
    return _cached(spec)


# A rotated copy counts as steered from the upright one when it is reproduced to this
# fraction of the basis' largest sample (float64 round-off is ~1e-16 of it).
STEERING_TOLERANCE = 1e-10


@lru_cache(maxsize=32)
def _steering(spec: BasisSpec) -> np.ndarray | None:
    basis = sample_basis(spec)
    k, rot = basis.shape[:2]
    upright = basis[:, 0].reshape(k, -1)  # [K, S*k*k]: every scale, one matrix per rotation
    scale = np.abs(basis).max()
    mats = np.empty((rot, k, k))
    for r in range(rot):
        turned = basis[:, r].reshape(k, -1)
        # M_r with basis[:, r] = M_r basis[:, 0]: the least-squares fit over all scales'
        # samples, kept only where it is exact to round-off
        fit = np.linalg.lstsq(upright.T, turned.T, rcond=None)[0].T
        if np.abs(fit @ upright - turned).max() > STEERING_TOLERANCE * scale:
            return None
        mats[r] = fit
    mats.setflags(write=False)
    return mats


def steering(spec: BasisSpec) -> np.ndarray | None:
    """``M [Nr, K, K]`` (float64, read-only) with ``basis[:, r, s] = M[r] @ basis[:, 0, s]``
    for every rotation r and scale s, where the sampled basis is *steerable*, else None.

    The FB modes are ``J_k(j r) cos k phi`` and ``J_k(j r) sin k phi`` sampled at rotated
    points, and ``cos k (phi - theta) = cos k theta cos k phi + sin k theta sin k phi``
    holds at every sample, so where the K modes hold both parts of each angular order k the
    copy at any rotation is, sample for sample, a 2x2 rotation of each (cos, sin) pair of the
    upright copy: ``M[r]`` is block-diagonal with blocks of angle ``k theta_r``. The
    lifting layer then needs the responses to the K upright copies only, not to all Nr K
    (``LiftingRSTConv``): its mixing weights absorb ``M[r]``. Computed from the samples (a
    least-squares fit, accepted only where it reproduces every rotation's samples to
    ``STEERING_TOLERANCE``), so it also finds the other families that are steerable (HG's
    complete degree shells) and refuses those that are not (SL's square domain, a mode
    whose partner was cut off by K)."""
    return _steering(spec)
