/* The FFT path's per-frequency complex products in eval, float32 on CPUs with AVX-512,
 * bfloat16 where the CPU has AVX512-BF16 dot products and int8 where it also has
 * AVX512-VNNI: see rstmodel/layers/native.py.
 *
 * For each frequency f:  [Re y; Im y] from  x = [Re x; Im x]  (2M rows, K columns) and the
 * filter spectrum G (K x N, complex), packed as tiles of 16 columns:
 *   g[f, t, k, 0:16] = Re G[k, 16t : 16t+16],  g[f, t, k, 16:32] = Im G[k, 16t : 16t+16]
 * (zero past column N). Each tile is read from memory once, in order, and summed in
 * registers for GROUP rows at a time (further groups read it from L1): at one image (M = 4)
 * the products are bound by reading G, which a batched GEMM library reads with strides at
 * half the speed.
 *   Re y = Re x Re G - Im x Im G,   Im y = Re x Im G + Im x Re G
 * x [F, 2M, K]; y [2, F, M, N]. Threads split the frequencies: OpenMP threads, which are
 * torch's own where the library is loaded beside torch's libgomp (one runtime, one pool of
 * threads: no second set of threads contending with torch's waiting ones for the cores).
 * Every kernel here hands its work out in chunks as threads come free (CHUNKS per thread,
 * OpenMP's dynamic schedule), not in one equal share each: in a server the cores also run
 * the HTTP threads, and a thread the OS preempts then holds up its chunk, not half the
 * kernel while the other waits at the end. */
#include <immintrin.h>

#include "_kernels_common.h"

#ifndef __AVX512F__
#error "AVX-512 only: elsewhere the library keeps torch.bmm"
#endif

#define GROUP 4 /* rows of Re x (and of Im x) summed in registers at a time */

#define LANES 16
typedef float v16 __attribute__((vector_size(4 * LANES)));
typedef float v16u __attribute__((vector_size(4 * LANES), aligned(4)));

typedef struct {
  const float *x, *g;
  float *y;
  long f0, f1, f_total, m, k, n;
} job_t;

/* one tile of 16 columns for the rows [r0, r0 + g) of Re x and of Im x (g <= GROUP), the
 * tile's K x 32 values read from memory for the first group and from L1 for the others;
 * inlined for each group size, so that the loops over rows unroll and the sums stay in
 * registers */
static inline __attribute__((always_inline)) void tile(const float *xf, const float *gt,
                                                       float *re, float *im, long m, long k,
                                                       long n, long c0, long r0, const long g) {
  v16 a_re[2 * GROUP] = {0}, a_im[2 * GROUP] = {0}; /* rows r0.. of Re x, then of Im x */
  for (long i = 0; i < k; ++i, gt += 2 * LANES) {
    const v16 g_re = *(const v16u *)gt, g_im = *(const v16u *)(gt + LANES);
#pragma GCC unroll 8
    for (long r = 0; r < 2 * g; ++r) {
      const float s = xf[((r < g ? 0 : m - g) + r0 + r) * k + i];
      a_re[r] += s * g_re;
      a_im[r] += s * g_im;
    }
  }
  const long width = n - c0 < LANES ? n - c0 : LANES;
  const __mmask16 mask = (__mmask16)((1u << width) - 1);
  for (long r = 0; r < g; ++r) {
    _mm512_mask_storeu_ps(re + (r0 + r) * n + c0, mask, (__m512)(a_re[r] - a_im[g + r]));
    _mm512_mask_storeu_ps(im + (r0 + r) * n + c0, mask, (__m512)(a_im[r] + a_re[g + r]));
  }
}

static void *run(void *arg) {
  const job_t *j = arg;
  const long m = j->m, k = j->k, n = j->n, tiles = (n + LANES - 1) / LANES;
  for (long f = j->f0; f < j->f1; ++f) {
    const float *xf = j->x + f * 2 * m * k;
    float *re = j->y + f * m * n, *im = j->y + (j->f_total + f) * m * n;
    for (long t = 0; t < tiles; ++t) {
      const float *gt = j->g + (f * tiles + t) * k * 2 * LANES;
      long r0 = 0;
      for (; r0 + GROUP <= m; r0 += GROUP) tile(xf, gt, re, im, m, k, n, t * LANES, r0, GROUP);
      switch (m - r0) {
      case 3: tile(xf, gt, re, im, m, k, n, t * LANES, r0, 3); break;
      case 2: tile(xf, gt, re, im, m, k, n, t * LANES, r0, 2); break;
      case 1: tile(xf, gt, re, im, m, k, n, t * LANES, r0, 1); break;
      }
    }
  }
  return NULL;
}

int joined_rows_product(const float *x, const float *g, float *y, long f, long m, long k,
                        long n, long threads) {
  if (m < 1 || threads < 1) return 1;
  const long chunk = chunk_size(f, threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (long c = 0; c < (f + chunk - 1) / chunk; ++c) {
    job_t job = {x, g, y, c * chunk, c * chunk + chunk < f ? c * chunk + chunk : f, f, m, k, n};
    run(&job);
  }
  return 0;
}

#ifdef __AVX512BF16__
/* bfloat16: each 32-bit lane of the spectra holds the pair (Re G, Im G) of one column,
 *   g[f, t, k, c] = (Re G[k, 16t + c], Im G[k, 16t + c])      (zero past column N),
 * and one dot-product instruction (vdpbf16ps: two bfloat16 products summed into float32)
 * gives a complex product's real or imaginary part for 16 columns from the broadcast
 * pair of one row:
 *   (Re x, -Im x) . (Re G, Im G) = Re(x G),   (Im x, Re x) . (Re G, Im G) = Im(x G).
 * So the spectra are read as stored, once per tile, and the four real products of each
 * complex one cost two instructions. x_re, x_im [F, M, K] bfloat16 (as uint16);
 * y [2, F, M, N] bfloat16, the sums rounded once. */
#define BGROUP 8 /* rows summed in registers at a time: 16 accumulators (brun's switch
                  * takes remainders of up to 7 rows) */

typedef struct {
  const unsigned short *x_re, *x_im;
  const int *g;
  unsigned short *y;
  long f0, f1, f_total, m, k, n;
} bjob_t;

/* one tile of 16 columns for rows [r0, r0 + g): pairs[i * m + r] is row r's pair for
 * input column i, first (Re x, -Im x) then, m * k further, (Im x, Re x) */
static inline __attribute__((always_inline)) void btile(const int *pairs, const int *gt,
                                                        unsigned short *re, unsigned short *im,
                                                        long m, long k, long n, long c0,
                                                        long r0, const long g) {
  __m512 a_re[BGROUP], a_im[BGROUP];
  for (long r = 0; r < g; ++r) a_re[r] = a_im[r] = _mm512_setzero_ps();
  const int *p_re = pairs + r0, *p_im = pairs + m * k + r0;
  for (long i = 0; i < k; ++i, gt += LANES, p_re += m, p_im += m) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(gt);
#pragma GCC unroll 8
    for (long r = 0; r < g; ++r) {
      a_re[r] = _mm512_dpbf16_ps(a_re[r], (__m512bh)_mm512_set1_epi32(p_re[r]), w);
      a_im[r] = _mm512_dpbf16_ps(a_im[r], (__m512bh)_mm512_set1_epi32(p_im[r]), w);
    }
  }
  const long width = n - c0 < LANES ? n - c0 : LANES;
  const __mmask16 mask = (__mmask16)((1u << width) - 1);
  for (long r = 0; r < g; ++r) {
    _mm256_mask_storeu_epi16(re + (r0 + r) * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(a_re[r]));
    _mm256_mask_storeu_epi16(im + (r0 + r) * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(a_im[r]));
  }
}

