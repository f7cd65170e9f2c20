"""Fused Triton kernels for the RST convolutions' fast paths on CUDA, each a registered
operator (so dispatch-level tools, ``train/step_cost.py`` and ``torch.compile``, see one
call) with its gradients:

- ``complex_mix``: the FFT path's frequency-wise channel mixing ``y = x G`` per frequency,
  complex, real and imaginary parts in separate arrays. The three cuBLAS products of
  ``_GaussProduct`` read and write whole spectra between products (``Re x + Im x``, then
  ``m``, then two ``baddbmm`` that read ``m`` again): about six passes over the input
  spectrum and five over the output per forward. Here each program keeps a tile of both
  outputs in registers through the whole reduction and reads each input tile once. Channel
  counts need not be multiples of 8 (the tiles are masked), which is what ruled out
  Hopper's own GEMM kernels for the widths 69, 135 and 204; spectra in float32 are cast in
  registers. One kernel serves the forward and both gradients, the same product with a
  conjugate and a transpose (``conj_a``, ``conj_b`` and strides):

      forward  y  = x G             [F, M, K] x [F, K, N]
      dL/dx    dx = dy conj(G)^T    [F, M, N] x [F, N, K]
      dL/dG    dG = conj(x)^T dy    [F, K, M] x [F, M, N]   (reduced over the batch rows M)

  (for a real loss and complex z = a + ib the gradient is dL/da + i dL/db).
- ``pooled_mix``: the lifting layer's ``relu(maxpool2x2(resp a^T + bias))`` (its basis
  path, ``_PooledMix``), the 2x2 max-pool, bias, ReLU and one-byte argmax in the product's
  epilogue, and the coefficients' gradient from the argmax in one pass. ``_PooledMix`` in
  torch runs two image rows at a time, a dozen elementwise passes per pair (631 launches per
  training step at batch 128); here the responses are read once and the pooled map written
  once.

Triton is optional: ``available(device)`` says whether the kernels can run, on CUDA, or
anywhere under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests check them on a
CPU). They are compiled on first use, so importing this module never needs Triton.
Elsewhere the operators run as torch products (to count a step's cost on a CPU, and to test
the wiring at speed). ``use_triton`` says whether the fast paths take them
(``RSTCNN_KERNELS``).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from .kernels import _dc_bias_grad, _pooled_bias_grad, _pooled_mix_grads, _pooled_mix_rows

__all__ = ["available", "complex_bmm", "complex_mix", "pooled_mix", "use_triton"]


def interpreting() -> bool:
    """Triton's interpreter is on: kernels run on the CPU, one program at a time."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: Triton installed, and a CUDA device or the
    interpreter."""
    return _have_triton() and (device.type == "cuda" or interpreting())


ENV = "RSTCNN_KERNELS"


def use_triton(x: Tensor) -> bool:
    """Whether the fast paths run ``x`` through this module's kernels. ``RSTCNN_KERNELS``:
    ``auto`` (the default: on CUDA where Triton is installed), ``triton`` (always: the
    kernels on CUDA or under ``TRITON_INTERPRET=1``, their torch stand-ins on a CPU
    otherwise) or ``torch`` (never: the torch operators, e.g. ``_GaussProduct``). Float64
    always takes torch's (the kernels accumulate in float32)."""
    mode = os.environ.get(ENV, "auto").lower()
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"{ENV} must be auto, triton or torch, got {mode!r}")
    if mode == "torch" or x.dtype == torch.float64:
        return False
    if mode == "triton":
        if x.device.type == "cuda" and not _have_triton():
            raise RuntimeError(f"{ENV}=triton needs Triton on CUDA: pip install triton")
        return True
    return x.device.type == "cuda" and available(x.device)


