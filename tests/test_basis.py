"""Fourier-Bessel / Sturm-Liouville bases against formulas computed here from scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special

from rstmodel.basis import (
    BasisFamily,
    BasisSpec,
    evaluate,
    fb_modes,
    max_modes,
    pixel_grid,
    reference_spec,
    sample_basis,
    sl_modes,
    steering,
)

FB = BasisFamily.FOURIER_BESSEL
SL = BasisFamily.STURM_LIOUVILLE
HG = BasisFamily.HERMITE_GAUSSIAN
RADII = tuple(2.5 * 3 ** (s / 3) for s in range(4))  # the models' radii: kernels 5, 7, 11, 15

# (k, q, part) of the 12 smallest Bessel roots j_kq: 2.405, 3.832 x2, 5.136 x2, 5.520,
# 6.380 x2, 7.016 x2, 7.588 x2 (cos before sin).
FB_ORDER_12 = [
    (0, 1, 0),
    (1, 1, 1),
    (1, 1, 2),
    (2, 1, 1),
    (2, 1, 2),
    (0, 2, 0),
    (3, 1, 1),
    (3, 1, 2),
    (1, 2, 1),
    (1, 2, 2),
    (4, 1, 1),
    (4, 1, 2),
]
# (n, m) by n^2 + m^2, ties smaller n first.
SL_ORDER_8 = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1), (2, 3), (3, 2)]


def fb_formula(k: int, q: int, part: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """c J_k(j_kq r) {1, sqrt2 cos k phi, sqrt2 sin k phi} on the unit disk, 0 outside."""
    j = special.jn_zeros(k, q)[-1]
    r = np.sqrt(x * x + y * y)
    phi = np.arctan2(y, x)
    c = 1.0 / (np.sqrt(np.pi) * abs(special.jv(k + 1, j)))
    angular = {0: np.ones_like(phi), 1: np.sqrt(2) * np.cos(k * phi)}.get(
        part, np.sqrt(2) * np.sin(k * phi)
    )
    return np.where(r < 1, c * special.jv(k, j * r) * angular, 0.0)


def sl_formula(n: int, m: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """sin(n pi (x+1)/2) sin(m pi (y+1)/2) on [-1, 1]^2, 0 outside."""
    inside = (np.abs(x) <= 1) & (np.abs(y) <= 1)
    return np.where(inside, np.sin(n * np.pi * (x + 1) / 2) * np.sin(m * np.pi * (y + 1) / 2), 0)


def kernel_coords(size: int) -> tuple[np.ndarray, np.ndarray]:
    """x right, y up, origin at the centre: row i, column j -> (j - c, c - i)."""
    c = (size - 1) / 2
    rows, cols = np.mgrid[0:size, 0:size].astype(np.float64)
    return cols - c, c - rows


def rotate_back(x: np.ndarray, y: np.ndarray, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """R_{-theta} (x, y)."""
    c, s = math.cos(theta), math.sin(theta)
    return c * x + s * y, -s * x + c * y


# ---------------------------------------------------------------- continuous modes


def test_fb_modes_are_ordered_by_bessel_root():
    modes = fb_modes(12)
    assert [(m.a, m.b, m.part) for m in modes] == FB_ORDER_12
    roots = np.array([special.jn_zeros(m.a, m.b)[-1] for m in modes])
    np.testing.assert_allclose([m.eigenvalue for m in modes], roots**2, rtol=1e-12)


def test_fb_ordering_matches_brute_force_sort_of_all_roots():
    roots = sorted(
        j for k in range(16) for j in special.jn_zeros(k, 16) for _ in range(1 if k == 0 else 2)
    )
    eig = np.array([m.eigenvalue for m in fb_modes(40)])
    assert np.all(np.diff(eig) >= 0)
    np.testing.assert_allclose(np.sqrt(eig), roots[:40], rtol=1e-12)


def test_sl_modes_are_ordered_by_eigenvalue():
    modes = sl_modes(8)
    assert [(m.a, m.b) for m in modes] == SL_ORDER_8
    np.testing.assert_allclose(
        [m.eigenvalue for m in modes], [(np.pi / 2) ** 2 * (n * n + m * m) for n, m in SL_ORDER_8]
    )


def test_fb_values_match_the_analytic_formula(rng):
    r = np.sqrt(rng.uniform(0, 1.3**2, 200))  # some points fall outside the disk
    phi = rng.uniform(-np.pi, np.pi, 200)
    x, y = r * np.cos(phi), r * np.sin(phi)
    for mode in fb_modes(12):
        expected = fb_formula(mode.a, mode.b, mode.part, x, y)
        np.testing.assert_allclose(evaluate(mode, x, y), expected, rtol=1e-12, atol=1e-14)
    assert np.all(evaluate(fb_modes(1)[0], x[r >= 1], y[r >= 1]) == 0)


def test_sl_values_match_the_analytic_formula(rng):
    x, y = rng.uniform(-1.3, 1.3, (2, 200))
    for mode in sl_modes(8):
        np.testing.assert_allclose(
            evaluate(mode, x, y), sl_formula(mode.a, mode.b, x, y), rtol=1e-12, atol=1e-14
        )


def test_fb_modes_are_orthonormal_on_the_unit_disk():
    t, w = np.polynomial.legendre.leggauss(64)
    r, wr = (t + 1) / 2, w / 2  # Gauss-Legendre on [0, 1]
    phi = 2 * np.pi * np.arange(64) / 64  # trapezoid: exact for these trigonometric degrees
    rr, pp = np.meshgrid(r, phi, indexing="ij")
    weight = (wr * r)[:, None] * (2 * np.pi / 64)  # r dr dphi
    values = np.stack([evaluate(m, rr * np.cos(pp), rr * np.sin(pp)) for m in fb_modes(30)])
    gram = np.einsum("ixy,jxy,xy->ij", values, values, np.broadcast_to(weight, rr.shape))
    assert np.abs(gram - np.eye(30)).max() < 1e-6


def test_sl_modes_are_orthonormal_on_the_square():
    t, w = np.polynomial.legendre.leggauss(48)
    xx, yy = np.meshgrid(t, t, indexing="ij")
    values = np.stack([evaluate(m, xx, yy) for m in sl_modes(20)])
    gram = np.einsum("ixy,jxy,x,y->ij", values, values, w, w)
    assert np.abs(gram - np.eye(20)).max() < 1e-6


@pytest.mark.parametrize("modes", [fb_modes(12), sl_modes(8)], ids=["fb", "sl"])
def test_modes_are_laplacian_eigenfunctions(modes):
    """-Laplace psi = mu psi at interior points (5-point finite differences)."""
    h = 1e-3
    x = np.array([0.31, -0.42, 0.05, -0.2])
    y = np.array([0.12, 0.37, -0.55, -0.3])
    for mode in modes:
        f = lambda dx, dy, m=mode: evaluate(m, x + dx, y + dy)  # noqa: E731
        lap = (f(h, 0) + f(-h, 0) + f(0, h) + f(0, -h) - 4 * f(0, 0)) / h**2
        np.testing.assert_allclose(-lap, mode.eigenvalue * f(0, 0), atol=2e-3 * mode.eigenvalue)


# ---------------------------------------------------------------- sampled bases


def test_pixel_grid_has_x_right_and_y_up():
    x, y = pixel_grid(5)
    ex, ey = kernel_coords(5)
    np.testing.assert_array_equal(x, ex)
    np.testing.assert_array_equal(y, ey)
    assert x[0, -1] == 2 and y[0, -1] == 2  # top-right pixel is (+2, +2)


@pytest.mark.parametrize("r", [0, 1, 2, 3, 5, 6])
def test_sampled_fb_basis_matches_formula_at_every_scale_and_rotation(r):
    spec = BasisSpec(FB, 12, 8, RADII)
    basis = sample_basis(spec)
    assert basis.shape == (12, 8, 4, 15, 15)
    x, y = kernel_coords(15)
    xr, yr = rotate_back(x, y, 2 * np.pi * r / 8)
    rho0 = RADII[0]
    for s, rho in enumerate(RADII):
        for i, (k, q, part) in enumerate(FB_ORDER_12):
            expected = (rho0 / rho) ** 2 / rho0 * fb_formula(k, q, part, xr / rho, yr / rho)
            np.testing.assert_allclose(basis[i, r, s], expected, rtol=1e-10, atol=1e-13)


def test_sampled_fb_centre_pixel_at_identity():
    """basis[k, 0, 0] at one pixel, spelled out: psi(u / rho0) / rho0."""
    spec = BasisSpec(FB, 12, 8, RADII)
    basis = sample_basis(spec)
    row, col = 6, 9  # u = (2, 1) in a 15 x 15 kernel
    j = special.jn_zeros(1, 1)[0]
    u = np.array([2.0, 1.0]) / 2.5
    rad = np.hypot(*u)
    value = np.sqrt(2) * np.cos(np.arctan2(u[1], u[0])) * special.jv(1, j * rad)
    value /= np.sqrt(np.pi) * abs(special.jv(2, j)) * 2.5
    assert basis[1, 0, 0, row, col] == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("r", [0, 1, 3, 6])
def test_sampled_sl_basis_matches_formula_on_inscribed_square(r):
    spec = BasisSpec(SL, 8, 8, RADII)
    basis = sample_basis(spec)
    x, y = kernel_coords(15)
    xr, yr = rotate_back(x, y, 2 * np.pi * r / 8)
    rho0 = RADII[0]
    for s, rho in enumerate(RADII):
        half = rho / np.sqrt(2)
        for i, (n, m) in enumerate(SL_ORDER_8):
            expected = (
                (rho0 / rho) ** 2 * np.sqrt(2) / rho0 * sl_formula(n, m, xr / half, yr / half)
            )
            np.testing.assert_allclose(basis[i, r, s], expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("family,num_funcs", [(FB, 12), (SL, 8)])
def test_sampled_norm_is_close_to_one_at_the_smallest_scale(family, num_funcs):
    """Sum over pixels of (psi(u / rho0) / rho0)**2 approximates the unit integral."""
    spec = BasisSpec(family, num_funcs, 4, (3.5,))
    norms = np.sqrt((sample_basis(spec)[:, 0, 0] ** 2).sum(axis=(-2, -1)))
    np.testing.assert_allclose(norms, 1.0, atol=0.02)


@pytest.mark.parametrize("family", [FB, SL, HG])
def test_scale_relation_two_to_the_minus_two_alpha(family):
    """With rho_1 = 2 rho_0: basis[s=1](2u) = basis[s=0](u) / 4, i.e. 2**(-2 alpha) psi(2**-alpha u)."""
    spec = BasisSpec(family, 8, 8, (2.5, 5.0))
    assert spec.kernel_sizes == (5, 9)
    basis = sample_basis(spec)
    coarse = basis[:, :, 1, ::2, ::2]  # pixels u = 2 u' of the 9 x 9 kernel
    fine = basis[:, :, 0, 2:7, 2:7]  # the 5 x 5 window of scale 0
    assert np.abs(fine).max() > 0.1
    np.testing.assert_allclose(coarse, fine / 4, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    "spec",
    [
        BasisSpec(FB, 12, 8, RADII),
        BasisSpec(SL, 8, 8, RADII),
        BasisSpec(HG, 10, 8, RADII),
        BasisSpec(FB, 12, 12, RADII[:2]),
        reference_spec(),
    ],
    ids=["fb", "sl", "hg", "fb-nr12", "reference"],
)
def test_quarter_turn_is_an_exact_permutation(spec):
    basis = sample_basis(spec)
    nr = spec.rotations
    for r in range(nr):
        turned = np.rot90(basis[:, r], 1, axes=(-2, -1))
        assert np.array_equal(basis[:, (r + nr // 4) % nr], turned), r


@pytest.mark.parametrize("num_funcs", [1, 3, 6, 12])
def test_fb_rotations_are_rotations_of_the_upright_modes(num_funcs):
    """Where the K modes hold both parts of each angular order, every rotated copy is, at
    every scale and sample, M_r times the upright copies: M_0 the identity, each M_r
    orthogonal with 2x2 blocks (cos, sin) of angle k theta_r, a quarter turn a signed
    permutation."""
    spec = BasisSpec(FB, num_funcs, 8, RADII)
    basis, mats = sample_basis(spec), steering(spec)
    assert mats is not None and mats.shape == (8, num_funcs, num_funcs)
    for r in range(8):
        steered = np.einsum("kj,jsxy->ksxy", mats[r], basis[:, 0])
        np.testing.assert_allclose(steered, basis[:, r], rtol=0, atol=1e-12)
        np.testing.assert_allclose(mats[r] @ mats[r].T, np.eye(num_funcs), atol=1e-9)
        assert ((np.abs(mats[r]) > 1e-9).sum(axis=1) <= 2).all()
    np.testing.assert_allclose(mats[0], np.eye(num_funcs), atol=1e-12)
    quarter = mats[2]
    assert np.allclose(np.abs(quarter[np.abs(quarter) > 1e-9]), 1)
    order1 = [i for i, m in enumerate(spec.modes()) if m.a == 1][:2]  # cos phi, sin phi
    if len(order1) == 2:  # an eighth turn turns the pair by 45 degrees
        c = math.cos(math.pi / 4)
        np.testing.assert_allclose(mats[1][np.ix_(order1, order1)], [[c, c], [-c, c]], atol=1e-9)


@pytest.mark.parametrize(
    "spec",
    [BasisSpec(FB, 2, 8, RADII), BasisSpec(FB, 4, 8, RADII), BasisSpec(SL, 6, 8, RADII)],
    ids=["fb-cos-without-sin", "fb-k4", "sl"],
)
def test_steering_is_refused_where_the_rotated_copies_leave_the_span(spec):
    """A cos mode whose sin partner K cuts off, or the SL square's modes: no M_r holds."""
    assert steering(spec) is None


