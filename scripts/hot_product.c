/* How close one 4-bit product comes to `vpdpbusd`'s own rate when its weights stay in the caches: a product of
 * SmolLM2's shapes called again and again on llmc's pool (its weights, ~0.3-1 MB, in L2), timed, against the rate
 * matrix_peak.c measures for `vpdpbusd` on the same threads in the same run. Where scripts/stream_products.c times
 * the products streamed from memory, this separates the loop's arithmetic from the memory (docs/performance_notes.md,
 * 2026-12-04 s41: at 8 rows one int8 level ran at 54-64 % of the rate, two at 64-74 %).
 *
 *   cd llmc/engines/kernels && gcc -O3 -std=gnu11 -fno-math-errno -I. ../../../scripts/hot_product.c \
 *       matmul_q4.c matmul_bf16.c matrix_peak.c ahead.c amx_bf16.c pool.c -o /tmp/hot_product -lpthread -lm
 *   /tmp/hot_product 576 3072 8 16 2
 *
 * Arguments: K (576), N (3072), rows of x (8), activation bits (8 or 16), threads (2), calls a round (2000). The
 * share of the rate counts each `vpdpbusd` the product issues: M K N / 64 a level (the VNNI path; elsewhere no
 * rate is printed). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "matmul_q4.h"
#include "harness.h"

double llmc_matrix_gflops(int kind, int threads, int repeats); /* matrix_peak.c (kind 2: AVX-512 VNNI) */

static int threads = 2;

int main(int argc, char** argv) {
  int64_t K = argc > 1 ? atoll(argv[1]) : 576, N = argc > 2 ? atoll(argv[2]) : 3072, M = argc > 3 ? atoll(argv[3]) : 8;
  int act = argc > 4 ? atoi(argv[4]) : 16, calls = argc > 6 ? atoi(argv[6]) : 2000;
  threads = argc > 5 ? atoi(argv[5]) : 2;
  if (K < 32 || K % 32 || N < 32 || N % 32 || M < 1 || M > 4096 || (act != 8 && act != 16) || threads < 1 ||
      calls < 10) {
    fprintf(stderr, "usage: hot_product [K: multiple of 32] [N: multiple of 32] [rows 1-4096] [act bits 8|16] "
                    "[threads >= 1] [calls >= 10]\n");
    return 2;
  }
  size_t bytes = (size_t)(N / 32) * (size_t)(K / 32) * LLMC_Q4_PAIR_BYTES;
  uint8_t* w = malloc(bytes);
  float* x = malloc(sizeof(float) * (size_t)(M * K));
  float* y = malloc(sizeof(float) * (size_t)(M * N));
  if (!w || !x || !y) return 1;
  memset(w, 0x11, bytes); /* nibbles of 1, fp16 scales and mins of 0x1111 (~6e-4): finite sums */
  for (int64_t i = 0; i < M * K; i++) x[i] = (float)((i * 37) % 101 - 50) / 50.f;
  llmc_q4_args a = {.M = M, .K = K, .N = N, .x = x, .w = w, .y = y, .threads = threads, .act_bits = act, .bits = 4};
  llmc_parallel_fn parallel = threads > 1 ? harness_on_pool : NULL;
  for (int i = 0; i < calls / 10; i++) {
    const char* e = llmc_q4_matmul(&a, parallel, &threads);
    if (e) {
      fprintf(stderr, "%s\n", e);
      return 1;
    }
  }
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    double t = llmc_probe_seconds();
    for (int i = 0; i < calls; i++) llmc_q4_matmul(&a, parallel, &threads);
    t = (llmc_probe_seconds() - t) / calls;
    best = t < best ? t : best;
  }
  double rate = llmc_matrix_gflops(2, threads, 3) / 128.0; /* G vpdpbusd a second: 64 MACs, 128 flops each */
  double issued = (double)M * (double)K * (double)N / 64.0 * (act == 16 ? 2 : 1);
  printf("K %lld N %lld rows %lld act_bits %d threads %d: %.1f us a call", (long long)K, (long long)N, (long long)M,
         act, threads, best * 1e6);
  if (rate > 0 && llmc_q4_path() != LLMC_Q4_PORTABLE && llmc_q4_path() != LLMC_Q4_AVX2)
    printf(", %.2f G vpdpbusd/s, %.0f %% of vpdpbusd's %.2f G/s\n", issued / best / 1e9,
           100.0 * issued / best / 1e9 / rate, rate);
  else
    printf("\n");
  free(w), free(x), free(y);
  return 0;
}