/* the frequencies [f0, f1) of the job; pairs: room for 2 M K ints */
static void brun(const bjob_t *j, int *pairs) {
  const long m = j->m, k = j->k, n = j->n, tiles = (n + LANES - 1) / LANES;
  for (long f = j->f0; f < j->f1; ++f) {
    /* this frequency's rows as broadcastable pairs, input column major */
    const unsigned short *xr = j->x_re + f * m * k, *xi = j->x_im + f * m * k;
    for (long r = 0; r < m; ++r)
      for (long i = 0; i < k; ++i) {
        const unsigned a = xr[r * k + i], b = xi[r * k + i];
        pairs[i * m + r] = (int)(a | (b ^ 0x8000u) << 16);
        pairs[m * k + i * m + r] = (int)(b | a << 16);
      }
    unsigned short *re = j->y + f * m * n, *im = j->y + (j->f_total + f) * m * n;
    for (long t = 0; t < tiles; ++t) {
      const int *gt = j->g + (f * tiles + t) * k * LANES;
      long r0 = 0;
      for (; r0 + BGROUP <= m; r0 += BGROUP) btile(pairs, gt, re, im, m, k, n, t * LANES, r0, BGROUP);
      switch (m - r0) {
      case 7: btile(pairs, gt, re, im, m, k, n, t * LANES, r0, 7); break;
      case 6: btile(pairs, gt, re, im, m, k, n, t * LANES, r0, 6); break;
      case 5: btile(pairs, gt, re, im, m, k, n, t * LANES, r0, 5); break;
      case 4: btile(pairs, gt, re, im, m, k, n, t * LANES, r0, 4); break;
      case 3: btile(pairs, gt, re, im, m, k, n, t * LANES, r0, 3); break;
      case 2: btile(pairs, gt, re, im, m, k, n, t * LANES, r0, 2); break;
      case 1: btile(pairs, gt, re, im, m, k, n, t * LANES, r0, 1); break;
      }
    }
  }
}

int paired_rows_product(const unsigned short *x_re, const unsigned short *x_im, const int *g,
                        unsigned short *y, long f, long m, long k, long n, long threads) {
  if (m < 1 || threads < 1) return 1;
  int failed = 0;
  const long chunk = chunk_size(f, threads);
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    int *pairs = malloc(sizeof(int) * 2 * m * k);
    failed |= pairs == NULL;
#pragma omp for schedule(dynamic, 1)
    for (long c = 0; c < (f + chunk - 1) / chunk; ++c) {
      bjob_t job = {x_re, x_im, g, y, c * chunk, c * chunk + chunk < f ? c * chunk + chunk : f,
                    f, m, k, n};
      if (pairs) brun(&job, pairs);
    }
    free(pairs);
  }
  return failed ? 2 : 0;
}

#ifdef __AVX512VNNI__
/* int8 (rstmodel.layers.native.quad_rows_product): the same products with each frequency's
 * rows quantized on the fly and the spectra quantized once (the eval cache). A row r of x
 * (K complex values) is scaled by 127 / max |Re x|, |Im x| and rounded to the nearest
 * integer (ties to even). Each 32-bit lane of the spectra holds one column's quad of
 * bytes for two input columns, each value offset by 128 (unsigned),
 *   g[f, t, i, c] = (Re G[2i, col], Im G[2i, col], Re G[2i+1, col], Im G[2i+1, col]) + 128,
 * col = 16t + c, G scaled per column and frequency (zero past K and N, before the offset).
 * One dot-product instruction (vpdpbusd: four unsigned-by-signed byte products summed into
 * 32 bits), its signed operand the row's quad broadcast from memory within the instruction,
 *   (Re x_2i, -Im x_2i, Re x_2i+1, -Im x_2i+1) for the real part, (Im x, Re x, ...) for
 * the imaginary one, gives eight real products of two complex ones per lane. The offset
 * adds 128 times the sum of the row's quad values, subtracted per row; the exact integer
 * sum is scaled by the row's and the column's scales (float32) and rounded to bfloat16
 * once: y [2, F, M, N] as the bfloat16 kernel writes it. gscale [F, 16T] float32, zero past
 * N. */
typedef struct {
  const unsigned short *x_re, *x_im;
  const int *g;
  const float *gscale;
  unsigned short *y;
  long f0, f1, f_total, m, k, n;
} qjob_t;

/* bfloat16 [16] (as uint16, masked) -> float32 */
static inline __m512 bf16_load(const unsigned short *p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

/* two rows of 16 rounded values (in [-127, 127]) -> 8 lanes of quads (a0, b0, a1, b1) */
static inline __m256i quads(__m512i a, __m512i b) {
  const __m512i byte = _mm512_set1_epi32(0xff);
  const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(b, byte), 8);
  return _mm512_cvtepi32_epi16(_mm512_or_si512(_mm512_and_si512(a, byte), hi));
}

/* rows of one frequency -> q[r * k2p + i] (real part's quads), q[(m + r) * k2p + i]
 * (imaginary part's), k2p = 8 ceil(K / 16) lanes a row (zeros past K); sx[r] its scale,
 * off[r] and off[m + r] 128 times the sum of its real and imaginary part's quad values */
static void quantize_rows(const unsigned short *xr, const unsigned short *xi, int *q, float *sx,
                          int *off, long m, long k) {
  const long k2p = 8 * ((k + 15) / 16);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (long r = 0; r < m; ++r, xr += k, xi += k) {
    __m512 mx = _mm512_setzero_ps();
    for (long i = 0; i < k; i += LANES) {
      const __mmask16 mask = (__mmask16)(k - i >= LANES ? 0xffff : (1u << (k - i)) - 1);
      mx = _mm512_max_ps(mx, _mm512_and_ps(bf16_load(xr + i, mask), sign));
      mx = _mm512_max_ps(mx, _mm512_and_ps(bf16_load(xi + i, mask), sign));
    }
    const float top = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(top > 0 ? 127.0f / top : 0.0f);
    sx[r] = top / 127.0f;
    int *qr = q + r * k2p, *qi = q + (m + r) * k2p;
    __m512i sum_a = _mm512_setzero_si512(), sum_b = _mm512_setzero_si512();
    for (long i = 0; i < k; i += LANES, qr += 8, qi += 8) {
      const __mmask16 mask = (__mmask16)(k - i >= LANES ? 0xffff : (1u << (k - i)) - 1);
      const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(bf16_load(xr + i, mask), inv));
      const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(bf16_load(xi + i, mask), inv));
      sum_a = _mm512_add_epi32(sum_a, a);
      sum_b = _mm512_add_epi32(sum_b, b);
      _mm256_storeu_si256((__m256i *)qr, quads(a, _mm512_sub_epi32(_mm512_setzero_si512(), b)));
      _mm256_storeu_si256((__m256i *)qi, quads(b, a));
    }
    const int sa = _mm512_reduce_add_epi32(sum_a), sb = _mm512_reduce_add_epi32(sum_b);
    off[r] = 128 * (sa - sb);
    off[m + r] = 128 * (sa + sb);
  }
}