def test_quarter_turn_is_counter_clockwise():
    """The k=1 cos mode at r = 0 is largest at +x; a quarter turn later it is at +y (top)."""
    basis = sample_basis(BasisSpec(FB, 3, 4, (3.5,)))
    row0, col0 = np.unravel_index(np.argmax(basis[1, 0, 0]), basis.shape[-2:])
    row1, col1 = np.unravel_index(np.argmax(basis[1, 1, 0]), basis.shape[-2:])
    assert (row0, col0 > 3) == (3, True)
    assert (row1 < 3, col1) == (True, 3)


def test_kernel_sizes_follow_the_support_radius():
    spec = BasisSpec(FB, 12, 8, RADII)
    assert spec.kernel_sizes == (5, 7, 11, 15)
    assert spec.kernel_size == 15
    assert spec.scale_step == pytest.approx(math.log2(3) / 3)
    basis = sample_basis(spec)
    for s, ks in enumerate(spec.kernel_sizes):
        lo = (15 - ks) // 2
        outside = np.ones((15, 15), dtype=bool)
        outside[lo : lo + ks, lo : lo + ks] = False
        assert np.all(basis[:, :, s][..., outside] == 0)
        assert np.abs(basis[:, :, s, lo : lo + ks, lo : lo + ks]).max() > 0


