"""The FFT path's frequency-wise channel mixing as one Triton kernel: ``y = x G`` per
frequency, complex, with the real and imaginary parts in separate arrays.

What it saves against the three cuBLAS products of ``_GaussProduct``: those read and write
whole spectra between products (``Re x + Im x``, then ``m``, then two ``baddbmm`` that read
``m`` again), about six passes over the input spectrum and five over the output per forward.
Here each program keeps a tile of both outputs in registers through the whole reduction and
reads each input tile once: two passes over the input, two over the output. Channel counts
need not be multiples of 8 (the tiles are masked), which is what ruled out Hopper's own
GEMM kernels for the widths 69, 135 and 204. Spectra in float32 are cast to the compute
dtype in registers, so the spectra never take a separate cast pass.

One kernel serves the forward and both gradients, which are the same product with a
conjugate and a transpose (``conj_a``, ``conj_b`` and strides):

    forward  y  = x G             [F, M, K] x [F, K, N]
    dL/dx    dx = dy conj(G)^T    [F, M, N] x [F, N, K]
    dL/dG    dG = conj(x)^T dy    [F, K, M] x [F, M, N]   (reduced over the batch rows M)

(for a real loss and complex z = a + ib the gradient is dL/da + i dL/db).

Triton is optional: ``available(device)`` says whether this kernel can run, on CUDA, or
anywhere under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests check it on a
CPU). The kernel is compiled on first use, so importing this module never needs Triton.
Elsewhere the same operator runs as torch products (to count a step's cost on a CPU, and
to test the wiring at speed); ``use_for`` says which mixing the FFT path takes.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from .kernels import _dc_bias_grad

__all__ = ["available", "complex_bmm", "complex_mix", "use_for"]


def interpreting() -> bool:
    """Triton's interpreter is on: kernels run on the CPU, one program at a time."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``: Triton installed, and a CUDA device or the
    interpreter."""
    return _have_triton() and (device.type == "cuda" or interpreting())


ENV = "RSTCNN_COMPLEX_MIX"


def use_for(x: Tensor) -> bool:
    """Whether the FFT path mixes ``x`` with ``complex_mix``. ``RSTCNN_COMPLEX_MIX``:
    ``auto`` (the default: on CUDA where Triton is installed), ``triton`` (always: the
    kernel on CUDA or under ``TRITON_INTERPRET=1``, its torch stand-in on a CPU otherwise)
    or ``gauss`` (never: three real products, ``_GaussProduct``). Float64 always takes the
    three products (the kernel accumulates in float32)."""
    mode = os.environ.get(ENV, "auto").lower()
    if mode not in ("auto", "triton", "gauss"):
        raise ValueError(f"{ENV} must be auto, triton or gauss, got {mode!r}")
    if mode == "gauss" or x.dtype == torch.float64:
        return False
    if mode == "triton":
        if x.device.type == "cuda" and not _have_triton():
            raise RuntimeError(f"{ENV}=triton needs Triton on CUDA: pip install triton")
        return True
    return x.device.type == "cuda" and available(x.device)


def _kernels():
    """The jitted kernel and its autotuned form (None under the interpreter), compiled or
    interpreted as ``TRITON_INTERPRET`` says now."""
    from . import _cbmm_triton

    if interpreting() != _cbmm_triton.INTERPRETED:
        importlib.reload(_cbmm_triton)
    return _cbmm_triton.cbmm_kernel, _cbmm_triton.cbmm_tuned


def _pow2_block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << max(n - 1, 0).bit_length()))


def _dot_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)


def complex_bmm(
    a: tuple[Tensor, Tensor],
    b: tuple[Tensor, Tensor],
    *,
    conj_a: bool = False,
    conj_b: bool = False,
    out_dtype: torch.dtype | None = None,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
    blocks: tuple[int, int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Batched complex product ``op(a) @ op(b)`` over the leading axis, op = conj where
    asked: ``a`` = (Re, Im) each ``[F, M, K]``, ``b`` each ``[F, K, N]`` (any strides: a
    transposed view costs nothing). Computes in ``out_dtype`` (default: a's dtype), float32
    accumulation; float32 operands use TF32 where torch allows it for matmuls. ``bias``
    [N] times ``dc_scale`` is added to the real part of the first ``dc_rows`` frequencies.
    Returns (Re, Im), each ``[F, M, N]`` contiguous.

    The Triton kernel on CUDA and under the interpreter; elsewhere the same arithmetic in
    torch matrix products (``_reference_bmm``), so that the step's cost can be counted and
    the wiring checked at speed on a CPU. ``blocks`` (BM, BN, BK) fixes the kernel's tiles
    (default: timed per shape on CUDA). A registered operator (``rstmodel::complex_bmm``),
    so that dispatch-level tools (``train/step_cost.py``, ``torch.compile``) see one call."""
    a_re, a_im = a
    b_re, b_im = b
    f, m, k = a_re.shape
    if a_im.stride() != a_re.stride() or b_im.stride() != b_re.stride():
        raise ValueError("real and imaginary parts must have the same strides")
    if b_re.shape[:2] != (f, k) or a_im.shape != a_re.shape or b_im.shape != b_re.shape:
        raise ValueError(f"shapes do not multiply: {tuple(a_re.shape)} x {tuple(b_re.shape)}")
    out_dtype = out_dtype or a_re.dtype
    if torch.float64 in (out_dtype, a_re.dtype, b_re.dtype):
        raise TypeError("complex_bmm accumulates in float32: no float64 operands")
    return _complex_bmm_op(
        a_re, a_im, b_re, b_im, bias, conj_a, conj_b, out_dtype, dc_rows, float(dc_scale),
        list(blocks or ()),
    )  # fmt: skip


