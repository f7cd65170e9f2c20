/* What one core of this CPU does per nanosecond, measured: float32 FMAs on 8 lanes
 * (vfmadd), and AVX2's word multiply-add (vpmaddwd: 16 multiply-adds of 16-bit values into
 * 8 32-bit sums) each followed by the 32-bit add that accumulates it, as the int16 products
 * kernel runs them; 10 (FMA) and 8 (word) independent chains, so latency does not bind.
 *   gcc -O3 -march=native -o /tmp/peak results/bench/peak-s26.c && /tmp/peak
 * Run it twice at once (one per core) to see whether the two cores are separate. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 200000000L
#define F(a) a = _mm256_fmadd_ps(a, w, b)

int main(int argc, char **argv) {
  (void)argv;
  const __m256 w = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.001f);
  __m256 f0 = w, f1 = w, f2 = w, f3 = w, f4 = w, f5 = w, f6 = w, f7 = w, f8 = w, f9 = w;
  double t = now();
  for (long n = 0; n < N; ++n) {
    F(f0); F(f1); F(f2); F(f3); F(f4); F(f5); F(f6); F(f7); F(f8); F(f9);
    __asm__ volatile("" : "+x"(f0));
  }
  double dt = now() - t;
  const float fs = f0[0] + f1[0] + f2[0] + f3[0] + f4[0] + f5[0] + f6[0] + f7[0] + f8[0] + f9[0];
  printf("float32 FMA: %.2f per ns = %.1f G multiply-adds/s per core (%g)\n", 10 * N / dt / 1e9,
         80 * N / dt / 1e9, fs);
  __m256i v = _mm256_set1_epi32(argc), a0 = v, a1 = v, a2 = v, a3 = v, a4 = v, a5 = v, a6 = v,
          a7 = v;
  static const int c[8][8] __attribute__((aligned(32))) = {
      {3, 3, 3, 3, 3, 3, 3, 3},         {5, 5, 5, 5, 5, 5, 5, 5},
      {7, 7, 7, 7, 7, 7, 7, 7},         {9, 9, 9, 9, 9, 9, 9, 9},
      {11, 11, 11, 11, 11, 11, 11, 11}, {13, 13, 13, 13, 13, 13, 13, 13},
      {15, 15, 15, 15, 15, 15, 15, 15}, {17, 17, 17, 17, 17, 17, 17, 17}};
  t = now();
  for (long n = 0; n < N; ++n) /* written out: GCC, given intrinsics, spills the sums */
    __asm__ volatile(
        "vpmaddwd %[c0], %[v], %%ymm0\n\tvpaddd %%ymm0, %[a0], %[a0]\n\t"
        "vpmaddwd %[c1], %[v], %%ymm1\n\tvpaddd %%ymm1, %[a1], %[a1]\n\t"
        "vpmaddwd %[c2], %[v], %%ymm0\n\tvpaddd %%ymm0, %[a2], %[a2]\n\t"
        "vpmaddwd %[c3], %[v], %%ymm1\n\tvpaddd %%ymm1, %[a3], %[a3]\n\t"
        "vpmaddwd %[c4], %[v], %%ymm0\n\tvpaddd %%ymm0, %[a4], %[a4]\n\t"
        "vpmaddwd %[c5], %[v], %%ymm1\n\tvpaddd %%ymm1, %[a5], %[a5]\n\t"
        "vpmaddwd %[c6], %[v], %%ymm0\n\tvpaddd %%ymm0, %[a6], %[a6]\n\t"
        "vpmaddwd %[c7], %[v], %%ymm1\n\tvpaddd %%ymm1, %[a7], %[a7]"
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4),
          [a5] "+x"(a5), [a6] "+x"(a6), [a7] "+x"(a7)
        : [v] "x"(v), [c0] "m"(c[0]), [c1] "m"(c[1]), [c2] "m"(c[2]), [c3] "m"(c[3]),
          [c4] "m"(c[4]), [c5] "m"(c[5]), [c6] "m"(c[6]), [c7] "m"(c[7])
        : "xmm0", "xmm1");
  dt = now() - t;
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
  sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
  const int s = _mm256_extract_epi32(sum, 0);
  printf("int16 vpmaddwd + vpaddd: %.2f pairs per ns = %.1f G multiply-adds/s per core (%d)\n",
         8 * N / dt / 1e9, 128 * N / dt / 1e9, s);
  return 0;
}
