"""The convolutions' fast-path kernels: autograd functions that keep memory and passes
down (the lifting layer's pooled channel mixing; the FFT path's GEMM DFTs, complex mixing
and the row gathers of quarter turns and scale blocks, each with a hand-written backward
that accumulates in place) and the cached DFT matrices."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import native
from .norm import _column_sums
from .pooling import _pool_quads, _unpool_quads


class _PooledMix(torch.autograd.Function):
    """``relu(maxpool2x2(resp @ a^T + bias))`` for spatial-major responses ``resp
    [H, W*M, K']`` (the lifting layer's basis path, M = R*S*B), a chunk of two rows of H at a
    time (``MIX_CHUNK_ROWS``): neither the full-resolution map nor its gradient is ever
    stored, only the pooled map and a one-byte argmax (4: clamped by the ReLU). Returns
    ``[H/2, W/2, M, Cout]``.
    (``triton_ops.pooled_mix`` is the same operator in one CUDA kernel each way; on the CPU,
    in float32 and under bfloat16 autocast, ``native.pooled_mix_train`` /
    ``native.pooled_mix_grad`` are the forward and the coefficients' gradient in one compiled
    pass each.)"""

    @staticmethod
    def forward(ctx, resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int):
        keep = any(ctx.needs_input_grad[:3])
        ctx.dtypes = a.dtype, None if bias is None else bias.dtype
        if keep and native.pooled_mix_train_available(resp, a):  # compiled, CPU
            # the coefficients and bias rounded to the responses' dtype, as autocast would
            b = None if bias is None else bias.to(resp.dtype)
            out, idx = native.pooled_mix_train(resp, a.to(resp.dtype), b, relu, w)
        else:
            out, idx = _pooled_mix_rows(resp, a, bias, relu, w, keep)
        if keep:
            ctx.save_for_backward(resp, a.to(resp.dtype), idx)
            ctx.w, ctx.has_bias = w, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        resp, a, idx = ctx.saved_tensors
        need_resp, need_a, need_bias = ctx.needs_input_grad[:3]
        a_dtype, bias_dtype = ctx.dtypes
        if need_a and not need_resp and native.pooled_mix_train_available(resp, a):
            # compiled: each output's gradient times its winning pixel's responses
            grad_resp, grad_a = None, native.pooled_mix_grad(resp, grad.float(), idx, ctx.w)
            grad_a = grad_a.to(a_dtype)
        else:
            grad_resp, grad_a = _pooled_mix_grads(
                resp, grad, idx, ctx.w, a if need_resp else None, a_dtype if need_a else None
            )
        grad_bias = _pooled_bias_grad(grad, idx, bias_dtype) if need_bias and ctx.has_bias else None
        return grad_resp, grad_a, grad_bias, None, None


def _pooled_mix_grads(
    resp: Tensor, grad: Tensor, idx: Tensor, w: int, a: Tensor | None, a_dtype: torch.dtype | None
) -> tuple[Tensor | None, Tensor | None]:
    """``_PooledMix``'s gradients from the pooled gradient and the argmax, a chunk of two
    rows at a time: the responses' (where ``a`` is given) and the coefficients' [Cout, K'] (where
    ``a_dtype`` is given, accumulated in it)."""
    h, wm, kk = resp.shape
    m, cout = wm // w, grad.shape[-1]
    grad_resp = resp.new_empty(resp.shape) if a is not None else None
    grad_a = resp.new_zeros(cout, kk, dtype=a_dtype) if a_dtype is not None else None
    step = _column_pairs(w, m)
    rows = grad.new_empty(2, 2 * step * m, cout)  # a chunk of two full-resolution rows
    for i in range(h // 2):
        for j in range(0, w // 2, step):
            n = min(step, w // 2 - j)
            chunk, cols = rows[:, : 2 * n * m], slice(2 * j * m, 2 * (j + n) * m)
            q = chunk.view(2, n, 2, m, cout)
            quads = (q[0, :, 0], q[0, :, 1], q[1, :, 0], q[1, :, 1])
            _unpool_quads(grad[i, j : j + n], idx[i, j : j + n], quads)
            if grad_a is not None:
                grad_a += (chunk.mT @ resp[2 * i : 2 * i + 2, cols]).sum(0, dtype=grad_a.dtype)
            if grad_resp is not None:
                for r in (0, 1):  # the chunk's rows are not one block of grad_resp's
                    torch.mm(chunk[r], a, out=grad_resp[2 * i + r, cols])
    return grad_resp, grad_a


def _pooled_mix_rows(
    resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int, argmax: bool
) -> tuple[Tensor, Tensor | None]:
    """``_PooledMix``'s forward: the pooled map ``[H/2, W/2, M, Cout]`` and, with ``argmax``,
    the one-byte window positions, computed in ``resp``'s dtype a chunk of two rows at a
    time (under autocast the responses come in bfloat16; out= and in-place ops are not
    autocast)."""
    h, wm, kk = resp.shape
    m, cout = wm // w, a.shape[0]
    a = a.to(resp.dtype)
    bias = None if bias is None else bias.to(resp.dtype)
    out = resp.new_empty(h // 2, w // 2, m, cout)
    idx = torch.empty(out.shape, dtype=torch.uint8, device=out.device) if argmax else None
    step = _column_pairs(w, m)
    rows = resp.new_empty(2, 2 * step * m, cout)  # a chunk of two full-resolution rows, reused
    for i in range(h // 2):
        for j in range(0, w // 2, step):
            n = min(step, w // 2 - j)
            chunk = rows[:, : 2 * n * m]
            torch.matmul(resp[2 * i : 2 * i + 2, 2 * j * m : 2 * (j + n) * m], a.t(), out=chunk)
            q = chunk.view(2, n, 2, m, cout)
            quads = (q[0, :, 0], q[0, :, 1], q[1, :, 0], q[1, :, 1])
            target = out[i, j : j + n]
            _, code = _pool_quads(*quads, out=target, bias=bias, relu=relu, argmax=argmax)
            if argmax:
                idx[i, j : j + n] = code
    return out, idx


# The pooled mixing's chunk: about this many full-resolution rows (pixels times R S B) of
# each of two image rows at a time, so that the GEMM's output stays in cache for the
# pooling that reads it (float32, batch 128: 32 ms a pair of whole rows, 10 in chunks;
# BENCHMARKS.md, "Issue 13, twelfth session").
MIX_CHUNK_ROWS = 8192


def _column_pairs(w: int, m: int) -> int:
    """How many 2x2 windows of one pair of image rows the pooled mixing takes at a time."""
    return max(1, min(w // 2, MIX_CHUNK_ROWS // (2 * m)))


def _pooled_bias_grad(grad: Tensor, idx: Tensor, dtype: torch.dtype) -> Tensor:
    """The bias's gradient through the pool and ReLU: the pooled gradient where the ReLU
    let the window's maximum through (argmax code < 4), summed per channel. On the CPU by
    the batch norm's chunked column sums (a sum over the leading dimensions of a
    channels-innermost map runs far under memory speed there; 2.5x faster for the lifting
    layer's map at batch 64, and summed in float64), elsewhere one masked sum."""
    kept = (idx >> 2) ^ 1  # a byte mask, as in unpooling: 1 below code 4, 0 at 4
    if grad.device.type != "cpu":
        return (grad * kept).sum(dim=(0, 1, 2)).to(dtype)
    c = grad.shape[-1]
    return _column_sums(torch.mul, grad.reshape(-1, c), kept.reshape(-1, c)).to(dtype)


