"""RST layers: equivariance, fast path == reference path, eval caches, expanded weights, validation."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rstmodel
from rstmodel.basis import BasisFamily, BasisSpec, reference_spec, sample_basis
from rstmodel.group import RSTElement, act_on_features, act_on_image
from rstmodel.layers import (
    ConvMethod,
    GroupMaxPool,
    GroupRSTConv,
    LiftingRSTConv,
    RotationTaps,
    RSTBatchNorm,
    RSTMaxPool,
)
from rstmodel.layers import conv as conv_module
from rstmodel.layers import kernels as kernels_module

FB = BasisFamily.FOURIER_BESSEL
SL = BasisFamily.STURM_LIOUVILLE
SPEC = BasisSpec(FB, 6, 8, (2.5, 2.5 * 2**0.5))  # kernels 5, 7; scale step 0.5
SPEC_SL = BasisSpec(SL, 6, 8, (2.5, 2.5 * 2**0.5))
SPEC3 = BasisSpec(FB, 6, 8, (2.5, 2.5 * 2**0.5, 5.0))  # kernels 5, 7, 9
SPEC3_SL = BasisSpec(SL, 6, 8, (2.5, 2.5 * 2**0.5, 5.0))
SPEC3_HG = BasisSpec(BasisFamily.HERMITE_GAUSSIAN, 6, 1, (2.5, 2.5 * 2**0.5, 5.0))  # SESN's
SPEC_BIG = BasisSpec(FB, 6, 8, (2.5, 2.5 * 3**0.5, 7.5))  # kernels 5, 9, 15
QUARTER = RSTElement(math.pi / 2)
EIGHTH = RSTElement(2 * math.pi / 8)
F64 = torch.float64

GROUP_CONFIGS = [
    (lt, mode, la)
    for lt in (1, 2, 4)
    for mode in (RotationTaps.COARSE, RotationTaps.ADJACENT)
    for la in (1, 2)
    if lt > 1 or mode is RotationTaps.COARSE  # one tap: both modes are the same operator
]


def group_id(cfg: tuple) -> str:
    lt, mode, la = cfg
    return f"Lt{lt}-{mode.value}-La{la}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def turn(y: torch.Tensor, spec: BasisSpec, k: int = 1) -> torch.Tensor:
    return act_on_features(y, RSTElement(k * math.pi / 2), scale_step=spec.scale_step)


# ---------------------------------------------------------------- exact equivariance


@pytest.mark.parametrize(
    "spec",
    [SPEC, SPEC_SL, reference_spec(8, 2, 49)],
    ids=["fb", "sl", "reference"],
)
@pytest.mark.parametrize("path", ["forward_direct", "forward_basis"])
def test_lifting_is_exactly_equivariant_to_quarter_turns(spec, path):
    conv = LiftingRSTConv(2, 3, spec).to(F64)
    fwd = getattr(conv, path)
    x = torch.randn(2, 2, 16, 16, dtype=F64)
    y = fwd(x)
    assert y.shape == (2, 3, 8, 2, 16, 16)
    for k in (1, 2, 3):
        assert rel(fwd(torch.rot90(x, k, (-2, -1))), turn(y, spec, k)) < 1e-10
    # control: without the R roll the maps differ
    assert rel(fwd(torch.rot90(x, 1, (-2, -1))), torch.rot90(y, 1, (-2, -1))) > 0.1


@pytest.mark.parametrize("cfg", GROUP_CONFIGS, ids=group_id)
@pytest.mark.parametrize("path", ["forward_direct", "forward_fft", "forward_basis"])
def test_group_conv_is_exactly_equivariant_to_quarter_turns(cfg, path):
    lt, mode, la = cfg
    conv = GroupRSTConv(2, 3, SPEC, rotation_taps=lt, scale_taps=la, tap_mode=mode).to(F64)
    fwd = getattr(conv, path)
    x = torch.randn(2, 2, 8, 2, 12, 12, dtype=F64)
    y = fwd(x)
    assert y.shape == (2, 3, 8, 2, 12, 12)
    turned = fwd(turn(x, SPEC))
    assert rel(turned, turn(y, SPEC)) < 1e-10
    assert rel(turned, torch.rot90(y, 1, (-2, -1))) > 0.1  # control: R must roll too


def test_batch_norm_is_equivariant_in_train_mode():
    bn = RSTBatchNorm(3).to(F64)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.normal_()
    x = torch.randn(2, 3, 8, 2, 6, 6, dtype=F64) * 3 + 1
    y = bn(x)
    assert rel(bn(turn(x, SPEC)), turn(y, SPEC)) < 1e-10
    # statistics are per channel over (B, R, S, H, W)
    bn.reset_running_stats()
    y = bn(x)
    mean = y.mean(dim=(0, 2, 3, 4, 5))
    torch.testing.assert_close(mean, bn.bias.detach(), rtol=0, atol=1e-10)


def test_batch_norm_keeps_float_statistics_for_bfloat16_input():
    """Under bfloat16 autocast the spatial-major batch norm gets bfloat16 maps: its running
    statistics stay float32 and match float32 statistics to bfloat16 rounding."""
    x = torch.randn(4, 3, 8, 2, 6, 6) * 2 + 1
    ref, low = RSTBatchNorm(3), RSTBatchNorm(3)
    y_ref = ref(spatial_major(x))
    y_low = low(spatial_major(x.bfloat16()))
    assert low.running_mean.dtype == low.running_var.dtype == torch.float32
    torch.testing.assert_close(low.running_mean, ref.running_mean, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(low.running_var, ref.running_var, rtol=1e-2, atol=1e-3)
    assert (y_low.float() - y_ref).abs().max() < 0.05
    # the map itself stays bfloat16 (half the bytes written, and read by the next layer);
    # float32 maps stay float32, in training and in eval
    assert y_low.dtype == torch.bfloat16 and y_ref.dtype == torch.float32
    low.eval()
    assert low(spatial_major(x.bfloat16())).dtype == torch.bfloat16


def test_batch_norm_statistics_stay_float32_under_autocast():
    """Under CPU autocast the chunked statistics' GEMVs would run in bfloat16 (a 2e-4
    relative error): they must not. Same bfloat16 values, with and without autocast."""
    x = (torch.randn(8, 3, 8, 4, 14, 14) * 2 + 1).bfloat16()
    ref, low = RSTBatchNorm(3), RSTBatchNorm(3)
    ref(spatial_major(x.float()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low(spatial_major(x))
    torch.testing.assert_close(low.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(low.running_var, ref.running_var, rtol=1e-5, atol=1e-6)


def spatial_major(x: torch.Tensor) -> torch.Tensor:
    """The same [B, C, R, S, H, W] values laid out in memory as [H, W, R, S, B, C]."""
    return x.permute(4, 5, 2, 3, 0, 1).contiguous().permute(4, 5, 2, 3, 0, 1)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("chunk_rows", [None, 100])
def test_batch_norm_gives_the_same_result_in_every_memory_layout(momentum, chunk_rows, monkeypatch):
    """The spatial-major path (chunked column sums on the CPU, its own backward; also in
    chunks of 100 rows with a remainder) against torch's batch norm, gradients included."""
    from rstmodel.layers import norm

    if chunk_rows is not None:
        monkeypatch.setattr(norm, "STAT_CHUNK_ROWS", chunk_rows)
    x = torch.randn(4, 3, 8, 2, 6, 6, dtype=F64) * 2 + 1
    norms = [RSTBatchNorm(3, momentum=momentum).to(F64) for _ in range(2)]
    for bn in norms:
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
            bn.bias.copy_(torch.tensor([-1.0, 0.0, 1.0]))
    grad_out = torch.randn_like(x)
    results = []
    for bn, xi in zip(norms, (x, spatial_major(x)), strict=True):
        xi = xi.detach().requires_grad_(True)
        for _ in range(2):
            y = bn(xi)
        (y * grad_out).sum().backward()
        bn.eval()
        with torch.no_grad():
            y_eval = bn(xi * 0.5)
        grads = (xi.grad, bn.weight.grad, bn.bias.grad)
        results.append((y, *grads, bn.running_mean, bn.running_var, y_eval))
    for default, other in zip(*results, strict=True):
        torch.testing.assert_close(other, default, rtol=1e-10, atol=1e-10)
    assert norms[0].num_batches_tracked == norms[1].num_batches_tracked == 2


