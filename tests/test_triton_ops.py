"""The FFT path's Triton mixing kernel (``rstmodel.layers.triton_ops``) against complex
matrix products and against the three-product path it replaces on CUDA. Here it runs in
Triton's interpreter on the CPU (the same kernel source; tests/test_cuda.py compiles it on a
GPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import rstmodel
from rstmodel.basis import BasisFamily, BasisSpec
from rstmodel.layers import GroupRSTConv, RotationTaps
from rstmodel.layers import triton_ops as cm

# a dev dependency (scripts/setup.sh installs it); not imported here, so that the fixture's
# TRITON_INTERPRET is set before Triton is
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (pip install triton)"
)

# small: the interpreter runs every program in Python, one per frequency and tile
SPEC = BasisSpec(BasisFamily.FOURIER_BESSEL, 6, 4, (2.5, 2.5 * 2**0.5))  # kernels 5, 7


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(cm.ENV, "triton")
    torch.manual_seed(0)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def as_complex(re: torch.Tensor, im: torch.Tensor) -> torch.Tensor:
    return torch.complex(re.double(), im.double())


@pytest.mark.parametrize("conj_a", [False, True])
@pytest.mark.parametrize("conj_b", [False, True])
def test_complex_bmm_equals_complex_matmul(interpret, conj_a, conj_b):
    # sizes off the tiles and over two reduction blocks; b a transposed view
    a = torch.randn(3, 21, 37, dtype=torch.complex128)
    b = torch.randn(3, 19, 37, dtype=torch.complex128).mT
    ref = (a.conj() if conj_a else a) @ (b.conj() if conj_b else b)
    parts = [(t.real.float(), t.imag.float()) for t in (a, b)]
    assert not parts[1][0].is_contiguous()
    re, im = cm.complex_bmm(*parts, conj_a=conj_a, conj_b=conj_b)
    assert re.shape == im.shape == (3, 21, 19) and re.dtype == torch.float32
    assert rel_err(as_complex(re, im), ref) < 1e-6


def test_complex_bmm_bias_and_bfloat16(interpret):
    a = torch.randn(4, 6, 33, dtype=torch.complex128)
    b = torch.randn(4, 33, 10, dtype=torch.complex128)
    bias = torch.randn(10)
    ref = a @ b
    ref.real[:2] += 7.0 * bias.double()
    parts = (a.real.float(), a.imag.float()), (b.real.float(), b.imag.float())
    re, im = cm.complex_bmm(*parts, bias=bias, dc_rows=2, dc_scale=7.0)
    assert rel_err(as_complex(re, im), ref) < 1e-6
    # bfloat16: operands rounded, float32 accumulation, bfloat16 out (spectra may stay float32)
    bf = (a.real.bfloat16(), a.imag.bfloat16()), parts[1]
    re, im = cm.complex_bmm(*bf, out_dtype=torch.bfloat16, bias=bias, dc_rows=2, dc_scale=7.0)
    assert re.dtype == torch.bfloat16
    assert 1e-4 < rel_err(as_complex(re, im), ref) < 1e-2


def test_complex_bmm_rejects_float64_and_mismatched_shapes(interpret):
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        cm.complex_bmm((x, x), (x.mT, x.mT))
    y = torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="do not multiply"):
        cm.complex_bmm((y, y), (y, y))


def test_triton_ops_gradients_equal_complex_autograd(interpret):
    x = torch.randn(5, 9, 23, dtype=torch.complex128)
    g = torch.randn(5, 23, 17, dtype=torch.complex128)
    bias = torch.randn(17, dtype=torch.float64)
    dy = torch.randn(5, 9, 17, dtype=torch.complex128)
    # reference: y = x g (+ 3 bias at the first two frequencies), loss = Re <dy, y>
    leaves = [t.clone().requires_grad_(True) for t in (x, g, bias)]
    y = leaves[0] @ leaves[1]
    y = y + torch.zeros_like(y).index_put((torch.arange(2),), 3.0 * leaves[2].to(y.dtype))
    (y.real * dy.real + y.imag * dy.imag).sum().backward()
    ref = [t.grad for t in leaves]
    ins = [t.float().requires_grad_(True) for t in (x.real, x.imag, g.real, g.imag, bias)]
    y_re, y_im = cm.complex_mix(*ins, 2, 3.0)
    (y_re * dy.real.float() + y_im * dy.imag.float()).sum().backward()
    assert rel_err(as_complex(y_re.detach(), y_im.detach()), y.detach()) < 1e-6
    assert rel_err(as_complex(ins[0].grad, ins[1].grad), ref[0]) < 1e-6
    assert rel_err(as_complex(ins[2].grad, ins[3].grad), ref[1]) < 1e-6
    assert rel_err(ins[4].grad.double(), ref[2]) < 1e-6


@pytest.mark.parametrize(
    "lt,mode,la,size",
    [
        (1, RotationTaps.COARSE, 1, (8, 8)),  # quarter turns share a spectrum
        (4, RotationTaps.COARSE, 2, (8, 8)),
        (3, RotationTaps.ADJACENT, 2, (6, 8)),  # rectangular: one spectrum per rotation
    ],
    ids=["Lt1-La1", "Lt4-La2", "Lt3-adjacent-La2-rect"],
)
def test_fft_path_with_the_kernel_equals_three_products_with_gradients(
    interpret, monkeypatch, lt, mode, la, size
):
    conv = GroupRSTConv(3, 5, SPEC, rotation_taps=lt, scale_taps=la, tap_mode=mode)
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 3, 4, 2, *size, requires_grad=True)
    grad_out = torch.randn(2, 5, 4, 2, *size)
    results = []
    for mix in ("torch", "triton"):
        monkeypatch.setenv(cm.ENV, mix)
        x.grad = conv.weight.grad = conv.bias.grad = None
        y = conv.forward_fft(x, bias=conv.bias)
        (y * grad_out).sum().backward()
        results.append((y.detach(), x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad))
    for ref, got in zip(*results, strict=True):
        assert rel_err(got, ref) < 1e-5


def test_model_under_bfloat16_autocast_agrees_with_three_products(interpret, monkeypatch):
    model = rstmodel.create_model(
        "rst_cnn_fb", channels=(4, 6, 8), input_size=16, rotations=4, num_scales=2, method="fft"
    ).eval()
    x = torch.randn(2, 1, 16, 16)
    calls = []
    kernel = cm.complex_bmm
    monkeypatch.setattr(cm, "complex_bmm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    blocks = []  # the scale blocks of each group conv's call: each mixes once
    for conv in model.modules():
        if isinstance(conv, GroupRSTConv):
            conv.register_forward_pre_hook(
                lambda mod, args: blocks.append(len(mod.scale_blocks(*args[0].shape[-2:])))
            )
    logits = {}
    for mix in ("torch", "triton"):
        monkeypatch.setenv(cm.ENV, mix)
        blocks.clear()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits[mix] = model(x).float()
        assert len(blocks) == 2 and len(calls) == (sum(blocks) if mix == "triton" else 0)
    # two bfloat16 roundings of the same products: close, not equal
    assert rel_err(logits["triton"], logits["torch"]) < 3e-2


def test_the_choice_of_mixing(monkeypatch):
    x = torch.zeros(2, 2)
    monkeypatch.delenv(cm.ENV, raising=False)
    assert not cm.use_triton(x)  # auto: CUDA only
    monkeypatch.setenv(cm.ENV, "triton")
    assert cm.use_triton(x)
    assert not cm.use_triton(x.double())  # float64 always takes the three products
    monkeypatch.setenv(cm.ENV, "torch")
    assert not cm.use_triton(x)
    monkeypatch.setenv(cm.ENV, "fast")
    with pytest.raises(ValueError, match="auto, triton or torch"):
        cm.use_triton(x)


def test_torch_stand_in_of_the_kernel_without_the_interpreter(monkeypatch):
    """Off CUDA and without the interpreter the operator runs as torch products, with the
    kernel's rounding: the FFT path through it equals the three products."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = torch.randn(3, 9, 13, dtype=torch.complex128)
    b = torch.randn(3, 13, 6, dtype=torch.complex128)
    bias = torch.randn(6)
    for conj_a, conj_b in [(False, False), (True, False), (False, True)]:
        ref = (a.conj() if conj_a else a) @ (b.conj() if conj_b else b)
        ref.real[:1] += 2.0 * bias.double()
        parts = [(t.real.float(), t.imag.float()) for t in (a, b)]
        re, im = cm.complex_bmm(
            *parts, conj_a=conj_a, conj_b=conj_b, bias=bias, dc_rows=1, dc_scale=2.0
        )
        assert rel_err(as_complex(re, im), ref) < 1e-6
    conv = GroupRSTConv(4, 6, SPEC)
    x = torch.randn(3, 4, 4, 2, 8, 8, requires_grad=True)
    results = []
    for mix in ("torch", "triton"):
        monkeypatch.setenv(cm.ENV, mix)
        x.grad = conv.weight.grad = None
        y = conv.forward_fft(x, bias=conv.bias)
        y.square().sum().backward()
        results.append((y.detach(), x.grad.clone(), conv.weight.grad.clone()))
    for ref, got in zip(*results, strict=True):
        assert rel_err(got, ref) < 1e-5