def test_sample_basis_is_cached_and_read_only():
    spec = BasisSpec("fb", 6, 8, (2.5,))
    a = sample_basis(spec)
    assert a is sample_basis(BasisSpec(FB, 6, 8, (2.5,)))
    assert a.dtype == np.float64 and not a.flags.writeable
    with pytest.raises(ValueError):
        a[0, 0, 0, 0, 0] = 1.0


# ---------------------------------------------------------------- aliasing and validation


@pytest.mark.parametrize("radius", [2.5, 3.5, 5.0])
def test_fb_max_modes_counts_roots_below_nyquist(radius):
    roots = [
        j for k in range(20) for j in special.jn_zeros(k, 20) for _ in range(1 if k == 0 else 2)
    ]
    assert max_modes(FB, radius) == sum(j <= np.pi * radius for j in roots)


def test_fb_aliasing_limit_at_radius_two_and_a_half():
    assert max_modes(FB, 2.5) == 12
    BasisSpec(FB, 12, 8, RADII)
    with pytest.raises(ValueError, match="alias"):
        BasisSpec(FB, 13, 8, RADII)


def test_sl_aliasing_limit_at_radius_two_and_a_half():
    assert max_modes(SL, 2.5) == 8
    BasisSpec(SL, 8, 8, RADII)
    with pytest.raises(ValueError, match="alias"):
        BasisSpec(SL, 9, 8, RADII)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rotations=0),
        dict(rotations=-4),
        dict(num_funcs=0),
        dict(scales=()),
        dict(scales=(3.0, 2.5)),
        dict(scales=(2.5, 2.5)),
        dict(scales=(-1.0, 2.5)),
        dict(scales=(2.5, 3.0, 5.0)),  # not geometric
        dict(kernel_sizes=(5, 8)),
        dict(kernel_sizes=(6, 7)),
        dict(kernel_sizes=(7, 5)),
        dict(kernel_sizes=(5,)),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_invalid_specs_raise(kwargs):
    args = dict(family=FB, num_funcs=6, rotations=8, scales=(2.5, 3.5)) | kwargs
    with pytest.raises(ValueError):
        BasisSpec(**args)