class _GaussProduct(torch.autograd.Function):
    """Batched complex matrix products y = x G in three real ones (Gauss):
    m = (Re x + Im x) Re G, Re y = m - Im x (Re G + Im G), Im y = m + Re x (Im G - Re G).
    Takes (Re x, Im x, Re G, Im G - Re G, Re G + Im G) and returns ``[Re y; Im y]`` stacked,
    ``[2, F, M, N]`` (what ``_InverseRealDFT2`` reads in one GEMM); saves only its inputs
    (the sum Re x + Im x is recomputed in backward, which also runs in three products per
    term).

    ``bias`` [Cout], if given, is added where it costs nothing: a map that is the constant c
    on the whole periodic nh x nw grid has the spectrum c nh nw at frequency (0, 0) and zero
    elsewhere, so adding ``dc_scale`` = nh nw times the bias to the first ``dc_rows`` rows
    (frequency (0, 0) of every group element) adds the bias to every output pixel."""

    @staticmethod
    def forward(
        ctx,
        x_re: Tensor,
        x_im: Tensor,
        g_re: Tensor,
        g_diff: Tensor,
        g_sum: Tensor,
        bias: Tensor | None = None,
        dc_rows: int = 0,
        dc_scale: float = 1.0,
    ):
        ctx.save_for_backward(x_re, x_im, g_re, g_diff, g_sum)
        ctx.dc_rows, ctx.dc_scale = dc_rows, dc_scale
        m = torch.bmm(x_re + x_im, g_re)
        # out= is not autocast: the operands in m's dtype
        x_re, x_im, g_diff, g_sum = (t.to(m.dtype) for t in (x_re, x_im, g_diff, g_sum))
        y = m.new_empty(2, *m.shape)
        _plus_product(m, x_im, g_sum, -1, out=y[0])
        if bias is not None:
            y[0, :dc_rows].add_(bias.to(y.dtype), alpha=dc_scale)
        _plus_product(m, x_re, g_diff, 1, out=y[1])
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        dy_re, dy_im = dy[0], dy[1]
        dtype = dy_re.dtype  # under autocast the saved inputs may be wider than the grads
        x_re, x_im, g_re, g_diff, g_sum = (t.to(dtype) for t in ctx.saved_tensors)
        need = ctx.needs_input_grad
        dm = dy_re + dy_im
        dx_re = dx_im = dg_re = dg_diff = dg_sum = dbias = None
        if need[0] or need[1]:
            dxs = torch.bmm(dm, g_re.mT)
            if need[0]:
                dx_re = _plus_product(dxs, dy_im, g_diff.mT, 1)
            if need[1]:
                dx_im = _plus_product(dxs, dy_re, g_sum.mT, -1)
        if need[2]:
            dg_re = torch.bmm((x_re + x_im).mT, dm)
        if need[3]:
            dg_diff = torch.bmm(x_re.mT, dy_im)
        if need[4]:
            dg_sum = torch.bmm(x_im.mT, dy_re).neg_()
        if len(need) > 5 and need[5]:
            dbias = _dc_bias_grad(dy_re, ctx.dc_rows, ctx.dc_scale)
        return dx_re, dx_im, dg_re, dg_diff, dg_sum, dbias, None, None


