/* What the C harnesses under scripts/ share beyond the operators' own probe clock (probe_clock.h): llmc's pool as
 * the operators' parallel call, its context the thread count (as ort_op.c hands it). */
#ifndef LLMC_SCRIPTS_HARNESS_H
#define LLMC_SCRIPTS_HARNESS_H

#include <stddef.h>

#include "pool.h"
#include "probe_clock.h"

static inline void harness_on_pool(void* threads, void (*fn)(void*, size_t), size_t total, void* data) {
  llmc_pool_run(threads, fn, total, data);
}

#endif