def test_valid_spec_with_explicit_odd_kernels():
    spec = BasisSpec(FB, 6, 8, (2.5, 3.5), kernel_sizes=(7, 9))
    assert sample_basis(spec).shape == (6, 8, 2, 9, 9)


# ---------------------------------------------------------------- public-code reference basis


def test_reference_spec_shape_windows_and_norm():
    spec = reference_spec()
    assert spec.kernel_sizes == (5, 7, 11, 15)
    basis = sample_basis(spec)
    assert basis.shape == (49, 8, 4, 15, 15)
    for s, ks in enumerate((5, 7, 11)):
        lo = (15 - ks) // 2
        outside = np.ones((15, 15), dtype=bool)
        outside[lo : lo + ks, lo : lo + ks] = False
        assert np.all(basis[:, :, s][..., outside] == 0), s
        # the disk (radius 3.5 sigma) is cropped by the window: its border is not empty
        assert np.abs(basis[:, :, s, lo, lo : lo + ks]).max() > 1e-3, s
    np.testing.assert_allclose(np.sqrt((basis[:, 0, 0] ** 2).sum(axis=(-2, -1))), 1.0, rtol=1e-12)


def test_reference_spec_rejects_too_many_functions():
    with pytest.raises(ValueError):
        reference_spec(num_funcs=61)


