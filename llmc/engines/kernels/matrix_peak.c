/* The matrix instructions' throughput the way a prompt's products use them, for `llmc bench`'s prefill fraction
 * (issue 17: prefill at a share of the machine's measured matrix throughput for the precision). `threads` threads
 * each run the prompt path's inner loop over operands that stay in L1, the median of `repeats` passes:
 *   kind 1, AMX-BF16 (where the CPU has it and the OS grants the tiles: MatMulQ4 / Q8 / BF16's prompts): the tile
 *     loop of amx_bf16.c, 32 rows x 2 tiles over K 128;
 *   kind 2, AVX-512 VNNI (int8 dot products: MatMulQ4's prompts elsewhere): vpdpbusd on 8 independent registers;
 *   kind 3, AVX-512 BF16 (MatMulBF16's prompts without AMX): vdpbf16ps on 8 independent registers;
 *   kind 4, AVX-512F fp32 FMA (fp32 engines' products in ONNX Runtime's MLAS; MatMulBF16 widened where the CPU has
 *     no BF16 instructions) and kind 5, the same on AVX2: FMAs on 12 independent registers;
 *   kind 0: none of them (the portable paths: no figure).
 * Each engine's products take one of them by its weights' precision (llmc_matrix_peak_kind_for).
 * Not an operator: `llmc bench` calls it through ctypes (llmc/bench/limits.py). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "probe_clock.h"

#include "amx_bf16.h"
#include "matmul_bf16.h"
#include "matmul_q4.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(LLMC_PORTABLE_ONLY)
#define LLMC_X86 1
#include <immintrin.h>
#endif

#define EXPORT __attribute__((visibility("default")))
#define PEAK_K 128   /* the AMX loop's K: x 32 x 128 bf16 (8 KB) and two tiles' 128 x 16 (8 KB): L1 */
#define CALLS 4000   /* AMX loop calls per pass: 4000 x 4 k steps x 4 tiles = 64 K tile products */
#define VNNI_ITERS 2000000
#define FMA_ITERS 1000000 /* x 12 registers */

typedef struct {
  int kind;
  double flop; /* done by this thread */
  double sink;
} peak_part;

#ifdef LLMC_X86
static void amx_pass(peak_part* p) {
  static __attribute__((aligned(64))) uint16_t x[LLMC_AMX_SPAN * PEAK_K], w[2 * PEAK_K * 16];
  __attribute__((aligned(64))) float c[4 * LLMC_AMX_ROWS * 16];
  for (int i = 0; i < LLMC_AMX_SPAN * PEAK_K; i++) x[i] = llmc_to_bf16((float)(i % 5) * 0.25f);
  for (int i = 0; i < 2 * PEAK_K * 16; i++) w[i] = llmc_to_bf16((float)(i % 3) * 0.5f);
  llmc_amx_configure();
  for (int r = 0; r < CALLS; r++) llmc_amx_bf16_rows((const char*)x, PEAK_K * 2, PEAK_K, w, w + PEAK_K * 16, c);
  llmc_amx_release();
  p->flop = 2.0 * CALLS * LLMC_AMX_SPAN * 32 * PEAK_K;
  p->sink = c[0];
}

