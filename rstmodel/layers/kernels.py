"""The convolutions' fast-path kernels: autograd functions that keep memory and passes
down (the lifting layer's pooled channel mixing, the FFT path's three-product complex
mixing and quarter-turn row gather) and the cached DFT matrices."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .pooling import _pool_quads, _unpool_quads


class _PooledMix(torch.autograd.Function):
    """``relu(maxpool2x2(resp @ a^T + bias))`` for spatial-major responses ``resp
    [H, W*M, K']`` (the lifting layer's basis path, M = R*S*B), two rows of H at a time:
    neither the full-resolution map nor its gradient is ever stored, only the pooled map
    and a one-byte argmax (4: clamped by the ReLU). Returns ``[H/2, W/2, M, Cout]``."""

    @staticmethod
    def forward(ctx, resp: Tensor, a: Tensor, bias: Tensor | None, relu: bool, w: int):
        h, wm, kk = resp.shape
        m, cout = wm // w, a.shape[0]
        keep = any(ctx.needs_input_grad[:3])
        ctx.dtypes = a.dtype, None if bias is None else bias.dtype
        # under autocast the responses come in bfloat16: compute in their dtype (out= and
        # in-place ops are not autocast)
        a = a.to(resp.dtype)
        bias = None if bias is None else bias.to(resp.dtype)
        out = resp.new_empty(h // 2, w // 2, m, cout)
        idx = torch.empty(out.shape, dtype=torch.uint8, device=out.device) if keep else None
        rows = resp.new_empty(2, wm, cout)  # one pair of full-resolution rows, reused
        for i in range(h // 2):
            torch.matmul(resp[2 * i : 2 * i + 2], a.t(), out=rows)
            q = rows.view(2, w // 2, 2, m, cout)
            quads = (q[0, :, 0], q[0, :, 1], q[1, :, 0], q[1, :, 1])
            _, code = _pool_quads(*quads, out=out[i], bias=bias, relu=relu, argmax=keep)
            if keep:
                idx[i] = code
        if keep:
            ctx.save_for_backward(resp, a, idx)
            ctx.w, ctx.has_bias = w, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        resp, a, idx = ctx.saved_tensors
        w = ctx.w
        h, wm, kk = resp.shape
        m, cout = wm // w, a.shape[0]
        need_resp, need_a, need_bias = ctx.needs_input_grad[:3]
        a_dtype, bias_dtype = ctx.dtypes
        grad_resp = resp.new_empty(resp.shape) if need_resp else None
        grad_a = a.new_zeros(a.shape, dtype=a_dtype) if need_a else None
        grad_bias = None
        if need_bias and ctx.has_bias:
            grad_bias = (grad * (idx < 4)).sum(dim=(0, 1, 2)).to(bias_dtype)
        rows = grad.new_empty(2, wm, cout)
        q = rows.view(2, w // 2, 2, m, cout)
        quads = (q[0, :, 0], q[0, :, 1], q[1, :, 0], q[1, :, 1])
        for i in range(h // 2):
            _unpool_quads(grad[i], idx[i], quads)
            if need_a:  # accumulated in the weight's dtype
                grad_a += rows.view(-1, cout).t() @ resp[2 * i : 2 * i + 2].reshape(-1, kk)
            if need_resp:
                torch.matmul(rows, a, out=grad_resp[2 * i : 2 * i + 2])
        return grad_resp, grad_a, grad_bias, None, None


def _accumulate(out: Tensor, m1: Tensor, m2: Tensor, alpha: float = 1) -> Tensor:
    """``out += alpha m1 @ m2`` in place (batched or not), saving a GB-sized allocation on
    the FFT path; autocast does not cast in-place ops, so the factors take ``out``'s dtype."""
    m1, m2 = m1.to(out.dtype), m2.to(out.dtype)
    if out.dim() == 3:
        return out.baddbmm_(m1, m2, alpha=alpha)
    return out.addmm_(m1, m2, alpha=alpha)