/* acc + w . (the quad at p, broadcast): the broadcast embedded in the instruction's memory
 * operand ({1to16}), which costs no shuffle of its own (GCC does not fold the intrinsics'
 * broadcast into it) */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i w,
                                                                  const int *p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
  return acc;
}

static inline __attribute__((always_inline)) void qtile(const int *q, const float *sx,
                                                        const int *off, const int *gt,
                                                        const float *gs, unsigned short *re,
                                                        unsigned short *im, long m, long k2,
                                                        long k2p, long n, long c0, long r0,
                                                        const long g) {
  __m512i a_re[BGROUP], a_im[BGROUP];
  for (long r = 0; r < g; ++r) a_re[r] = a_im[r] = _mm512_setzero_si512();
  const int *q_re = q + r0 * k2p, *q_im = q + (m + r0) * k2p;
  for (long i = 0; i < k2; ++i, gt += LANES) {
    /* the spectra stream from memory once per tile: with eight rows or more the dot
     * products outrun the hardware prefetcher, so ask 48 lanes (3 KB) ahead (0.71-0.92x
     * the time; at four rows it cost as much as it saved) */
    if (m >= 8) _mm_prefetch((const char *)(gt + 48 * LANES), _MM_HINT_T0);
    const __m512i w = _mm512_loadu_si512(gt);
#pragma GCC unroll 8
    for (long r = 0; r < g; ++r) {
      a_re[r] = dpbusd_bcast(a_re[r], w, q_re + r * k2p + i);
      a_im[r] = dpbusd_bcast(a_im[r], w, q_im + r * k2p + i);
    }
  }
  const long width = n - c0 < LANES ? n - c0 : LANES;
  const __mmask16 mask = (__mmask16)((1u << width) - 1);
  const __m512 sv = _mm512_loadu_ps(gs + c0);
  for (long r = 0; r < g; ++r) {
    const __m512 s = _mm512_mul_ps(sv, _mm512_set1_ps(sx[r0 + r]));
    const __m512i o_re = _mm512_set1_epi32(off[r0 + r]), o_im = _mm512_set1_epi32(off[m + r0 + r]);
    const __m512 y_re = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a_re[r], o_re)), s);
    const __m512 y_im = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a_im[r], o_im)), s);
    _mm256_mask_storeu_epi16(re + (r0 + r) * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(y_re));
    _mm256_mask_storeu_epi16(im + (r0 + r) * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(y_im));
  }
}

/* the frequencies [f0, f1) of the job; q: room for 2 M k2p ints, sx for M floats, off for
 * 2 M ints */
static void qrun(const qjob_t *j, int *q, float *sx, int *off) {
  const long m = j->m, k = j->k, n = j->n, tiles = (n + LANES - 1) / LANES;
  const long k2 = (k + 1) / 2, k2p = 8 * ((k + 15) / 16);
  for (long f = j->f0; f < j->f1; ++f) {
    quantize_rows(j->x_re + f * m * k, j->x_im + f * m * k, q, sx, off, m, k);
    unsigned short *re = j->y + f * m * n, *im = j->y + (j->f_total + f) * m * n;
    const float *gs = j->gscale + f * tiles * LANES;
    for (long t = 0; t < tiles; ++t) {
      const int *gt = j->g + (f * tiles + t) * k2 * LANES;
      const long c0 = t * LANES;
      long r0 = 0;
      for (; r0 + BGROUP <= m; r0 += BGROUP)
        qtile(q, sx, off, gt, gs, re, im, m, k2, k2p, n, c0, r0, BGROUP);
      switch (m - r0) {
      case 7: qtile(q, sx, off, gt, gs, re, im, m, k2, k2p, n, c0, r0, 7); break;
      case 6: qtile(q, sx, off, gt, gs, re, im, m, k2, k2p, n, c0, r0, 6); break;
      case 5: qtile(q, sx, off, gt, gs, re, im, m, k2, k2p, n, c0, r0, 5); break;
      case 4: qtile(q, sx, off, gt, gs, re, im, m, k2, k2p, n, c0, r0, 4); break;
      case 3: qtile(q, sx, off, gt, gs, re, im, m, k2, k2p, n, c0, r0, 3); break;
      case 2: qtile(q, sx, off, gt, gs, re, im, m, k2, k2p, n, c0, r0, 2); break;
      case 1: qtile(q, sx, off, gt, gs, re, im, m, k2, k2p, n, c0, r0, 1); break;
      }
    }
  }
}

int quad_rows_product(const unsigned short *x_re, const unsigned short *x_im, const int *g,
                      const float *gscale, unsigned short *y, long f, long m, long k, long n,
                      long threads) {
  if (m < 1 || threads < 1) return 1;
  int failed = 0;
  const long chunk = chunk_size(f, threads), k2p = 8 * ((k + 15) / 16);
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    int *q = malloc(sizeof(int) * 2 * m * k2p), *off = malloc(sizeof(int) * 2 * m);
    float *sx = malloc(sizeof(float) * m);
    failed |= q == NULL || sx == NULL || off == NULL;
#pragma omp for schedule(dynamic, 1)
    for (long c = 0; c < (f + chunk - 1) / chunk; ++c) {
      qjob_t job = {x_re, x_im, g, gscale, y, c * chunk,
                    c * chunk + chunk < f ? c * chunk + chunk : f, f, m, k, n};
      if (q && sx && off) qrun(&job, q, sx, off);
    }
    free(q);
    free(sx);
    free(off);
  }
  return failed ? 2 : 0;
}
#endif
#endif

/* The lifting layer's channel mixing and 2x2 max pool in one pass, for eval
 * (rstmodel.layers.native.pooled_mix): for each 2x2 window (i, j) and each (rotation,
 * scale, image) m, the four pixels' basis responses r[4][KK] (pixel (y, x) of m at
 * resp + ((y w + x) M + m) KK) times the weights give four output vectors of COUT
 * channels, summed in registers; their maximum plus the bias, through the ReLU, is the
 * only thing written: out[((i w/2 + j) M + m) COUT + c]. The weights are packed in tiles
 * of 16 channels, wt[t][k][16] (float32) or wt[t][k/2][16] pairs (bfloat16), zero past
 * COUT; the bias is float32, zero-padded to whole tiles. Up to TGROUP tiles at a time
 * (4 x TGROUP sums in registers).
 * SETS > 1 (a steerable basis: rstmodel.basis.steering): the responses hold M / SETS
 * branches per pixel, and branch m of the output is branch m % (M / SETS) of the
 * responses mixed by weight set m / (M / SETS) (one per rotation), each set packed as
 * above, one after the other. */
#define TGROUP 5

typedef struct {
  const void *resp, *wt;
  const float *bias;
  void *out;
  long h, w, m, kk, cout, sets, relu;
  unsigned char *code; /* float32 with a gradient to come: the window position that won */
} mjob_t;

