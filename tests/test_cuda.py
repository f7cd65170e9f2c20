"""The same checks on a CUDA device: they run where a GPU is (the project's GPU machine
runs them with ``python -m pytest tests/test_cuda.py``) and are skipped elsewhere."""

import math

import pytest
import torch

import rstmodel
from rstcnn.export.bake import bake
from rstmodel.basis import BasisSpec
from rstmodel.group import RSTElement, act_on_features, act_on_image
from rstmodel.layers import GroupRSTConv, LiftingRSTConv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPEC = BasisSpec("fb", 12, 8, tuple(2.5 * 3 ** (s / 3) for s in range(4)))


@pytest.fixture
def device():
    # TF32 convolutions (cuDNN's default) round to ~1e-3: compare in full float32
    torch.manual_seed(0)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield torch.device("cuda")
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_fast_paths_match_reference_on_cuda(device):
    lift = LiftingRSTConv(2, 5, SPEC).to(device, torch.float64)
    conv = GroupRSTConv(5, 6, SPEC, rotation_taps=2, scale_taps=2).to(device, torch.float64)
    x = torch.randn(3, 2, 20, 20, device=device, dtype=torch.float64)
    y = lift.forward_direct(x)
    assert torch.allclose(lift.forward_basis(x), y, atol=1e-10)
    z = conv.forward_direct(y)
    assert torch.allclose(conv.forward_fft(y), z, atol=1e-9)
    assert torch.allclose(conv.forward_basis(y), z, atol=1e-9)


def test_quarter_turn_equivariance_on_cuda(device):
    lift = LiftingRSTConv(1, 4, SPEC).to(device, torch.float64)
    conv = GroupRSTConv(4, 3, SPEC, rotation_taps=4).to(device, torch.float64)
    x = torch.randn(2, 1, 16, 16, device=device, dtype=torch.float64)
    g = RSTElement(math.pi / 2)
    out = conv(lift(act_on_image(x, g)))
    expected = act_on_features(conv(lift(x)), g, scale_step=SPEC.scale_step)
    assert (out - expected).abs().max() < 1e-10 * expected.abs().max()


@pytest.mark.parametrize("name", ["rst_cnn_fb", "rst_cnn_plus_sl", "rst_resnet16"])
def test_models_train_step_and_export_on_cuda(device, name):
    small = {"widths": (8, 8, 16)} if "resnet" in name else {"channels": (6, 8, 10)}
    model = rstmodel.create_model(name, **small).to(device)
    cfg = model.config
    x = torch.randn(4, cfg.in_channels, cfg.input_size, cfg.input_size, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), torch.arange(4, device=device)).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        logits = model(x)
        scale = logits.abs().max()
        assert (bake(model)(x) - logits).abs().max() < 1e-5 * scale
        turned = model(torch.rot90(x, 1, dims=(-2, -1)))
        assert (turned - logits).abs().max() < 1e-5 * scale


def test_tuned_method_and_bf16_autocast_on_cuda(device):
    """ConvMethod.TUNED times each layer's forms on CUDA and keeps the fastest: the same
    function as the automatic choice; bfloat16 autocast (train/run.py --bf16) stays close."""
    torch.manual_seed(0)
    auto = rstmodel.create_model("rst_cnn_fb", channels=(4, 6, 8)).to(device).eval()
    tuned = rstmodel.create_model("rst_cnn_fb", channels=(4, 6, 8), method="tuned")
    tuned = tuned.to(device).eval()
    tuned.load_state_dict(auto.state_dict())
    x = torch.randn(8, 1, 56, 56, device=device)
    with torch.no_grad():
        ref = auto(x)
        torch.testing.assert_close(tuned(x), ref, rtol=1e-4, atol=1e-4)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            half = auto(x).float()
    assert ((half - ref).norm() / ref.norm()).item() < 0.05


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_triton_mixing_equals_three_products_on_cuda(device, monkeypatch, precision):
    """The FFT path's one-kernel mixing (rstmodel.layers.triton_ops, the default on CUDA)
    against the three cuBLAS products it replaces: values and every gradient."""
    from rstmodel.layers import triton_ops

    conv = GroupRSTConv(5, 6, SPEC).to(device)
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(3, 5, 8, 4, 20, 20, device=device, requires_grad=True)
    grad_out = torch.randn(3, 6, 8, 4, 20, 20, device=device)
    results = []
    for kernels in ("torch", "triton"):
        monkeypatch.setenv(triton_ops.ENV, kernels)
        x.grad = conv.weight.grad = conv.bias.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            y = conv.forward_fft(x, bias=conv.bias)
        (y.float() * grad_out).sum().backward()
        results.append(
            (y.detach().float(), x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad)
        )
    tol = 1e-5 if precision == "fp32" else 2e-2
    for ref, got in zip(*results, strict=True):
        assert ((got - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_triton_pooled_lifting_equals_torch_on_cuda(device, monkeypatch, precision):
    """The lifting layer's pooled mixing in one kernel each way (triton_ops.pooled_mix, the
    default on CUDA) against the torch path: values and the coefficients' gradients."""
    from rstmodel.layers import triton_ops

    lift = LiftingRSTConv(1, 69, SPEC, method="basis").to(device)
    with torch.no_grad():
        lift.bias.normal_()
    x = torch.randn(4, 1, 56, 56, device=device)
    grad_out = torch.randn(4, 69, 8, 4, 28, 28, device=device)
    results = []
    for kernels in ("torch", "triton"):
        monkeypatch.setenv(triton_ops.ENV, kernels)
        lift.weight.grad = lift.bias.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            y = lift.forward_pooled(x, relu=True)
        (y.float() * grad_out).sum().backward()
        with torch.no_grad(), torch.autocast("cuda", enabled=precision == "bf16"):
            y_eval = lift.forward_pooled(x, relu=True)  # no argmax kept: its own kernel variant
        torch.testing.assert_close(y_eval.float(), y.detach().float())
        results.append((y.detach().float(), lift.weight.grad.clone(), lift.bias.grad.clone()))
    tol = 1e-5 if precision == "fp32" else 2e-2
    for ref, got in zip(*results, strict=True):
        assert ((got - ref).norm() / ref.norm()).item() < tol


def test_step_cost_counts_the_backward_on_cuda(device):
    """train/step_cost.py on CUDA, where autograd runs the backward on its own device
    thread: the dispatch mode must still see it (a step costs 2-3 forwards in FLOPs)."""
    from rstcnn.train import step_cost
    from rstcnn.train.fastpath import Setting, train_step

    tiny = {"channels": (4, 6, 8), "hidden": 16}
    model = rstmodel.create_model("rst_cnn_fb", **tiny).to(device)
    x = torch.randn(2, 1, 56, 56, device=device)
    forward = sum(c.flops for c in step_cost.count(lambda: model(x)).costs.values())
    step = train_step("rst_cnn_fb", Setting("bf16", "bf16"), tiny, device, 2)
    step()
    tally = step_cost.count(step, per_layer=True)
    flops = sum(c.flops for c in tally.costs.values())
    assert 2.0 * forward < flops <= 3.0 * forward
    assert {where for where, _ in tally.costs} >= {"blocks.0", "blocks.1", "blocks.2"}
