/* Where the kernels' streaming prefetches put the lines they read next (the weights of a decode product, the rows
 * of a KV cache), chosen once per call.
 *
 * A prefetch into L1 (prefetcht0) holds one of the core's L1 miss buffers until its line arrives from memory, and
 * a core has few of them: streaming ~100 MB of weights a decode step, the buffers, not the memory, bound the
 * read. A prefetch into L2 (prefetcht2) takes an L2 miss entry instead, of which there are more, and the loads
 * then hit L2. Measured on an AMD EPYC (Zen 4) VM, SmolLM2's 121 int4 decode products in turn on two threads,
 * alternating processes: 1 row 5.79 -> 4.92 ms, 8 rows 8.51 -> 7.25 ms, 8 rows with two activation levels 15.5 ->
 * 11.7 ms (docs/performance_notes.md). On an Intel Xeon (Emerald Rapids) VM the same products 1 row 3.84 -> 3.48
 * ms, 8 rows 6.91 -> 6.55 (2026-12-03; on the Sapphire Rapids VM the attention kernel's keys measured within noise
 * both ways): L2 is every x86 CPU's default.
 *
 * On AMD's CPUs the 4-bit and 8-bit products' weights at decode go to L2 at three distances (LLMC_PREFETCH_L2X3;
 * Intel's keep one until it is measured there): each line is asked for at d, 2 d and 4 d bytes ahead of its load
 * (d = 5 KiB). Measured on the EPYC VM (2026-12-04, s40), SmolLM2's 121 int4 products in a C loop on llmc's pool
 * (scripts/stream_products.c), each run beside the read probe over the same 98 MB: one distance streamed 0.89-0.92
 * of what the probe read while the VM's memory gave ~35-42 GB/s and ~0.67-0.70 when it gave 45-58 (the products
 * stayed at ~34-35 GB/s, as if a core kept only so many prefetches in flight), three distances 0.97 and 0.79
 * (41.7 GB/s). One distance of 10 or 20 KiB, or the same line asked for twice at 5 KiB, streamed as one at 5; two
 * distances (5 and 10, 10 and 20 KiB) between the two (docs/performance_notes.md).
 *
 * LLMC_PREFETCH=l1, l2 (one distance into L2) or l2x3 overrides the choice (tests run each on one machine; the
 * results never depend on it). The bf16 product and the attention take L2 at one distance for l2x3 (the bf16
 * engine's batch-1 decode measured no faster with three distances: 10.0 against 10.2 ms a step, four pairs).
 */
#ifndef LLMC_PREFETCH_H
#define LLMC_PREFETCH_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

enum { LLMC_PREFETCH_L1 = 0, LLMC_PREFETCH_L2 = 1, LLMC_PREFETCH_L2X3 = 2 };

/* Where the streaming prefetches go: LLMC_PREFETCH_L1, _L2 or _L2X3; by default _L2X3 on AMD's CPUs, where it
 * was measured, else _L2 (any other value of LLMC_PREFETCH is ignored). */
static inline int llmc_prefetch_mode(void) {
  const char* e = getenv("LLMC_PREFETCH");
  if (e && !strcmp(e, "l1")) return LLMC_PREFETCH_L1;
  if (e && !strcmp(e, "l2")) return LLMC_PREFETCH_L2;
  if (e && !strcmp(e, "l2x3")) return LLMC_PREFETCH_L2X3;
  return __builtin_cpu_is("amd") ? LLMC_PREFETCH_L2X3 : LLMC_PREFETCH_L2;
}

/* 1: prefetch into L2, 0: into L1. */
static inline int llmc_prefetch_l2(void) { return llmc_prefetch_mode() != LLMC_PREFETCH_L1; }

static inline __attribute__((always_inline)) void llmc_prefetch(const void* p, int l2) {
  if (l2)
    _mm_prefetch((const char*)p, _MM_HINT_T2);
  else
    _mm_prefetch((const char*)p, _MM_HINT_T0);
}

/* A weight stream's prefetches for the line at p, `ahead` bytes on (mode: llmc_prefetch_mode): into L1 or L2 there,
 * or (LLMC_PREFETCH_L2X3) into L2 there, `ahead` further and 3 `ahead` further still. */
static inline __attribute__((always_inline)) void llmc_prefetch_stream(const void* p, int64_t ahead, int mode) {
  const char* at = (const char*)p + ahead;
  if (mode == LLMC_PREFETCH_L1) {
    _mm_prefetch(at, _MM_HINT_T0);
    return;
  }
  _mm_prefetch(at, _MM_HINT_T2);
  if (mode == LLMC_PREFETCH_L2X3) {
    _mm_prefetch(at + ahead, _MM_HINT_T2);
    _mm_prefetch(at + 3 * ahead, _MM_HINT_T2);
  }
}
#endif

#endif