static inline __attribute__((always_inline)) v16 pool4(v16 a, v16 b, v16 c, v16 d, v16 bias,
                                                        long relu) {
  __m512 top = _mm512_max_ps((__m512)a, (__m512)b), low = _mm512_max_ps((__m512)c, (__m512)d);
  __m512 mx = _mm512_add_ps(_mm512_max_ps(top, low), (__m512)bias);
  return (v16)(relu ? _mm512_max_ps(mx, _mm512_setzero_ps()) : mx);
}

/* float32: tiles [t0, t0 + g) of one window and branch; p[q] the q-th pixel's responses */
static inline __attribute__((always_inline)) void mix_f32(const float *const p[4],
                                                          const float *wt, const float *bias,
                                                          float *o, unsigned char *code, long kk,
                                                          long cout, long t0, long relu,
                                                          const long g) {
  v16 acc[4][TGROUP];
  for (long q = 0; q < 4; ++q)
    for (long t = 0; t < g; ++t) acc[q][t] = (v16){0};
  for (long i = 0; i < kk; ++i) {
    v16 wv[TGROUP];
    for (long t = 0; t < g; ++t) wv[t] = *(const v16u *)(wt + ((t0 + t) * kk + i) * LANES);
    for (long q = 0; q < 4; ++q) {
      const float s = p[q][i];
      for (long t = 0; t < g; ++t) acc[q][t] += s * wv[t];
    }
  }
  for (long t = 0; t < g; ++t) {
    const long c0 = (t0 + t) * LANES, width = cout - c0 < LANES ? cout - c0 : LANES;
    const v16 bv = *(const v16u *)(bias + c0);
    const v16 y = pool4(acc[0][t], acc[1][t], acc[2][t], acc[3][t], bv, relu);
    _mm512_mask_storeu_ps(o + c0, (__mmask16)((1u << width) - 1), (__m512)y);
    if (code) { /* kernels._pool_quads' code: scan order, the first of equal values wins */
      const __m512 a0 = (__m512)acc[0][t], a1 = (__m512)acc[1][t];
      const __m512 a2 = (__m512)acc[2][t], a3 = (__m512)acc[3][t];
      const __m512 top = _mm512_max_ps(a0, a1), low = _mm512_max_ps(a2, a3);
      const __mmask16 below = _mm512_cmp_ps_mask(low, top, _CMP_GT_OQ);
      const __mmask16 right = (_mm512_cmp_ps_mask(a3, a2, _CMP_GT_OQ) & below) |
                              (_mm512_cmp_ps_mask(a1, a0, _CMP_GT_OQ) & ~below);
      __m512i c = _mm512_or_si512(_mm512_maskz_set1_epi32(below, 2),
                                  _mm512_maskz_set1_epi32(right, 1));
      if (relu) { /* clamped by the ReLU: no gradient */
        const __m512 mx = _mm512_add_ps(_mm512_max_ps(top, low), (__m512)bv);
        c = _mm512_mask_set1_epi32(c, _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_LE_OQ), 4);
      }
      _mm_mask_storeu_epi8(code + c0, (__mmask16)((1u << width) - 1), _mm512_cvtepi32_epi8(c));
    }
  }
}

static void mix_f32_rows(const mjob_t *j, long u0, long u1) {
  const long m = j->m, mr = m / j->sets, kk = j->kk, cout = j->cout, half = j->w / 2;
  const long tiles = (cout + LANES - 1) / LANES;
  const float *resp = j->resp;
  for (long u = u0; u < u1; ++u) { /* u = (i half + jj) m + mi */
    const long mi = u % m, ri = mi % mr, win = u / m, y = 2 * (win / half), x = 2 * (win % half);
    const float *wt = (const float *)j->wt + mi / mr * tiles * kk * LANES;
    const float *const p[4] = {resp + ((y * j->w + x) * mr + ri) * kk,
                               resp + ((y * j->w + x + 1) * mr + ri) * kk,
                               resp + (((y + 1) * j->w + x) * mr + ri) * kk,
                               resp + (((y + 1) * j->w + x + 1) * mr + ri) * kk};
    float *o = (float *)j->out + u * cout;
    unsigned char *code = j->code ? j->code + u * cout : NULL;
    long t0 = 0;
    for (; t0 + TGROUP <= tiles; t0 += TGROUP)
      mix_f32(p, wt, j->bias, o, code, kk, cout, t0, j->relu, TGROUP);
    switch (tiles - t0) {
    case 4: mix_f32(p, wt, j->bias, o, code, kk, cout, t0, j->relu, 4); break;
    case 3: mix_f32(p, wt, j->bias, o, code, kk, cout, t0, j->relu, 3); break;
    case 2: mix_f32(p, wt, j->bias, o, code, kk, cout, t0, j->relu, 2); break;
    case 1: mix_f32(p, wt, j->bias, o, code, kk, cout, t0, j->relu, 1); break;
    }
  }
}

int pooled_mix_f32(const float *resp, const float *wt, const float *bias, float *out,
                   unsigned char *code, long h, long w, long m, long kk, long cout, long sets,
                   long relu, long threads) {
  if (h < 2 || w < 2 || m < 1 || kk < 1 || cout < 1 || sets < 1 || m % sets || threads < 1)
    return 1;
  const mjob_t job = {resp, wt, bias, out, h, w, m, kk, cout, sets, relu, code};
  const long units = (h / 2) * (w / 2) * m;
  const long chunk = chunk_size(units, threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (long c = 0; c < (units + chunk - 1) / chunk; ++c)
    mix_f32_rows(&job, c * chunk, c * chunk + chunk < units ? c * chunk + chunk : units);
  return 0;
}

/* The coefficients' gradient of the pooled mixing (float32, training): for each output
 * (window, branch m, channel c) with code q < 4, grad[.., c] times the responses of the
 * window's pixel q, summed into partial[thread][tile][k][16] (channel 16 tile + lane; the
 * caller zeroes it and adds the threads' parts): ``kernels._pooled_mix_grads``' grad_a
 * without the full-resolution gradient map. Code 4 (clamped by the ReLU) adds nothing. */
int pooled_mix_grad_f32(const float *resp, const float *grad, const unsigned char *code,
                        float *partial, long h, long w, long m, long kk, long cout,
                        long threads) {
  if (h < 2 || w < 2 || m < 1 || kk < 1 || cout < 1 || threads < 1) return 1;
  const long tiles = (cout + LANES - 1) / LANES, half = w / 2;
  const long units = (h / 2) * half * m, chunk = chunk_size(units, threads);
#pragma omp parallel num_threads(threads)
  {
    float *acc = partial + (long)omp_get_thread_num() * tiles * kk * LANES;
#pragma omp for schedule(dynamic, chunk)
    for (long u = 0; u < units; ++u) {
      const long mi = u % m, win = u / m, y = 2 * (win / half), x = 2 * (win % half);
      const float *const p[4] = {resp + ((y * w + x) * m + mi) * kk,
                                 resp + ((y * w + x + 1) * m + mi) * kk,
                                 resp + (((y + 1) * w + x) * m + mi) * kk,
                                 resp + (((y + 1) * w + x + 1) * m + mi) * kk};
      for (long t = 0; t < tiles; ++t) {
        const long c0 = t * LANES, width = cout - c0 < LANES ? cout - c0 : LANES;
        const __mmask16 mask = (__mmask16)((1u << width) - 1);
        const __m512 g = _mm512_maskz_loadu_ps(mask, grad + u * cout + c0);
        const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, code + u * cout + c0));
        __m512 gq[4];
        for (long q = 0; q < 4; ++q)
          gq[q] = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(q)), g);
        float *a = acc + t * kk * LANES;
        for (long k = 0; k < kk; ++k) {
          __m512 v = _mm512_loadu_ps(a + k * LANES);
          for (long q = 0; q < 4; ++q) v = _mm512_fmadd_ps(gq[q], _mm512_set1_ps(p[q][k]), v);
          _mm512_storeu_ps(a + k * LANES, v);
        }
      }
    }
  }
  return 0;
}

