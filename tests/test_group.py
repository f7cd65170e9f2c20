"""The RST group: group law, action on images and on [B, C, R, S, H, W] feature maps."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rstmodel.group import (
    RSTElement,
    act_on_features,
    act_on_image,
    fold,
    quarter_turns,
    unfold,
)

angles = st.floats(-math.pi, math.pi, allow_nan=False)
log2_scales = st.floats(-1.5, 1.5, allow_nan=False)
shifts = st.tuples(st.floats(-8, 8, allow_nan=False), st.floats(-8, 8, allow_nan=False))
elements = st.builds(RSTElement, angles, log2_scales, shifts)

QUARTER = RSTElement(math.pi / 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- group law


@given(elements)
def test_identity_is_neutral(g):
    e = RSTElement.identity()
    assert (e @ g).is_close(g)
    assert (g @ e).is_close(g)


@given(elements, elements, elements)
def test_product_is_associative(a, b, c):
    assert ((a @ b) @ c).is_close(a @ (b @ c), tol=1e-8)


@given(elements)
def test_inverse_gives_identity(g):
    assert (g @ g.inverse()).is_close(RSTElement.identity())
    assert (g.inverse() @ g).is_close(RSTElement.identity())


@given(elements, elements)
def test_matrix_is_a_homomorphism(a, b):
    torch.testing.assert_close((a @ b).matrix(), a.matrix() @ b.matrix(), rtol=1e-12, atol=1e-12)


@given(elements)
def test_is_close_tells_elements_apart(g):
    other = RSTElement(g.angle + 0.01, g.log2_scale, g.shift)
    assert not g.is_close(other)


def test_matrix_rotates_counter_clockwise_then_scales_then_shifts():
    g = RSTElement(math.pi / 2, 1.0, (1.0, 0.0))
    u = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(g.matrix() @ u, torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64))


def test_quarter_turns_recognises_grid_maps():
    assert quarter_turns(RSTElement()) == 0
    assert quarter_turns(QUARTER) == 1
    assert quarter_turns(RSTElement(-math.pi / 2)) == 3
    assert quarter_turns(RSTElement(5 * math.pi)) == 2
    assert quarter_turns(RSTElement(math.pi / 4)) is None
    assert quarter_turns(RSTElement(math.pi / 2, 0.5)) is None
    assert quarter_turns(RSTElement(0.0, 0.0, (1.0, 0.0))) is None


# ---------------------------------------------------------------- action on images


def test_identity_action_is_exact():
    x = torch.randn(2, 3, 9, 9)
    assert torch.equal(act_on_image(x, RSTElement.identity()), x)


@pytest.mark.parametrize("k", [-1, 0, 1, 2, 3, 4, 5])
def test_quarter_turn_is_rot90(k):
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    assert torch.equal(act_on_image(x, RSTElement(k * math.pi / 2)), torch.rot90(x, k, (-2, -1)))


@pytest.mark.parametrize("k1", range(4))
@pytest.mark.parametrize("k2", range(4))
def test_composition_is_exact_for_quarter_turns(k1, k2):
    x = torch.randn(1, 2, 6, 6)
    g1, g2 = RSTElement(k1 * math.pi / 2), RSTElement(k2 * math.pi / 2)
    assert torch.equal(act_on_image(act_on_image(x, g2), g1), act_on_image(x, g1 @ g2))


def test_bright_pixel_on_plus_x_turns_to_plus_y():
    x = torch.zeros(9, 9)
    x[4, 7] = 1.0  # centre (4, 4): u = (+3, 0)
    turned = act_on_image(x, QUARTER)
    assert turned[1, 4] == 1.0  # u = (0, +3): top of the image
    # the resampling path (a tiny scale forces it) agrees on orientation
    resampled = act_on_image(x, RSTElement(math.pi / 2, 1e-7))
    assert divmod(int(resampled.argmax()), 9) == (1, 4)
    assert resampled[1, 4] > 0.99


def test_eighth_turn_moves_plus_x_to_the_upper_right():
    x = torch.zeros(31, 31, dtype=torch.float64)
    x[15, 25] = 1.0  # u = (+10, 0)
    row, col = divmod(int(act_on_image(x, RSTElement(math.pi / 4)).argmax()), 31)
    assert (row, col) == (15 - 7, 15 + 7)  # 10 (cos 45, sin 45) ~ (7.07, 7.07)


def test_integer_shift_moves_right_and_up():
    x = torch.randn(1, 7, 7, dtype=torch.float64)
    right = act_on_image(x, RSTElement(0.0, 0.0, (1.0, 0.0)))
    torch.testing.assert_close(right[..., 1:], x[..., :-1], rtol=0, atol=1e-12)
    assert right[..., 0].abs().max() < 1e-12
    up = act_on_image(x, RSTElement(0.0, 0.0, (0.0, 2.0)))
    torch.testing.assert_close(up[..., :-2, :], x[..., 2:, :], rtol=0, atol=1e-12)
    assert up[..., -2:, :].abs().max() < 1e-12


def test_resampling_path_matches_rot90_for_a_quarter_turn():
    x = torch.randn(2, 10, 10, dtype=torch.float64)
    resampled = act_on_image(x, RSTElement(math.pi / 2, 0.0, (1e-9, 0.0)), mode="bilinear")
    torch.testing.assert_close(resampled, torch.rot90(x, 1, (-2, -1)), rtol=0, atol=1e-6)


def test_scaling_enlarges_about_the_centre():
    x = torch.zeros(17, 17, dtype=torch.float64)
    x[8, 11] = 1.0  # u = (+3, 0)
    y = act_on_image(x, RSTElement(0.0, 1.0), mode="nearest")  # u -> 2u
    assert y[8, 14] == 1.0  # u = (+6, 0)
    assert y[8, 11] == 0.0


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_composition_law_is_approximate_for_off_grid_elements(blobs, interior, mode):
    x = blobs((2,), 48, sigma=3.0)
    g1 = RSTElement(math.pi / 6, 0.25, (1.5, -1.0))
    g2 = RSTElement(math.pi / 6, -0.4, (-2.0, 0.5))
    twice = act_on_image(act_on_image(x, g2, mode=mode), g1, mode=mode)
    once = act_on_image(x, g1 @ g2, mode=mode)
    wrong = act_on_image(x, g2 @ g1, mode=mode)  # the group is not abelian
    err = rel(interior(twice, 18), interior(once, 18))
    err_wrong = rel(interior(wrong, 18), interior(once, 18))
    assert err < 0.05
    assert err < 0.2 * err_wrong


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_inverse_law_is_approximate(blobs, interior, mode):
    x = blobs((2,), 48, sigma=3.0)
    g = RSTElement(-math.pi / 6, 0.3, (1.0, 2.0))
    back = act_on_image(act_on_image(x, g, mode=mode), g.inverse(), mode=mode)
    err = rel(interior(back, 16), interior(x, 16))
    moved = rel(interior(act_on_image(x, g, mode=mode), 16), interior(x, 16))
    assert err < 0.05
    assert moved > 0.3


def test_quarter_turn_of_a_non_square_grid_raises():
    with pytest.raises(ValueError, match="non-square"):
        act_on_image(torch.zeros(4, 6), QUARTER)


# ---------------------------------------------------------------- action on feature maps


def manual_roll_r(x: torch.Tensor, steps: int) -> torch.Tensor:
    """out[:, :, r] = x[:, :, (r - steps) mod R]."""
    rot = x.shape[2]
    return torch.stack([x[:, :, (r - steps) % rot] for r in range(rot)], dim=2)


def manual_shift_s(x: torch.Tensor, steps: int) -> torch.Tensor:
    """out[:, :, :, s] = x[:, :, :, s - steps], zero where s - steps leaves [0, S)."""
    out = torch.zeros_like(x)
    for s in range(x.shape[3]):
        if 0 <= s - steps < x.shape[3]:
            out[:, :, :, s] = x[:, :, :, s - steps]
    return out


@pytest.mark.parametrize("k", range(4))
def test_features_quarter_turn_rolls_r_and_rotates_space(k):
    x = torch.randn(2, 3, 8, 4, 6, 6, dtype=torch.float64)
    y = act_on_features(x, RSTElement(k * math.pi / 2), scale_step=0.5)
    assert torch.equal(y, manual_roll_r(torch.rot90(x, k, (-2, -1)), 2 * k))


def test_features_off_quarter_rotation_rolls_r_by_its_grid_index():
    x = torch.randn(1, 2, 8, 2, 10, 10, dtype=torch.float64)
    g = RSTElement(3 * 2 * math.pi / 8)
    y = act_on_features(x, g, scale_step=0.5)
    assert torch.equal(y, manual_roll_r(act_on_image(x, g), 3))
    g_neg = RSTElement(-2 * math.pi / 8)
    y_neg = act_on_features(x, g_neg, scale_step=0.5)
    assert torch.equal(y_neg, manual_roll_r(act_on_image(x, g_neg), -1))


@pytest.mark.parametrize("steps", [1, 2, -1, -3, 4, -5])
def test_features_scale_shifts_s_with_zero_fill(steps):
    x = torch.randn(2, 2, 4, 4, 8, 8, dtype=torch.float64)
    g = RSTElement(0.0, 0.5 * steps)
    y = act_on_features(x, g, scale_step=0.5)
    assert torch.equal(y, manual_shift_s(act_on_image(x, g), steps))
    if abs(steps) < 4:
        assert y.abs().sum() > 0


def test_features_rotation_and_scale_together():
    x = torch.randn(1, 2, 4, 3, 8, 8, dtype=torch.float64)
    g = RSTElement(math.pi / 2, 1.0)
    y = act_on_features(x, g, scale_step=1.0)
    expected = manual_shift_s(manual_roll_r(act_on_image(x, g), 1), 1)
    assert torch.equal(y, expected)


def test_features_identity_is_exact():
    x = torch.randn(2, 3, 8, 4, 6, 6)
    assert torch.equal(act_on_features(x, RSTElement(), scale_step=0.5), x)


@pytest.mark.parametrize(
    "g",
    [RSTElement(0.1), RSTElement(math.pi / 3), RSTElement(0.0, 0.3)],
    ids=["angle-0.1", "angle-pi/3", "scale-0.3"],
)
def test_features_off_grid_element_raises(g):
    x = torch.zeros(1, 1, 8, 4, 6, 6)
    with pytest.raises(ValueError, match="not a multiple"):
        act_on_features(x, g, scale_step=0.5)


def test_features_scale_on_a_single_scale_axis_raises():
    with pytest.raises(ValueError):
        act_on_features(torch.zeros(1, 1, 8, 1, 6, 6), RSTElement(0.0, 0.5), scale_step=0.0)


def test_features_need_six_dims():
    with pytest.raises(ValueError, match=r"\[B, C, R, S, H, W\]"):
        act_on_features(torch.zeros(1, 8, 4, 6, 6), QUARTER, scale_step=0.5)


# ---------------------------------------------------------------- fold / unfold


def test_fold_unfold_round_trip_and_order():
    b, c, r, s, h, w = 2, 3, 4, 5, 2, 3
    x = torch.arange(b * c * r * s * h * w, dtype=torch.float64).view(b, c, r, s, h, w)
    folded = fold(x)
    assert folded.shape == (b, c * r * s, h, w)
    for ci in range(c):
        for ri in range(r):
            for si in range(s):
                assert torch.equal(folded[:, ci * r * s + ri * s + si], x[:, ci, ri, si])
    assert torch.equal(unfold(folded, r, s), x)
