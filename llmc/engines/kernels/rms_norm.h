/* RMSNorm of a residual sum: sum = x + skip, y = sum / sqrt(mean(sum^2) + eps) * gamma, over the last axis, fp32.
 *
 * ai.llmc.SkipRMSNorm's kernel: what ONNX Runtime's SkipSimplifiedLayerNormalization computes (the residual add and
 * the next block's norm in one node), where that op took ~50 us for a 128 x 576 prompt on two threads (SmolLM2:
 * 60 of them, ~6 % of a 128-token prefill) for ~1 MB of reads and writes. Rows of a prompt are split over the
 * pool's threads; decode's few rows stay in the calling thread (the pool's round trip costs more than they do).
 */
#ifndef LLMC_RMS_NORM_H
#define LLMC_RMS_NORM_H

#include <stdint.h>

#include "parallel.h"

typedef struct {
  int64_t M, D; /* rows, and the normalized axis' size */
  const float* x;
  const float* skip;  /* [M, D], added to x */
  const float* gamma; /* [D] */
  float eps;
  float* y;   /* [M, D]: the normalized sum */
  float* sum; /* [M, D]: x + skip (the residual stream), or NULL */
} llmc_rms_norm_args;

/* Returns NULL on success, else a message naming the value and its limit. */
const char* llmc_skip_rms_norm(const llmc_rms_norm_args* a, llmc_parallel_fn parallel, void* parallel_ctx);

#endif