def compile_for_hopper(kernel, sig: dict, const: dict, warps: int = 4, stages: int = 3):
    """Triton's compiler (ptxas ships in its wheel) builds ``kernel`` for an H100 / H200
    (sm_90) without a GPU: what the interpreter cannot show (types, layouts, registers,
    shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = sig | {c: "constexpr" for c in const}
    out = triton.compile(
        ASTSource(fn=kernel, signature=sig, constexprs=const),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )
    assert len(out.asm["cubin"]) > 10_000
    assert out.metadata.shared <= 227 * 1024  # fits a Hopper SM's shared memory
    return out


def test_kernels_compile_for_hopper(monkeypatch):
    """Every variant the fast paths launch, in bfloat16 and float32 (TF32 or not), with
    each autotuning configuration of the mixing kernel."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton.language as tl

    kernels = cm._kernels()
    assert kernels.cbmm_tuned is not None  # compiled mode: the autotuned form exists
    pointers = ["a_re", "a_im", "b_re", "b_im", "c_re", "c_im", "bias"]
    ints = ["M", "N", "K", "dc_rows"]
    strides = [
        f"s_{t}{d}" for t, dims in zip("abc", ("fmk", "fkn", "fmn"), strict=True) for d in dims
    ]
    variants = [  # forward (with a bias), dL/dx, dL/dG
        (1, 1, True, "bf16", "ieee"),
        (1, -1, False, "bf16", "ieee"),
        (-1, 1, False, "fp32", "ieee"),
        (1, 1, False, "fp32", "tf32"),
    ]
    configs = [(c.kwargs, c.num_warps, c.num_stages) for c in kernels.CONFIGS]
    for (sa, sb, bias, dt, prec), (blocks, warps, stages) in zip(
        variants * 2, configs, strict=True
    ):
        sig = {p: f"*{dt}" for p in pointers} | {i: "i32" for i in ints} | {"dc_scale": "fp32"}
        sig |= {s: "i64" for s in strides}
        const = dict(SIGN_A=sa, SIGN_B=sb, HAS_BIAS=bias, PRECISION=prec, WIDEN=False, **blocks)
        const["DOT_DTYPE"] = tl.bfloat16 if dt == "bf16" else tl.float32
        compile_for_hopper(kernels.cbmm_kernel, sig, const, warps, stages)
    for dt, dot in (("bf16", tl.bfloat16), ("fp32", tl.float32)):
        sizes = {i: "i32" for i in ("W", "M", "N", "K")}
        common = dict(DOT_DTYPE=dot, PRECISION="ieee", WIDEN=False, BM=32, BN=128, BK=16)
        for save_idx in (True, False):  # training; eval (the output stands in for idx)
            sig = {"resp": f"*{dt}", "a": "*fp32", "bias": "*fp32", "out": f"*{dt}"}
            sig["idx"] = "*u8" if save_idx else f"*{dt}"
            const = dict(HAS_BIAS=True, RELU=True, SAVE_IDX=save_idx, **common)
            compile_for_hopper(kernels.pooled_mix_kernel, sig | sizes, const)
        sig = {"resp": f"*{dt}", "grad": f"*{dt}", "idx": "*u8", "part": "*fp32"}
        compile_for_hopper(kernels.pooled_mix_grad_kernel, sig | sizes, common | {"ROWS_PER": 512})