@pytest.mark.parametrize("affine", [True, False])
def test_row_batch_norm_passes_gradcheck(affine, monkeypatch):
    from rstmodel.layers import norm

    monkeypatch.setattr(norm, "STAT_CHUNK_ROWS", 7)
    x = (torch.randn(30, 3, dtype=F64) * 2 + 1).requires_grad_()
    w = torch.rand(3, dtype=F64, requires_grad=True) + 0.5 if affine else None
    b = torch.randn(3, dtype=F64, requires_grad=True) if affine else None
    torch.autograd.gradcheck(lambda *t: norm._RowBatchNorm.apply(*t, 1e-5)[0], (x, w, b))
    y, mean, var = norm._RowBatchNorm.apply(x, w, b, 1e-5)
    var_ref, mean_ref = torch.var_mean(x.detach(), dim=0, correction=0)
    torch.testing.assert_close((mean, var), (mean_ref, var_ref), rtol=1e-12, atol=1e-12)
    assert not (mean.requires_grad or var.requires_grad)


@pytest.mark.parametrize("relu", [True, False])
def test_max_pool_is_exactly_equivariant(relu):
    pool = RSTMaxPool(relu=relu)
    x = torch.randn(2, 3, 8, 2, 8, 8, dtype=F64)
    y = pool(x)
    assert y.shape == (2, 3, 8, 2, 4, 4)
    assert (y.min() >= 0).item() is relu
    assert torch.equal(pool(turn(x, SPEC)), turn(y, SPEC))


def test_group_max_pool_is_invariant_or_equivariant():
    x = torch.randn(2, 3, 8, 2, 6, 6, dtype=F64)
    full, planar = GroupMaxPool(spatial=True), GroupMaxPool(spatial=False)
    assert full(x).shape == (2, 3)
    assert torch.equal(full(turn(x, SPEC)), full(x))
    assert torch.equal(planar(turn(x, SPEC)), torch.rot90(planar(x), 1, (-2, -1)))
    torch.testing.assert_close(full(x), x.flatten(2).amax(-1))


# ---------------------------------------------------------------- approximate equivariance


@pytest.mark.parametrize("spec", [SPEC, SPEC_SL], ids=["fb", "sl"])
def test_lifting_is_approximately_equivariant_to_an_eighth_turn(spec, blobs, interior):
    conv = LiftingRSTConv(2, 3, spec).to(F64)
    x = blobs((1, 2), 24)
    y = conv(x)
    lhs = interior(conv(act_on_image(x, EIGHTH, mode="bicubic")), 7)
    rhs = interior(act_on_features(y, EIGHTH, scale_step=spec.scale_step, mode="bicubic"), 7)
    wrong = interior(torch.roll(act_on_image(y, EIGHTH, mode="bicubic"), -1, dims=2), 7)
    err, err_wrong = rel(lhs, rhs), rel(lhs, wrong)
    assert err < 0.1
    assert err < 0.5 * err_wrong


@pytest.mark.parametrize("cfg", [(1, 1), (2, 2), (4, 1)], ids=["Lt1La1", "Lt2La2", "Lt4La1"])
@pytest.mark.parametrize("spec", [SPEC3, SPEC3_SL], ids=["fb", "sl"])
def test_group_conv_is_approximately_equivariant_to_an_eighth_turn(spec, cfg, blobs, interior):
    lt, la = cfg
    conv = GroupRSTConv(2, 3, spec, rotation_taps=lt, scale_taps=la).to(F64)
    x = blobs((1, 2, 8, 3), 24)
    y = conv(x)
    moved = act_on_features(x, EIGHTH, scale_step=spec.scale_step, mode="bicubic")
    lhs = interior(conv(moved), 7)
    rhs = interior(act_on_features(y, EIGHTH, scale_step=spec.scale_step, mode="bicubic"), 7)
    wrong = interior(torch.roll(act_on_image(y, EIGHTH, mode="bicubic"), -1, dims=2), 7)
    err, err_wrong = rel(lhs, rhs), rel(lhs, wrong)
    assert err < 0.1
    assert err < 0.5 * err_wrong


@pytest.mark.parametrize("spec", [SPEC3, SPEC3_SL, SPEC3_HG], ids=["fb", "sl", "hg"])
def test_lifting_is_approximately_equivariant_to_a_scale_step(spec, blobs, interior):
    """Scale s >= 1 of the lifted zoomed image = scale s - 1 of the lifted image, zoomed."""
    conv = LiftingRSTConv(2, 3, spec).to(F64)
    g = RSTElement(0.0, spec.scale_step)
    x = blobs((1, 2), 24)
    y = conv(x)
    lhs = interior(conv(act_on_image(x, g, mode="bicubic"))[:, :, :, 1:], 7)
    rhs = interior(
        act_on_features(y, g, scale_step=spec.scale_step, mode="bicubic")[:, :, :, 1:], 7
    )
    wrong = interior(act_on_image(y, g, mode="bicubic")[:, :, :, 1:], 7)  # S not shifted
    err, err_wrong = rel(lhs, rhs), rel(lhs, wrong)
    assert err < 0.1
    assert err < 0.5 * err_wrong