__attribute__((target("avx512f,avx512vnni"))) static void vnni_pass(peak_part* p) {
  __m512i acc[8], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (int i = 0; i < 8; i++) acc[i] = _mm512_set1_epi32(i);
  for (int it = 0; it < VNNI_ITERS; it++)
    for (int i = 0; i < 8; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  __m512i s = acc[0];
  for (int i = 1; i < 8; i++) s = _mm512_add_epi32(s, acc[i]);
  p->flop = 2.0 * VNNI_ITERS * 8 * 64;
  p->sink = (double)_mm512_reduce_add_epi32(s);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void bf16_dot_pass(peak_part* p) {
  __m512 acc[8];
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x3F003F00); /* 1, 0.5 */
  for (int i = 0; i < 8; i++) acc[i] = _mm512_set1_ps((float)i);
  for (int it = 0; it < VNNI_ITERS; it++)
    for (int i = 0; i < 8; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 8; i++) s = _mm512_add_ps(s, acc[i]);
  p->flop = 2.0 * VNNI_ITERS * 8 * 32;
  p->sink = (double)_mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f"))) static void fma512_pass(peak_part* p) {
  __m512 acc[12], a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i);
  for (int it = 0; it < FMA_ITERS; it++)
    for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, acc[i]);
  p->flop = 2.0 * FMA_ITERS * 12 * 16;
  p->sink = (double)_mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static void fma256_pass(peak_part* p) {
  __m256 acc[12], a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps((float)i);
  for (int it = 0; it < FMA_ITERS; it++)
    for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  float out[8];
  _mm256_storeu_ps(out, acc[0]);
  p->flop = 2.0 * FMA_ITERS * 12 * 8;
  p->sink = (double)out[0];
}
#endif

static void* run_pass(void* arg) {
  peak_part* p = (peak_part*)arg;
  (void)p;
#ifdef LLMC_X86
  if (p->kind == 1) amx_pass(p);
  else if (p->kind == 2) vnni_pass(p);
  else if (p->kind == 3) bf16_dot_pass(p);
  else if (p->kind == 4) fma512_pass(p);
  else if (p->kind == 5) fma256_pass(p);
#endif
  return NULL;
}

static int fp32_fma_kind(void) {
#ifdef LLMC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 4;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 5;
#endif
  return 0;
}

/* The kind the prompts' products of an engine take on this CPU, by its weights: precision 0 int4 / int8 (MatMulQ4 /
 * Q8, as the environment overrides it now: LLMC_KERNELS_NO_AMX, _AVX2, _GENERIC), 1 bf16 (MatMulBF16: also
 * LLMC_KERNELS_NO_BF16), 2 fp32 (ONNX Runtime's own products). */
EXPORT int llmc_matrix_peak_kind_for(int precision) {
  if (precision == 0) {
    int path = llmc_q4_path();
    return path == LLMC_Q4_AMX ? 1 : path == LLMC_Q4_VNNI ? 2 : 0;
  }
  if (precision == 1) {
    int path = llmc_bf16_path();
    return path == LLMC_BF16_AMX ? 1 : path == LLMC_BF16_AVX512 ? 3 : path == LLMC_BF16_AVX512F ? 4
         : path == LLMC_BF16_AVX2 ? 5 : 0;
  }
  return precision == 2 ? fp32_fma_kind() : 0;
}

static int has_kind(int kind) {
#ifdef LLMC_X86
  __builtin_cpu_init();
  if (kind == 1) return llmc_amx_bf16_usable();
  if (kind == 2) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
  if (kind == 3) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  if (kind == 4) return __builtin_cpu_supports("avx512f");
  if (kind == 5) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  (void)kind;
  return 0;
}

/* GFLOP/s (a multiply-add is 2) of `kind` over `threads` threads, or -1 (no such kind here, or no thread).
 * threads 1..64, repeats 1..64. */
EXPORT double llmc_matrix_gflops(int kind, int threads, int repeats) {
  if (!has_kind(kind) || threads < 1 || threads > 64 || repeats < 1 || repeats > 64) return -1.0;
  peak_part parts[64];
  pthread_t tid[64];
  double rates[64];
  for (int r = 0; r < repeats; r++) {
    double t0 = llmc_probe_seconds();
    int started = 0;
    for (int i = 0; i < threads; i++) {
      parts[i] = (peak_part){kind, 0.0, 0.0};
      if (i > 0 && pthread_create(&tid[i], NULL, run_pass, &parts[i]) != 0) break;
      started = i + 1;
    }
    if (started == threads) run_pass(&parts[0]);
    for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
    if (started != threads) return -1.0;
    double flop = 0.0;
    for (int i = 0; i < threads; i++) flop += parts[i].flop;
    rates[r] = flop / (llmc_probe_seconds() - t0) / 1e9;
  }
  return llmc_probe_median(rates, repeats);
}
