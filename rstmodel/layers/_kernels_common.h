/* What both kernel sources share (_joined_rows.c for AVX-512, _joined_rows_portable.c for
 * AVX2): how work is handed to OpenMP threads, and the batch norm's column sums around
 * each source's own block of rows. See rstmodel/layers/native.py. */
#ifndef RSTMODEL_KERNELS_COMMON_H
#define RSTMODEL_KERNELS_COMMON_H

#include <omp.h>
#include <stdlib.h>

#define CHUNKS 16 /* chunks of work per thread (the dynamic schedule's) */
#define SROWS 256 /* rows of the column sums summed in float32 before a float64 addition */

/* units of work per chunk: CHUNKS per thread, at least one */
static inline long chunk_size(long units, long threads) {
  const long c = units / (threads * CHUNKS);
  return c > 0 ? c : 1;
}

/* one block of rows [r0, r1) of the column sums, added into s (2C float64) */
typedef void (*stat_block_fn)(const void *x, const void *g, const float *k, double *s, long r0,
                              long r1, long c, long bf16);

/* The batch norm's column sums over [N, C] rows (channels innermost), in one pass:
 *   g == NULL:  s[c] = sum_n (x - k[c]),  s[C + c] = sum_n (x - k[c])^2
 *   g != NULL:  s[c] = sum_n g,           s[C + c] = sum_n g (x - k[c])
 * blocks of SROWS rows summed by `block` in float32 and added in float64 per thread, the
 * threads' partials at the end into s (float64, 2C, zeroed by the caller). The shift k (a
 * value near each column's mean) keeps the one-pass variance free of cancellation. */
static inline int column_sums(stat_block_fn block, const void *x, const void *g,
                              const float *k, double *s, long n, long c, long bf16,
                              long threads) {
  if (n < 1 || c < 1 || threads < 1) return 1;
  const long blocks = (n + SROWS - 1) / SROWS;
  double *part = calloc((size_t)(threads * 2 * c), sizeof(double));
  if (!part) return 2;
#pragma omp parallel num_threads(threads)
  {
    double *mine = part + omp_get_thread_num() * 2 * c;
#pragma omp for schedule(dynamic, chunk_size(blocks, threads))
    for (long b = 0; b < blocks; ++b) {
      const long r0 = b * SROWS, r1 = r0 + SROWS < n ? r0 + SROWS : n;
      block(x, g, k, mine, r0, r1, c, bf16);
    }
  }
  for (long t = 0; t < threads; ++t)
    for (long i = 0; i < 2 * c; ++i) s[i] += part[t * 2 * c + i];
  free(part);
  return 0;
}

#endif