def test_step_cost_counts_the_operator_as_one_product():
    """train/step_cost.py sees one ``complex_bmm`` (not the products inside it): four real
    products' FLOPs, and the bytes of its four operands and two results, once."""
    from rstcnn.train import step_cost

    a, b = torch.randn(3, 5, 7), torch.randn(3, 7, 4)
    parts = (a, a.clone()), (b, b.clone())
    tally = step_cost.count(lambda: cm.complex_bmm(*parts)).costs[("all", "matmul")]
    assert (tally.calls, tally.flops) == (1, 4 * 2 * 3 * 5 * 7 * 4)
    assert tally.bytes == 4 * (2 * 105 + 2 * 84 + 2 * 60)
    resp, a = torch.randn(4, 6 * 5, 12), torch.randn(7, 12, requires_grad=True)
    pooled = step_cost.count(lambda: cm.pooled_mix(resp, a, None, True, 6).sum().backward())
    ops = {name: c for (_, name), c in pooled.ops.items()}
    assert ops["pooled_mix"].flops == ops["pooled_mix_grad"].flops == 2 * 4 * 30 * 12 * 7
    assert ops["pooled_mix"].bytes == 4 * (4 * 30 * 12 + 7 * 12 + 2 * 3 * 5 * 7) + 2 * 3 * 5 * 7