def _plus_product(
    base: Tensor, a: Tensor, b: Tensor, sign: int, out: Tensor | None = None
) -> Tensor:
    """``base + sign * a @ b`` (batched), into ``out`` if given. float32 and float64 on the
    CPU take a product, then a pass that adds: MKL's batched GEMM with an accumulated output
    (what ``baddbmm`` calls there) ran at about half its plain rate on this project's CPU
    (BENCHMARKS.md, "Issue 13, thirteenth session"). Reduced precision (oneDNN adds at no cost
    and rounds once) and other devices (cuBLAS) keep ``baddbmm``."""
    if base.device.type != "cpu" or base.dtype not in (torch.float32, torch.float64):
        return torch.baddbmm(base, a, b, alpha=sign, out=out)
    p = torch.bmm(a, b, out=out)
    return p.add_(base) if sign > 0 else torch.sub(base, p, out=p)


def joined_complex_product(
    x_re: Tensor,
    x_im: Tensor,
    g: Tensor,
    bias: Tensor | None = None,
    dc_rows: int = 0,
    dc_scale: float = 1.0,
) -> Tensor:
    """``_GaussProduct``'s y = x G in four real products done as one: the rows
    ``[Re x; Im x]`` times the columns ``[Re G, Im G]`` (``g`` ``[F, K, 2N]``), then
    Re y = Re x Re G - Im x Im G and Im y = Re x Im G + Im x Re G; returns ``[Re y; Im y]``
    stacked, ``[2, F, M, N]``, the bias as ``_GaussProduct`` adds it. It reads two spectra
    where the Gauss form reads three, at 4/3 of its multiply-adds: the faster form where
    few rows share each frequency's spectrum (one image), since the products are then bound
    by reading the spectra. Plain operators (autograd's backward)."""
    m, n = x_re.shape[1], g.shape[2] // 2
    p = torch.bmm(torch.cat([x_re, x_im], 1), g)  # [F, 2M, 2N]: (re, im) x (re, im)
    y = torch.stack([p[:, :m, :n] - p[:, m:, n:], p[:, :m, n:] + p[:, m:, :n]])
    if bias is not None:
        y[0, :dc_rows] += bias.to(y.dtype) * dc_scale
    return y