#ifdef __AVX512BF16__
/* bfloat16: the responses as pairs (two channels of one pixel in 32 bits), the weights as
 * the matching pairs of each output channel; one dot-product instruction per pair and
 * tile. The pooled value is rounded to bfloat16 once. */
static inline __attribute__((always_inline)) void mix_bf16(const int *const p[4], const int *wt,
                                                           const float *bias,
                                                           unsigned short *o, long pairs,
                                                           long cout, long t0, long relu,
                                                           const long g) {
  __m512 acc[4][TGROUP];
  for (long q = 0; q < 4; ++q)
    for (long t = 0; t < g; ++t) acc[q][t] = _mm512_setzero_ps();
  for (long i = 0; i < pairs; ++i) {
    __m512bh wv[TGROUP];
    for (long t = 0; t < g; ++t)
      wv[t] = (__m512bh)_mm512_loadu_si512(wt + ((t0 + t) * pairs + i) * LANES);
    for (long q = 0; q < 4; ++q) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(p[q][i]);
      for (long t = 0; t < g; ++t) acc[q][t] = _mm512_dpbf16_ps(acc[q][t], s, wv[t]);
    }
  }
  for (long t = 0; t < g; ++t) {
    const long c0 = (t0 + t) * LANES, width = cout - c0 < LANES ? cout - c0 : LANES;
    const v16 y = pool4((v16)acc[0][t], (v16)acc[1][t], (v16)acc[2][t], (v16)acc[3][t],
                        *(const v16u *)(bias + c0), relu);
    _mm256_mask_storeu_epi16(o + c0, (__mmask16)((1u << width) - 1),
                             (__m256i)_mm512_cvtneps_pbh((__m512)y));
  }
}

static void mix_bf16_rows(const mjob_t *j, long u0, long u1) {
  const long m = j->m, mr = m / j->sets, pairs = j->kk / 2, cout = j->cout, half = j->w / 2;
  const long tiles = (cout + LANES - 1) / LANES;
  const int *resp = j->resp;
  for (long u = u0; u < u1; ++u) {
    const long mi = u % m, ri = mi % mr, win = u / m, y = 2 * (win / half), x = 2 * (win % half);
    const int *wt = (const int *)j->wt + mi / mr * tiles * pairs * LANES;
    const int *const p[4] = {resp + ((y * j->w + x) * mr + ri) * pairs,
                             resp + ((y * j->w + x + 1) * mr + ri) * pairs,
                             resp + (((y + 1) * j->w + x) * mr + ri) * pairs,
                             resp + (((y + 1) * j->w + x + 1) * mr + ri) * pairs};
    unsigned short *o = (unsigned short *)j->out + u * cout;
    long t0 = 0;
    for (; t0 + TGROUP <= tiles; t0 += TGROUP)
      mix_bf16(p, wt, j->bias, o, pairs, cout, t0, j->relu, TGROUP);
    switch (tiles - t0) {
    case 4: mix_bf16(p, wt, j->bias, o, pairs, cout, t0, j->relu, 4); break;
    case 3: mix_bf16(p, wt, j->bias, o, pairs, cout, t0, j->relu, 3); break;
    case 2: mix_bf16(p, wt, j->bias, o, pairs, cout, t0, j->relu, 2); break;
    case 1: mix_bf16(p, wt, j->bias, o, pairs, cout, t0, j->relu, 1); break;
    }
  }
}

int pooled_mix_bf16(const int *resp, const int *wt, const float *bias, unsigned short *out,
                    long h, long w, long m, long kk, long cout, long sets, long relu,
                    long threads) {
  if (h < 2 || w < 2 || m < 1 || kk < 2 || kk % 2 || cout < 1 || sets < 1 || m % sets ||
      threads < 1)
    return 1;
  const mjob_t job = {resp, wt, bias, out, h, w, m, kk, cout, sets, relu, NULL};
  const long units = (h / 2) * (w / 2) * m;
  const long chunk = chunk_size(units, threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (long c = 0; c < (units + chunk - 1) / chunk; ++c)
    mix_bf16_rows(&job, c * chunk, c * chunk + chunk < units ? c * chunk + chunk : units);
  return 0;
}
#endif

#ifdef __AVX512BF16__
/* The DFTs' GEMMs in bfloat16 (rstmodel.layers.native.small_gemm): C[b] = A B[b] with a
 * small A (M x K, K even: a DFT matrix of a few dozen rows and columns) and long rows in B
 * (K x N, millions of columns, or a batch of them). A library GEMM tiles for square
 * problems; here the whole of A stays in L1 and B streams through once. For each panel of
 * 32 columns, the K rows of B are interleaved into pairs of rows, (B[2p, n], B[2p+1, n]) in
 * one 32-bit lane (a two-source word permute), kept in an L1 buffer; then each block of
 * RB rows of A sums its 2 x 16 columns in 2 RB registers, one dot-product instruction per
 * pair of A's row, broadcast from A's row-major storage as it is (adjacent k are a pair).
 * C gets the sums rounded once to bfloat16. Threads split the (batch, panel) pairs. */
#define RB 8
#define KMAX 512
#define PREFETCH 64 /* columns ahead: pair_rows */
/* words of two rows' panels interleaved (row 0's word i, row 1's word i), the first half */
static const short PAIR_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

typedef struct {
  const int *a; /* [M][K/2] pairs */
  const unsigned short *b;
  unsigned short *c;
  long batch, ldb_batch, ldc_batch, m, k, n;
  const long *idx; /* NULL, or B's rows gathered (small_gemm_gather_bf16) */
  long seg;
} gjob_t;

static inline __attribute__((always_inline)) void gblock(const int *a, const int *buf,
                                                         unsigned short *c, long n, long pairs,
                                                         long m0, __mmask32 mask, const long g) {
  __m512 acc[RB][2];
  for (long r = 0; r < g; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int *ar = a + m0 * pairs;
  for (long p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(buf + p * 32);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(buf + p * 32 + 16);
#pragma GCC unroll 8
    for (long r = 0; r < g; ++r) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(ar[r * pairs + p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], s, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], s, b1);
    }
  }
  for (long r = 0; r < g; ++r)
    _mm512_mask_storeu_epi16(c + (m0 + r) * n, mask,
                             (__m512i)_mm512_cvtne2ps_pbh(acc[r][1], acc[r][0]));
}