def _kernels():
    """The kernels' module, compiled or interpreted as ``TRITON_INTERPRET`` says now."""
    from . import _triton_kernels

    if interpreting() != _triton_kernels.INTERPRETED:
        importlib.reload(_triton_kernels)
    return _triton_kernels


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
) -> Tensor:
    """Batched complex product ``op(a) @ op(b)`` over the leading axis, op = conj where
    asked: ``a`` = (Re, Im) each ``[F, M, K]``, ``b`` each ``[F, K, N]`` (any strides: a
    transposed view costs nothing). Computes in ``out_dtype`` (default: a's dtype), float32
    accumulation; float32 operands use TF32 where torch allows it for matmuls. ``bias``
    [N] times ``dc_scale`` is added to the real part of the first ``dc_rows`` frequencies.
    Returns ``[Re; Im]`` stacked, ``[2, F, M, N]`` contiguous (``re, im = complex_bmm(...)``
    unpacks it).

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
) -> Tensor:
    f, m, k = a_re.shape
    n = b_re.shape[2]
    c = a_re.new_empty((2, f, m, n), dtype=out_dtype)
    c_re, c_im = c[0], c[1]
    if f == 0 or m == 0 or n == 0:
        return c
    if a_re.device.type != "cuda" and not interpreting():
        sa, sb = (-1 if conj_a else 1), (-1 if conj_b else 1)
        _reference_bmm(a_re, a_im, b_re, b_im, sa, sb, c_re, c_im)
        if bias is not None:
            c_re[:dc_rows] += (bias.float() * dc_scale).to(out_dtype)
        return c
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
        DOT_DTYPE=_dot_dtype(out_dtype),
        PRECISION=_precision(out_dtype),
        # the interpreter multiplies bfloat16 tiles wrongly (triton 3.9): emulate exactly
        WIDEN=interpreting(),
    )
    kernels = _kernels()
    kernel, tuned = kernels.cbmm_kernel, kernels.cbmm_tuned
    if not blocks and tuned is not None:  # compiled: tiles timed per shape

        def grid(meta):
            return (f, -(-m // meta["BM"]) * -(-n // meta["BN"]))

        tuned[grid](*args, **flags)
    else:
        bm, bn, bk = blocks or (_pow2_block(m, 16, 64), _pow2_block(n, 16, 64), 32)
        kernel[(f, -(-m // bm) * -(-n // bn))](*args, **flags, BM=bm, BN=bn, BK=bk)
    return c


@_complex_bmm_op.register_fake
def _(a_re, a_im, b_re, b_im, bias, conj_a, conj_b, out_dtype, dc_rows, dc_scale, blocks):
    return a_re.new_empty((2, a_re.shape[0], a_re.shape[1], b_re.shape[2]), dtype=out_dtype)


def _reference_bmm(a_re, a_im, b_re, b_im, sa: int, sb: int, c_re: Tensor, c_im: Tensor):
    """The kernel's arithmetic in torch products: operands rounded to the output dtype,
    products and sums in float32 (or wider), written into ``c_re``, ``c_im``."""
    wide = torch.promote_types(c_re.dtype, torch.float32)
    ar, ai, br, bi = (t.to(c_re.dtype).to(wide) for t in (a_re, a_im, b_re, b_im))
    c_re.copy_(torch.bmm(ar, br).sub_(torch.bmm(ai, bi), alpha=sa * sb))
    c_im.copy_(torch.bmm(ar, bi).mul_(sb).add_(torch.bmm(ai, br), alpha=sa))


class _ComplexMix(torch.autograd.Function):
    """``y = x G`` per frequency (``complex_bmm``) with its gradients, each one kernel
    launch; ``bias`` as ``_GaussProduct``'s (nh nw times the bias at frequency (0, 0)).
    Returns ``[Re y; Im y]`` stacked, ``[2, F, M, N]``."""

    @staticmethod
    def forward(ctx, x_re, x_im, g_re, g_im, bias=None, dc_rows=0, dc_scale=1.0):
        ctx.save_for_backward(x_re, x_im, g_re, g_im)
        ctx.dc_rows, ctx.dc_scale = dc_rows, dc_scale
        return complex_bmm(
            (x_re, x_im), (g_re, g_im), bias=bias, dc_rows=dc_rows, dc_scale=dc_scale
        )

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_re, x_im, g_re, g_im = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        dy_re, dy_im = dy[0], dy[1]
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
) -> Tensor:
    """The FFT path's mixing ``y = x G`` per frequency: ``x`` [F, M, K] in the compute
    dtype, ``G`` [F, K, N] (any float dtype; cast in registers) -> ``[Re y; Im y]``,
    ``[2, F, M, N]``. Differentiable."""
    return _ComplexMix.apply(x_re, x_im, g_re, g_im, bias, dc_rows, dc_scale)


# ----------------------------------------------------------------- the lifting layer's pool


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: TF32 for float32 where torch allows it for matmuls."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _k_block(k: int) -> int:
    return _pow2_block(k, 16, 1 << 30)


def pooled_mix_fits(resp: Tensor) -> bool:
    """Whether ``pooled_mix`` takes these responses: ``K'`` = Cin K within one tile (64)."""
    return resp.shape[-1] <= 64


