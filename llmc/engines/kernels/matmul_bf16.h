/* bf16 weight x fp32 activation matrix product, fp32 accumulation (bf16 engines: half the weight bytes of fp32).
 *
 * W [K, N] (used as y = x @ W), K even, packed offline (llmc/graph/quant.py, pack_bf16_tiles) in tiles of 16
 * columns: uint16 (bf16 bits) [ceil(N / 16), K / 2, 32]; tile t, pair p: for column j = 0..15 the two values
 * w[2p, 16t + j], w[2p + 1, 16t + j] side by side (AVX-512 BF16 vdpbf16ps' form: 16 columns x 2 consecutive k per
 * register; the columns past N are zeros). x is rounded to bf16 (to nearest, ties to even; a NaN stays NaN) per
 * call, each product is exact in fp32 and the sums are fp32:
 *   y[m, n] = sum_k bf16(x[m, k]) * w[k, n]  (+ bias[n]).
 * gated (SwiGLU): W holds the gate and up projections as alternating tiles (gate tile i at 2 i, its up tile at
 * 2 i + 1; N a multiple of 32, the bias [gate | up]) and y [M, N / 2] = silu(x @ gate) * (x @ up), as MatMulQ4's.
 */
#ifndef LLMC_MATMUL_BF16_H
#define LLMC_MATMUL_BF16_H

#include <stddef.h>
#include <stdint.h>

#include "parallel.h"

#define LLMC_BF16_TILE 16

typedef struct {
  int64_t M, K, N; /* x [M, K]; W [K, N]; K even */
  const float* x;
  const uint16_t* w;  /* packed: ceil(N / 16) tiles */
  const float* bias;  /* [N] or NULL */
  float* y;           /* [M, N] (gated: [M, N / 2]) */
  int gated;          /* 1: W's tiles alternate gate and up (see above) */
  int threads;        /* the pool's threads: each takes one contiguous part of W; 0 = unknown */
} llmc_bf16_args;

/* Returns NULL on success, else a message naming the value and its limit. */
const char* llmc_bf16_matmul(const llmc_bf16_args* a, llmc_parallel_fn parallel, void* parallel_ctx);

enum { LLMC_BF16_PORTABLE = 0, LLMC_BF16_AVX512 = 1, LLMC_BF16_AMX = 2, LLMC_BF16_AVX512F = 3, LLMC_BF16_AVX2 = 4 };

/* AMX-BF16 for 4 rows or more (fewer: AVX-512 BF16) where the CPU has it and the OS grants it, else AVX-512 BF16
 * where the CPU has it, else the weights widened to fp32 in registers on AVX-512F or AVX2 + FMA (the same sums as
 * vdpbf16ps'), else portable C (the same arithmetic: exact products, fp32 sums, in another order).
 * LLMC_KERNELS_GENERIC=1 forces the portable path, LLMC_KERNELS_AVX2=1 the AVX2 one, LLMC_KERNELS_NO_BF16=1 the
 * widened AVX-512F one on a BF16 CPU, LLMC_KERNELS_NO_AMX=1 AVX-512 BF16 on an AMX CPU. */
int llmc_bf16_path(void);

#endif
