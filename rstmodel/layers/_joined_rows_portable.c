/* The float32 kernels of _joined_rows.c for CPUs without AVX-512 (built where the CPU has
 * AVX2 and FMA: see rstmodel/layers/native.py): the same entry points, arguments, layouts
 * and values, written with GCC's generic vectors of 8 floats so that the compiler picks the
 * instructions (one AVX2 register each). The AVX-512 layouts stay as they are: a tile of 16
 * columns (or channels) is taken as two halves of 8, so the Python side packs the same
 * tensors for both builds. With 16 vector registers instead of 32, fewer sums are held in
 * registers at a time (GROUP rows of the products, HGROUP halves of the pooled mixing).
 *
 * Built here: joined_rows_product, its 16-bit integer form word_rows_product (AVX2's
 * vpmaddwd; the AVX-512 build has int8 products instead), pooled_mix_f32,
 * pooled_mix_grad_f32, column_stats, pool2x2, unpool2x2 (the last three also take
 * bfloat16, widened exactly by a shift), and
 * the DFTs' GEMMs in float32 (small_gemm_f32, its gathered and pooled forms: the AVX-512
 * build's bfloat16 ones have no float32 twin there, where the library GEMM serves). The
 * bfloat16 and int8 dot-product kernels need AVX512-BF16 and AVX512-VNNI and are absent;
 * rstmodel.layers.native then keeps torch's forms for them.
 *
 * Every kernel hands its work to OpenMP threads in chunks, as the AVX-512 build does
 * (CHUNKS per thread, the dynamic schedule). */
#include <immintrin.h>

#include "_kernels_common.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "AVX2 and FMA only: elsewhere the library keeps torch's forms"
#endif

#define TILE 16 /* columns per tile of the packed layouts (the AVX-512 build's register) */
#define HALF 8 /* columns per vector here */
#ifndef GROUP
#define GROUP 3 /* rows of Re x (and of Im x) summed in registers at a time */
#endif
#ifndef HGROUP
#define HGROUP 3 /* halves of channels summed in registers at a time (4 pixels each) */
#endif

typedef float v8 __attribute__((vector_size(4 * HALF)));
typedef float v8u __attribute__((vector_size(4 * HALF), aligned(4)));
typedef int v8i __attribute__((vector_size(4 * HALF)));
typedef int v8iu __attribute__((vector_size(4 * HALF), aligned(2)));
typedef unsigned int v8w __attribute__((vector_size(4 * HALF)));
typedef unsigned short v8h __attribute__((vector_size(2 * HALF)));
typedef unsigned short v8hu __attribute__((vector_size(2 * HALF), aligned(2)));


static inline long lanes_left(long total, long at) {
  return total - at < HALF ? total - at : HALF;
}

/* the first `width` floats at p (zeros after them) */
static inline v8 load8(const float *p, long width) {
  if (width >= HALF) return *(const v8u *)p;
  v8 v = {0};
  for (long l = 0; l < width; ++l) v[l] = p[l];
  return v;
}

static inline void store8(float *p, v8 v, long width) {
  if (width >= HALF) {
    *(v8u *)p = v;
    return;
  }
  for (long l = 0; l < width; ++l) p[l] = v[l];
}

/* a if a > b, else b: the AVX max instruction's rule, so the values match the AVX-512
 * build's bit for bit */
static inline v8 vmax(v8 a, v8 b) {
  const v8i gt = a > b;
  return (v8)((gt & (v8i)a) | (~gt & (v8i)b));
}

static inline v8 vselect(v8i mask, v8 a) { return (v8)(mask & (v8i)a); }

/* ------------------------------------------------------------------ the products */

/* One half tile (8 columns from c0) for rows [r0, r0 + g) of Re x and of Im x (g <= GROUP):
 * xq holds the group's rows interleaved, xq[i][0:g] = Re x[r0:r0+g, i] and xq[i][g:2g] =
 * Im x[...] (one cache line per k, not 2g); gt points at the half's first real part in the
 * packed tile g[f, t, k, 0:2, 0:16]; the K x 16 values are read from memory for the first
 * group and from cache for the others. */
static inline __attribute__((always_inline)) void half_tile(const float *xq, const float *gt,
                                                            float *re, float *im, long k,
                                                            long n, long c0, long r0,
                                                            const long g) {
  v8 a_re[2 * GROUP], a_im[2 * GROUP];
  for (long r = 0; r < 2 * g; ++r) a_re[r] = a_im[r] = (v8){0};
  for (long i = 0; i < k; ++i, gt += 2 * TILE, xq += 2 * g) {
    const v8 g_re = *(const v8u *)gt, g_im = *(const v8u *)(gt + TILE);
#pragma GCC unroll 8
    for (long r = 0; r < 2 * g; ++r) {
      const float s = xq[r];
      a_re[r] += s * g_re;
      a_im[r] += s * g_im;
    }
  }
  const long width = lanes_left(n, c0);
  for (long r = 0; r < g; ++r) {
    store8(re + (r0 + r) * n + c0, a_re[r] - a_im[g + r], width);
    store8(im + (r0 + r) * n + c0, a_im[r] + a_re[g + r], width);
  }
}

/* the groups of rows of one frequency's x [2M, K] interleaved for half_tile: group q (rows
 * r0..r0+g) at xp + 2 r0 k, as [k][2g] */
static void interleave_rows(const float *xf, float *xp, long m, long k) {
  for (long r0 = 0; r0 < m; r0 += GROUP) {
    const long g = m - r0 < GROUP ? m - r0 : GROUP;
    float *q = xp + 2 * r0 * k;
    for (long i = 0; i < k; ++i)
      for (long r = 0; r < g; ++r) {
        q[i * 2 * g + r] = xf[(r0 + r) * k + i];
        q[i * 2 * g + g + r] = xf[(m + r0 + r) * k + i];
      }
  }
}