def _dc_bias_grad(dy_re: Tensor, dc_rows: int, dc_scale: float) -> Tensor:
    """The gradient of a bias added as ``dc_scale`` times itself to the real part of the
    first ``dc_rows`` rows of ``[F, M, N]`` spectra; bfloat16 gradients summed in float32."""
    wide = torch.promote_types(dy_re.dtype, torch.float32)
    return dy_re[:dc_rows].sum((0, 1), dtype=wide).mul_(dc_scale)


def _copy_runs(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` where both hold their last dimension contiguous: short runs (a
    basis's K values, 24 bytes in bfloat16) move as 8-byte words where sizes and offsets
    allow, which the element-wise copy does 1.3x slower in bfloat16 (BENCHMARKS.md); a plain
    copy where autograd records it."""
    size = dst.element_size()
    if (
        size < 8
        and not (torch.is_grad_enabled() and src.requires_grad)
        and dst.dtype == src.dtype
        and dst.stride(-1) == src.stride(-1) == 1
        and (dst.shape[-1] * size) % 8 == 0
        and all((t.storage_offset() * size) % 8 == 0 for t in (dst, src))
        and all((st * size) % 8 == 0 for t in (dst, src) for st in t.stride()[:-1])
    ):
        dst, src = dst.view(torch.int64), src.view(torch.int64)
    dst.copy_(src)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on ``device``'s type now, None where it is off."""
    kind = device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype a kernel computes ``t`` in: autocast's, where autocast is on and would cast
    it (it leaves float64 alone), else ``t``'s own."""
    autocast = _autocast_dtype(t.device)
    return autocast if autocast is not None and t.dtype != torch.float64 else t.dtype


def _dft_product(a: Tensor, b: Tensor) -> Tensor:
    """A DFT matrix ``a`` ``[M, K]`` times maps ``b`` ``[K, N]`` or, the same matrix for
    each, ``[B, K, N]``: in bfloat16 on the CPU the compiled kernel for a small matrix and
    long rows (``native.small_gemm``; 1.2-3.3x the library GEMM at these shapes,
    BENCHMARKS.md), else torch's GEMM."""
    if native.small_gemm_available(a, b):
        return native.small_gemm(a, b)
    return a @ b if b.dim() == 2 else torch.bmm(a.expand(b.shape[0], *a.shape), b)


def _inverse_along_h(y: Tensor, shape: tuple[int, int, int, int]) -> tuple[_DFTMatrices, Tensor]:
    """The inverse DFT's first GEMM, along H, in the dtype it computes in: the spectrum
    ``[Re Y; Im Y]`` (``[2, nh, Fw*M]``) -> the DFT matrices and z ``[H, 2Fw, M]``, rows
    (h, re/im), z = sum_n y e^{+i 2 pi n h / nh}."""
    h, w, nh, nw = shape
    fw = nw // 2 + 1
    dtype = _compute_dtype(y)
    dft = _dft_matrices(h, w, nh, nw, dtype, y.device)
    y = y.to(dtype).reshape(2 * nh, -1)
    with torch.autocast(y.device.type, enabled=False):
        return dft, _dft_product(dft.inv_h, y).view(h, 2 * fw, y.shape[1] // fw)


class _RealDFT2(torch.autograd.Function):
    """The 2D DFT of real maps zero-padded to an nh x nw periodic grid, half spectrum along W:
    spatial-major ``x [H, W*M] -> (Re X, Im X)``, each ``[nh, Fw, M]``, Fw = nw//2 + 1, in
    two GEMMs (GEMMs beat FFTs at these sizes): along W first, where the input is real and
    the half spectrum is all that is kept (2 Fw W multiply-adds per row), then along H on
    complex values (4 nh H per column; H first would pay 2 nh H on the real input, then
    4 Fw W per row, a third more in all). The backward runs the transposed GEMMs and
    accumulates in place, so autograd never sums the two gradients of an intermediate that
    feeds two products (an allocation and a pass over it each). ``shape`` = (H, W, nh, nw);
    computes in autocast's dtype where autocast is on."""

    @staticmethod
    def forward(ctx, x: Tensor, shape: tuple[int, int, int, int]):
        h, w, nh, nw = ctx.shape = shape
        dtype = _compute_dtype(x)
        dft = _dft_matrices(h, w, nh, nw, dtype, x.device)
        x = x.to(dtype)
        m = x.shape[1] // w
        with torch.autocast(x.device.type, enabled=False):
            # along W: a = sum_w x e^{-i 2 pi f w / nw}, rows (h, re/im): [H, 2Fw, M]
            a = _dft_product(dft.fwd_w, x.view(h, w, m))
        return _forward_along_h(dft, a, shape)

    @staticmethod
    def backward(ctx, g_re: Tensor, g_im: Tensor):
        h, w, nh, nw = ctx.shape
        fw = nw // 2 + 1
        g_im = g_im.to(g_re.dtype)
        dft = _dft_matrices(h, w, nh, nw, g_re.dtype, g_re.device)
        m = g_re.shape[-1]
        ga = dft.fwd_h[:nh].mT @ g_re.reshape(nh, fw * m)
        ga.addmm_(dft.fwd_h[nh:].mT, g_im.reshape(nh, fw * m))  # [2H, Fw*M], rows (h, re/im)
        gx = torch.bmm(dft.fwd_w.mT.expand(h, w, 2 * fw), ga.view(h, 2 * fw, m))
        return gx.view(h, w * m), None


def _forward_along_h(
    dft: _DFTMatrices, a: Tensor, shape: tuple[int, int, int, int]
) -> tuple[Tensor, Tensor]:
    """The forward DFT's second GEMM: ``a`` ``[H, 2Fw, M]`` (rows (h, re/im), the first
    GEMM's) -> (Re X, Im X), each ``[nh, Fw, M]``; X = sum_h a e^{-i 2 pi n h / nh}."""
    h, _, nh, nw = shape
    fw, m = nw // 2 + 1, a.shape[-1]
    with torch.autocast(a.device.type, enabled=False):
        spectrum = _dft_product(dft.fwd_h, a.view(2 * h, fw * m))  # rows (re/im, n)
    return spectrum[:nh].view(nh, fw, m), spectrum[nh:].view(nh, fw, m)


def real_dft2_rows(
    xs: Tensor, index: Tensor, shape: tuple[int, int, int, int]
) -> tuple[Tensor, Tensor]:
    """``_RealDFT2`` of the rows ``xs[index]`` (viewed ``[H, W*M]``), without a gradient:
    on the CPU, in bfloat16 (the AVX-512 build) or float32 (the AVX2 build), the first GEMM
    reads each row where it lies
    (``native.small_gemm_gather``: the gathered copy is neither written nor read back),
    elsewhere the gathered copy and ``_RealDFT2``."""
    h, w, nh, nw = shape
    dtype = _compute_dtype(xs)
    dft = _dft_matrices(h, w, nh, nw, dtype, xs.device)
    src = xs.to(dtype)
    if native.small_gemm_gather_available(dft.fwd_w, src):
        with torch.autocast(xs.device.type, enabled=False):
            a = native.small_gemm_gather(dft.fwd_w, src, index, h)
        return _forward_along_h(dft, a, shape)
    return _RealDFT2.apply(xs.index_select(0, index).view(h, -1), shape)


class _InverseRealDFT2(torch.autograd.Function):
    """The inverse of ``_RealDFT2``'s transform, first H x W outputs only: the spectrum
    ``[Re Y; Im Y]`` stacked, ``[2, nh, Fw*M]`` (as the mixing returns it) -> ``y [H, W, M]``
    (real; the half spectrum stands for the whole by Hermitian symmetry), one GEMM along
    each axis each way (rows (h, re/im) between them)."""

    @staticmethod
    def forward(ctx, y: Tensor, shape: tuple[int, int, int, int]):
        ctx.shape, ctx.in_shape = shape, y.shape
        dft, z = _inverse_along_h(y, shape)
        with torch.autocast(z.device.type, enabled=False):
            # along W, Hermitian weights folded into the matrix: [H, W, M]
            return _dft_product(dft.inv_w, z)

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, w, nh, nw = ctx.shape
        fw = nw // 2 + 1
        dft = _dft_matrices(h, w, nh, nw, grad.dtype, grad.device)
        m = grad.shape[-1]
        gz = torch.bmm(dft.inv_w.mT.expand(h, 2 * fw, w), grad).view(2 * h, fw * m)
        return (dft.inv_h.mT @ gz).view(ctx.in_shape), None


def inverse_real_dft2_pooled(
    y: Tensor,
    shape: tuple[int, int, int, int],
    relu: bool,
    out: Tensor | None = None,
    index: Tensor | None = None,
) -> Tensor:
    """``_InverseRealDFT2``'s maps ``[H, W, M]`` 2x2 max-pooled (and through a ReLU if
    ``relu``), without a gradient: ``[H/2, W/2, M]``. On the CPU, in bfloat16 (the AVX-512
    build) or float32 (the AVX2 build), the last GEMM and the pool are one compiled pass (``native.small_gemm_pool``: the full-resolution
    maps never written), elsewhere the inverse and then ``_pool_quads``. With ``out``
    ``[rows, SEG]`` and ``index``: the pooled maps as rows of SEG values go to
    ``out[index]`` (in the compiled pass as it writes them), and ``out`` is returned."""
    h, w = shape[:2]
    dft, z = _inverse_along_h(y, shape)
    with torch.autocast(z.device.type, enabled=False):
        if native.small_gemm_pool_available(dft.inv_w, z):
            if out is not None and out.dtype == z.dtype and out.shape[1] >= 32:
                return native.small_gemm_pool(dft.inv_w, z, relu, out=out, index=index)
            pooled = native.small_gemm_pool(dft.inv_w, z, relu)
        else:
            v = _dft_product(dft.inv_w, z).view(h // 2, 2, w // 2, 2, z.shape[-1])
            pooled = v.new_empty(h // 2, w // 2, v.shape[-1])
            quads = (v[:, 0, :, 0], v[:, 0, :, 1], v[:, 1, :, 0], v[:, 1, :, 1])
            _pool_quads(*quads, relu=relu, argmax=False, out=pooled)
    if out is None:
        return pooled
    return out.index_copy_(0, index, pooled.view(-1, out.shape[1]).to(out.dtype))


class _GatherRows(torch.autograd.Function):
    """Blocks of rows of a 2D tensor, ``x[index]`` for each index of ``indices``, where the
    indices together name every row once: the gradient writes each block's rows back (no
    zero fill, no scatter-add)."""

    @staticmethod
    def forward(ctx, x: Tensor, *indices: Tensor):
        ctx.indices, ctx.shape = indices, x.shape
        return tuple(x.index_select(0, index) for index in indices)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        gx = grads[0].new_empty(ctx.shape)
        for index, grad in zip(ctx.indices, grads, strict=True):
            gx.index_copy_(0, index, grad)
        return (gx, *(None for _ in ctx.indices))


class _ScatterRows(torch.autograd.Function):
    """The inverse of ``_GatherRows``: ``y[index] = block`` for each (index, block), the
    indices together naming every row of ``y`` once."""

    @staticmethod
    def forward(ctx, indices: tuple[Tensor, ...], *blocks: Tensor):
        ctx.indices = indices
        rows = sum(len(index) for index in indices)
        y = blocks[0].new_empty(rows, *blocks[0].shape[1:])
        for index, block in zip(indices, blocks, strict=True):
            y.index_copy_(0, index, block)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (None, *(grad.index_select(0, index) for index in ctx.indices))


@functools.lru_cache(maxsize=32)
def _fft_rows(
    h: int, w: int, rot: int, quarters: int, bounds: tuple[int, ...], device: torch.device
) -> tuple[Tensor, ...] | None:
    """Which rows of an ``[H, W, R, S]`` grid of maps (rows (h, w, r, s)) the FFT path's
    blocks of scales read: for the scales ``bounds[i]`` to ``bounds[i + 1]``, rows (h, w, p,
    s, q), r = q R/Q + p, where map q R/Q + p is turned back by q quarter turns (Q =
    ``quarters``, 1 or 4; quarter turns need H = W). None where that is the identity (one
    block, Q = 1)."""
    if quarters == 1 and len(bounds) == 2:
        return None
    nsc, part = bounds[-1], rot // quarters
    pixels = torch.arange(h * w).view(h, w)
    # source pixel of each output pixel of a map turned by -q quarter turns
    turned = torch.stack([torch.rot90(pixels, -q, (0, 1)).flatten() for q in range(quarters)])
    hw = torch.arange(h * w).view(-1, 1, 1, 1)
    p = torch.arange(part).view(1, -1, 1, 1)
    q = torch.arange(quarters).view(1, 1, 1, -1)
    maps = (turned[q, hw] * rot + q * part + p) * nsc  # [H*W, R/Q, 1, Q], scale 0
    blocks = []
    for first, end in zip(bounds, bounds[1:], strict=False):
        index = maps + torch.arange(first, end).view(1, 1, -1, 1)  # [H*W, R/Q, S', Q]
        blocks.append(index.flatten().to(device))
    return tuple(blocks)


class _DFTMatrices:
    """Real DFT matrices for an H x W signal zero-padded to an nh x nw periodic grid."""

    def __init__(self, h: int, w: int, nh: int, nw: int, dtype: torch.dtype, device: torch.device):
        fw = nw // 2 + 1
        two_pi = 2 * math.pi
        rows, cols = torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64)
        kh, kw = torch.arange(nh, dtype=torch.float64), torch.arange(fw, dtype=torch.float64)
        ang_h = two_pi * torch.outer(kh, rows) / nh  # [nh, H]
        ang_w = two_pi * torch.outer(kw, cols) / nw  # [Fw, W]
        # Hermitian weights of the half spectrum: DC (and Nyquist) once, the rest twice
        weight = torch.full((fw,), 2.0, dtype=torch.float64)
        weight[0] = 1
        if nw % 2 == 0:
            weight[-1] = 1
        scale = 1.0 / (nh * nw)

        def cast(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        # forward along W from the real maps to rows (re/im, f) per image row h ...
        cw, sw = ang_w.cos(), ang_w.sin()
        self.fwd_w = cast(torch.cat([cw, -sw]))  # [2Fw, W]
        # ... then along H from columns (h, re/im) to rows (re/im, n):
        # Re X = cos Re a + sin Im a, Im X = cos Im a - sin Re a
        ch, sh = ang_h.cos(), ang_h.sin()  # [nh, H]
        re_rows = torch.stack([ch, sh], 2).flatten(1, 2)  # [nh, 2H], columns (h, re/im)
        im_rows = torch.stack([-sh, ch], 2).flatten(1, 2)
        self.fwd_h = cast(torch.cat([re_rows, im_rows]))  # [2nh, 2H]
        # inverse along H from [Re Y; Im Y] to rows (h, re/im), then along W from [Re z; Im z],
        # the Hermitian weights folded in
        ic, is_ = ang_h.cos().T, ang_h.sin().T  # [H, nh]
        rows = torch.stack([torch.cat([ic, -is_], 1), torch.cat([is_, ic], 1)], 1)
        self.inv_h = cast(rows.flatten(0, 1))  # [2H, 2nh]
        self.inv_w = cast(torch.cat([cw.T, -sw.T], 1) * torch.cat([weight, weight]) * scale)

    def separate(self) -> dict[str, Tensor]:
        """The eight real matrices the joined ones are made of, each contiguous: cos_h,
        msin_h [nh, H]; cos_w, sin_w [Fw, W]; inv_cos_h, inv_sin_h [H, nh]; inv_cos_w,
        inv_sin_w [W, Fw] (``export.floor_bench`` writes its graph with them)."""
        nh, fw = self.inv_h.shape[1] // 2, self.inv_w.shape[1] // 2
        parts = {
            "cos_h": self.fwd_h[:nh, 0::2],
            "msin_h": self.fwd_h[nh:, 0::2],
            "cos_w": self.fwd_w[:fw],
            "sin_w": -self.fwd_w[fw:],
            "inv_cos_h": self.inv_h[0::2, :nh],
            "inv_sin_h": self.inv_h[1::2, :nh],
            "inv_cos_w": self.inv_w[:, :fw],
            "inv_sin_w": self.inv_w[:, fw:],
        }
        return {name: t.contiguous() for name, t in parts.items()}


@functools.lru_cache(maxsize=64)
def _dft_matrices(
    h: int, w: int, nh: int, nw: int, dtype: torch.dtype, device: torch.device
) -> _DFTMatrices:
    return _DFTMatrices(h, w, nh, nw, dtype, device)