class _GaussProduct(torch.autograd.Function):
    """Batched complex matrix products y = x G in three real ones (Gauss):
    m = (Re x + Im x) Re G, Re y = m - Im x (Re G + Im G), Im y = m + Re x (Im G - Re G).
    Takes (Re x, Im x, Re G, Im G - Re G, Re G + Im G); saves only its inputs (the sum
    Re x + Im x is recomputed in backward, which also runs in three products per term)."""

    @staticmethod
    def forward(ctx, x_re: Tensor, x_im: Tensor, g_re: Tensor, g_diff: Tensor, g_sum: Tensor):
        ctx.save_for_backward(x_re, x_im, g_re, g_diff, g_sum)
        m = torch.bmm(x_re + x_im, g_re)
        y_re = torch.baddbmm(m, x_im, g_sum, alpha=-1)
        # in place into m (autocast does not cast in-place ops: match m's dtype)
        return y_re, m.baddbmm_(x_re.to(m.dtype), g_diff.to(m.dtype))

    @staticmethod
    def backward(ctx, dy_re: Tensor, dy_im: Tensor):
        dtype = dy_re.dtype  # under autocast the saved inputs may be wider than the grads
        x_re, x_im, g_re, g_diff, g_sum = (t.to(dtype) for t in ctx.saved_tensors)
        need = ctx.needs_input_grad
        dm = dy_re + dy_im
        dx_re = dx_im = dg_re = dg_diff = dg_sum = None
        if need[0] or need[1]:
            dxs = torch.bmm(dm, g_re.mT)
            if need[0]:
                dx_re = torch.baddbmm(dxs, dy_im, g_diff.mT)
            if need[1]:
                dx_im = torch.baddbmm(dxs, dy_re, g_sum.mT, alpha=-1)
        if need[2]:
            dg_re = torch.bmm((x_re + x_im).mT, dm)
        if need[3]:
            dg_diff = torch.bmm(x_re.mT, dy_im)
        if need[4]:
            dg_sum = torch.bmm(x_im.mT, dy_re).neg_()
        return dx_re, dx_im, dg_re, dg_diff, dg_sum


class _RowGather(torch.autograd.Function):
    """Rows ``x[index]`` of a 2D tensor, where ``index`` is a permutation and ``inverse``
    its inverse: the gradient is the inverse gather (no scatter-add)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


@functools.lru_cache(maxsize=32)
def _quarter_turn_rows(n: int, rot: int, nsc: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row permutation of an ``[n, n, R, S]`` grid of maps (rows (h, w, r, s)) to rows
    (h, w, p, s, q), r = q R/4 + p, where map q R/4 + p is turned back by q quarter
    turns; and its inverse (which turns them forward again)."""
    quarter = rot // 4
    pixels = torch.arange(n * n).view(n, n)
    # source pixel of each output pixel of a map turned by -q quarter turns
    turned = torch.stack([torch.rot90(pixels, -q, (0, 1)).flatten() for q in range(4)])  # [4, n*n]
    hw = torch.arange(n * n).view(-1, 1, 1, 1)
    p = torch.arange(quarter).view(1, -1, 1, 1)
    s = torch.arange(nsc).view(1, 1, -1, 1)
    q = torch.arange(4).view(1, 1, 1, -1)
    index = (turned[q, hw] * rot + q * quarter + p) * nsc + s  # [n*n, R/4, S, 4]
    index = index.flatten()
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel())
    return index.to(device), inverse.to(device)


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

        self.cos_h = cast(ang_h.cos())  # [nh, H]
        self.msin_h = cast(-ang_h.sin())
        self.cos_w = cast(ang_w.cos())  # [Fw, W]
        self.sin_w = cast(ang_w.sin())
        self.inv_cos_h = cast(ang_h.cos().T)  # [H, nh]
        self.inv_sin_h = cast(ang_h.sin().T)
        self.inv_cos_w = cast(ang_w.cos().T * weight * scale)  # [W, Fw]
        self.inv_sin_w = cast(-ang_w.sin().T * weight * scale)


@functools.lru_cache(maxsize=16)
def _dft_matrices(
    h: int, w: int, nh: int, nw: int, dtype: torch.dtype, device: torch.device
) -> _DFTMatrices:
    return _DFTMatrices(h, w, nh, nw, dtype, device)