/* Each frequency's rows group by group, each group over every tile: the group's interleaved
 * rows (6 x K values) stay in L1 while the frequency's spectra (all tiles: ~80 KB at K 69,
 * N 135) are read again from L2 for each group. Tiles outermost instead (each tile read once
 * into L1, every group's rows passing through it) took 1.04-1.39x the time at batches 8-22
 * on an AVX2 EPYC (BENCHMARKS.md, "Issue 13, twenty-fifth session"). */
static void product_rows(const float *x, const float *g, float *y, long f0, long f1, long f_total,
                         long m, long k, long n, float *xp) {
  const long tiles = (n + TILE - 1) / TILE;
  for (long f = f0; f < f1; ++f) {
    interleave_rows(x + f * 2 * m * k, xp, m, k);
    float *re = y + f * m * n, *im = y + (f_total + f) * m * n;
    for (long r0 = 0; r0 < m; r0 += GROUP) {
      const long gg = m - r0 < GROUP ? m - r0 : GROUP;
      for (long t = 0; t < tiles; ++t)
        for (long h = 0; h < 2 && t * TILE + h * HALF < n; ++h) {
          const float *gt = g + (f * tiles + t) * k * 2 * TILE + h * HALF;
          const long c0 = t * TILE + h * HALF;
          switch (gg) {
          case GROUP: half_tile(xp + 2 * r0 * k, gt, re, im, k, n, c0, r0, GROUP); break;
#if GROUP > 3
          case 3: half_tile(xp + 2 * r0 * k, gt, re, im, k, n, c0, r0, 3); break;
#endif
          case 2: half_tile(xp + 2 * r0 * k, gt, re, im, k, n, c0, r0, 2); break;
          case 1: half_tile(xp + 2 * r0 * k, gt, re, im, k, n, c0, r0, 1); break;
          }
        }
    }
  }
}

/* x [F, 2M, K] (rows of Re x, then of Im x), g packed as native.pack_joined, y [2, F, M, N] */
int joined_rows_product(const float *x, const float *g, float *y, long f, long m, long k,
                        long n, long threads) {
  if (m < 1 || threads < 1) return 1;
  const long chunk = chunk_size(f, threads), per = 2 * m * k;
  float *xps = malloc(sizeof(float) * threads * per);
  if (!xps) return 2;
#pragma omp parallel num_threads(threads)
  {
    float *xp = xps + omp_get_thread_num() * per;
#pragma omp for schedule(dynamic, 1)
    for (long c = 0; c < (f + chunk - 1) / chunk; ++c)
      product_rows(x, g, y, c * chunk, c * chunk + chunk < f ? c * chunk + chunk : f, f, m, k, n,
                   xp);
  }
  free(xps);
  return 0;
}

/* ------------------------------------------- the products on 16-bit integers */

/* joined_rows_product with x and the spectra quantized to 16-bit integers and the complex
 * products summed exactly in 32 bits: each 32-bit lane of the spectra holds one column's
 * pair (Re G, Im G), and one multiply-add of word pairs (vpmaddwd: two 16-bit products
 * summed into 32 bits) gives a complex product's real part for 8 columns from the broadcast
 * pair (Re x, -Im x), or its imaginary part from (Im x, Re x): 16 multiply-adds per
 * instruction where a float32 FMA does 8 (on Zen 3 one issues per cycle against two FMAs:
 * the same rate, results/bench/peak-s26.c), four bytes per spectrum value pair read, not 8.
 * Each frequency's row r is scaled by levels / max(|Re x[r]|, |Im x[r]|) and rounded (ties
 * to even), the spectra likewise per column once (native.pack_words); with
 * 2 K levels^2 < 2^31 no sum can overflow. The sums are scaled back by
 * (top_x / levels) (top_g / levels), rounded once to float32. */
#ifndef IGROUP
#define IGROUP 4 /* rows summed in registers at a time (8 sums): 0.91-1.0x the time of 6 (12
                  * sums, the most that fit beside the spectra's vector, a broadcast and a
                  * product) at the shipped model's shapes */
#endif
#if IGROUP < 1 || IGROUP > 4
#error "IGROUP: 1 to 4 (word_rows' switch)"
#endif

/* one frequency's rows [M, K] (real and imaginary parts) as word pairs in group order, group
 * q (rows r0..r0+g) at q + 2 r0 k as [k][2g]: (Re, -Im) of each row, then (Im, Re), so that
 * a group's 2g broadcasts per k come from one cache line (rows apart, 2g lines: 1.02-1.23x
 * the kernel's time at the shipped model's shapes); sx[r] the row's scale */
