/* Whether 8-bit products pay on this CPU without AVX-512: AVX2's byte multiply-add
 * (vpmaddubsw: 32 products of an unsigned and a signed byte, summed in pairs into 16 16-bit
 * lanes) against the word multiply-add the int16 products kernel runs (vpmaddwd + vpaddd,
 * results/bench/peak-s26.c). Two ways to accumulate the bytes' 16-bit sums into 32 bits:
 *   - "each": every vpmaddubsw widened at once (vpmaddwd with ones, then vpaddd), as a
 *     VNNI dot product is emulated: two multiply instructions per 32 products;
 *   - "by 4": four vpmaddubsw summed in 16 bits (vpaddw; no overflow when rows are 6-bit
 *     unsigned, <= 63, and spectra 7-bit, |w| <= 63: 4 x 2 x 63 x 63 = 31,752) before one
 *     widening: five multiply instructions per 128 products.
 * Written out in assembly (GCC spills the sums otherwise); 8 independent chains.
 *   gcc -O3 -march=native -o /tmp/peak8 results/bench/peak-bytes-s27.c && /tmp/peak8 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 100000000L

static const short ones[16] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1,
                                                           1, 1, 1, 1, 1, 1, 1, 1};
static const char w[4][32] __attribute__((aligned(32))) = {{3}, {5}, {7}, {9}};

int main(int argc, char **argv) {
  (void)argv;
  __m256i v = _mm256_set1_epi8((char)argc), a0 = v, a1 = v, a2 = v, a3 = v;
  __m256i a4 = v, a5 = v, a6 = v, a7 = v;
  double t = now();
  for (long n = 0; n < N; ++n)
    __asm__ volatile(
        "vpmaddwd %[c0], %[v], %%ymm0\n\tvpaddd %%ymm0, %[a0], %[a0]\n\t"
        "vpmaddwd %[c1], %[v], %%ymm1\n\tvpaddd %%ymm1, %[a1], %[a1]\n\t"
        "vpmaddwd %[c2], %[v], %%ymm0\n\tvpaddd %%ymm0, %[a2], %[a2]\n\t"
        "vpmaddwd %[c3], %[v], %%ymm1\n\tvpaddd %%ymm1, %[a3], %[a3]\n\t"
        "vpmaddwd %[c0], %[v], %%ymm0\n\tvpaddd %%ymm0, %[a4], %[a4]\n\t"
        "vpmaddwd %[c1], %[v], %%ymm1\n\tvpaddd %%ymm1, %[a5], %[a5]\n\t"
        "vpmaddwd %[c2], %[v], %%ymm0\n\tvpaddd %%ymm0, %[a6], %[a6]\n\t"
        "vpmaddwd %[c3], %[v], %%ymm1\n\tvpaddd %%ymm1, %[a7], %[a7]"
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4),
          [a5] "+x"(a5), [a6] "+x"(a6), [a7] "+x"(a7)
        : [v] "x"(v), [c0] "m"(w[0]), [c1] "m"(w[1]), [c2] "m"(w[2]), [c3] "m"(w[3])
        : "xmm0", "xmm1");
  double dt = now() - t;
  printf("words, vpmaddwd + vpaddd:      %.1f G multiply-adds/s per core\n", 128 * N / dt / 1e9);

  t = now();
  for (long n = 0; n < N; ++n) /* 4 chains, each: vpmaddubsw, widen, add */
    __asm__ volatile(
        "vpmaddubsw %[c0], %[v], %%ymm0\n\tvpmaddwd %[o], %%ymm0, %%ymm0\n\t"
        "vpaddd %%ymm0, %[a0], %[a0]\n\t"
        "vpmaddubsw %[c1], %[v], %%ymm1\n\tvpmaddwd %[o], %%ymm1, %%ymm1\n\t"
        "vpaddd %%ymm1, %[a1], %[a1]\n\t"
        "vpmaddubsw %[c2], %[v], %%ymm2\n\tvpmaddwd %[o], %%ymm2, %%ymm2\n\t"
        "vpaddd %%ymm2, %[a2], %[a2]\n\t"
        "vpmaddubsw %[c3], %[v], %%ymm3\n\tvpmaddwd %[o], %%ymm3, %%ymm3\n\t"
        "vpaddd %%ymm3, %[a3], %[a3]"
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3)
        : [v] "x"(v), [o] "m"(ones), [c0] "m"(w[0]), [c1] "m"(w[1]), [c2] "m"(w[2]),
          [c3] "m"(w[3])
        : "xmm0", "xmm1", "xmm2", "xmm3");
  dt = now() - t;
  printf("bytes, each widened:           %.1f G multiply-adds/s per core\n", 128 * N / dt / 1e9);

  t = now();
  for (long n = 0; n < N; ++n) /* 2 chains, each: 4 vpmaddubsw summed in 16 bits, widen, add */
    __asm__ volatile(
        "vpmaddubsw %[c0], %[v], %%ymm0\n\tvpmaddubsw %[c0], %[v], %%ymm4\n\t"
        "vpmaddubsw %[c1], %[v], %%ymm1\n\tvpmaddubsw %[c1], %[v], %%ymm5\n\t"
        "vpaddw %%ymm1, %%ymm0, %%ymm0\n\tvpaddw %%ymm5, %%ymm4, %%ymm4\n\t"
        "vpmaddubsw %[c2], %[v], %%ymm2\n\tvpmaddubsw %[c2], %[v], %%ymm6\n\t"
        "vpaddw %%ymm2, %%ymm0, %%ymm0\n\tvpaddw %%ymm6, %%ymm4, %%ymm4\n\t"
        "vpmaddubsw %[c3], %[v], %%ymm3\n\tvpmaddubsw %[c3], %[v], %%ymm7\n\t"
        "vpaddw %%ymm3, %%ymm0, %%ymm0\n\tvpaddw %%ymm7, %%ymm4, %%ymm4\n\t"
        "vpmaddwd %[o], %%ymm0, %%ymm0\n\tvpmaddwd %[o], %%ymm4, %%ymm4\n\t"
        "vpaddd %%ymm0, %[a0], %[a0]\n\tvpaddd %%ymm4, %[a1], %[a1]"
        : [a0] "+x"(a0), [a1] "+x"(a1)
        : [v] "x"(v), [o] "m"(ones), [c0] "m"(w[0]), [c1] "m"(w[1]), [c2] "m"(w[2]),
          [c3] "m"(w[3])
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
  dt = now() - t;
  printf("bytes, widened by 4:           %.1f G multiply-adds/s per core\n", 256 * N / dt / 1e9);
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
  s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
  printf("(%d)\n", _mm256_extract_epi32(s, 0));
  return 0;
}
