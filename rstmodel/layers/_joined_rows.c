/* The FFT path's per-frequency complex products in eval, float32 on CPUs with AVX-512 and
 * bfloat16 where the CPU has AVX512-BF16 dot products: see rstmodel/layers/native.py.
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
 * threads: no second set of threads contending with torch's waiting ones for the cores). */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

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
#pragma omp parallel num_threads(threads)
  {
    const long i = omp_get_thread_num(), t = omp_get_num_threads();
    job_t job = {x, g, y, f * i / t, f * (i + 1) / t, f, m, k, n};
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

static void *brun(void *arg) {
  const bjob_t *j = arg;
  const long m = j->m, k = j->k, n = j->n, tiles = (n + LANES - 1) / LANES;
  int *pairs = malloc(sizeof(int) * 2 * m * k);
  if (!pairs) return (void *)1;
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
  free(pairs);
  return NULL;
}

int paired_rows_product(const unsigned short *x_re, const unsigned short *x_im, const int *g,
                        unsigned short *y, long f, long m, long k, long n, long threads) {
  if (m < 1 || threads < 1) return 1;
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    const long i = omp_get_thread_num(), t = omp_get_num_threads();
    bjob_t job = {x_re, x_im, g, y, f * i / t, f * (i + 1) / t, f, m, k, n};
    failed |= brun(&job) != NULL;
  }
  return failed ? 2 : 0;
}
#endif
