/* The float32 kernels of _joined_rows.c for CPUs without AVX-512 (built where the CPU has
 * AVX2 and FMA: see rstmodel/layers/native.py): the same entry points, arguments, layouts
 * and values, written with GCC's generic vectors of 8 floats so that the compiler picks the
 * instructions (one AVX2 register each). The AVX-512 layouts stay as they are: a tile of 16
 * columns (or channels) is taken as two halves of 8, so the Python side packs the same
 * tensors for both builds. With 16 vector registers instead of 32, fewer sums are held in
 * registers at a time (GROUP rows of the products, HGROUP halves of the pooled mixing).
 *
 * Built here: joined_rows_product, pooled_mix_f32, pooled_mix_grad_f32, column_stats,
 * pool2x2, unpool2x2 (the last three also take bfloat16, widened exactly by a shift). The
 * bfloat16 and int8 dot-product kernels need AVX512-BF16 and AVX512-VNNI and are absent;
 * rstmodel.layers.native then keeps torch's forms for them.
 *
 * Every kernel hands its work to OpenMP threads in chunks, as the AVX-512 build does
 * (CHUNKS per thread, the dynamic schedule). */
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
 * gt points at the half's first real part in the packed tile g[f, t, k, 0:2, 0:16]; the
 * K x 16 values are read from memory for the first group and from cache for the others. */
static inline __attribute__((always_inline)) void half_tile(const float *xf, const float *gt,
                                                            float *re, float *im, long m,
                                                            long k, long n, long c0, long r0,
                                                            const long g) {
  v8 a_re[2 * GROUP], a_im[2 * GROUP];
  for (long r = 0; r < 2 * g; ++r) a_re[r] = a_im[r] = (v8){0};
  for (long i = 0; i < k; ++i, gt += 2 * TILE) {
    const v8 g_re = *(const v8u *)gt, g_im = *(const v8u *)(gt + TILE);
#pragma GCC unroll 8
    for (long r = 0; r < 2 * g; ++r) {
      const float s = xf[((r < g ? 0 : m - g) + r0 + r) * k + i];
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

static void product_rows(const float *x, const float *g, float *y, long f0, long f1, long f_total,
                         long m, long k, long n) {
  const long tiles = (n + TILE - 1) / TILE;
  for (long f = f0; f < f1; ++f) {
    const float *xf = x + f * 2 * m * k;
    float *re = y + f * m * n, *im = y + (f_total + f) * m * n;
    for (long t = 0; t < tiles; ++t)
      for (long h = 0; h < 2 && t * TILE + h * HALF < n; ++h) {
        const float *gt = g + (f * tiles + t) * k * 2 * TILE + h * HALF;
        const long c0 = t * TILE + h * HALF;
        long r0 = 0;
        for (; r0 + GROUP <= m; r0 += GROUP) half_tile(xf, gt, re, im, m, k, n, c0, r0, GROUP);
        switch (m - r0) {
#if GROUP > 3
        case 3: half_tile(xf, gt, re, im, m, k, n, c0, r0, 3); break;
#endif
        case 2: half_tile(xf, gt, re, im, m, k, n, c0, r0, 2); break;
        case 1: half_tile(xf, gt, re, im, m, k, n, c0, r0, 1); break;
        }
      }
  }
}

/* x [F, 2M, K] (rows of Re x, then of Im x), g packed as native.pack_joined, y [2, F, M, N] */
int joined_rows_product(const float *x, const float *g, float *y, long f, long m, long k,
                        long n, long threads) {
  if (m < 1 || threads < 1) return 1;
  const long chunk = chunk_size(f, threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (long c = 0; c < (f + chunk - 1) / chunk; ++c)
    product_rows(x, g, y, c * chunk, c * chunk + chunk < f ? c * chunk + chunk : f, f, m, k, n);
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