def test_hermite_gaussian_basis_is_sesns_family():
    """SESN's basis: H_n(2x/rho) H_m(2y/rho) exp(-4 |u|^2 / rho^2) on the disk, lowest degree
    first, unit norm at the smallest scale, aliasing-limited like the others."""
    from scipy import special

    spec = BasisSpec(HG, 10, 1, (2.5, 5.0))
    basis = sample_basis(spec)
    assert basis.shape == (10, 1, 2, 9, 9)
    assert [(m.a, m.b) for m in spec.modes()][:6] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (0, 2),
        (1, 1),
        (2, 0),
    ]
    assert [m.a + m.b for m in spec.modes()] == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    np.testing.assert_allclose(np.sqrt((basis[:, 0, 0] ** 2).sum(axis=(-2, -1))), 1.0)
    x, y = pixel_grid(9)
    for s, rho in enumerate(spec.scales):
        inside = np.hypot(x, y) < rho
        for i, mode in enumerate(spec.modes()):
            tx, ty = 2 * x / rho, 2 * y / rho
            shape = special.eval_hermite(mode.a, tx) * special.eval_hermite(mode.b, ty)
            shape = np.where(inside, shape * np.exp(-(tx**2 + ty**2)), 0.0)
            big = np.abs(shape) > 1e-3 * np.abs(shape).max()
            ratio = basis[i, 0, s][big] / shape[big]  # one constant per function and scale
            np.testing.assert_allclose(ratio, ratio[0], rtol=1e-9)
            assert not basis[i, 0, s][~inside].any()
    with pytest.raises(ValueError, match="alias"):
        BasisSpec(HG, 40, 1, (2.5,))
