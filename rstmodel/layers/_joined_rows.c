/* The FFT path's per-frequency complex products for a few rows (one image, its quarter
 * turns), float32 on CPUs with AVX-512: see rstmodel/layers/native.py.
 *
 * For each frequency f:  [Re y; Im y] from  x = [Re x; Im x]  (2M rows, K columns) and the
 * filter spectrum G (K x N, complex), packed as tiles of 16 columns:
 *   g[f, t, k, 0:16] = Re G[k, 16t : 16t+16],  g[f, t, k, 16:32] = Im G[k, 16t : 16t+16]
 * (zero past column N). Each tile is read once, in order, and accumulated in registers for
 * all rows: the products are bound by reading G, which a batched GEMM library reads with
 * strides at half the speed.
 *   Re y = Re x Re G - Im x Im G,   Im y = Re x Im G + Im x Re G
 * x [F, 2M, K]; y [2, F, M, N]; M <= MAX_ROWS. Threads split the frequencies. */
#include <immintrin.h>
#include <pthread.h>

#ifndef __AVX512F__
#error "AVX-512 only: elsewhere the library keeps torch.bmm"
#endif

#define MAX_ROWS 4
#define LANES 16
typedef float v16 __attribute__((vector_size(4 * LANES)));
typedef float v16u __attribute__((vector_size(4 * LANES), aligned(4)));

typedef struct {
  const float *x, *g;
  float *y;
  long f0, f1, f_total, m, k, n;
} job_t;

/* the frequencies [f0, f1) of one job; inlined for each row count, so that the loops over
 * rows unroll and the accumulators stay in registers */
static inline __attribute__((always_inline)) void frequencies(const job_t *j, const long m) {
  const long k = j->k, n = j->n, tiles = (n + LANES - 1) / LANES;
  for (long f = j->f0; f < j->f1; ++f) {
    const float *xf = j->x + f * 2 * m * k;
    const float *gt = j->g + f * tiles * k * 2 * LANES;
    float *re = j->y + f * m * n, *im = j->y + (j->f_total + f) * m * n;
    for (long t = 0; t < tiles; ++t) {
      v16 a_re[2 * MAX_ROWS] = {0}, a_im[2 * MAX_ROWS] = {0}; /* row r of [Re x; Im x] */
      for (long i = 0; i < k; ++i, gt += 2 * LANES) {
        const v16 g_re = *(const v16u *)gt, g_im = *(const v16u *)(gt + LANES);
#pragma GCC unroll 8
        for (long r = 0; r < 2 * m; ++r) {
          const float s = xf[r * k + i];
          a_re[r] += s * g_re;
          a_im[r] += s * g_im;
        }
      }
      const long c0 = t * LANES, width = n - c0 < LANES ? n - c0 : LANES;
      const __mmask16 mask = (__mmask16)((1u << width) - 1);
      for (long r = 0; r < m; ++r) {
        _mm512_mask_storeu_ps(re + r * n + c0, mask, (__m512)(a_re[r] - a_im[m + r]));
        _mm512_mask_storeu_ps(im + r * n + c0, mask, (__m512)(a_im[r] + a_re[m + r]));
      }
    }
  }
}

static void *run(void *arg) {
  const job_t *j = arg;
  switch (j->m) {
  case 1: frequencies(j, 1); break;
  case 2: frequencies(j, 2); break;
  case 3: frequencies(j, 3); break;
  default: frequencies(j, 4);
  }
  return NULL;
}

int joined_rows_product(const float *x, const float *g, float *y, long f, long m, long k,
                        long n, long threads) {
  if (m < 1 || m > MAX_ROWS || threads < 1) return 1;
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