@pytest.mark.parametrize("la", [1, 2])
@pytest.mark.parametrize("spec", [SPEC3, SPEC3_SL], ids=["fb", "sl"])
def test_group_conv_is_approximately_equivariant_to_a_scale_step(spec, la, blobs, interior):
    """Compare only scales whose taps stay inside the truncated range after the shift."""
    conv = GroupRSTConv(2, 3, spec, rotation_taps=2, scale_taps=la).to(F64)
    g = RSTElement(0.0, spec.scale_step)
    x = blobs((1, 2, 8, 3), 24)
    y = conv(x)
    keep = slice(1, 3) if la == 1 else slice(1, 2)
    moved = act_on_features(x, g, scale_step=spec.scale_step, mode="bicubic")
    lhs = interior(conv(moved)[:, :, :, keep], 7)
    rhs = interior(
        act_on_features(y, g, scale_step=spec.scale_step, mode="bicubic")[:, :, :, keep], 7
    )
    wrong = interior(act_on_image(y, g, mode="bicubic")[:, :, :, keep], 7)
    err, err_wrong = rel(lhs, rhs), rel(lhs, wrong)
    assert err < 0.1
    assert err < 0.5 * err_wrong


# ---------------------------------------------------------------- fast path == reference path


@pytest.mark.parametrize("spec", [SPEC, SPEC_SL, SPEC_BIG], ids=["fb", "sl", "k15"])
def test_lifting_basis_path_matches_direct_path_with_gradients(spec):
    conv = LiftingRSTConv(3, 4, spec).to(F64)
    x = torch.randn(2, 3, 14, 18, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 4, 8, spec.num_scales, 14, 18, dtype=F64)
    results = []
    for path in (conv.forward_direct, conv.forward_basis):
        x.grad = conv.weight.grad = None
        y = path(x)
        (y * grad_out).sum().backward()
        results.append((y.detach(), x.grad.clone(), conv.weight.grad.clone()))
    for ref, fast in zip(*results, strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "lt,mode,la",
    [
        (1, RotationTaps.COARSE, 1),
        (4, RotationTaps.COARSE, 2),
        (3, RotationTaps.ADJACENT, 2),
    ],
    ids=["Lt1-La1", "Lt4-coarse-La2", "Lt3-adjacent-La2"],
)
@pytest.mark.parametrize("size", [(12, 12), (10, 16)], ids=["square", "rect"])
@pytest.mark.parametrize("fast", ["forward_fft", "forward_basis"])
def test_group_fast_paths_match_direct_path_with_gradients(lt, mode, la, size, fast):
    conv = GroupRSTConv(3, 4, SPEC3, rotation_taps=lt, scale_taps=la, tap_mode=mode).to(F64)
    x = torch.randn(2, 3, 8, 3, *size, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 4, 8, 3, *size, dtype=F64)
    results = []
    for path in (conv.forward_direct, getattr(conv, fast)):
        x.grad = conv.weight.grad = None
        y = path(x)
        (y * grad_out).sum().backward()
        results.append((y.detach(), x.grad.clone(), conv.weight.grad.clone()))
    for ref, got in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "make",
    [
        lambda: GroupRSTConv(2, 3, SPEC, rotation_taps=2, scale_taps=2, method="direct"),
        lambda: GroupRSTConv(2, 3, SPEC, rotation_taps=2, scale_taps=2, method="fft"),
        lambda: GroupRSTConv(2, 3, SPEC, rotation_taps=2, scale_taps=2, method="basis"),
        lambda: RSTBatchNorm(2),
        lambda: RSTMaxPool(relu=True),
        lambda: GroupMaxPool(spatial=False),
    ],
    ids=["group-direct", "group-fft", "group-basis", "batchnorm", "maxpool", "groupmax"],
)
def test_layers_give_the_same_values_in_every_memory_layout(make):
    """Contiguous [B, C, R, S, H, W] and spatial-major [H, W, R, S, B, C] memory."""
    layer = make().to(F64)
    x = torch.randn(3, 2, 8, 2, 10, 10, dtype=F64)
    grad_out = None
    results = []
    for xi in (x, spatial_major(x)):
        xi = xi.detach().requires_grad_(True)
        y = layer(xi)
        grad_out = torch.randn_like(y) if grad_out is None else grad_out
        (y * grad_out).sum().backward()
        results.append((y.detach(), xi.grad))
    for default, other in zip(*results, strict=True):
        torch.testing.assert_close(other, default, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "spec",
    [SPEC3, SPEC3_SL, reference_spec(8, 3, 49), BasisSpec(FB, 6, 4, (2.5, 2.5 * 2**0.5))],
    ids=["fb", "sl", "reference", "fb-R4"],
)
@pytest.mark.parametrize("la", [1, 2])
def test_fft_path_sharing_quarter_turns_equals_one_spectrum_per_rotation(spec, la):
    """Four output rotations a quarter turn apart share one filter spectrum: same values
    and gradients as the plain FFT path, a quarter of the cached spectra."""
    conv = GroupRSTConv(3, 4, spec, scale_taps=la).to(F64)
    assert conv.quarter_turns(12, 12) == 4
    x = torch.randn(2, 3, spec.rotations, spec.num_scales, 12, 12, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 4, spec.rotations, spec.num_scales, 12, 12, dtype=F64)
    results = []
    for share in (False, True):
        x.grad = conv.weight.grad = None
        y = conv.forward_fft(x, share_quarter_turns=share)
        (y * grad_out).sum().backward()
        results.append((y.detach(), x.grad.clone(), conv.weight.grad.clone()))
    for plain, shared in zip(*results, strict=True):
        torch.testing.assert_close(shared, plain, rtol=1e-10, atol=1e-10)
    conv.eval()
    with torch.no_grad():
        conv.forward_fft(x)
    spectra = [v[2][0] for k, v in conv._cache.items() if k.startswith("fft")]
    blocks = conv.scale_blocks(12, 12)
    assert len(spectra) == len(blocks)
    for g, (first, end, nh, nw) in zip(spectra, blocks, strict=True):
        assert g.shape[0] == nh * (nw // 2 + 1) * spec.rotations // 4 * (end - first)


@pytest.mark.parametrize(
    "make, size",
    [
        (lambda: GroupRSTConv(2, 3, SPEC, rotation_taps=2), (12, 12)),  # taps read other quarters
        (lambda: GroupRSTConv(2, 3, BasisSpec(FB, 6, 6, (2.5,))), (12, 12)),  # R = 6
        (lambda: GroupRSTConv(2, 3, SPEC), (10, 12)),  # not square
    ],
    ids=["Lt2", "R6", "rect"],
)
def test_quarter_turn_sharing_is_used_only_where_it_is_exact(make, size):
    conv = make().to(F64)
    assert conv.quarter_turns(*size) == 1
    x = torch.randn(1, 2, conv.spec.rotations, conv.spec.num_scales, *size, dtype=F64)
    torch.testing.assert_close(conv.forward_fft(x), conv.forward_direct(x), rtol=1e-10, atol=1e-10)


def test_fft_rows_name_every_row_once_turned_back_in_scale_blocks():
    rows = kernels_module._fft_rows(6, 6, 8, 4, (0, 1, 3), torch.device("cpu"))
    assert torch.equal(torch.cat(rows).sort().values, torch.arange(6 * 6 * 8 * 3))
    # block (scale 0), block (scales 1-2): rows (h, w, p, s, q) of map r = 2q + p turned
    # back by q quarter turns
    maps = torch.randn(6, 6, 8, 3)
    first = maps.reshape(-1)[rows[0]].view(6, 6, 2, 1, 4)
    second = maps.reshape(-1)[rows[1]].view(6, 6, 2, 2, 4)
    for q in range(4):
        for p in range(2):
            expected = torch.rot90(maps[:, :, 2 * q + p], -q, (0, 1))
            assert torch.equal(first[:, :, p, 0, q], expected[..., 0])
            assert torch.equal(second[:, :, p, :, q], expected[..., 1:])
    # no turns, one block: nothing to gather
    assert kernels_module._fft_rows(6, 6, 8, 1, (0, 3), torch.device("cpu")) is None
    plain = kernels_module._fft_rows(4, 6, 8, 1, (0, 2, 3), torch.device("cpu"))
    grid = torch.arange(4 * 6 * 8 * 3).view(-1, 3)  # rows (h, w, r), scales
    assert torch.equal(plain[0], grid[:, :2].flatten())
    assert torch.equal(plain[1], grid[:, 2])


def test_fft_path_runs_each_scale_on_its_own_grid():
    """Scales whose kernels differ get grids of their own, each H + k//2; equal ones share;
    L_alpha > 1 keeps one grid (its taps read the next scales)."""
    spec = BasisSpec(FB, 6, 8, (2.5, 2.5 * 2**0.5, 5.0), kernel_sizes=(7, 7, 11))
    conv = GroupRSTConv(2, 3, spec).to(F64)
    assert conv.scale_blocks(12, 10) == [(0, 2, 15, 13), (2, 3, 17, 15)]
    assert GroupRSTConv(2, 3, spec, scale_taps=2).scale_blocks(12, 12) == [(0, 3, 17, 17)]
    for size in ((12, 12), (12, 10)):
        x = torch.randn(2, 2, 8, 3, *size, dtype=F64, requires_grad=True)
        y = conv.forward_fft(x, bias=conv.bias)
        torch.testing.assert_close(
            y, conv._add_bias(conv.forward_direct(x)), rtol=1e-10, atol=1e-10
        )
        grad = torch.randn_like(y)
        fft_grads = torch.autograd.grad(y, (x, conv.weight), grad)
        ref = conv._add_bias(conv.forward_direct(x))
        ref_grads = torch.autograd.grad(ref, (x, conv.weight), grad)
        for got, want in zip(fft_grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("size", [4, 6, 8])
def test_group_fft_path_handles_maps_smaller_than_the_kernel(size):
    """A 15 x 15 kernel on a small map (the third layer of a model with a small input)."""
    conv = GroupRSTConv(2, 3, SPEC_BIG).to(F64)
    x = torch.randn(1, 2, 8, 3, size, size, dtype=F64)
    torch.testing.assert_close(conv.forward_fft(x), conv.forward_direct(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "method", [ConvMethod.AUTO, ConvMethod.DIRECT, ConvMethod.FFT, ConvMethod.BASIS]
)
def test_group_forward_dispatch_adds_bias(method):
    conv = GroupRSTConv(2, 3, SPEC, method=method).to(F64)
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(1, 2, 8, 2, 10, 10, dtype=F64)
    expected = conv.forward_direct(x) + conv.bias.view(1, -1, 1, 1, 1, 1)
    torch.testing.assert_close(conv(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method", [ConvMethod.AUTO, ConvMethod.DIRECT, ConvMethod.BASIS])
def test_lifting_forward_dispatch_adds_bias(method):
    conv = LiftingRSTConv(2, 3, SPEC, method=method).to(F64)
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(1, 2, 10, 10, dtype=F64)
    expected = conv.forward_direct(x) + conv.bias.view(1, -1, 1, 1, 1, 1)
    torch.testing.assert_close(conv(x), expected, rtol=1e-10, atol=1e-10)


def test_float64_cast_uses_the_exact_basis():
    conv = LiftingRSTConv(1, 1, SPEC).to(F64)
    assert conv.basis.dtype == F64
    assert torch.equal(conv.basis, torch.from_numpy(sample_basis(SPEC).copy()))


# ---------------------------------------------------------------- eval-mode filter caches


LAYERS: dict[str, Callable[[], nn.Module]] = {
    "lifting-direct": lambda: LiftingRSTConv(2, 3, SPEC, method=ConvMethod.DIRECT),
    "group-direct": lambda: GroupRSTConv(2, 3, SPEC, rotation_taps=2, method=ConvMethod.DIRECT),
    "group-fft": lambda: GroupRSTConv(2, 3, SPEC, rotation_taps=2, method=ConvMethod.FFT),
    "group-basis": lambda: GroupRSTConv(2, 3, SPEC, rotation_taps=2, method=ConvMethod.BASIS),
    "lifting-basis": lambda: LiftingRSTConv(2, 3, SPEC, method=ConvMethod.BASIS),
}


def layer_input(layer: nn.Module, batch: int = 2, dtype=torch.float32) -> torch.Tensor:
    if isinstance(layer, LiftingRSTConv):
        return torch.randn(batch, layer.in_channels, 12, 12, dtype=dtype)
    return torch.randn(batch, layer.in_channels, 8, 2, 12, 12, dtype=dtype)


def fresh_output(make: Callable[[], nn.Module], source: nn.Module, x: torch.Tensor):
    """The output of a newly built layer holding ``source``'s parameters (no cache)."""
    fresh = make().to(x.dtype)
    fresh.load_state_dict(source.state_dict())
    fresh.eval()
    with torch.no_grad():
        return fresh(x)


def infer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward without autograd: in eval mode this is what fills and reads the caches."""
    with torch.no_grad():
        return layer(x)


def cached_eval(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    layer.eval()
    return infer(layer, x)


@pytest.mark.parametrize("kind", LAYERS)
def test_cache_follows_in_place_edit_of_weight_data(kind):
    """``p.data.mul_()`` does not bump ``p._version``: the cache must notice anyway."""
    make = LAYERS[kind]
    layer = make().eval()
    x = layer_input(layer)
    before = infer(layer, x)
    layer.weight.data.mul_(-2.0)
    after = infer(layer, x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, fresh_output(make, layer, x))


@pytest.mark.parametrize("kind", LAYERS)
def test_cache_follows_in_place_edit_under_no_grad(kind):
    make = LAYERS[kind]
    layer = make().eval()
    x = layer_input(layer)
    before = infer(layer, x)
    with torch.no_grad():
        layer.weight.add_(torch.randn_like(layer.weight))
    after = infer(layer, x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, fresh_output(make, layer, x))


@pytest.mark.parametrize("kind", LAYERS)
def test_cache_follows_replaced_weight_data(kind):
    make = LAYERS[kind]
    layer = make().eval()
    x = layer_input(layer)
    before = infer(layer, x)
    layer.weight.data = torch.randn_like(layer.weight)
    after = infer(layer, x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, fresh_output(make, layer, x))


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("train_mode", [True, False], ids=["train-step", "eval-step"])
def test_cache_follows_an_optimiser_step(kind, train_mode):
    """Train-mode step then eval; or a step taken in eval mode (frozen batch norm)."""
    make = LAYERS[kind]
    layer = make().eval()
    x = layer_input(layer)
    before = infer(layer, x)
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    if train_mode:
        layer.train()
    with torch.enable_grad():
        layer(x).square().mean().backward()
    opt.step()
    after = cached_eval(layer, x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, fresh_output(make, layer, x))


@pytest.mark.parametrize("kind", LAYERS)
def test_load_state_dict_clears_cache(kind):
    make = LAYERS[kind]
    layer, other = make().eval(), make()
    x = layer_input(layer)
    before = infer(layer, x)
    layer.load_state_dict(other.state_dict())
    after = infer(layer, x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, cached_eval(other, x))


@pytest.mark.parametrize("kind", LAYERS)
def test_cache_follows_a_dtype_cast(kind):
    make = LAYERS[kind]
    layer = make().eval()
    x = layer_input(layer)
    infer(layer, x)
    layer.to(F64)
    out = infer(layer, x.to(F64))
    assert out.dtype == F64
    torch.testing.assert_close(out, fresh_output(make, layer, x.to(F64)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", LAYERS)
def test_cache_keeps_autocast_and_float32_entries_apart(kind):
    """A bfloat16-autocast call fills the cache with bfloat16 filters or spectra; a float32
    call after it must not read them (it raised a dtype error), nor the reverse."""
    make = LAYERS[kind]
    layer = make().eval()
    x = layer_input(layer)
    exact = infer(layer, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = infer(layer, x)
    again = infer(layer, x)
    assert again.dtype == torch.float32 and torch.equal(again, exact)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(infer(layer, x), half)
    fresh = make().eval()
    fresh.load_state_dict(layer.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(infer(fresh, x), half)  # the same as without a float32 entry


# ---------------------------------------------------------------- expanded weights


def test_expanded_filters_are_the_full_filters_cut_to_each_scale():
    """``expanded(s)``, what export.bake and the direct paths read, is ``filters()`` at
    scale s cut to that scale's kernel, for the lifting and the group layer (with taps)."""
    lift = LiftingRSTConv(2, 3, SPEC)
    group = GroupRSTConv(2, 3, SPEC, rotation_taps=2, scale_taps=2)
    k = SPEC.kernel_size
    for s, ks in enumerate(SPEC.kernel_sizes):
        w = slice((k - ks) // 2, (k - ks) // 2 + ks)
        full = lift.filters()[:, :, s, :, w, w]  # [Cout, R, Cin, ks, ks]
        torch.testing.assert_close(lift.expanded(s), full.transpose(0, 1))
        torch.testing.assert_close(lift.conv_weights()[s], full.flatten(0, 1))
        taps = group.filters()[:, :, s, :, :, w, w]  # [Cout, R, Cin, T, ks, ks]
        torch.testing.assert_close(group.expanded(s), taps.permute(1, 0, 3, 2, 4, 5))
        for t, weight in enumerate(group.conv_weights()[s]):  # [R*Cout, Cin, ks, ks]
            torch.testing.assert_close(weight, taps[:, :, :, t].transpose(0, 1).flatten(0, 1))


def test_static_form_and_auto_choice_read_one_cost_count():
    """One multiply-add count per scale (``form_costs``): the static form takes the smaller
    (DIRECT on a tie), the lifting layer's AUTO choice compares their sums over scales."""
    for cout in (1, 4, 64):
        lift = LiftingRSTConv(3, cout, SPEC)
        group = GroupRSTConv(3, cout, SPEC, rotation_taps=2)
        for layer in (lift, group):
            for s, ks in enumerate(SPEC.kernel_sizes):
                costs = layer.form_costs(s)
                cin = 3 * layer.taps
                assert costs[ConvMethod.DIRECT] == cin * cout * ks * ks
                assert costs[ConvMethod.BASIS] == cin * SPEC.num_funcs * (ks * ks + cout)
                cheaper = min(costs, key=lambda m: (costs[m], m is not ConvMethod.DIRECT))
                assert layer.static_form(s) is cheaper
        direct = sum(lift.form_costs(s)[ConvMethod.DIRECT] for s in range(SPEC.num_scales))
        basis = sum(lift.form_costs(s)[ConvMethod.BASIS] for s in range(SPEC.num_scales))
        assert lift.choose_method() is (ConvMethod.DIRECT if direct < basis else ConvMethod.BASIS)


# ---------------------------------------------------------------- max-pool gradient


def reference_pool(x: torch.Tensor, relu: bool) -> torch.Tensor:
    y = F.max_pool2d(x.flatten(0, -3), 2)
    y = F.relu(y) if relu else y
    return y.view(*x.shape[:-2], *y.shape[-2:])


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_max_pool_gradient_matches_max_pool2d(relu, ties):
    if ties:
        x = torch.randint(-2, 3, (2, 3, 4, 2, 6, 6)).to(F64)
    else:
        x = torch.randn(2, 3, 4, 2, 6, 6, dtype=F64)
    grad_out = torch.randn(2, 3, 4, 2, 3, 3, dtype=F64)
    grads = []
    for pool in (RSTMaxPool(relu=relu), lambda t: reference_pool(t, relu)):
        xi = x.clone().requires_grad_(True)
        y = pool(xi)
        (y * grad_out).sum().backward()
        grads.append((y.detach(), xi.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_unpooling_routes_each_gradient_to_its_window_position_exactly(dtype):
    """``_unpool_quads`` (byte masks multiplied as bytes) puts each pooled gradient where its
    code says, 0-3, and nowhere for code 4 (clamped by the ReLU), bit-exactly in every
    dtype, and ``_pooled_bias_grad`` sums the gradients whose code is below 4."""
    from rstmodel.layers.kernels import _pooled_bias_grad
    from rstmodel.layers.pooling import _unpool_quads

    torch.manual_seed(0)
    grad = torch.randn(3, 5, 2, 7).to(dtype)
    idx = torch.randint(0, 5, grad.shape, dtype=torch.uint8)
    quads = [torch.full_like(grad, float("nan")) for _ in range(4)]
    _unpool_quads(grad, idx, quads)
    for d, quad in enumerate(quads):
        assert quad.dtype == dtype
        assert torch.equal(quad, torch.where(idx == d, grad, torch.zeros_like(grad)))
    expected = torch.where(idx < 4, grad, torch.zeros_like(grad)).double().sum(dim=(0, 1, 2))
    got = _pooled_bias_grad(grad, idx, torch.float64)
    tol = 0.05 if dtype is torch.bfloat16 else 1e-6
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["spatial-major", "sliced", "expanded"])
def test_max_pool_gradient_in_any_memory_layout(layout):
    base = torch.randn(1, 2, 4, 2, 6, 12, dtype=F64, requires_grad=True)
    views = {
        "spatial-major": lambda t: spatial_major(t),
        "sliced": lambda t: t[..., ::2],  # strided view with gaps
        "expanded": lambda t: t[..., :6].expand(3, -1, -1, -1, -1, -1),  # stride 0 on B
    }
    grad_out = None
    grads = []
    for pool in (RSTMaxPool(relu=True), lambda t: reference_pool(t, True)):
        base.grad = None
        y = pool(views[layout](base))
        grad_out = torch.randn_like(y) if grad_out is None else grad_out
        (y * grad_out).sum().backward()
        grads.append((y.detach(), base.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=1e-12)


def test_max_pool_passes_gradcheck():
    x = (torch.randn(1, 2, 2, 1, 4, 4, dtype=F64) + 0.3).requires_grad_(True)
    assert torch.autograd.gradcheck(RSTMaxPool(relu=True), (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 8, 2, 7, 8), (1, 1, 8, 2, 8, 5)])
def test_max_pool_refuses_odd_sizes(shape):
    with pytest.raises(ValueError, match="even"):
        RSTMaxPool()(torch.zeros(shape))


# ---------------------------------------------------------------- input validation


@pytest.mark.parametrize(
    "shape",
    [(2, 2, 8, 4, 10, 10), (2, 3, 4, 4, 10, 10), (2, 3, 8, 2, 10, 10), (2, 3, 8, 10, 10)],
    ids=["channels", "rotations", "scales", "5d"],
)
def test_group_conv_rejects_wrong_shapes(shape):
    spec = BasisSpec(FB, 6, 8, tuple(2.5 * 2 ** (s / 2) for s in range(4)))
    conv = GroupRSTConv(3, 2, spec)
    with pytest.raises(ValueError) as info:
        conv(torch.zeros(shape))
    assert "[B, 3, 8, 4, H, W]" in str(info.value)


@pytest.mark.parametrize("shape", [(2, 2, 10, 10), (2, 3, 10), (2, 3, 8, 1, 10, 10)])
def test_lifting_rejects_wrong_shapes(shape):
    conv = LiftingRSTConv(3, 2, SPEC)
    with pytest.raises(ValueError) as info:
        conv(torch.zeros(shape))
    assert "[B, 3, H, W]" in str(info.value)


def test_norm_and_pool_reject_wrong_shapes():
    with pytest.raises(ValueError, match=r"\[B, 3, R, S, H, W\]"):
        RSTBatchNorm(3)(torch.zeros(2, 2, 8, 2, 4, 4))
    with pytest.raises(ValueError, match=r"\[B, 3, R, S, H, W\]"):
        RSTBatchNorm(3)(torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match=r"\[B, C, R, S, H, W\]"):
        GroupMaxPool()(torch.zeros(2, 3, 4, 4))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rotation_taps=3),  # does not divide Nr = 8 on the coarse grid
        dict(rotation_taps=0),
        dict(rotation_taps=9, tap_mode="adjacent"),
        dict(scale_taps=3),  # > Ns = 2
        dict(scale_taps=0),
        dict(method="winograd"),
        dict(tap_mode="diagonal"),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_group_conv_rejects_invalid_configs(kwargs):
    with pytest.raises(ValueError):
        GroupRSTConv(2, 3, SPEC, **kwargs)


def test_group_conv_accepts_adjacent_taps_that_do_not_divide():
    conv = GroupRSTConv(2, 3, SPEC, rotation_taps=3, tap_mode="adjacent")
    assert conv.rot_index[:, 0].tolist() == [0, 1, 2]
    coarse = GroupRSTConv(2, 3, SPEC, rotation_taps=4)
    assert coarse.rot_index[:, 0].tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("cls", [LiftingRSTConv, GroupRSTConv])
def test_convs_reject_empty_channels(cls):
    with pytest.raises(ValueError):
        cls(0, 3, SPEC)
    with pytest.raises(ValueError):
        cls(2, 0, SPEC)


# ---------------------------------------------------------------- TUNED: timed path choice

_PATH_OF = {
    "forward_direct": ConvMethod.DIRECT,
    "forward_basis": ConvMethod.BASIS,
    "forward_fft": ConvMethod.FFT,
}


def test_tuned_conv_times_each_path_once_per_input_shape(monkeypatch):
    fake = {ConvMethod.DIRECT: 3.0, ConvMethod.BASIS: 1.0, ConvMethod.FFT: 2.0}
    timed: list[ConvMethod] = []

    def fake_time(path, x):
        timed.append(_PATH_OF[path.__name__])
        return fake[timed[-1]]

    monkeypatch.setattr(conv_module, "_time_path", fake_time)
    conv = GroupRSTConv(3, 4, SPEC, method="tuned").to(F64).eval()
    x = torch.randn(2, 3, 8, 2, 10, 10, dtype=F64)
    with torch.no_grad():
        y = conv(x)
        assert sorted(timed) == sorted(fake)  # every path, once
        assert conv(x).equal(y) and len(timed) == 3  # remembered for this shape
        conv(x[:1])
    assert len(timed) == 6 and set(conv._tuned.values()) == {ConvMethod.BASIS}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        conv(x)  # under autocast: timed again, kept apart from the plain calls
        conv(x)
    assert len(timed) == 9 and len(conv._tuned) == 3
    from rstmodel.precision import inference, int8_supported

    if int8_supported():  # int8 products: timed again, apart from bfloat16 autocast alone
        with inference("int8"):
            conv(x)
            conv(x)
        assert len(timed) == 12 and len(conv._tuned) == 4
    count = len(timed)
    expected = conv.forward_direct(x) + conv.bias.view(1, -1, 1, 1, 1, 1)
    assert rel(y, expected) < 1e-10  # the basis path's result
    # training never times: it takes AUTO's choice
    conv.train()
    conv(x)
    assert len(timed) == count

    fake[ConvMethod.FFT] = 0.5
    lift = LiftingRSTConv(1, 3, SPEC, method=ConvMethod.TUNED).eval()
    timed.clear()
    lift(torch.randn(1, 1, 12, 12))
    assert sorted(timed) == sorted([ConvMethod.DIRECT, ConvMethod.BASIS])  # lifting: no FFT
    assert list(lift._tuned.values()) == [ConvMethod.BASIS]


def test_tuned_model_matches_auto_with_real_timing():
    torch.manual_seed(0)
    auto = rstmodel.create_model("rst_cnn_fb", channels=(3, 4, 5)).eval()
    tuned = rstmodel.create_model("rst_cnn_fb", channels=(3, 4, 5), method="tuned").eval()
    tuned.load_state_dict(auto.state_dict())
    x = torch.randn(2, 1, 56, 56)
    with torch.no_grad():
        y_auto, y_tuned = auto(x), tuned(x)
    assert (y_tuned - y_auto).abs().max() < 1e-4 * y_auto.abs().max()
    convs = [m for m in tuned.modules() if isinstance(m, (LiftingRSTConv, GroupRSTConv))]
    assert all(len(m._tuned) == 1 for m in convs)


@pytest.mark.parametrize("grads", ["all", "inputs", "filters"])
def test_gauss_product_equals_the_complex_product_with_gradients(grads):
    x = torch.randn(5, 3, 4, dtype=torch.complex128)
    g = torch.randn(5, 4, 6, dtype=torch.complex128)
    parts = [x.real, x.imag, g.real, g.imag - g.real, g.real + g.imag]
    parts = [
        p.clone().requires_grad_(grads == "all" or (grads == "inputs") == (i < 2))
        for i, p in enumerate(parts)
    ]
    y_re, y_im = kernels_module._GaussProduct.apply(*parts)
    torch.testing.assert_close(torch.complex(y_re, y_im), x @ g, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *p: kernels_module._GaussProduct.apply(*p), parts, eps=1e-6, atol=1e-8
    )
    # the bias enters the first dc_rows rows' real part, dc_scale times
    bias = torch.randn(6, dtype=F64, requires_grad=grads == "all")
    y_re, y_im = kernels_module._GaussProduct.apply(*parts, bias, 2, 9.0)
    expected = (x @ g).clone()
    expected[:2] += 9.0 * bias.detach()
    torch.testing.assert_close(torch.complex(y_re, y_im), expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *p: kernels_module._GaussProduct.apply(*p, 2, 9.0),
        [*parts, bias],
        eps=1e-6,
        atol=1e-8,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sign", [1, -1])
def test_plus_product_is_baddbmm(dtype, sign):
    """``_plus_product`` (a product, then a pass that adds, for float32/float64; baddbmm for
    reduced precision) equals ``base + sign * a @ b``, returned and written into ``out``."""
    torch.manual_seed(0)
    base, a, b = torch.randn(3, 5, 7), torch.randn(3, 5, 4), torch.randn(3, 4, 7)
    expected = base.double() + sign * a.double() @ b.double()
    base, a, b = base.to(dtype), a.to(dtype), b.to(dtype)
    tol = {"rtol": 2e-2, "atol": 5e-2} if dtype is torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    y = kernels_module._plus_product(base, a, b, sign)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), expected, **tol)
    out = torch.empty(2, 3, 5, 7, dtype=dtype)
    returned = kernels_module._plus_product(base, a, b.mT.contiguous().mT, sign, out=out[1])
    assert returned.data_ptr() == out[1].data_ptr()
    torch.testing.assert_close(out[1].double(), expected, **tol)


@pytest.mark.parametrize("dims", [(6, 6, 9, 9), (5, 7, 8, 11)], ids=["square", "rect"])
def test_real_dft_pair_equals_torch_fft_with_gradients(dims):
    """``_RealDFT2`` is rfft2 of the zero-padded maps and ``_InverseRealDFT2`` the first H x W
    outputs of irfft2; their hand-written backwards pass gradcheck."""
    h, w, nh, nw = dims
    fw, m = nw // 2 + 1, 3
    x = torch.randn(h, w, m, dtype=F64, requires_grad=True)
    x_re, x_im = kernels_module._RealDFT2.apply(x.view(h, w * m), dims)
    padded = torch.zeros(nh, nw, m, dtype=F64)
    padded[:h, :w] = x.detach()
    spectrum = torch.fft.rfft2(padded, dim=(0, 1))
    torch.testing.assert_close(torch.complex(x_re, x_im), spectrum, rtol=1e-10, atol=1e-10)
    y = torch.randn(nh, fw, m, dtype=torch.complex128)
    y[0, 0].imag = 0  # a Hermitian half spectrum: DC (and Nyquist) real
    if nw % 2 == 0:
        y[:, -1].imag = 0
    y_re = y.real.reshape(nh, fw * m).clone().requires_grad_(True)
    y_im = y.imag.reshape(nh, fw * m).clone().requires_grad_(True)
    got = kernels_module._InverseRealDFT2.apply(torch.stack([y_re, y_im]), dims)
    expected = torch.fft.irfft2(y, s=(nh, nw), dim=(0, 1))[:h, :w]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(
        lambda t: kernels_module._RealDFT2.apply(t, dims), [x.view(h, w * m)], eps=1e-6, atol=1e-8
    )
    assert torch.autograd.gradcheck(
        lambda a, b: kernels_module._InverseRealDFT2.apply(torch.stack([a, b]), dims),
        [y_re, y_im],
        eps=1e-6,
        atol=1e-8,
    )


def test_fft_path_adds_the_bias_at_frequency_zero_with_gradients():
    conv = GroupRSTConv(3, 4, SPEC3, method="fft").to(F64)
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 3, 8, 3, 12, 12, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 4, 8, 3, 12, 12, dtype=F64)
    results = []
    for path in ("direct", "fft"):
        x.grad = conv.weight.grad = conv.bias.grad = None
        if path == "fft":
            y = conv.forward_fft(x, bias=conv.bias)
        else:
            y = conv.forward_direct(x) + conv.bias.view(-1, 1, 1, 1, 1)
        (y * grad_out).sum().backward()
        results.append((y.detach(), x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad))
    for ref, got in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("chunk_rows", [None, 1, 4 * 2 * 32])
def test_lifting_conv_fused_with_pooling_equals_conv_then_pool_with_gradients(
    relu, chunk_rows, monkeypatch
):
    """Also in chunks of one window per pair of rows, and of four with a remainder of two
    (``MIX_CHUNK_ROWS``; here M = R S B = 32 rows per pixel, six windows per pair)."""
    from rstmodel.layers import kernels

    if chunk_rows is not None:
        monkeypatch.setattr(kernels, "MIX_CHUNK_ROWS", chunk_rows)
    assert kernels._column_pairs(12, 32) == {None: 6, 1: 1, 256: 4}[chunk_rows]
    conv = LiftingRSTConv(2, 3, SPEC, method="basis").to(F64)
    with torch.no_grad():
        conv.bias.normal_()
    assert conv.pools_fused()
    x = torch.randn(2, 2, 12, 12, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 3, 8, 2, 6, 6, dtype=F64)
    results = []
    for fused in (False, True):
        x.grad = conv.weight.grad = conv.bias.grad = None
        y = conv.forward_pooled(x, relu=relu) if fused else RSTMaxPool(relu=relu)(conv(x))
        (y * grad_out).sum().backward()
        results.append((y.detach(), x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad))
    for plain, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="even spatial sizes"):
        conv.forward_pooled(torch.randn(1, 2, 11, 12, dtype=F64), relu=relu)
    with pytest.raises(ValueError, match=r"\[B, 2, H, W\]"):
        conv.forward_pooled(torch.randn(1, 3, 12, 12, dtype=F64), relu=relu)


def test_lifting_conv_fused_without_grad_keeps_no_argmax_and_gives_the_same_map(monkeypatch):
    """Under no_grad the weights still require grad (so autograd's needs_input_grad says
    yes), but no backward can come: the fused pool must not compute or keep the argmax."""
    import rstmodel.layers.conv as conv_module
    from rstmodel.layers import kernels

    conv = LiftingRSTConv(2, 3, SPEC, method="basis").to(F64)
    x = torch.randn(2, 2, 12, 12, dtype=F64)
    with_grad = conv.forward_pooled(x, relu=True).detach()
    asked, original = [], kernels._pooled_mix_rows

    def rows(resp, a, bias, relu, w, argmax):
        asked.append(argmax)
        return original(resp, a, bias, relu, w, argmax)

    monkeypatch.setattr(conv_module, "_pooled_mix_rows", rows, raising=False)
    monkeypatch.setattr(kernels, "_pooled_mix_rows", rows)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            torch.testing.assert_close(conv.forward_pooled(x, relu=True), with_grad)
    assert asked == [False, False]


def test_rst_cnn_runs_the_lifting_block_fused_and_equal_to_the_plain_sequence():
    model = rstmodel.create_model("rst_cnn_fb", channels=(16, 4, 5)).to(F64).train()
    block = model.blocks[0]
    assert block[0].pools_fused()
    x = torch.randn(2, 1, 56, 56, dtype=F64)
    torch.testing.assert_close(block(x), nn.Sequential.forward(block, x), rtol=1e-10, atol=1e-10)
    assert not rstmodel.create_model("rst_cnn_fb", method="direct").blocks[0][0].pools_fused()


def test_fused_lifting_block_trains_under_bfloat16_autocast():
    torch.manual_seed(0)
    model = rstmodel.create_model("rst_cnn_fb", channels=(16, 4, 5)).train()
    block, x = model.blocks[0], torch.randn(2, 1, 56, 56)
    assert block[0].pools_fused()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, plain = block(x), nn.Sequential.forward(block, x)
        loss = model(x).float().square().mean()
    torch.testing.assert_close(fused.float(), plain.float(), rtol=0, atol=0)
    loss.backward()
    conv = block[0]
    for grad in (conv.weight.grad, conv.bias.grad):
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_fft_path_takes_the_joined_product_for_one_image_and_both_forms_agree():
    """One image (4 rows per frequency with its quarter turns) takes the four-products-in-
    one form, two images the Gauss form: the same values and gradients as the direct path,
    bias included."""
    conv = GroupRSTConv(3, 4, SPEC3).to(F64)
    with torch.no_grad():
        conv.bias.normal_()
    for batch in (1, 2):
        x = torch.randn(batch, 3, 8, 3, 10, 10, dtype=F64, requires_grad=True)
        y = conv.forward_fft(x, bias=conv.bias)
        ref = conv._add_bias(conv.forward_direct(x))
        torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
        grad = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, conv.weight, conv.bias), grad)
        want = torch.autograd.grad(ref, (x, conv.weight, conv.bias), grad)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    conv.eval()
    for batch, joined in ((1, True), (2, False)):
        conv._cache.clear()
        with torch.no_grad():
            conv.forward_fft(torch.randn(batch, 3, 8, 3, 10, 10, dtype=F64))
        assert conv._cache and all(k.startswith("fftj") == joined for k in conv._cache)


@pytest.mark.parametrize("size", [(10, 10), (10, 14)])
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("batch,cin", [(2, 3), (8, 4)])
def test_group_conv_pooled_in_its_own_rows_is_the_conv_then_the_pool(size, dtype, batch, cin):
    """The FFT path pooled before its scatter (``forward_pooled``: each block of scales
    pooled where its maps are turned back by quarter turns; non-square maps have no quarter
    turns) gives exactly the unfused conv, then ``RSTMaxPool``: max and the ReLU commute
    with the rows' order, and a 2x2 window of an even-sided map turns into one. Rows of
    B Cin and B Cout of 32 values (batch 8) take, in bfloat16 on an AVX512-BF16 CPU, the
    compiled gathered DFT and the pooled GEMM that scatters as it writes."""
    torch.manual_seed(0)
    conv = GroupRSTConv(cin, 4, SPEC3, method=ConvMethod.FFT).to(F64).eval()
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(batch, cin, 8, 3, *size, dtype=F64)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with torch.no_grad(), ctx:
        assert conv.pools_fused(x)
        for relu in (True, False):
            fused = conv.forward_pooled(x, relu=relu)
            plain = RSTMaxPool(relu=relu)(conv(x))
            assert fused.shape == (batch, 4, 8, 3, size[0] // 2, size[1] // 2)
            assert torch.equal(fused, plain)


def test_group_conv_pools_fused_only_without_gradient_on_the_fft_path():
    conv = GroupRSTConv(3, 4, SPEC3, method=ConvMethod.FFT)
    x = torch.randn(1, 3, 8, 3, 10, 10)
    assert not conv.pools_fused(x)  # the weights want their gradient
    with torch.no_grad():
        assert conv.pools_fused(x)
        assert not conv.pools_fused(torch.randn(1, 3, 8, 3, 10, 11))  # odd side
        assert not GroupRSTConv(3, 4, SPEC3, method=ConvMethod.DIRECT).pools_fused(x)
    block = rstmodel.create_model("rst_cnn_fb", channels=(16, 6, 8)).eval().blocks[1]
    h = torch.randn(2, 16, 8, 4, 28, 28)
    with torch.no_grad():
        assert block[0].pools_fused(h)
        torch.testing.assert_close(block(h), nn.Sequential.forward(block, h), rtol=0, atol=0)


def test_a_hooked_conv_runs_unfused_so_its_hooks_see_it():
    """Forward hooks on a block's conv see its call and its full-resolution output; without
    hooks the block takes the fused pool, with the same values."""
    block = rstmodel.create_model("rst_cnn_fb", channels=(16, 6, 8)).eval().blocks[1]
    h = torch.randn(1, 16, 8, 4, 28, 28)
    seen = []
    with torch.no_grad():
        fused = block(h)
        handle = block[0].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
        hooked = block(h)
        handle.remove()
    assert seen == [torch.Size([1, 6, 8, 4, 28, 28])]
    torch.testing.assert_close(hooked, fused, rtol=0, atol=0)
