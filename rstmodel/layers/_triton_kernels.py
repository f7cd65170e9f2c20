"""The Triton kernel of ``complex_mix`` (imported on first use: it needs Triton, and
whether it compiles or runs in Triton's interpreter is fixed when it is imported).

``cbmm_kernel`` takes its tile sizes as arguments; ``cbmm_tuned`` (compiled mode only) picks
them, the warps and the pipeline depth by timing ``CONFIGS`` on the first call of each
problem shape (a few seconds once per process: the FFT path has six shapes per model)."""

import triton
import triton.language as tl

from .triton_ops import interpreting

# the mode triton.jit chose below; complex_mix reloads this module if it changes
INTERPRETED = interpreting()


@triton.jit
def _rounded(x, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """float32 ``x`` rounded to DTYPE (to nearest, ties to even), as float32. Triton's
    interpreter truncates where it converts to bfloat16, so there it rounds the bits."""
    if WIDEN and tl.bfloat16 == DTYPE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def _operand(x, DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """A loaded tile as tl.dot's operand: in DTYPE, or under the interpreter (WIDEN: it
    multiplies bfloat16 tiles wrongly) in float32 holding DTYPE's values; a product of two
    bfloat16 values is exact in float32, so the sums are the same."""
    y = _rounded(x.to(tl.float32), DTYPE, WIDEN) if WIDEN else x.to(DTYPE)
    return y


@triton.jit
def cbmm_kernel(
    a_re,
    a_im,
    b_re,
    b_im,
    c_re,
    c_im,
    bias,
    M,
    N,
    K,
    dc_rows,
    dc_scale,
    s_af,
    s_am,
    s_ak,
    s_bf,
    s_bk,
    s_bn,
    s_cf,
    s_cm,
    s_cn,
    SIGN_A: tl.constexpr,  # +1, or -1 for conj(a)
    SIGN_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,  # the interpreter: DOT_DTYPE's values in float32 (see _operand)
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One [BM, BN] tile of c = a b (a, b complex; a or b conjugated by SIGN_A / SIGN_B = -1)
    at frequency program_id(0), tile program_id(1) of (M / BM) x (N / BN); reals and
    imaginaries accumulate in float32. Builtins only (no triton.language.standard such as
    tl.zeros or tl.cdiv), so the interpreter runs it whenever TRITON_INTERPRET is set before
    this module is imported, even if Triton itself was imported before (torch does)."""
    f = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles_n = (N + BN - 1) // BN
    rm = (tile // tiles_n) * BM + tl.arange(0, BM)
    rn = (tile % tiles_n) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_off = f * s_af + rm[:, None] * s_am + rk[None, :] * s_ak
    b_off = f * s_bf + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc_re = tl.full((BM, BN), 0.0, tl.float32)
    acc_im = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        mask_a = (rm[:, None] < M) & (rk[None, :] + k0 < K)
        mask_b = (rk[:, None] + k0 < K) & (rn[None, :] < N)
        ar = _operand(tl.load(a_re + a_off, mask=mask_a, other=0.0), DOT_DTYPE, WIDEN)
        ai = _operand(tl.load(a_im + a_off, mask=mask_a, other=0.0), DOT_DTYPE, WIDEN)
        br = _operand(tl.load(b_re + b_off, mask=mask_b, other=0.0), DOT_DTYPE, WIDEN)
        bi = _operand(tl.load(b_im + b_off, mask=mask_b, other=0.0), DOT_DTYPE, WIDEN)
        # (ar + i sa ai)(br + i sb bi) = ar br - sa sb ai bi + i (sb ar bi + sa ai br);
        # the signs go on operands in registers (exact), so two accumulators suffice
        bi_re = -bi if SIGN_A == SIGN_B else bi
        bi_im = bi if SIGN_B == 1 else -bi
        ai_im = ai if SIGN_A == 1 else -ai
        acc_re = tl.dot(ar, br, acc_re, input_precision=PRECISION)
        acc_re = tl.dot(ai, bi_re, acc_re, input_precision=PRECISION)
        acc_im = tl.dot(ar, bi_im, acc_im, input_precision=PRECISION)
        acc_im = tl.dot(ai_im, br, acc_im, input_precision=PRECISION)
        a_off += BK * s_ak
        b_off += BK * s_bk
    if HAS_BIAS:  # added to the real part at the first dc_rows frequencies
        add = tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32) * dc_scale
        acc_re += add[None, :] * (f < dc_rows).to(tl.float32)
    c_off = f * s_cf + rm[:, None] * s_cm + rn[None, :] * s_cn
    mask_c = (rm[:, None] < M) & (rn[None, :] < N)
    acc_re, acc_im = _rounded(acc_re, DOT_DTYPE, WIDEN), _rounded(acc_im, DOT_DTYPE, WIDEN)
    tl.store(c_re + c_off, acc_re.to(c_re.dtype.element_ty), mask=mask_c)
    tl.store(c_im + c_off, acc_im.to(c_im.dtype.element_ty), mask=mask_c)


CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=warps, num_stages=stages)
    for bm, bn, bk, warps, stages in [
        (16, 64, 32, 4, 3),  # batch 1: four rows (the quarter turns)
        (32, 64, 32, 4, 4),
        (64, 64, 32, 4, 3),
        (64, 64, 64, 4, 3),
        (128, 64, 32, 4, 3),
        (64, 128, 32, 4, 3),
        (128, 128, 32, 8, 3),
        (128, 64, 64, 8, 2),
    ]
]
cbmm_tuned = (
    None
    if INTERPRETED
    else triton.autotune(CONFIGS, key=["M", "N", "K", "SIGN_A", "SIGN_B"])(cbmm_kernel)
)


@triton.jit
def _rows_dot(
    resp,
    row,
    rm,
    rk,
    M,
    K,
    a_t,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Responses of full-resolution pixel ``row`` (rows ``rm`` of its M) times ``a_t``."""
    offs = (row * M + rm[:, None]).to(tl.int64) * K + rk[None, :]
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    r = _operand(tl.load(resp + offs, mask=mask, other=0.0), DOT_DTYPE, WIDEN)
    # rounded as torch's product in the responses' dtype would be, so that the window's
    # comparisons (and so the argmax) are the torch path's
    return _rounded(tl.dot(r, a_t, input_precision=PRECISION), DOT_DTYPE, WIDEN)


@triton.jit
def pooled_mix_kernel(
    resp,
    a,
    bias,
    out,
    idx,
    W,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    SAVE_IDX: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One [BM, BN] tile of the pooled map at pooled pixel program_id(0) = i W/2 + j:
    relu(max over the 2x2 window of resp[pixel] a^T + bias) and the window position that
    won (0..3 in scan order, the first of equal values; 4 where the ReLU clamps). resp
    [H*W, M, K] and out / idx [H/2 * W/2, M, N], contiguous; K <= BK (one block)."""
    p = tl.program_id(0)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rn = tl.program_id(2) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_mask = (rk[:, None] < K) & (rn[None, :] < N)
    a_t = _operand(
        tl.load(a + rn[None, :] * K + rk[:, None], mask=a_mask, other=0.0), DOT_DTYPE, WIDEN
    )
    half = W // 2
    row = 2 * (p // half) * W + 2 * (p % half)  # the window's top left pixel
    p0 = _rows_dot(resp, row, rm, rk, M, K, a_t, DOT_DTYPE, PRECISION, WIDEN)
    p1 = _rows_dot(resp, row + 1, rm, rk, M, K, a_t, DOT_DTYPE, PRECISION, WIDEN)
    top = tl.maximum(p0, p1)
    code = tl.where(p1 > p0, 1, 0)
    p2 = _rows_dot(resp, row + W, rm, rk, M, K, a_t, DOT_DTYPE, PRECISION, WIDEN)
    p3 = _rows_dot(resp, row + W + 1, rm, rk, M, K, a_t, DOT_DTYPE, PRECISION, WIDEN)
    bottom = tl.maximum(p2, p3)
    code = tl.where(bottom > top, tl.where(p3 > p2, 3, 2), code)
    best = tl.maximum(top, bottom)
    if HAS_BIAS:
        b = _rounded(tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32), DOT_DTYPE, WIDEN)
        best = _rounded(best + b[None, :], DOT_DTYPE, WIDEN)
    if RELU:
        code = tl.where(best <= 0, 4, code)
        best = tl.maximum(best, 0.0)
    offs = (p * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out + offs, best.to(out.dtype.element_ty), mask=mask)
    if SAVE_IDX:
        tl.store(idx + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def _window_grad(
    resp,
    row,
    d,
    g,
    code,
    rm,
    rk,
    M,
    K,
    acc,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """acc [BN, BK] += (the gradient where window position d won)^T resp[row]."""
    gd = _operand(tl.where(code == d, g, 0.0), DOT_DTYPE, WIDEN)
    offs = (row * M + rm[:, None]).to(tl.int64) * K + rk[None, :]
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    r = _operand(tl.load(resp + offs, mask=mask, other=0.0), DOT_DTYPE, WIDEN)
    return tl.dot(tl.trans(gd), r, acc, input_precision=PRECISION)


@triton.jit
def pooled_mix_grad_kernel(
    resp,
    grad,
    idx,
    part,
    W,
    M,
    N,
    K,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    ROWS_PER: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """The coefficients' gradient from pooled pixel program_id(0), rows program_id(2) *
    ROWS_PER of its M: part [N, K] = the sum over the window's positions d and those rows of
    (grad where d won)^T resp[position d]; the caller sums the parts (a fixed order: no
    atomics, the same result every run)."""
    p = tl.program_id(0)
    chunk = tl.program_id(2)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    half = W // 2
    row = 2 * (p // half) * W + 2 * (p % half)
    acc = tl.full((BN, BK), 0.0, tl.float32)
    for m0 in range(chunk * ROWS_PER, chunk * ROWS_PER + ROWS_PER, BM):
        rm = m0 + tl.arange(0, BM)
        offs = (p * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
        code = tl.load(idx + offs, mask=mask, other=4).to(tl.int32)
        acc = _window_grad(resp, row, 0, g, code, rm, rk, M, K, acc, DOT_DTYPE, PRECISION, WIDEN)
        acc = _window_grad(
            resp, row + 1, 1, g, code, rm, rk, M, K, acc, DOT_DTYPE, PRECISION, WIDEN
        )
        acc = _window_grad(
            resp, row + W, 2, g, code, rm, rk, M, K, acc, DOT_DTYPE, PRECISION, WIDEN
        )
        acc = _window_grad(
            resp, row + W + 1, 3, g, code, rm, rk, M, K, acc, DOT_DTYPE, PRECISION, WIDEN
        )
    offs = ((p * tl.num_programs(2) + chunk) * N + rn[:, None]).to(tl.int64) * K + rk[None, :]
    tl.store(part + offs, acc, mask=(rn[:, None] < N) & (rk[None, :] < K))
