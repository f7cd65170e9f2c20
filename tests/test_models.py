"""Registered models: registry, sizes, forward/backward, 90-degree invariance, export."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rstcnn.export.bake import bake
from rstmodel import create_model, list_models, register_model
from rstmodel.models import registry

F64 = torch.float64
PAPER_MODELS = {
    "cnn",
    "rst_cnn_fb",
    "rst_cnn_sl",
    "rst_cnn_plus_fb",
    "rst_cnn_plus_sl",
    "rot_cnn",
    "rdcf_plus",
    "scale_cnn",
    "sesn",
    "sfcnn",
    "sfcnn_plus",
    "sevf",
    "resnet16",
    "rst_resnet16",
}
# Nr divisible by 4: logits must not move under torch.rot90 of the input.
ROTATION_INVARIANT = [
    "rst_cnn_fb",
    "rst_cnn_sl",
    "rst_cnn_plus_fb",
    "rst_cnn_plus_sl",
    "rst_cnn_fb_ref",
    "rst_cnn_fb_nr4",
    "rot_cnn",
    "rdcf_plus",
    "rst_resnet16",
    "sfcnn",
]


@functools.cache
def default_config(name: str):
    with torch.random.fork_rng():  # building must not shift the test's random stream
        return create_model(name).config


def small(name: str, **extra) -> dict:
    """Overrides that shrink a model's channels (the structure stays the paper's)."""
    fields = {f.name for f in dataclasses.fields(default_config(name))}
    if "channels" in fields:
        extra.setdefault("channels", (4, 6, 8))
    if "widths" in fields:
        extra.setdefault("widths", (4, 8, 8))
    return extra


def images(model: nn.Module, batch: int, dtype=torch.float32) -> torch.Tensor:
    cfg = model.config
    return torch.randn(batch, cfg.in_channels, cfg.input_size, cfg.input_size, dtype=dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def settle_batch_norm(model: nn.Module, x: torch.Tensor) -> None:
    """Two train-mode forwards move the running statistics off their initial values."""
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(x)
    model.eval()


# ---------------------------------------------------------------- registry


def test_list_models_holds_the_paper_models():
    names = list_models()
    assert set(names) >= PAPER_MODELS
    assert names == sorted(names)


def test_duplicate_registration_raises():
    def cnn(**overrides):
        return nn.Identity()

    with pytest.raises(ValueError, match="already registered"):
        register_model(cnn)
    assert type(create_model("cnn")).__name__ == "CNN"


def test_register_and_create_a_new_model(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    def tiny_test_model(**overrides):
        """A one-layer model."""
        return nn.Linear(overrides.get("width", 2), 1)

    register_model(tiny_test_model)
    assert "tiny_test_model" in list_models()
    assert create_model("tiny_test_model", width=5).in_features == 5


def test_unknown_model_lists_the_available_names():
    with pytest.raises(ValueError) as info:
        create_model("rst_cnn_nonexistent")
    message = str(info.value)
    assert "rst_cnn_nonexistent" in message
    for name in list_models():
        assert name in message


def test_overrides_reach_the_config():
    model = create_model("rst_cnn_fb", channels=(4, 6, 8), rotations=4, num_scales=2)
    assert model.config.channels == (4, 6, 8)
    assert (model.spec.rotations, model.spec.num_scales) == (4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.config.rotations = 8


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "name,target,tol",
    [
        ("cnn", 495_000, 0.02),
        ("rst_cnn_fb", 500_000, 0.05),
        ("rst_cnn_sl", 500_000, 0.05),
        ("rst_cnn_fb_ref", 500_000, 0.05),
        ("rst_cnn_fb_nr4", 500_000, 0.05),
        ("rot_cnn", 500_000, 0.05),
        ("scale_cnn", 500_000, 0.05),
        ("rst_cnn_plus_fb", 1_600_000, 0.05),
        ("rst_cnn_plus_sl", 1_600_000, 0.05),
        ("rdcf_plus", 1_600_000, 0.05),
        ("sesn", 500_000, 0.05),
        ("sfcnn", 500_000, 0.05),
        ("sfcnn_plus", 1_600_000, 0.05),
        ("sevf", 500_000, 0.05),
    ],
)
def test_parameter_counts_match_the_paper(name, target, tol):
    model = default_model(name)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert abs(count - target) <= tol * target, count


@functools.cache
def default_model(name: str) -> nn.Module:
    """A registered model at its defaults, built once for the tests that only read it (the
    e2cnn peers take ~20 s each to build)."""
    return create_model(name)


@pytest.mark.parametrize("name", list_models())
def test_every_default_model_builds(name):
    model = default_model(name)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert dataclasses.is_dataclass(model.config)


# ---------------------------------------------------------------- forward / backward


@pytest.mark.parametrize("name", list_models())
def test_every_model_runs_forward_and_backward(name):
    model = create_model(name, **small(name))
    x = images(model, 1)
    model.eval()  # batch 1: BatchNorm1d needs eval mode
    logits = model(x)
    assert logits.shape == (1, model.config.num_classes)
    assert torch.isfinite(logits).all()
    logits.square().sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", list_models())
def test_every_model_takes_a_training_step(name):
    model = create_model(name, **small(name, input_size=32))
    x = images(model, 2)
    target = torch.tensor([1, 3])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    F.cross_entropy(model(x), target).backward()
    opt.step()
    moved = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert moved == len(before)


@pytest.mark.parametrize("method", ["direct", "fft", "auto"])
def test_small_inputs_run_with_every_conv_method(method):
    """A valid config (input 16: the third layer sees 4x4 maps under 15x15 kernels)."""
    model = create_model("rst_cnn_fb", input_size=16, channels=(4, 6, 8), method=method)
    reference = create_model("rst_cnn_fb", input_size=16, channels=(4, 6, 8), method="direct")
    reference.load_state_dict(model.state_dict())
    model, reference = model.to(F64).eval(), reference.to(F64).eval()
    x = images(model, 2, F64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- invariance / equivariance


@pytest.mark.parametrize("name", ROTATION_INVARIANT)
def test_logits_and_features_are_exact_under_quarter_turns(name):
    """32 px input: every pooled map stays even (32, 16, 8), as at the real sizes."""
    model = create_model(name, **small(name, input_size=32)).to(F64)
    x = images(model, 2, F64)
    settle_batch_norm(model, x)
    with torch.no_grad():
        logits = model(x)
        feats = model.forward_features(x)
        rotations = feats.shape[2]
        assert rotations % 4 == 0
        for k in (1, 2, 3):
            xk = torch.rot90(x, k, (-2, -1))
            assert rel(model(xk), logits) < 1e-9, k
            expected = torch.roll(torch.rot90(feats, k, (-2, -1)), k * rotations // 4, dims=2)
            assert rel(model.forward_features(xk), expected) < 1e-9, k
        # control: the features do move (the invariance is not a constant map)
        assert rel(model.forward_features(torch.rot90(x, 1, (-2, -1))), feats) > 1e-2


@pytest.mark.parametrize("name", ["rst_cnn_fb", "rst_cnn_plus_sl"])
def test_logits_are_invariant_at_the_real_input_size(name):
    """56 px: the maps are 56, 28, 14 and an odd 7 x 7 before the group max-pool."""
    model = create_model(name, **small(name)).to(F64)
    x = images(model, 2, F64)
    settle_batch_norm(model, x)
    with torch.no_grad():
        logits = model(x)
        for k in (1, 3):
            assert rel(model(torch.rot90(x, k, (-2, -1))), logits) < 1e-9, k


@pytest.mark.parametrize("name", ["cnn", "scale_cnn"])
def test_models_without_rotation_grid_are_not_invariant(name):
    """Control for the test above: the same check fails where it should."""
    model = create_model(name, **small(name, input_size=32)).to(F64)
    x = images(model, 2, F64)
    settle_batch_norm(model, x)
    with torch.no_grad():
        assert rel(model(torch.rot90(x, 1, (-2, -1))), model(x)) > 1e-3


# ---------------------------------------------------------------- export


def no_rstmodel_modules(module: nn.Module) -> bool:
    return all(not type(m).__module__.startswith("rstmodel") for m in module.modules())


@pytest.mark.parametrize("name", list_models())
def test_export_matches_eval_forward_after_training(name):
    model = create_model(name, **small(name, input_size=32))
    x = images(model, 4)
    target = torch.tensor([0, 1, 2, 3])
    model.eval()
    with torch.no_grad():
        model(x)  # fills the eval caches that training must invalidate
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), target).backward()
        opt.step()
    exported = bake(model)
    assert model.training  # export leaves the source alone
    assert no_rstmodel_modules(exported)
    model.eval()
    with torch.no_grad():
        expected = model(x)
        got = exported(x)
    # relative: a few BN updates leave eval-mode logits of very different magnitudes
    assert rel(got, expected) < 1e-5


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("rst_cnn_fb", dict(rotations=0)),
        ("rst_cnn_fb", dict(num_funcs=13)),  # aliases at the 2.5 px smallest scale
        ("rst_cnn_sl", dict(num_funcs=9)),
        ("rst_cnn_fb", dict(kernel_sizes=(5, 7, 11, 14))),
        ("rst_cnn_fb", dict(scale_ratio=0.9)),  # scales not ascending
        ("rst_cnn_fb", dict(num_scales=0)),
        ("rst_cnn_fb", dict(channels=(4, 0, 8))),
        ("rst_cnn_fb", dict(input_size=60)),  # not divisible by 2**3
        ("rst_cnn_fb", dict(dropout=1.0)),
        ("rst_cnn_plus_fb", dict(rotation_taps=3)),  # does not divide Nr = 8
        ("rst_cnn_fb", dict(scale_taps=5)),  # > Ns = 4
        ("cnn", dict(kernel_size=6)),
        ("cnn", dict(input_size=50)),
        ("resnet16", dict(widths=(8, 8))),
        ("rst_resnet16", dict(input_size=98)),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_invalid_configs_raise(name, overrides):
    with pytest.raises(ValueError):
        create_model(name, **overrides)


def test_aliasing_message_says_what_to_change():
    with pytest.raises(ValueError, match="num_funcs"):
        create_model("rst_cnn_fb", num_funcs=13)


@pytest.mark.parametrize("name", ["cnn", "rst_cnn_fb"])
@pytest.mark.parametrize("shape", [(1, 3, 56, 56), (1, 1, 28, 28), (1, 56, 56), (1, 1, 56, 48)])
def test_wrong_input_shape_raises(name, shape):
    model = create_model(name, **small(name))
    with pytest.raises(ValueError) as info:
        model(torch.zeros(shape))
    assert "[B, 1, 56, 56]" in str(info.value)


@pytest.mark.parametrize("name", ["resnet16", "rst_resnet16"])
def test_resnet_wrong_input_shape_raises(name):
    model = create_model(name, **small(name))
    with pytest.raises(ValueError) as info:
        model(torch.zeros(1, 1, 96, 96))
    assert "[B, 3, 96, 96]" in str(info.value)


@pytest.mark.parametrize("name", ["rst_cnn_fb", "rst_resnet16"])
def test_forward_features_checks_its_input(name):
    model = create_model(name, **small(name))
    with pytest.raises(ValueError, match=r"\[B, "):
        model.forward_features(torch.zeros(1, 2, 32, 32))


def test_the_steerable_peers_name_their_extra_when_e2cnn_is_missing(monkeypatch):
    """Without the peers extra, creating sfcnn says what to install (the rest still works)."""
    import builtins

    real_import = builtins.__import__

    def no_e2cnn(name, *args, **kwargs):
        if name.split(".")[0] == "e2cnn":
            raise ImportError("No module named 'e2cnn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_e2cnn)
    monkeypatch.setattr(
        "importlib.import_module",
        lambda name, *a: no_e2cnn(name) if name == "e2cnn" else real_import(name),
    )
    with pytest.raises(ImportError, match=r"pip install 'rstcnn\[peers\]'"):
        create_model("sfcnn")
    assert create_model("cnn") is not None


def test_sfcnn_plain_copy_gives_the_same_logits():
    """plain() (e2cnn's own export of each layer, our group max-pool, the head): what the
    exporter bakes."""
    model = create_model("sfcnn", channels=(3, 4, 5), input_size=32)
    x = images(model, 2)
    settle_batch_norm(model, x)
    with torch.no_grad():
        torch.testing.assert_close(model.plain()(x), model(x), rtol=1e-5, atol=1e-5)
    assert all(
        type(m).__module__.split(".")[0] in {"torch", "rstmodel"} for m in model.plain().modules()
    )


def test_summary_describes_the_rst_models_and_the_e2cnn_peers():
    from rstmodel.summary import describe

    assert describe("rst_cnn_fb")["group"] == "Nr=8 Ns=4"
    row = describe("sfcnn")
    assert row["group"] == "C8 regular" and row["params"] == "509,992" and row["kernels"] == "7"


def test_sevf_carries_the_scale_of_the_largest_response_as_a_direction():
    """ScaleVectorField: per channel and pixel the largest response over the scales is the
    magnitude, and its scale s the direction pi s / (Ns - 1); the 2x2 max-pool keeps the
    scale of the pixel it keeps."""
    from rstmodel.models.sevf import ScaleVectorField

    layer = ScaleVectorField(1, 4).eval()  # batch norm at its initial statistics: identity
    y = torch.zeros(1, 1, 1, 4, 2, 2)
    y[0, 0, 0, 2, 0, 1] = 5.0  # the pooled window's maximum: scale 2
    y[0, 0, 0, 3, 1, 0] = 3.0
    with torch.no_grad():
        out = layer(y)
    assert out.shape == (1, 2, 1, 1)
    angle = math.pi * 2 / 3
    eps = layer.norm.eps
    expected = 5.0 / math.sqrt(1 + eps) * torch.tensor([math.cos(angle), math.sin(angle)])
    torch.testing.assert_close(out.flatten(), expected.float())
    last = ScaleVectorField(1, 4, last=True).eval()
    with torch.no_grad():
        assert last(y).shape == (1, 1, 1, 1)