static void pair_rows(const unsigned short *b, long n, long pairs, __mmask32 mask, int *buf);
static void pair_gathered_rows(const gjob_t *j, long bi, long n0, __mmask32 mask, int *buf);

static void gpanel(const gjob_t *j, long bi, long n0, int *buf) {
  const long m = j->m, pairs = j->k / 2, n = j->n, width = n - n0 < 32 ? n - n0 : 32;
  const __mmask32 mask = width == 32 ? ~(__mmask32)0 : (((__mmask32)1 << width) - 1);
  unsigned short *c = j->c + bi * j->ldc_batch + n0;
  if (j->idx)
    pair_gathered_rows(j, bi, n0, mask, buf);
  else
    pair_rows(j->b + bi * j->ldb_batch + n0, n, pairs, mask, buf);
  long m0 = 0;
  for (; m0 + RB <= m; m0 += RB) gblock(j->a, buf, c, n, pairs, m0, mask, RB);
  switch (m - m0) {
  case 7: gblock(j->a, buf, c, n, pairs, m0, mask, 7); break;
  case 6: gblock(j->a, buf, c, n, pairs, m0, mask, 6); break;
  case 5: gblock(j->a, buf, c, n, pairs, m0, mask, 5); break;
  case 4: gblock(j->a, buf, c, n, pairs, m0, mask, 4); break;
  case 3: gblock(j->a, buf, c, n, pairs, m0, mask, 3); break;
  case 2: gblock(j->a, buf, c, n, pairs, m0, mask, 2); break;
  case 1: gblock(j->a, buf, c, n, pairs, m0, mask, 1); break;
  }
}

/* every (batch, panel) pair of the job, handed out in chunks */
static int gemm_panels(const gjob_t *job, long threads) {
  const long panels = (job->n + 31) / 32, units = job->batch * panels;
  const long chunk = chunk_size(units, threads);
#pragma omp parallel num_threads(threads)
  {
    int buf[KMAX / 2 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, chunk)
    for (long u = 0; u < units; ++u) gpanel(job, u / panels, (u % panels) * 32, buf);
  }
  return 0;
}

int small_gemm_bf16(const int *a, const unsigned short *b, unsigned short *c, long batch,
                    long m, long k, long n, long threads) {
  if (batch < 1 || m < 1 || k < 2 || k % 2 || k > KMAX || n < 1 || threads < 1) return 1;
  const gjob_t job = {a, b, c, batch, k * n, m * n, m, k, n, NULL, 0};
  return gemm_panels(&job, threads);
}
#endif

#ifdef __AVX512BF16__
/* small_gemm_bf16 with B's rows gathered from a table of rows (the forward DFT's first
 * GEMM reading the FFT path's blocks of maps where they lie: no gathered copy written and
 * read back): B[bi][k][n] = src[idx[(bi K + k) J + n / SEG] SEG + n % SEG], J = N / SEG
 * segments of SEG >= 32 values per row of B, so a panel of 32 columns spans at most two. */
static inline __m512i gathered_panel(const unsigned short *src, const long *seg, long len,
                                     long n0, __mmask32 mask) {
  const long j0 = n0 / len, off = n0 % len, first = len - off;
  const unsigned short *p0 = src + seg[j0] * len + off;
  _mm_prefetch((const char *)(p0 + PREFETCH), _MM_HINT_T0);
  if (first >= 32) return _mm512_maskz_loadu_epi16(mask, p0);
  const __mmask32 lo = ((__mmask32)1 << first) - 1;
  const __m512i v = _mm512_maskz_loadu_epi16(mask & lo, p0);
  if (!(mask & ~lo)) return v;
  /* lanes first..31 from the next segment's start */
  return _mm512_mask_loadu_epi16(v, mask & ~lo, src + seg[j0 + 1] * len - first);
}

static void pair_gathered_rows(const gjob_t *j, long bi, long n0, __mmask32 mask, int *buf) {
  const __m512i idx_lo = _mm512_loadu_si512(PAIR_LO);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  const long segs = j->n / j->seg;
  const long *row = j->idx + bi * j->k * segs;
  for (long p = 0; p < j->k / 2; ++p) {
    const __m512i r0 = gathered_panel(j->b, row + 2 * p * segs, j->seg, n0, mask);
    const __m512i r1 = gathered_panel(j->b, row + (2 * p + 1) * segs, j->seg, n0, mask);
    _mm512_store_si512(buf + p * 32, _mm512_permutex2var_epi16(r0, idx_lo, r1));
    _mm512_store_si512(buf + p * 32 + 16, _mm512_permutex2var_epi16(r0, idx_hi, r1));
  }
}

int small_gemm_gather_bf16(const int *a, const unsigned short *src, const long *idx,
                           unsigned short *c, long batch, long m, long k, long n, long seg,
                           long threads) {
  if (batch < 1 || m < 1 || k < 2 || k % 2 || k > KMAX || n < 1 || seg < 32 || n % seg ||
      threads < 1)
    return 1;
  const gjob_t job = {a, src, c, batch, 0, m * n, m, k, n, idx, seg};
  return gemm_panels(&job, threads);
}
#endif

#ifdef __AVX512BF16__
/* The inverse DFT's last GEMM with the 2x2 max pool (and ReLU) after it, in bfloat16
 * (rstmodel.layers.native.small_gemm_pool): out[h/2, w/2, n] = pool over h in {2i, 2i+1}
 * and w in {2j, 2j+1} of (A B[h])[w, n], A [W, K] (K even), B [H, K, N]. The two image rows
 * of a window are computed side by side from their own paired rows (gpanel's buffers),
 * four rows of A at a time (16 sums in registers), and only the pooled values are written:
 * the full-resolution map never leaves the registers. */
/* a panel's 32 values of one output row, written where its segments of LEN values go:
 * dst[seg[j] LEN + l] for column j LEN + l of the row (the scatter that follows the group
 * convolution, small_gemm_pool_scatter_bf16) */
static inline void scattered_store(unsigned short *dst, const long *seg, long len, long n0,
                                   __mmask32 mask, __m512i v) {
  const long j0 = n0 / len, off = n0 % len, first = len - off;
  if (first >= 32) {
    _mm512_mask_storeu_epi16(dst + seg[j0] * len + off, mask, v);
    return;
  }
  const __mmask32 lo = ((__mmask32)1 << first) - 1;
  _mm512_mask_storeu_epi16(dst + seg[j0] * len + off, mask & lo, v);
  if (mask & ~lo) _mm512_mask_storeu_epi16(dst + seg[j0 + 1] * len - first, mask & ~lo, v);
}

/* where gpool writes: row m/2 of o (row stride n), or, with dst != NULL, scattered:
 * pooled row ww's segments listed at dst + ww * segs (scattered_store into out) */
typedef struct {
  unsigned short *o, *out;
  const long *dst;
  long n, n0, seg, segs;
} gdest_t;