static void quantize_rows(const float *xr, const float *xi, int *q, float *sx, long m, long k,
                          float levels) {
  const v8i no_sign = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                       0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  for (long r = 0; r < m; ++r) {
    const float *a = xr + r * k, *b = xi + r * k;
    v8 top8 = {0};
    for (long i = 0; i < k; i += HALF) {
      const long width = lanes_left(k, i);
      top8 = vmax(top8, (v8)((v8i)load8(a + i, width) & no_sign));
      top8 = vmax(top8, (v8)((v8i)load8(b + i, width) & no_sign));
    }
    float top = 0.0f;
    for (long l = 0; l < HALF; ++l) top = top8[l] > top ? top8[l] : top;
    const float inv = top > 0.0f ? levels / top : 0.0f;
    sx[r] = top / levels;
    const long r0 = r / IGROUP * IGROUP, g = m - r0 < IGROUP ? m - r0 : IGROUP, rr = r - r0;
    int *qg = q + 2 * r0 * k;
    const v8 vinv = {inv, inv, inv, inv, inv, inv, inv, inv};
    for (long i = 0; i < k; i += HALF) {
      const long width = lanes_left(k, i);
      const v8i qa = (v8i)_mm256_cvtps_epi32((__m256)(load8(a + i, width) * vinv));
      const v8i qb = (v8i)_mm256_cvtps_epi32((__m256)(load8(b + i, width) * vinv));
      const v8i p_re = (qa & 0xffff) | (v8i)((v8w)(-qb) << 16);
      const v8i p_im = (qb & 0xffff) | (v8i)((v8w)qa << 16);
      for (long l = 0; l < width; ++l) {
        qg[(i + l) * 2 * g + rr] = p_re[l];
        qg[(i + l) * 2 * g + g + rr] = p_im[l];
      }
    }
  }
}

/* acc + the word pairs' products of the pair at p (broadcast) and w. The empty assembly
 * statement keeps each broadcast beside its product: without it GCC hoists all 2g
 * broadcasts of a k above the products and spills the sums to the stack (AVX2 has 16
 * registers) */
static inline __attribute__((always_inline)) v8i word_madd(v8i acc, const int *p, v8i w) {
  __m256i b = _mm256_set1_epi32(*p);
  __asm__("" : "+x"(b)); /* here, not hoisted */
  return acc + (v8i)_mm256_madd_epi16(b, (__m256i)w);
}

/* one half tile (8 columns from c0) for rows [r0, r0 + g) of one frequency: xq the group's
 * word pairs ([k][2g], quantize_rows), gt the half's first pair in the packed tile
 * g[f, t, k, 0:16, 0:2] */
static inline __attribute__((always_inline)) void word_half_tile(
    const int *xq, const short *gt, const float *sx, const float *sg, float *re, float *im,
    long k, long n, long c0, long r0, const long g) {
  v8i a_re[IGROUP], a_im[IGROUP];
  for (long r = 0; r < g; ++r) a_re[r] = a_im[r] = (v8i){0};
  for (long i = 0; i < k; ++i, gt += 2 * TILE, xq += 2 * g) {
    const v8i w = *(const v8iu *)gt;
#pragma GCC unroll 8
    for (long r = 0; r < g; ++r) {
      a_re[r] = word_madd(a_re[r], xq + r, w);
      a_im[r] = word_madd(a_im[r], xq + g + r, w);
    }
  }
  const long width = lanes_left(n, c0);
  const v8 s_g = *(const v8u *)(sg + c0);
  for (long r = 0; r < g; ++r) {
    const float s_x = sx[r0 + r];
    const v8 s = s_x * s_g; /* one rounding, then one for the product */
    store8(re + (r0 + r) * n + c0, __builtin_convertvector(a_re[r], v8) * s, width);
    store8(im + (r0 + r) * n + c0, __builtin_convertvector(a_im[r], v8) * s, width);
  }
}

static void word_rows(const float *x_re, const float *x_im, const short *g, const float *gs,
                      float *y, long f0, long f1, long f_total, long m, long k, long n,
                      float levels, int *xq, float *sx) {
  const long tiles = (n + TILE - 1) / TILE;
  for (long f = f0; f < f1; ++f) {
    quantize_rows(x_re + f * m * k, x_im + f * m * k, xq, sx, m, k, levels);
    float *re = y + f * m * n, *im = y + (f_total + f) * m * n;
    const float *sg = gs + f * tiles * TILE;
    for (long r0 = 0; r0 < m; r0 += IGROUP) {
      const long gg = m - r0 < IGROUP ? m - r0 : IGROUP;
      const int *q = xq + 2 * r0 * k;
      for (long t = 0; t < tiles; ++t)
        for (long h = 0; h < 2 && t * TILE + h * HALF < n; ++h) {
          const short *gt = g + (f * tiles + t) * k * 2 * TILE + 2 * h * HALF;
          const long c0 = t * TILE + h * HALF;
          switch (gg) { /* a constant group size for each inlined copy */
          case IGROUP: word_half_tile(q, gt, sx, sg, re, im, k, n, c0, r0, IGROUP); break;
#if IGROUP > 3
          case 3: word_half_tile(q, gt, sx, sg, re, im, k, n, c0, r0, 3); break;
#endif
#if IGROUP > 2
          case 2: word_half_tile(q, gt, sx, sg, re, im, k, n, c0, r0, 2); break;
#endif
#if IGROUP > 1
          case 1: word_half_tile(q, gt, sx, sg, re, im, k, n, c0, r0, 1); break;
#endif
          }
        }
    }
  }
}

/* x_re, x_im [F, M, K] float32; g int16 [F, T, K, 16, 2] (pairs, zero past column N); gs
 * [F, T * 16] the columns' scales; y [2, F, M, N] float32. Returns 1 for no rows, 2 out of
 * memory, 3 for levels whose sums could overflow. */
int word_rows_product(const float *x_re, const float *x_im, const short *g, const float *gs,
                      float *y, long f, long m, long k, long n, long levels, long threads) {
  if (m < 1 || k < 1 || threads < 1) return 1;
  if (levels < 1 || levels > 32767 || 2.0 * k * levels * levels > 2147483647.0) return 3;
  const long chunk = chunk_size(f, threads), per = 2 * m * k + m;
  int *bufs = malloc(sizeof(int) * threads * per);
  if (!bufs) return 2;
#pragma omp parallel num_threads(threads)
  {
    int *xq = bufs + omp_get_thread_num() * per;
#pragma omp for schedule(dynamic, 1)
    for (long c = 0; c < (f + chunk - 1) / chunk; ++c)
      word_rows(x_re, x_im, g, gs, y, c * chunk, c * chunk + chunk < f ? c * chunk + chunk : f,
                f, m, k, n, (float)levels, xq, (float *)(xq + 2 * m * k));
  }
  free(bufs);
  return 0;
}

