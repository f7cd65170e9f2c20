/* The FFT path's per-frequency complex products for a few rows (one image, its quarter
 * turns), float32 on CPUs with AVX-512: see rstmodel/layers/native.py.
 *
 * For each frequency f:  [Re y; Im y] from  x = [Re x; Im x]  (2M rows, K columns) and the
 * filter spectrum G (K x N, complex), packed as tiles of 16 columns:
 *   g[f, t, k, 0:16] = Re G[k, 16t : 16t+16],  g[f, t, k, 16:32] = Im G[k, 16t : 16t+16]
 * (zero past column N). Each tile is read from memory once, in order, and summed in
 * registers for GROUP rows at a time (further groups read it from L1): at one image (M = 4)
 * the products are bound by reading G, which a batched GEMM library reads with strides at
 * half the speed.
 *   Re y = Re x Re G - Im x Im G,   Im y = Re x Im G + Im x Re G
 * x [F, 2M, K]; y [2, F, M, N]. Threads split the frequencies. */
#include <immintrin.h>
#include <pthread.h>

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
  pthread_t ids[64];
  int started[64] = {0};
  job_t jobs[64];
  if (threads > 64) threads = 64;
  for (long i = 0; i < threads; ++i)
    jobs[i] = (job_t){x, g, y, f * i / threads, f * (i + 1) / threads, f, m, k, n};
  for (long i = 1; i < threads; ++i) started[i] = !pthread_create(&ids[i], NULL, run, &jobs[i]);
  for (long i = 0; i < threads; ++i)
    if (!started[i]) run(&jobs[i]); /* the caller's share, and any thread that did not start */
  for (long i = 1; i < threads; ++i)
    if (started[i]) pthread_join(ids[i], NULL);
  return 0;
}