static inline __attribute__((always_inline)) void gpool(const int *a, const int *buf0,
                                                        const int *buf1, const gdest_t *d,
                                                        long pairs, long m0, long relu,
                                                        __mmask32 mask, const long g) {
  __m512 acc[2][4][2];
  for (long q = 0; q < 2; ++q)
    for (long r = 0; r < g; ++r) acc[q][r][0] = acc[q][r][1] = _mm512_setzero_ps();
  const int *ar = a + m0 * pairs;
  for (long p = 0; p < pairs; ++p) {
    const __m512bh b00 = (__m512bh)_mm512_load_si512(buf0 + p * 32);
    const __m512bh b01 = (__m512bh)_mm512_load_si512(buf0 + p * 32 + 16);
    const __m512bh b10 = (__m512bh)_mm512_load_si512(buf1 + p * 32);
    const __m512bh b11 = (__m512bh)_mm512_load_si512(buf1 + p * 32 + 16);
#pragma GCC unroll 4
    for (long r = 0; r < g; ++r) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(ar[r * pairs + p]);
      acc[0][r][0] = _mm512_dpbf16_ps(acc[0][r][0], s, b00);
      acc[0][r][1] = _mm512_dpbf16_ps(acc[0][r][1], s, b01);
      acc[1][r][0] = _mm512_dpbf16_ps(acc[1][r][0], s, b10);
      acc[1][r][1] = _mm512_dpbf16_ps(acc[1][r][1], s, b11);
    }
  }
  for (long r = 0; r < g; r += 2)
    for (long t = 0; t < 2; ++t) {
      __m512 mx = _mm512_max_ps(_mm512_max_ps(acc[0][r][t], acc[0][r + 1][t]),
                                _mm512_max_ps(acc[1][r][t], acc[1][r + 1][t]));
      acc[0][r][t] = relu ? _mm512_max_ps(mx, _mm512_setzero_ps()) : mx;
    }
  for (long r = 0; r < g; r += 2) {
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(acc[0][r][1], acc[0][r][0]);
    const long ww = (m0 + r) / 2;
    if (d->dst)
      scattered_store(d->out, d->dst + ww * d->segs, d->seg, d->n0, mask, v);
    else
      _mm512_mask_storeu_epi16(d->o + ww * d->n, mask, v);
  }
}

/* rows 2p and 2p + 1 of a panel of 32 columns of B (row stride n) interleaved into pairs:
 * buf[p][0:16] for columns 0-15, buf[p][16:32] for 16-31; masked past the panel's width.
 * The K rows are K streams a row stride apart, more than the hardware prefetcher follows:
 * each row's line two panels ahead is fetched here (5-15 % off the DFTs' GEMMs alone,
 * BENCHMARKS.md, "Issue 13, sixteenth session"; a prefetch past the end does not fault). */
static void pair_rows(const unsigned short *b, long n, long pairs, __mmask32 mask, int *buf) {
  const __m512i idx_lo = _mm512_loadu_si512(PAIR_LO);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  for (long p = 0; p < pairs; ++p) {
    _mm_prefetch((const char *)(b + 2 * p * n + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(b + (2 * p + 1) * n + PREFETCH), _MM_HINT_T0);
    const __m512i r0 = _mm512_maskz_loadu_epi16(mask, b + 2 * p * n);
    const __m512i r1 = _mm512_maskz_loadu_epi16(mask, b + (2 * p + 1) * n);
    _mm512_store_si512(buf + p * 32, _mm512_permutex2var_epi16(r0, idx_lo, r1));
    _mm512_store_si512(buf + p * 32 + 16, _mm512_permutex2var_epi16(r0, idx_hi, r1));
  }
}

/* out: [H/2, W/2, N]; or, with dst (small_gemm_pool_scatter_bf16), the table of rows of
 * SEG values that dst names for each segment of each pooled row */
static int pool_rows(const int *a, const unsigned short *b, unsigned short *out,
                     const long *dst, long seg, long h, long w, long k, long n, long relu,
                     long threads) {
  if (h < 2 || h % 2 || w < 2 || w % 2 || k < 2 || k % 2 || k > KMAX || n < 1 || threads < 1)
    return 1;
  if (dst && (seg < 32 || n % seg)) return 1;
  const long segs = dst ? n / seg : 0;
  const long pairs = k / 2, panels = (n + 31) / 32, units = (h / 2) * panels;
  const long chunk = chunk_size(units, threads);
#pragma omp parallel num_threads(threads)
  {
    int buf0[KMAX / 2 * 32] __attribute__((aligned(64)));
    int buf1[KMAX / 2 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, chunk)
    for (long u = 0; u < units; ++u) {
      const long hh = u / panels, n0 = (u % panels) * 32, width = n - n0 < 32 ? n - n0 : 32;
      const __mmask32 mask = width == 32 ? ~(__mmask32)0 : (((__mmask32)1 << width) - 1);
      pair_rows(b + 2 * hh * k * n + n0, n, pairs, mask, buf0);
      pair_rows(b + (2 * hh + 1) * k * n + n0, n, pairs, mask, buf1);
      const gdest_t d = {out + hh * (w / 2) * n + n0, out, dst ? dst + hh * (w / 2) * segs : NULL,
                         n, n0, seg, segs};
      long m0 = 0;
      for (; m0 + 4 <= w; m0 += 4) gpool(a, buf0, buf1, &d, pairs, m0, relu, mask, 4);
      if (m0 < w) gpool(a, buf0, buf1, &d, pairs, m0, relu, mask, 2);
    }
  }
  return 0;
}

int small_gemm_pool_bf16(const int *a, const unsigned short *b, unsigned short *out, long h,
                         long w, long k, long n, long relu, long threads) {
  return pool_rows(a, b, out, NULL, 0, h, w, k, n, relu, threads);
}

/* small_gemm_pool_bf16 with each pooled row's segments of SEG values written to the rows
 * of a table that dst names: out[dst[(i W/2 + j) J + n / SEG] SEG + n % SEG], J = N / SEG,
 * SEG >= 32 (the group convolution's scatter back to the feature layout, fused) */
int small_gemm_pool_scatter_bf16(const int *a, const unsigned short *b, unsigned short *out,
                                 const long *dst, long h, long w, long k, long n, long seg,
                                 long relu, long threads) {
  if (!dst) return 1;
  return pool_rows(a, b, out, dst, seg, h, w, k, n, relu, threads);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* The batch norm's column sums (_kernels_common.h's column_sums) over one block of rows:
 * x and g float32 (bf16 == 0) or bfloat16 (bf16 == 1, widened exactly), summed in float32
 * in registers, 16 columns at a time (a block's rows stay in cache for the next 16). */

static inline __attribute__((always_inline)) __m512 row16(const void *p, long i, long bf16,
                                                          __mmask16 m) {
  if (bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const unsigned short *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

static void stat_block(const void *x, const void *g, const float *k, double *s, long r0,
                       long r1, long c, long bf16) {
  for (long j = 0; j < c; j += 16) {
    const __mmask16 m = c - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (c - j)) - 1);
    const __m512 kk = _mm512_maskz_loadu_ps(m, k + j);
    __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps();
    __m512 b1 = _mm512_setzero_ps(), b2 = _mm512_setzero_ps();
    long r = r0;
    if (g) {
      for (; r + 1 < r1; r += 2) {
        const __m512 d0 = _mm512_sub_ps(row16(x, r * c + j, bf16, m), kk);
        const __m512 d1 = _mm512_sub_ps(row16(x, (r + 1) * c + j, bf16, m), kk);
        const __m512 g0 = row16(g, r * c + j, bf16, m), g1 = row16(g, (r + 1) * c + j, bf16, m);
        a1 = _mm512_add_ps(a1, g0), b1 = _mm512_add_ps(b1, g1);
        a2 = _mm512_fmadd_ps(g0, d0, a2), b2 = _mm512_fmadd_ps(g1, d1, b2);
      }
      for (; r < r1; ++r) {
        const __m512 d0 = _mm512_sub_ps(row16(x, r * c + j, bf16, m), kk);
        const __m512 g0 = row16(g, r * c + j, bf16, m);
        a1 = _mm512_add_ps(a1, g0), a2 = _mm512_fmadd_ps(g0, d0, a2);
      }
    } else {
      for (; r + 1 < r1; r += 2) {
        const __m512 d0 = _mm512_sub_ps(row16(x, r * c + j, bf16, m), kk);
        const __m512 d1 = _mm512_sub_ps(row16(x, (r + 1) * c + j, bf16, m), kk);
        a1 = _mm512_add_ps(a1, d0), b1 = _mm512_add_ps(b1, d1);
        a2 = _mm512_fmadd_ps(d0, d0, a2), b2 = _mm512_fmadd_ps(d1, d1, b2);
      }
      for (; r < r1; ++r) {
        const __m512 d0 = _mm512_sub_ps(row16(x, r * c + j, bf16, m), kk);
        a1 = _mm512_add_ps(a1, d0), a2 = _mm512_fmadd_ps(d0, d0, a2);
      }
    }
    float t1[16], t2[16];
    _mm512_storeu_ps(t1, _mm512_add_ps(a1, b1));
    _mm512_storeu_ps(t2, _mm512_add_ps(a2, b2));
    const long width = c - j < 16 ? c - j : 16;
    for (long l = 0; l < width; ++l) s[j + l] += t1[l], s[c + j + l] += t2[l];
  }
}

int column_stats(const void *x, const void *g, const float *k, double *s, long n, long c,
                 long bf16, long threads) {
  return column_sums(stat_block, x, g, k, s, n, c, bf16, threads);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* 2x2 max-pool of spatial-major maps x [H, W, L] -> out [H/2, W/2, L] (a window's four
 * positions are four contiguous runs of L values), the ReLU after it if relu, and, where
 * code is given, the window position that won each output: kernels._pool_quads' code (scan
 * order, the first of equal values wins; 4 where the ReLU clamps). float32 (bf16 == 0) or
 * bfloat16 (bf16 == 1: widened exactly to compare, the winner written back as it was). */
/* Unit u of a pass over the 2x2 windows, 16 values of L at a time: the window, its top-left
 * pixel (y, x), the offset i in L and the lanes' mask. */
typedef struct {
  long win, i, y, x;
  __mmask16 m;
} wlanes_t;

static inline __attribute__((always_inline)) wlanes_t window_lanes(long u, long lanes, long w,
                                                                   long l) {
  const long win = u / lanes, i = (u % lanes) * 16, half = w / 2;
  const __mmask16 m = l - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (l - i)) - 1);
  return (wlanes_t){win, i, 2 * (win / half), 2 * (win % half), m};
}