/* ------------------------------------------------- the lifting layer's pooled mixing */

/* Halves [h0, h0 + g) of channels of one window and branch: p[q] the q-th pixel's KK
 * responses, wt the weight set's tiles wt[t][k][16]; the pooled value (plus the bias,
 * through the ReLU if relu) written to o and, where code is given, the window position
 * that won (scan order, the first of equal values; 4 where the ReLU clamps). */
static inline __attribute__((always_inline)) void mix_halves(const float *const p[4],
                                                             const float *wt,
                                                             const float *bias, float *o,
                                                             unsigned char *code, long kk,
                                                             long cout, long h0, long relu,
                                                             const long g) {
  v8 acc[4][HGROUP];
  const float *w[HGROUP];
  for (long t = 0; t < g; ++t) {
    const long hh = h0 + t;
    w[t] = wt + (hh / 2) * kk * TILE + (hh % 2) * HALF;
    for (long q = 0; q < 4; ++q) acc[q][t] = (v8){0};
  }
  for (long i = 0; i < kk; ++i) {
    v8 wv[HGROUP];
    for (long t = 0; t < g; ++t) wv[t] = *(const v8u *)(w[t] + i * TILE);
    for (long q = 0; q < 4; ++q) {
      const float s = p[q][i];
      for (long t = 0; t < g; ++t) acc[q][t] += s * wv[t];
    }
  }
  const v8 zero = {0};
  for (long t = 0; t < g; ++t) {
    const long c0 = (h0 + t) * HALF, width = lanes_left(cout, c0);
    const v8 top = vmax(acc[0][t], acc[1][t]), low = vmax(acc[2][t], acc[3][t]);
    const v8 mx = vmax(top, low) + *(const v8u *)(bias + c0);
    store8(o + c0, relu ? vmax(mx, zero) : mx, width);
    if (code) {
      const v8i below = low > top;
      const v8i right = ((acc[3][t] > acc[2][t]) & below) | ((acc[1][t] > acc[0][t]) & ~below);
      v8i c = (below & 2) | (right & 1);
      if (relu) {
        const v8i clamped = mx <= zero;
        c = (clamped & 4) | (~clamped & c);
      }
      for (long l = 0; l < width; ++l) code[c0 + l] = (unsigned char)c[l];
    }
  }
}

static void mix_rows(const float *resp, const float *wts, const float *bias, float *out,
                     unsigned char *codes, long w, long m, long kk, long cout, long sets,
                     long relu, long u0, long u1) {
  const long mr = m / sets, half = w / 2, tiles = (cout + TILE - 1) / TILE;
  const long halves = (cout + HALF - 1) / HALF;
  for (long u = u0; u < u1; ++u) { /* u = (i half + jj) m + mi */
    const long mi = u % m, ri = mi % mr, win = u / m, y = 2 * (win / half), x = 2 * (win % half);
    const float *wt = wts + mi / mr * tiles * kk * TILE;
    const float *const p[4] = {resp + ((y * w + x) * mr + ri) * kk,
                               resp + ((y * w + x + 1) * mr + ri) * kk,
                               resp + (((y + 1) * w + x) * mr + ri) * kk,
                               resp + (((y + 1) * w + x + 1) * mr + ri) * kk};
    float *o = out + u * cout;
    unsigned char *code = codes ? codes + u * cout : NULL;
    long h0 = 0;
    for (; h0 + HGROUP <= halves; h0 += HGROUP)
      mix_halves(p, wt, bias, o, code, kk, cout, h0, relu, HGROUP);
    switch (halves - h0) {
    case 2: mix_halves(p, wt, bias, o, code, kk, cout, h0, relu, 2); break;
    case 1: mix_halves(p, wt, bias, o, code, kk, cout, h0, relu, 1); break;
    }
  }
}

/* the responses [H, W*M/SETS, KK], the weights [SETS][tiles][KK][16] (zero past COUT), the
 * bias padded to whole tiles; out [H/2, W/2, M, COUT] and, where code is given, its bytes */
