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
 * LLMC_PREFETCH=l1 or l2 overrides the choice (tests run both on one machine; the results never depend on it).
 */
#ifndef LLMC_PREFETCH_H
#define LLMC_PREFETCH_H

#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* 1: prefetch into L2, 0: into L1. */
static inline int llmc_prefetch_l2(void) {
  const char* e = getenv("LLMC_PREFETCH");
  if (e && e[0] == 'l' && (e[1] == '1' || e[1] == '2') && !e[2]) return e[1] == '2';
  return 1;
}

static inline __attribute__((always_inline)) void llmc_prefetch(const void* p, int l2) {
  if (l2)
    _mm_prefetch((const char*)p, _MM_HINT_T2);
  else
    _mm_prefetch((const char*)p, _MM_HINT_T0);
}
#endif

#endif
