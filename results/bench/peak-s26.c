/* What one core of this CPU does per nanosecond, measured: float32 FMAs on 8 lanes
 * (vfmadd), and AVX2's word multiply-add (vpmaddwd: 16 multiply-adds of 16-bit values into
 * 8 32-bit sums) each followed by the 32-bit add that accumulates it, as the int16 products
 * kernel runs them; 10 independent chains each, so latency does not bind.
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
#define W(a, x) a = _mm256_add_epi32(a, _mm256_madd_epi16(x, v))

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
  __m256i v = _mm256_set1_epi32(argc), x[10], a[10];
  for (int i = 0; i < 10; ++i) x[i] = _mm256_set1_epi32(i + 3), a[i] = _mm256_setzero_si256();
  t = now();
  for (long n = 0; n < N; ++n) {
    for (int i = 0; i < 10; ++i) W(a[i], x[i]);
    __asm__ volatile("" : "+x"(v));
  }
  dt = now() - t;
  int s = 0;
  for (int i = 0; i < 10; ++i) s += _mm256_extract_epi32(a[i], 0);
  printf("int16 vpmaddwd + vpaddd: %.2f pairs per ns = %.1f G multiply-adds/s per core (%d)\n",
         10 * N / dt / 1e9, 160 * N / dt / 1e9, s);
  return 0;
}