@torch.library.custom_op("rstmodel::complex_bmm", mutates_args=())
def _complex_bmm_op(
    a_re: Tensor,
    a_im: Tensor,
    b_re: Tensor,
    b_im: Tensor,
    bias: Tensor | None,
    conj_a: bool,
    conj_b: bool,
    out_dtype: torch.dtype,
    dc_rows: int,
    dc_scale: float,
    blocks: list[int],
) -> tuple[Tensor, Tensor]:
    f, m, k = a_re.shape
    n = b_re.shape[2]
    c_re = a_re.new_empty((f, m, n), dtype=out_dtype)
    c_im = a_re.new_empty((f, m, n), dtype=out_dtype)
    if f == 0 or m == 0 or n == 0:
        return c_re, c_im
    if a_re.device.type != "cuda" and not interpreting():
        sa, sb = (-1 if conj_a else 1), (-1 if conj_b else 1)
        _reference_bmm(a_re, a_im, b_re, b_im, sa, sb, c_re, c_im)
        if bias is not None:
            c_re[:dc_rows] += (bias.float() * dc_scale).to(out_dtype)
        return c_re, c_im
    dot_dtype = _dot_dtype(out_dtype)
    tf32 = out_dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    args = (
        a_re,
        a_im,
        b_re,
        b_im,
        c_re,
        c_im,
        bias if bias is not None else c_re,  # any pointer when there is no bias
        m,
        n,
        k,
        dc_rows,
        float(dc_scale),
        *a_re.stride(),
        *b_re.stride(),
        *c_re.stride(),
    )
    flags = dict(
        SIGN_A=-1 if conj_a else 1,
        SIGN_B=-1 if conj_b else 1,
        HAS_BIAS=bias is not None,
        DOT_DTYPE=dot_dtype,
        PRECISION="tf32" if tf32 else "ieee",
        # the interpreter multiplies bfloat16 tiles wrongly (triton 3.9): emulate exactly
        WIDEN=interpreting(),
    )
    kernel, tuned = _kernels()
    if not blocks and tuned is not None:  # compiled: tiles timed per shape

        def grid(meta):
            return (f, -(-m // meta["BM"]) * -(-n // meta["BN"]))

        tuned[grid](*args, **flags)
    else:
        bm, bn, bk = blocks or (_pow2_block(m, 16, 64), _pow2_block(n, 16, 64), 32)
        kernel[(f, -(-m // bm) * -(-n // bn))](*args, **flags, BM=bm, BN=bn, BK=bk)
    return c_re, c_im


@_complex_bmm_op.register_fake
def _(a_re, a_im, b_re, b_im, bias, conj_a, conj_b, out_dtype, dc_rows, dc_scale, blocks):
    shape = (a_re.shape[0], a_re.shape[1], b_re.shape[2])
    return a_re.new_empty(shape, dtype=out_dtype), a_re.new_empty(shape, dtype=out_dtype)


@functools.cache
def register_flops() -> None:
    """Tell ``torch.utils.flop_counter`` (and so train/step_cost.py) what the operator
    costs: four real products of [M, K] x [K, N] per frequency. Not done on import:
    the flop counter imports Triton, which every import of the model would then pay for."""
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.rstmodel.complex_bmm)
    def _flops(a_re, a_im, b_re, b_im, *args, **kwargs) -> int:  # shapes, not tensors
        f, m, k = a_re
        return 4 * 2 * f * m * k * b_re[-1]


def _reference_bmm(a_re, a_im, b_re, b_im, sa: int, sb: int, c_re: Tensor, c_im: Tensor):
    """The kernel's arithmetic in torch products: operands rounded to the output dtype,
    products and sums in float32 (or wider), written into ``c_re``, ``c_im``."""
    wide = torch.promote_types(c_re.dtype, torch.float32)
    ar, ai, br, bi = (t.to(c_re.dtype).to(wide) for t in (a_re, a_im, b_re, b_im))
    c_re.copy_(torch.bmm(ar, br).sub_(torch.bmm(ai, bi), alpha=sa * sb))
    c_im.copy_(torch.bmm(ar, bi).mul_(sb).add_(torch.bmm(ai, br), alpha=sa))


class _ComplexMix(torch.autograd.Function):
    """``y = x G`` per frequency (``complex_bmm``) with its gradients, each one kernel
    launch; ``bias`` as ``_GaussProduct``'s (nh nw times the bias at frequency (0, 0))."""

    @staticmethod
    def forward(ctx, x_re, x_im, g_re, g_im, bias=None, dc_rows=0, dc_scale=1.0):
        ctx.save_for_backward(x_re, x_im, g_re, g_im)
        ctx.dc_rows, ctx.dc_scale = dc_rows, dc_scale
        return complex_bmm(
            (x_re, x_im), (g_re, g_im), bias=bias, dc_rows=dc_rows, dc_scale=dc_scale
        )

    @staticmethod
    def backward(ctx, dy_re: Tensor, dy_im: Tensor):
        x_re, x_im, g_re, g_im = ctx.saved_tensors
        need = ctx.needs_input_grad
        dtype = dy_re.dtype
        dy_re, dy_im = dy_re.contiguous(), dy_im.to(dtype).contiguous()
        dx_re = dx_im = dg_re = dg_im = dbias = None
        if need[0] or need[1]:
            dx_re, dx_im = complex_bmm((dy_re, dy_im), (g_re.mT, g_im.mT), conj_b=True)
        if need[2] or need[3]:
            dg_re, dg_im = complex_bmm(
                (x_re.mT, x_im.mT), (dy_re, dy_im), conj_a=True, out_dtype=g_re.dtype
            )
        if need[4]:
            dbias = _dc_bias_grad(dy_re, ctx.dc_rows, ctx.dc_scale)
        return dx_re, dx_im, dg_re, dg_im, dbias, None, None


def complex_mix(
    x_re: Tensor,
    x_im: Tensor,
    g_re: Tensor,
    g_im: Tensor,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """The FFT path's mixing ``(Re y, Im y) = x G`` per frequency: ``x`` [F, M, K] in the
    compute dtype, ``G`` [F, K, N] (any float dtype; cast in registers). Differentiable."""
    return _ComplexMix.apply(x_re, x_im, g_re, g_im, bias, dc_rows, dc_scale)