# ---------------------------------------------------------------- the lifting layer's pool


def pooled_both_ways(resp, a, bias, relu, w, grad):
    """(out, grad a, grad bias) from the torch path (``_PooledMix`` in torch ops: the CPU's
    compiled kernels, which round bfloat16 once, set aside) and from ``pooled_mix``."""
    from unittest import mock

    from rstmodel.layers import native
    from rstmodel.layers.kernels import _PooledMix

    results = []
    for fn in (_PooledMix.apply, cm.pooled_mix):
        leaves = [a.detach().requires_grad_(True), bias.detach().requires_grad_(True)]
        with mock.patch.object(native, "pooled_mix_train_available", lambda *_: False):
            y = fn(resp, leaves[0], leaves[1], relu, w)
            (y.float() * grad).sum().backward()
        results.append((y.detach().float(), leaves[0].grad, leaves[1].grad))
    return results


@pytest.mark.parametrize(
    "relu,n,rows_per",
    [(True, 7, 512), (False, 7, 512), (True, 130, 512), (True, 7, 32)],
    ids=["relu", "no-relu", "two-column-tiles", "rows-over-two-programs"],
)
def test_pooled_mix_equals_the_torch_path_with_gradients(interpret, monkeypatch, relu, n, rows_per):
    monkeypatch.setattr(cm, "_GRAD_ROWS_PER", rows_per)
    h, w, m, k = 4, 6, 37, 12  # M over one 32-row tile
    resp, a, bias = torch.randn(h, w * m, k), torch.randn(n, k), torch.randn(n)
    grad = torch.randn(h // 2, w // 2, m, n)
    ref, got = pooled_both_ways(resp, a, bias, relu, w, grad)
    for r, g in zip(ref, got, strict=True):
        assert rel_err(g, r) < 1e-5


def test_pooled_mix_without_grad_gives_the_same_map(interpret):
    h, w, m, k, n = 4, 6, 5, 12, 7
    resp, bias = torch.randn(h, w * m, k), torch.randn(n)
    a = torch.randn(n, k, requires_grad=True)  # a weight: requires grad even in eval
    with_grad = cm.pooled_mix(resp, a, bias, True, w)
    assert with_grad.requires_grad
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            torch.testing.assert_close(cm.pooled_mix(resp, a, bias, True, w), with_grad.detach())


def test_pooled_mix_in_bfloat16_rounds_like_the_torch_path(interpret):
    h, w, m, k, n = 4, 4, 9, 36, 11  # K' = 36: three image channels
    resp = torch.randn(h, w * m, k).bfloat16()
    a, bias = torch.randn(n, k), torch.randn(n)
    grad = torch.randn(h // 2, w // 2, m, n)
    ref, got = pooled_both_ways(resp, a, bias, True, w, grad)
    assert got[0].dtype == ref[0].dtype == torch.float32  # compared as float32 copies
    # the same bfloat16 rounding of each window's products: the same maxima nearly everywhere
    assert (got[0] == ref[0]).float().mean() > 0.95 and rel_err(got[0], ref[0]) < 1e-2
    assert rel_err(got[1], ref[1]) < 2e-2 and rel_err(got[2], ref[2]) < 2e-2


def test_pooled_mix_refuses_what_it_cannot_do():
    a = torch.randn(3, 12)
    with pytest.raises(ValueError, match="no gradient for the responses"):
        cm.pooled_mix(torch.randn(2, 8, 12, requires_grad=True), a, None, True, 2)
    with pytest.raises(ValueError, match="at most 64"):
        cm.pooled_mix(torch.randn(2, 8, 65), torch.randn(3, 65), None, True, 2)


@pytest.mark.parametrize("kernels", ["interpreter", "stand-in"])
def test_lifting_layer_through_the_kernel_equals_torch_with_gradients(monkeypatch, kernels):
    from rstmodel.layers import LiftingRSTConv

    if kernels == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    conv = LiftingRSTConv(1, 6, SPEC, method="basis")
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 1, 8, 8)
    grad = torch.randn(2, 6, 4, 2, 4, 4)
    calls = []
    op = cm._pooled_mix_op
    monkeypatch.setattr(cm, "_pooled_mix_op", lambda *a: calls.append(1) or op(*a))
    results = []
    for mix in ("torch", "triton"):
        monkeypatch.setenv(cm.ENV, mix)
        conv.weight.grad = conv.bias.grad = None
        y = conv.forward_pooled(x, relu=True)
        (y * grad).sum().backward()
        results.append((y.detach(), conv.weight.grad.clone(), conv.bias.grad.clone()))
    assert calls == [1]
    for ref, got in zip(*results, strict=True):
        assert rel_err(got, ref) < 1e-5
