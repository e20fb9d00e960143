/* The memory read bandwidth the way a decode step reads weights: `threads` threads each stream their share of a
 * buffer far larger than the caches with wide loads and software prefetch (as llmc's operators read weights), the
 * median of `repeats` passes. ONNX Runtime's ReduceSum, the probe before, reads about half of what the engines
 * stream on some VMs (10 against 19-22 GB/s on 2 cores of an Intel Xeon VM), so the fraction of the limit it gave
 * was no limit at all. Not an operator: `llmc bench` calls it through ctypes (llmc/bench/bandwidth.py). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "bandwidth.h"
#include "probe_clock.h"

#ifdef __x86_64__
#include <immintrin.h>
#endif

#define EXPORT __attribute__((visibility("default")))
#define STEP 256     /* bytes per loop iteration: four 64-byte lines */
#define AHEAD 2048   /* prefetch distance in bytes */

typedef struct {
  const char* p;
  size_t n;
  double sink;
} part_t;

#ifdef __x86_64__
__attribute__((target("avx512f"))) static double read_avx512(const char* p, size_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + STEP <= n; i += STEP) {
    for (int l = 0; l < STEP; l += 64) _mm_prefetch(p + i + AHEAD + l, _MM_HINT_T0);
    s0 = _mm512_add_ps(s0, _mm512_load_ps((const float*)(p + i)));
    s1 = _mm512_add_ps(s1, _mm512_load_ps((const float*)(p + i + 64)));
    s2 = _mm512_add_ps(s2, _mm512_load_ps((const float*)(p + i + 128)));
    s3 = _mm512_add_ps(s3, _mm512_load_ps((const float*)(p + i + 192)));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
#endif

static double read_portable(const char* p, size_t n) {
  uint64_t s[4] = {0, 0, 0, 0};
  for (size_t i = 0; i + 32 <= n; i += 32) {
    const uint64_t* q = (const uint64_t*)(p + i);
    s[0] += q[0], s[1] += q[1], s[2] += q[2], s[3] += q[3];
  }
  return (double)(s[0] ^ s[1] ^ s[2] ^ s[3]);
}

double llmc_read_span(const char* p, size_t n) {
#ifdef __x86_64__
  if (__builtin_cpu_supports("avx512f") && !getenv("LLMC_KERNELS_GENERIC")) return read_avx512(p, n);
#endif
  return read_portable(p, n);
}

static void* run_part(void* arg) {
  part_t* t = (part_t*)arg;
  t->sink = llmc_read_span(t->p, t->n);
  return NULL;
}

/* GB/s (1e9 bytes), or -1 when the buffer or a thread cannot be had. threads 1..64, repeats 1..64. */
EXPORT double llmc_read_gbs(int threads, size_t bytes, int repeats) {
  if (threads < 1 || threads > 64 || repeats < 1 || repeats > 64 || bytes < (size_t)threads * 4096) return -1.0;
  size_t per = bytes / (size_t)threads / STEP * STEP;
  char* buf = NULL;
  if (posix_memalign((void**)&buf, 2 << 20, per * (size_t)threads)) return -1.0;
#ifdef MADV_HUGEPAGE
  madvise(buf, per * (size_t)threads, MADV_HUGEPAGE); /* as large allocations get where the kernel allows it */
#endif
  memset(buf, 1, per * (size_t)threads); /* every page real memory */
  part_t parts[64];
  pthread_t tid[64];
  double times[64];
  double result = -1.0;
  for (int r = 0; r < repeats; r++) {
    double t0 = llmc_probe_seconds();
    int started = 0;
    for (int i = 0; i < threads; i++) {
      parts[i] = (part_t){buf + (size_t)i * per, per, 0.0};
      if (i > 0 && pthread_create(&tid[i], NULL, run_part, &parts[i]) != 0) break;
      started = i + 1;
    }
    if (started == threads) run_part(&parts[0]);
    for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
    if (started != threads) goto done;
    times[r] = llmc_probe_seconds() - t0;
  }
  result = (double)(per * (size_t)threads) / llmc_probe_median(times, repeats) / 1e9;
done:
  free(buf);
  return result;
}