int pooled_mix_f32(const float *resp, const float *wt, const float *bias, float *out,
                   unsigned char *code, long h, long w, long m, long kk, long cout, long sets,
                   long relu, long threads) {
  if (h < 2 || w < 2 || m < 1 || kk < 1 || cout < 1 || sets < 1 || m % sets || threads < 1)
    return 1;
  const long units = (h / 2) * (w / 2) * m;
  const long chunk = chunk_size(units, threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (long c = 0; c < (units + chunk - 1) / chunk; ++c)
    mix_rows(resp, wt, bias, out, code, w, m, kk, cout, sets, relu, c * chunk,
             c * chunk + chunk < units ? c * chunk + chunk : units);
  return 0;
}

/* The coefficients' gradient of the pooled mixing: partial[thread][tile][k][16] += the
 * gradient of each output whose code is q < 4 times the responses of the window's pixel q
 * (the caller zeroes partial and adds the threads' parts). */
int pooled_mix_grad_f32(const float *resp, const float *grad, const unsigned char *code,
                        float *partial, long h, long w, long m, long kk, long cout,
                        long threads) {
  if (h < 2 || w < 2 || m < 1 || kk < 1 || cout < 1 || threads < 1) return 1;
  const long tiles = (cout + TILE - 1) / TILE, half = w / 2;
  const long units = (h / 2) * half * m, chunk = chunk_size(units, threads);
#pragma omp parallel num_threads(threads)
  {
    float *acc = partial + (long)omp_get_thread_num() * tiles * kk * TILE;
#pragma omp for schedule(dynamic, chunk)
    for (long u = 0; u < units; ++u) {
      const long mi = u % m, win = u / m, y = 2 * (win / half), x = 2 * (win % half);
      const float *const p[4] = {resp + ((y * w + x) * m + mi) * kk,
                                 resp + ((y * w + x + 1) * m + mi) * kk,
                                 resp + (((y + 1) * w + x) * m + mi) * kk,
                                 resp + (((y + 1) * w + x + 1) * m + mi) * kk};
      for (long c0 = 0; c0 < cout; c0 += HALF) {
        const long width = lanes_left(cout, c0);
        const v8 g = load8(grad + u * cout + c0, width);
        v8i c = {-1, -1, -1, -1, -1, -1, -1, -1};
        for (long l = 0; l < width; ++l) c[l] = code[u * cout + c0 + l];
        v8 gq[4];
        for (int q = 0; q < 4; ++q) gq[q] = vselect(c == q, g);
        float *a = acc + (c0 / TILE) * kk * TILE + c0 % TILE;
        for (long k = 0; k < kk; ++k) {
          v8 v = *(v8u *)(a + k * TILE);
          for (int q = 0; q < 4; ++q) v += gq[q] * p[q][k];
          *(v8u *)(a + k * TILE) = v;
        }
      }
    }
  }
  return 0;
}

/* ------------------------------------------------ the batch norm's sums and the pools */

/* 8 values at element i of p: float32 (bf16 == 0) or bfloat16 widened exactly (bf16 == 1);
 * zeros past width */
static inline v8 row8(const void *p, long i, long bf16, long width) {
  if (!bf16) return load8((const float *)p + i, width);
  const unsigned short *s = (const unsigned short *)p + i;
  v8h hv = {0};
  if (width >= HALF)
    hv = *(const v8hu *)s;
  else
    for (long l = 0; l < width; ++l) hv[l] = s[l];
  return (v8)(__builtin_convertvector(hv, v8w) << 16);
}

/* v at element i of p, float32 or (bf16 == 1) the top half of each value: exact for the
 * widened bfloat16 values (and zeros) the pools write */
static inline void put8(void *p, long i, long bf16, long width, v8 v) {
  if (!bf16) {
    store8((float *)p + i, v, width);
    return;
  }
  const v8h hv = __builtin_convertvector((v8w)v >> 16, v8h);
  unsigned short *d = (unsigned short *)p + i;
  if (width >= HALF)
    *(v8hu *)d = hv;
  else
    for (long l = 0; l < width; ++l) d[l] = hv[l];
}

/* The batch norm's column sums (_kernels_common.h's column_sums) over one block of rows,
 * in float32, 8 columns at a time, even and odd rows apart. */
static void stat_block(const void *x, const void *g, const float *k, double *s, long r0,
                       long r1, long c, long bf16) {
  for (long j = 0; j < c; j += HALF) {
    const long width = lanes_left(c, j);
    const v8 kk = load8(k + j, width);
    v8 a1 = {0}, a2 = {0}, b1 = {0}, b2 = {0};
    long r = r0;
    if (g) {
      for (; r + 1 < r1; r += 2) {
        const v8 d0 = row8(x, r * c + j, bf16, width) - kk;
        const v8 d1 = row8(x, (r + 1) * c + j, bf16, width) - kk;
        const v8 g0 = row8(g, r * c + j, bf16, width), g1 = row8(g, (r + 1) * c + j, bf16, width);
        a1 += g0, b1 += g1;
        a2 += g0 * d0, b2 += g1 * d1;
      }
      for (; r < r1; ++r) {
        const v8 d0 = row8(x, r * c + j, bf16, width) - kk, g0 = row8(g, r * c + j, bf16, width);
        a1 += g0, a2 += g0 * d0;
      }
    } else {
      for (; r + 1 < r1; r += 2) {
        const v8 d0 = row8(x, r * c + j, bf16, width) - kk;
        const v8 d1 = row8(x, (r + 1) * c + j, bf16, width) - kk;
        a1 += d0, b1 += d1;
        a2 += d0 * d0, b2 += d1 * d1;
      }
      for (; r < r1; ++r) {
        const v8 d0 = row8(x, r * c + j, bf16, width) - kk;
        a1 += d0, a2 += d0 * d0;
      }
    }
    const v8 t1 = a1 + b1, t2 = a2 + b2;
    for (long l = 0; l < width; ++l) s[j + l] += t1[l], s[c + j + l] += t2[l];
  }
}

int column_stats(const void *x, const void *g, const float *k, double *s, long n, long c,
                 long bf16, long threads) {
  return column_sums(stat_block, x, g, k, s, n, c, bf16, threads);
}

/* 2x2 max-pool of spatial-major maps x [H, W, L] -> out [H/2, W/2, L], through the ReLU if
 * relu, and where code is given the window position that won (scan order, the first of
 * equal values; 4 where the ReLU clamps). Unit u: a window and 8 values of L. */
int pool2x2(const void *x, void *out, unsigned char *code, long h, long w, long l, long relu,
            long bf16, long threads) {
  if (h < 2 || w < 2 || h % 2 || w % 2 || l < 1 || threads < 1) return 1;
  const long lanes = (l + HALF - 1) / HALF, half = w / 2, units = (h / 2) * half * lanes;
  const long chunk = chunk_size(units, threads);
  const v8 zero = {0};
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
  for (long u = 0; u < units; ++u) {
    const long win = u / lanes, i = (u % lanes) * HALF, width = lanes_left(l, i);
    const long b0 = ((2 * (win / half)) * w + 2 * (win % half)) * l + i, b2 = b0 + w * l;
    const v8 p0 = row8(x, b0, bf16, width), p1 = row8(x, b0 + l, bf16, width);
    const v8 p2 = row8(x, b2, bf16, width), p3 = row8(x, b2 + l, bf16, width);
    const v8 top = vmax(p0, p1), bottom = vmax(p2, p3);
    v8 v = vmax(top, bottom);
    const v8i clamped = relu ? (v <= zero) : (v8i){0};
    v = vselect(~clamped, v);
    put8(out, win * l + i, bf16, width, v);
    if (code) {
      const v8i low = bottom > top;
      const v8i right = ((p3 > p2) & low) | ((p1 > p0) & ~low);
      const v8i c = (clamped & 4) | (~clamped & ((low & 2) | (right & 1)));
      for (long j = 0; j < width; ++j) code[win * l + i + j] = (unsigned char)c[j];
    }
  }
  return 0;
}

/* The gradient of pool2x2: grad [H/2, W/2, L] into the window position code names in
 * gx [H, W, L], zeros at the other three (at all four where code is 4). */
int unpool2x2(const void *grad, const unsigned char *code, void *gx, long h, long w, long l,
              long bf16, long threads) {
  if (h < 2 || w < 2 || h % 2 || w % 2 || l < 1 || threads < 1) return 1;
  const long lanes = (l + HALF - 1) / HALF, half = w / 2, units = (h / 2) * half * lanes;
  const long chunk = chunk_size(units, threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
  for (long u = 0; u < units; ++u) {
    const long win = u / lanes, i = (u % lanes) * HALF, width = lanes_left(l, i);
    const v8 g = row8(grad, win * l + i, bf16, width);
    v8i c = {-1, -1, -1, -1, -1, -1, -1, -1};
    for (long j = 0; j < width; ++j) c[j] = code[win * l + i + j];
    const long b0 = ((2 * (win / half)) * w + 2 * (win % half)) * l + i, b2 = b0 + w * l;
    const long at[4] = {b0, b0 + l, b2, b2 + l};
    for (int q = 0; q < 4; ++q) put8(gx, at[q], bf16, width, vselect(c == q, g));
  }
  return 0;
}

/* ------------------------------------------------------- the DFTs' GEMMs in float32 */

/* C[b] = A B[b] for a small A (M x K: a DFT matrix of a few dozen rows and columns) and
 * long rows in B (K x N, up to millions of columns, or a batch of them): the float32 form
 * of the AVX-512 build's bfloat16 small_gemm (rstmodel.layers.native.small_gemm). A library
 * GEMM tiles for square problems and ran these shapes at 11-25 G multiply-adds/s on a
 * 2-core AVX2 CPU; here A stays in L1 and B streams through once. Each panel of PANEL
 * columns of B (its K rows, prefetched ahead: K streams a row stride apart are more than the
 * hardware prefetcher follows) is copied into an L1 buffer, zero past N, and each block of
 * GRB rows of A sums it in 2 GRB registers, one broadcast of A's element per row and k.
 * Threads split the (batch, panel) pairs. The gathered form reads B's rows through an
 * index (small_gemm_gather_f32); the pooled form computes two rows of B's batch side by
 * side and writes only their 2x2 max pool (small_gemm_pool_f32). */
#define PANEL 16 /* columns of B per panel: two vectors */
#define GRB 6 /* rows of A summed in registers at a time (12 sums; fblocks' cases 1-6) */
#define KMAX 512 /* rows of B a panel buffer holds */
#define AHEAD 64 /* floats ahead that a panel's rows are prefetched */
#ifndef UNIT
#define UNIT 64 /* columns of B per unit of work: its rows copied in one pass */
#endif

typedef struct {
  const float *a, *b;
  float *c;
  long batch, ldb_batch, ldc_batch, m, k, n;
  const long *idx; /* NULL, or B's rows gathered (small_gemm_gather_f32) */
  long seg;
  long stream; /* C's whole panels written past the caches (stream_panels) */
} fjob_t;

/* Whether a GEMM writes C's whole panels with non-temporal stores: where C is larger than
 * the caches its lines would be read from memory before each write (for ownership) and
 * evicted unread; streamed, they are only written. 0.69-0.81x the kernel's time at the
 * DFTs' shapes of a sweep's batch (C 17-35 MB) on a 2-core AVX2 EPYC; where C fits the
 * caches (one image: 1.6 MB) the next GEMM reads it from there, so it is not streamed.
 * Needs C's rows on 32-byte boundaries. */
#define STREAM_BYTES (8L << 20)
static long stream_panels(const float *c, long batch, long m, long n) {
  return batch * m * n * 4 >= STREAM_BYTES && !(((unsigned long)c | (unsigned long)(n * 4)) & 31);
}

/* rows [m0, m0 + g) of A times the panel in buf (K x PANEL), into C (row stride n) */
static inline __attribute__((always_inline)) void fblock(const float *a, const float *buf,
                                                         float *c, long n, long k, long m0,
                                                         long width, long stream,
                                                         const long g) {
  v8 acc[GRB][2];
  for (long r = 0; r < g; ++r) acc[r][0] = acc[r][1] = (v8){0};
  const float *ar = a + m0 * k;
  for (long i = 0; i < k; ++i) {
    const v8 b0 = *(const v8 *)(buf + i * PANEL), b1 = *(const v8 *)(buf + i * PANEL + HALF);
#pragma GCC unroll 8
    for (long r = 0; r < g; ++r) {
      const float s = ar[r * k + i];
      acc[r][0] += s * b0;
      acc[r][1] += s * b1;
    }
  }
  if (width == PANEL && stream) {
    for (long r = 0; r < g; ++r) {
      _mm256_stream_ps(c + (m0 + r) * n, (__m256)acc[r][0]);
      _mm256_stream_ps(c + (m0 + r) * n + HALF, (__m256)acc[r][1]);
    }
    return;
  }
  if (width == PANEL) {
    for (long r = 0; r < g; ++r) {
      *(v8u *)(c + (m0 + r) * n) = acc[r][0];
      *(v8u *)(c + (m0 + r) * n + HALF) = acc[r][1];
    }
    return;
  }
  for (long r = 0; r < g; ++r) {
    store8(c + (m0 + r) * n, acc[r][0], width);
    if (width > HALF) store8(c + (m0 + r) * n + HALF, acc[r][1], width - HALF);
  }
}

/* the K rows of a panel of B (row stride n), `width` columns, into buf, zeros after them */
static void copy_panel(const float *b, long n, long k, long width, float *buf) {
  for (long i = 0; i < k; ++i) {
    const float *row = b + i * n;
    __builtin_prefetch(row + AHEAD);
    *(v8 *)(buf + i * PANEL) = load8(row, width);
    *(v8 *)(buf + i * PANEL + HALF) = width > HALF ? load8(row + HALF, width - HALF) : (v8){0};
  }
}

/* width values of row r of B's gathered form from n0: src[seg[n / len] len + n % len] for
 * the row's list of segments `seg`; a panel spans at most two segments (len >= PANEL) */
static void copy_gathered(const float *src, const long *seg, long len, long n0, long width,
                          float *dst) {
  const long j0 = n0 / len, off = n0 % len, first = len - off < width ? len - off : width;
  const float *p0 = src + seg[j0] * len + off;
  __builtin_prefetch(p0 + AHEAD);
  long l = 0;
  for (; l < first; ++l) dst[l] = p0[l];
  if (l < width) {
    const float *p1 = src + seg[j0 + 1] * len - first;
    for (; l < width; ++l) dst[l] = p1[l];
  }
  for (; l < PANEL; ++l) dst[l] = 0.0f;
}

/* rows of A in blocks of at most GRB, as even as the count allows (56 rows: 6 blocks of 6
 * and 4 of 5, not 9 of 6 and one of 2) */
static void fblocks(const float *a, const float *buf, float *c, long n, long k, long m,
                    long width, long stream) {
  const long blocks = (m + GRB - 1) / GRB, base = m / blocks, extra = m % blocks;
  long m0 = 0;
  for (long q = 0; q < blocks; ++q) {
    const long g = base + (q < extra);
    switch (g) {
    case 6: fblock(a, buf, c, n, k, m0, width, stream, 6); break;
    case 5: fblock(a, buf, c, n, k, m0, width, stream, 5); break;
    case 4: fblock(a, buf, c, n, k, m0, width, stream, 4); break;
    case 3: fblock(a, buf, c, n, k, m0, width, stream, 3); break;
    case 2: fblock(a, buf, c, n, k, m0, width, stream, 2); break;
    case 1: fblock(a, buf, c, n, k, m0, width, stream, 1); break;
    }
    m0 += g;
  }
}

/* a unit of work: UNIT columns of B from n0 (its K rows read once, UNIT / PANEL panels) */
static void fpanel(const fjob_t *j, long bi, long n0, float *buf) {
  const long m = j->m, k = j->k, n = j->n;
  float *c = j->c + bi * j->ldc_batch;
  for (long p0 = n0; p0 < n0 + UNIT && p0 < n; p0 += PANEL) {
    const long width = n - p0 < PANEL ? n - p0 : PANEL;
    float *pb = buf + (p0 - n0) / PANEL * k * PANEL;
    if (j->idx) {
      const long segs = n / j->seg;
      const long *row = j->idx + bi * k * segs;
      for (long i = 0; i < k; ++i)
        copy_gathered(j->b, row + i * segs, j->seg, p0, width, pb + i * PANEL);
    } else {
      copy_panel(j->b + bi * j->ldb_batch + p0, n, k, width, pb);
    }
  }
  for (long p0 = n0; p0 < n0 + UNIT && p0 < n; p0 += PANEL)
    fblocks(j->a, buf + (p0 - n0) / PANEL * k * PANEL, c + p0, n, k, m,
            n - p0 < PANEL ? n - p0 : PANEL, j->stream);
}

/* every (batch, panel) pair of the job, handed out in chunks */
static int fgemm_panels(const fjob_t *job, long threads) {
  const long panels = (job->n + UNIT - 1) / UNIT, units = job->batch * panels;
  const long chunk = chunk_size(units, threads), per = job->k * UNIT;
  float *bufs = aligned_alloc(32, sizeof(float) * threads * per); /* a multiple of 32 bytes */
  if (!bufs) return 2;
#pragma omp parallel num_threads(threads)
  {
    float *buf = bufs + omp_get_thread_num() * per;
#pragma omp for schedule(dynamic, chunk)
    for (long u = 0; u < units; ++u) fpanel(job, u / panels, (u % panels) * UNIT, buf);
    if (job->stream) _mm_sfence(); /* the streamed stores seen before the threads join */
  }
  free(bufs);
  return 0;
}

int small_gemm_f32(const float *a, const float *b, float *c, long batch, long m, long k,
                   long n, long threads) {
  if (batch < 1 || m < 1 || k < 1 || k > KMAX || n < 1 || threads < 1) return 1;
  const fjob_t job = {a, b, c, batch, k * n, m * n, m, k, n, NULL, 0,
                      stream_panels(c, batch, m, n)};
  return fgemm_panels(&job, threads);
}

/* small_gemm_f32 with B's rows gathered from a table of rows of SEG values:
 * B[bi][k][n] = src[idx[(bi K + k) J + n / SEG] SEG + n % SEG], J = N / SEG, SEG >= 32 */
int small_gemm_gather_f32(const float *a, const float *src, const long *idx, float *c,
                          long batch, long m, long k, long n, long seg, long threads) {
  if (batch < 1 || m < 1 || k < 1 || k > KMAX || n < 1 || seg < 32 || n % seg || threads < 1)
    return 1;
  const fjob_t job = {a, src, c, batch, 0, m * n, m, k, n, idx, seg,
                      stream_panels(c, batch, m, n)};
  return fgemm_panels(&job, threads);
}

/* width values of v at column c0 of a row whose segments of len values are stored at the
 * rows seg[] of out (out[seg[c / len] len + c % len] for column c); lanes that cross into
 * the next segment go to its row */
static inline void scatter8(float *out, const long *seg, long len, long c0, v8 v, long width) {
  const long j0 = c0 / len, off = c0 % len, first = len - off < width ? len - off : width;
  store8(out + seg[j0] * len + off, v, first);
  for (long l = first; l < width; ++l) out[seg[j0 + 1] * len + l - first] = v[l];
}

/* The pooled form: out[h/2, w/2, n] = max over h in {2i, 2i+1} and w in {2j, 2j+1} of
 * (A B[h])[w, n] (through the ReLU if relu), A [W, K], B [H, K, N]: the two image rows'
 * panels side by side, two rows of A (one pooled column) at a time, 8 sums in registers,
 * only the pooled values written. With dst (small_gemm_pool_scatter_f32): pooled row
 * (i, j)'s segments of SEG values go to the rows of out that dst + (i W/2 + j) J lists. */
static int fpool_rows(const float *a, const float *b, float *out, const long *dst, long seg,
                      long h, long w, long k, long n, long relu, long threads) {
  if (h < 2 || h % 2 || w < 2 || w % 2 || k < 1 || k > KMAX || n < 1 || threads < 1) return 1;
  if (dst && (seg < 32 || n % seg)) return 1;
  const long segs = dst ? n / seg : 0, panels = (n + PANEL - 1) / PANEL;
  const long units = (h / 2) * panels, chunk = chunk_size(units, threads);
  const v8 zero = {0};
#pragma omp parallel num_threads(threads)
  {
    float buf0[KMAX * PANEL] __attribute__((aligned(32)));
    float buf1[KMAX * PANEL] __attribute__((aligned(32)));
#pragma omp for schedule(dynamic, chunk)
    for (long u = 0; u < units; ++u) {
      const long hh = u / panels, n0 = (u % panels) * PANEL;
      const long width = n - n0 < PANEL ? n - n0 : PANEL;
      copy_panel(b + 2 * hh * k * n + n0, n, k, width, buf0);
      copy_panel(b + (2 * hh + 1) * k * n + n0, n, k, width, buf1);
      for (long ww = 0; ww < w / 2; ++ww) {
        const float *a0 = a + 2 * ww * k, *a1 = a0 + k;
        v8 acc[2][2][2]; /* [image row][row of A][half] */
        for (int q = 0; q < 2; ++q)
          for (int r = 0; r < 2; ++r) acc[q][r][0] = acc[q][r][1] = (v8){0};
        for (long i = 0; i < k; ++i) {
          const v8 b00 = *(const v8 *)(buf0 + i * PANEL);
          const v8 b01 = *(const v8 *)(buf0 + i * PANEL + HALF);
          const v8 b10 = *(const v8 *)(buf1 + i * PANEL);
          const v8 b11 = *(const v8 *)(buf1 + i * PANEL + HALF);
          const float s0 = a0[i], s1 = a1[i];
          acc[0][0][0] += s0 * b00, acc[0][0][1] += s0 * b01;
          acc[0][1][0] += s1 * b00, acc[0][1][1] += s1 * b01;
          acc[1][0][0] += s0 * b10, acc[1][0][1] += s0 * b11;
          acc[1][1][0] += s1 * b10, acc[1][1][1] += s1 * b11;
        }
        for (long t = 0; t < 2 && t * HALF < width; ++t) {
          const v8 mx = vmax(vmax(acc[0][0][t], acc[0][1][t]), vmax(acc[1][0][t], acc[1][1][t]));
          const v8 v = relu ? vmax(mx, zero) : mx;
          const long c0 = n0 + t * HALF, lanes = lanes_left(n, c0);
          if (dst)
            scatter8(out, dst + (hh * (w / 2) + ww) * segs, seg, c0, v, lanes);
          else
            store8(out + (hh * (w / 2) + ww) * n + c0, v, lanes);
        }
      }
    }
  }
  return 0;
}

int small_gemm_pool_f32(const float *a, const float *b, float *out, long h, long w, long k,
                        long n, long relu, long threads) {
  return fpool_rows(a, b, out, NULL, 0, h, w, k, n, relu, threads);
}

int small_gemm_pool_scatter_f32(const float *a, const float *b, float *out, const long *dst,
                                long h, long w, long k, long n, long seg, long relu,
                                long threads) {
  if (!dst) return 1;
  return fpool_rows(a, b, out, dst, seg, h, w, k, n, relu, threads);
}