@torch.library.custom_op("rstmodel::pooled_mix", mutates_args=())
def _pooled_mix_op(
    resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int, save_idx: bool
) -> tuple[Tensor, Tensor]:
    h, wm, k = resp.shape
    m, n = wm // w, a.shape[0]
    if resp.device.type != "cuda" and not interpreting():  # the torch stand-in
        out, idx = _pooled_mix_rows(resp, a, bias, relu, w, save_idx)
        return out, idx if save_idx else resp.new_empty(0, dtype=torch.uint8)
    resp, a = resp.contiguous(), a.contiguous()
    out = resp.new_empty(h // 2, w // 2, m, n)
    idx = torch.empty(out.shape if save_idx else 0, dtype=torch.uint8, device=out.device)
    bm, bn = 32, _pow2_block(n, 16, 128)
    grid = ((h // 2) * (w // 2), -(-m // bm), -(-n // bn))
    _kernels().pooled_mix_kernel[grid](
        resp,
        a,
        bias if bias is not None else a,
        out,
        idx if save_idx else out,
        w,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        RELU=relu,
        SAVE_IDX=save_idx,
        DOT_DTYPE=_dot_dtype(resp.dtype),
        PRECISION=_precision(resp.dtype),
        WIDEN=interpreting(),
        BM=bm,
        BN=bn,
        BK=_k_block(k),
    )
    return out, idx


@_pooled_mix_op.register_fake
def _(resp, a, bias, relu, w, save_idx):
    h, wm, _ = resp.shape
    out = resp.new_empty(h // 2, w // 2, wm // w, a.shape[0])
    return out, torch.empty(out.shape if save_idx else 0, dtype=torch.uint8, device=out.device)


_GRAD_ROWS_PER = 512  # rows of one pooled pixel per program of the gradient kernel


@torch.library.custom_op("rstmodel::pooled_mix_grad", mutates_args=())
def _pooled_mix_grad_op(resp: Tensor, grad: Tensor, idx: Tensor, w: int, n: int) -> Tensor:
    """d loss / d a [N, K'] in float32, from the pooled gradient and the argmax."""
    h, wm, k = resp.shape
    m = wm // w
    if resp.device.type != "cuda" and not interpreting():  # the torch stand-in
        return _pooled_mix_grads(resp, grad, idx, w, None, torch.float32)[1]
    pixels, rows_per, bn = (h // 2) * (w // 2), _GRAD_ROWS_PER, _pow2_block(n, 16, 128)
    chunks = -(-m // rows_per)  # rows of a pixel split over programs: more of them in flight
    part = resp.new_empty(pixels * chunks, n, k, dtype=torch.float32)
    _kernels().pooled_mix_grad_kernel[(pixels, -(-n // bn), chunks)](
        resp.contiguous(),
        grad.contiguous(),
        idx,
        part,
        w,
        m,
        n,
        k,
        DOT_DTYPE=_dot_dtype(resp.dtype),
        PRECISION=_precision(resp.dtype),
        WIDEN=interpreting(),
        ROWS_PER=rows_per,
        BM=32,
        BN=bn,
        BK=_k_block(k),
    )
    return part.sum(0)


@_pooled_mix_grad_op.register_fake
def _(resp, grad, idx, w, n):
    return resp.new_empty(n, resp.shape[-1], dtype=torch.float32)


class _PooledMixKernel(torch.autograd.Function):
    """``_PooledMix`` through the two kernels: no gradient for the responses (the lifting
    layer's come from the input images, which need none; the caller checks)."""

    @staticmethod
    def forward(ctx, resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int):
        keep = any(ctx.needs_input_grad[1:3])
        out, idx = _pooled_mix_op(resp, a, bias, relu, w, keep)
        if keep:
            ctx.save_for_backward(resp, idx)
            ctx.w, ctx.dtypes = w, (a.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        resp, idx = ctx.saved_tensors
        a_dtype, bias_dtype = ctx.dtypes
        need_a, need_bias = ctx.needs_input_grad[1:3]
        grad_a = grad_bias = None
        if need_a:
            grad_a = _pooled_mix_grad_op(resp, grad, idx, ctx.w, grad.shape[-1]).to(a_dtype)
        if need_bias and bias_dtype is not None:
            grad_bias = _pooled_bias_grad(grad, idx, bias_dtype)
        return None, grad_a, grad_bias, None, None


def pooled_mix(resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int) -> Tensor:
    """The lifting layer's ``relu(maxpool2x2(resp a^T + bias))``: spatial-major responses
    ``resp [H, W*M, K']`` (no gradient: they come from the input), ``a`` [Cout, K'] ->
    ``[H/2, W/2, M, Cout]`` in ``resp``'s dtype. Differentiable in ``a`` and ``bias``."""
    if resp.requires_grad:
        raise ValueError("pooled_mix gives no gradient for the responses: use _PooledMix")
    if not pooled_mix_fits(resp):
        raise ValueError(f"pooled_mix takes at most 64 responses per pixel, got {resp.shape[-1]}")
    if not torch.is_grad_enabled():  # no backward to come: no argmax to keep
        return _pooled_mix_op(resp, a, bias, relu, w, False)[0]
    return _PooledMixKernel.apply(resp, a, bias, relu, w)


@functools.cache
def register_flops() -> None:
    """Tell ``torch.utils.flop_counter`` (and so train/step_cost.py) what the operators
    cost: four real products of [M, K] x [K, N] per frequency for the mixing, every
    pixel's responses times a^T for the pooled mixing and its gradient. Not done on import:
    the flop counter imports Triton, which every import of the model would then pay for."""
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.rstmodel.complex_bmm)
    def _mix_flops(a_re, a_im, b_re, b_im, *args, **kwargs) -> int:  # shapes, not tensors
        f, m, k = a_re
        return 4 * 2 * f * m * k * b_re[-1]

    @register_flop_formula(torch.ops.rstmodel.pooled_mix)
    def _pool_flops(resp, a, *args, **kwargs) -> int:  # every pixel's responses times a^T
        h, wm, k = resp
        return 2 * h * wm * k * a[0]

    @register_flop_formula(torch.ops.rstmodel.pooled_mix_grad)
    def _pool_grad_flops(resp, grad, idx, w, n, **kwargs) -> int:
        h, wm, k = resp
        return 2 * h * wm * k * n
