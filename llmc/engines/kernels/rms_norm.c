/* RMSNorm of a residual sum (see rms_norm.h). */
#include "rms_norm.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(LLMC_PORTABLE_ONLY)
#define LLMC_X86 1
#include <immintrin.h>
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define ROWS_PER_TASK 32 /* a prompt's rows per pool task; fewer rows than two tasks' run in the calling thread */

typedef struct {
  const llmc_rms_norm_args* a;
  int avx512;
} norm_job;

static void row_generic(const llmc_rms_norm_args* a, int64_t m) {
  const float *x = a->x + m * a->D, *s = a->skip + m * a->D;
  float* sum = a->sum ? a->sum + m * a->D : a->y + m * a->D; /* (y holds the sum until it is normalized) */
  float* y = a->y + m * a->D;
  float squares = 0.f;
  for (int64_t d = 0; d < a->D; d++) {
    float v = x[d] + s[d];
    sum[d] = v;
    squares += v * v;
  }
  float inv = 1.f / sqrtf(squares / (float)a->D + a->eps);
  for (int64_t d = 0; d < a->D; d++) y[d] = sum[d] * inv * a->gamma[d];
}

#ifdef LLMC_X86
/* 16 lanes of squares summed (in another order than row_generic: the same to ~1e-7 of the sum). */
__attribute__((target("avx512f"))) static void row_avx512(const llmc_rms_norm_args* a, int64_t m) {
  const float *x = a->x + m * a->D, *s = a->skip + m * a->D;
  float* sum = a->sum ? a->sum + m * a->D : a->y + m * a->D;
  float* y = a->y + m * a->D;
  __m512 sq = _mm512_setzero_ps();
  for (int64_t d = 0; d < a->D; d += 16) {
    __m512 v = _mm512_add_ps(_mm512_loadu_ps(x + d), _mm512_loadu_ps(s + d));
    _mm512_storeu_ps(sum + d, v);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(sq) / (float)a->D + a->eps));
  for (int64_t d = 0; d < a->D; d += 16)
    _mm512_storeu_ps(y + d, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(sum + d), inv), _mm512_loadu_ps(a->gamma + d)));
}

static int uses_avx512(int64_t D) {
  const char* generic = getenv("LLMC_KERNELS_GENERIC");
  __builtin_cpu_init();
  return D % 16 == 0 && !(generic && *generic && *generic != '0') && __builtin_cpu_supports("avx512f");
}
#endif

static void rows_task(void* data, size_t task) {
  const norm_job* j = (const norm_job*)data;
  const llmc_rms_norm_args* a = j->a;
  int64_t first = (int64_t)task * ROWS_PER_TASK, end = first + ROWS_PER_TASK < a->M ? first + ROWS_PER_TASK : a->M;
  for (int64_t m = first; m < end; m++) {
#ifdef LLMC_X86
    if (j->avx512) {
      row_avx512(a, m);
      continue;
    }
#endif
    row_generic(a, m);
  }
}

const char* llmc_skip_rms_norm(const llmc_rms_norm_args* a, llmc_parallel_fn parallel, void* parallel_ctx) {
  static _Thread_local char msg[96];
  if (a->D <= 0 || !(a->eps >= 0.f)) {
    snprintf(msg, sizeof msg, "size %lld must be positive and epsilon %g not negative", (long long)a->D,
             (double)a->eps);
    return msg;
  }
  norm_job j = {a, 0};
#ifdef LLMC_X86
  j.avx512 = uses_avx512(a->D);
#endif
  size_t tasks = (size_t)((a->M + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
  if (parallel && tasks >= 2)
    parallel(parallel_ctx, rows_task, tasks, &j);
  else
    for (size_t t = 0; t < tasks; t++) rows_task(&j, t);
  return NULL;
}
