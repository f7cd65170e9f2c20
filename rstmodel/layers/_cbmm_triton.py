"""The Triton kernel of ``complex_mix`` (imported on first use: it needs Triton, and
whether it compiles or runs in Triton's interpreter is fixed when it is imported).

``cbmm_kernel`` takes its tile sizes as arguments; ``cbmm_tuned`` (compiled mode only) picks
them, the warps and the pipeline depth by timing ``CONFIGS`` on the first call of each
problem shape (a few seconds once per process: the FFT path has six shapes per model)."""

import triton
import triton.language as tl

from .complex_mix import interpreting

# the mode triton.jit chose below; complex_mix reloads this module if it changes
INTERPRETED = interpreting()


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
    WIDEN: tl.constexpr,  # the interpreter: round to DOT_DTYPE, multiply in float32
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
        ar = tl.load(a_re + a_off, mask=mask_a, other=0.0).to(DOT_DTYPE)
        ai = tl.load(a_im + a_off, mask=mask_a, other=0.0).to(DOT_DTYPE)
        br = tl.load(b_re + b_off, mask=mask_b, other=0.0).to(DOT_DTYPE)
        bi = tl.load(b_im + b_off, mask=mask_b, other=0.0).to(DOT_DTYPE)
        if WIDEN:  # same products: a bfloat16 product is exact in float32
            ar, ai, br, bi = (
                ar.to(tl.float32),
                ai.to(tl.float32),
                br.to(tl.float32),
                bi.to(tl.float32),
            )
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