static inline __attribute__((always_inline)) void store16(void *p, long i, long bf16,
                                                          __mmask16 m, __m512 v) {
  if (bf16) { /* a widened bfloat16 (or zero): its top half is the value */
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    _mm256_mask_storeu_epi16((unsigned short *)p + i, m, h);
  } else {
    _mm512_mask_storeu_ps((float *)p + i, m, v);
  }
}

int pool2x2(const void *x, void *out, unsigned char *code, long h, long w, long l, long relu,
            long bf16, long threads) {
  if (h < 2 || w < 2 || h % 2 || w % 2 || l < 1 || threads < 1) return 1;
  const long lanes = (l + 15) / 16, units = (h / 2) * (w / 2) * lanes;
  const long chunk = chunk_size(units, threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
  for (long u = 0; u < units; ++u) {
    const wlanes_t t = window_lanes(u, lanes, w, l);
    const long win = t.win, i = t.i;
    const __mmask16 m = t.m;
    const long b0 = (t.y * w + t.x) * l + i, b2 = b0 + w * l;
    const __m512 p0 = row16(x, b0, bf16, m), p1 = row16(x, b0 + l, bf16, m);
    const __m512 p2 = row16(x, b2, bf16, m), p3 = row16(x, b2 + l, bf16, m);
    const __m512 top = _mm512_max_ps(p0, p1), bottom = _mm512_max_ps(p2, p3);
    __m512 v = _mm512_max_ps(top, bottom);
    const __mmask16 clamped = relu ? _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LE_OQ) : 0;
    if (relu) v = _mm512_maskz_mov_ps((__mmask16)~clamped, v);
    store16(out, win * l + i, bf16, m, v);
    if (code) {
      const __mmask16 low = _mm512_cmp_ps_mask(bottom, top, _CMP_GT_OQ);
      const __mmask16 right = (_mm512_cmp_ps_mask(p3, p2, _CMP_GT_OQ) & low) |
                              (_mm512_cmp_ps_mask(p1, p0, _CMP_GT_OQ) & (__mmask16)~low);
      __m512i c = _mm512_maskz_mov_epi32(low, _mm512_set1_epi32(2));
      c = _mm512_mask_add_epi32(c, right, c, _mm512_set1_epi32(1));
      c = _mm512_mask_mov_epi32(c, clamped, _mm512_set1_epi32(4));
      _mm_mask_storeu_epi8(code + win * l + i, m, _mm512_cvtepi32_epi8(c));
    }
  }
  return 0;
}

/* The gradient of pool2x2: grad [H/2, W/2, L] into the window position code names in
 * gx [H, W, L], zeros at the other three (at all four where code is 4). */
int unpool2x2(const void *grad, const unsigned char *code, void *gx, long h, long w, long l,
              long bf16, long threads) {
  if (h < 2 || w < 2 || h % 2 || w % 2 || l < 1 || threads < 1) return 1;
  const long lanes = (l + 15) / 16, units = (h / 2) * (w / 2) * lanes;
  const long chunk = chunk_size(units, threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
  for (long u = 0; u < units; ++u) {
    const wlanes_t t = window_lanes(u, lanes, w, l);
    const __mmask16 m = t.m;
    const __m512 g = row16(grad, t.win * l + t.i, bf16, m);
    const __m128i c = _mm_maskz_loadu_epi8(m, code + t.win * l + t.i);
    const long b0 = (t.y * w + t.x) * l + t.i, b2 = b0 + w * l;
    const long at[4] = {b0, b0 + l, b2, b2 + l};
    for (int q = 0; q < 4; ++q) {
      const __mmask16 won = _mm_cmpeq_epi8_mask(c, _mm_set1_epi8((char)q));
      store16(gx, at[q], bf16, m, _mm512_maskz_mov_ps(won, g));
    }
  }
  return 0;
}
#endif
