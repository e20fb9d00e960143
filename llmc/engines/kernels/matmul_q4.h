/* 4-bit and 8-bit weight x fp32 activation matrix products, weights in "scale + min" blocks (GGUF Q4_1's form; 8
 * bits hold GGUF Q8_0's symmetric blocks too, and a 4-bit grid's), and 2-bit ones with a scale and min a column.
 *
 * W [K, N] (used as y = x @ W) in blocks of 32 along K: w[k, n] = scale[b, n] * q[k, n] + min[b, n], q in 0..15,
 * scale and min fp16. Packed offline (llmc/graph/quant.py, pack_q4_tiles) in tiles of 16 columns, two tiles side by
 * side (so the two a work unit reads are one stream): uint8 [ceil(N / 32), K / 32, 640]; tile t, block b at byte
 * ((t / 2 * blocks + b) * 2 + t % 2) * 320:
 *   4 chunks of 64 bytes; chunk c, byte 4 j + i (column 16 t + j, i = 0..3):
 *     low nibble q[32 b + 8 c + i, 16 t + j], high nibble q[32 b + 8 c + 4 + i, 16 t + j]
 *   then 16 fp16 scales and 16 fp16 mins (columns 16 t .. 16 t + 15).
 * x is quantized per row and block to int8 (scale = max |x| / 127), and the product is the quantized x's:
 *   y[m, n] = sum_b scale[b, n] * xscale[m, b] * (q . xq)[m, b, n] + min[b, n] * xscale[m, b] sum(xq)[m, b]
 *   (+ bias[n]): the activations' error meets the weights centred on 0.
 * act_bits 16: two int8 levels, the second quantizing the first's remainder r = x - xscale_1 xq_1 the same way
 * (xscale_2 = max |r| / 127), so x ~ xscale_1 xq_1 + xscale_2 xq_2 (~15 bits) and the product is the sum of the two
 * int8 products, each with its scale: twice the integer work, the same weight bytes.
 *
 * bits 8 (ai.llmc.MatMulQ8): w[k, n] = scale[b, n] * q[k, n] + min[b, n], q in 0..255, scale and min fp16 (a Q8_0
 * block d * q8 is scale d, min -128 d, q = q8 + 128; a Q4_1 block's 4-bit grid is scale d / 17, q = 17 q4), the same
 * tiles of 16 columns and pairs of them: uint8 [ceil(N / 32), K / 32, 1152]; tile t, block b at byte
 * ((t / 2 * blocks + b) * 2 + t % 2) * 576:
 *   8 chunks of 64 bytes; chunk c, byte 4 j + i: q[32 b + 4 c + i, 16 t + j]; then 16 fp16 scales, 16 fp16 mins.
 *
 * bits 2 (ai.llmc.MatMulQ2: BitNet b1.58's ternary layers, each column's values -h, 0 and h): w[k, n] = scale[n] *
 * q[k, n] + min[n], q in 0..3, one fp32 scale and min per column for all of K (ternary: scale h, min -h, q = 0, 1,
 * 2), in the same tiles of 16 columns and pairs of them: uint8 [ceil(N / 32), K / 32 + 1, 256]; pair row 0 holds
 * each tile's 16 fp32 scales and 16 fp32 mins (tile t at byte (t % 2) * 128), row b + 1 tile t's block b at byte
 * (t % 2) * 128:
 *   2 chunks of 64 bytes; chunk c, byte 4 j + i, bits 2 s .. 2 s + 1 (s = 0..3): q[32 b + 16 c + 4 s + i, 16 t + j].
 * 2.03 bits a weight where 4-bit tiles take 5: a decode step of a ternary model reads 0.4x the layers' bytes. The
 * products: y[m, n] = scale[n] * sum_b sum_l xscale_l[m, b] (q . xq_l)[m, b, n] + min[n] * sum_b xsum[m, b].
 * Never the AMX-BF16 path (every row takes the int8 dot products).
 *
 * Prompts (LLMC_Q4_WIDE_ROWS rows or more, where the CPU has AMX-BF16 and the OS grants its tiles, int8_prompts 0):
 * each work unit's weights are expanded once per call to w = scale q + min rounded to bf16, and x is rounded to
 * bf16, the products exact in fp32 and summed in fp32 over all of K:
 *   y[m, n] = sum_k bf16(x)[m, k] bf16(scale q + min)[k, n]  (+ bias[n]).
 * That is closer to x @ W than the int8 activations (bf16 keeps 8 bits of each value, int8 7 of its block's
 * largest), and the rounding of the weights is ~2^-9 of each (the 4-bit grid's own step is ~1/15 of its block's
 * range). act_bits 16 takes the same single bf16 level here: 16-bit activations, as precise as its two int8 levels
 * measured (SmolLM2's default int4 engine: the prompts' last logits at mean KL 1.37e-4 against fp32 this way,
 * 1.13e-4 on the two int8 levels, verify's top-1 99.2 % and greedy match 26.2 this way, 98.9 % and 24.8 those),
 * while a second bf16 level (x ~ hi + lo, KL 4.8e-5) cost a second pass of the tiles: prefill 1.5x as long.
 *
 * window (act_bits 16, not gated; 0 = off): from LLMC_Q4_WINDOW_ROWS rows on (decode's batches; never the AMX-BF16
 * prompts) each row is first computed at one int8 level, exactly act_bits 8's values, and then the 16-column tiles
 * holding a value within `window` of the row's largest are computed again at two levels, exactly act_bits 16's: for
 * the LM head, whose logits matter only near the largest (at a margin of 8 a token outside has a probability under
 * e^-8 of the top one's, and one level's ~0.04 mean error there moves it by ~4 %, ~1e-5 of the distribution), the
 * second level's integer work on a few per cent of the columns instead of all (SmolLM2's verify prompts: ~3 % on
 * average, ~10 % on random-token prompts, whose distributions are flat), and the same top token. Fewer rows than
 * LLMC_Q4_WINDOW_ROWS take the two levels throughout (their product waits on the weights' bytes, not the
 * arithmetic, and a second read of the window's tiles would cost more).
 *
 * gated (SwiGLU): W holds the gate and up projections as alternating tiles (gate tile i at 2 i, its up tile at
 * 2 i + 1) and y [M, N / 2] = silu(x @ gate) * (x @ up): the MLP's first half in one pass.
 */
#ifndef LLMC_MATMUL_Q4_H
#define LLMC_MATMUL_Q4_H

#include <stddef.h>
#include <stdint.h>

#include "parallel.h"

#define LLMC_Q4_BLOCK 32
#define LLMC_Q4_TILE 16
#define LLMC_Q4_TILE_BYTES 320 /* one tile's block: 256 bytes of nibbles, 16 fp16 scales, 16 fp16 mins */
#define LLMC_Q4_PAIR_BYTES (2 * LLMC_Q4_TILE_BYTES)
#define LLMC_Q8_TILE_BYTES 576 /* bits 8: 512 bytes of 8-bit values, 16 fp16 scales, 16 fp16 mins */
#define LLMC_Q8_PAIR_BYTES (2 * LLMC_Q8_TILE_BYTES)
#define LLMC_Q2_TILE_BYTES 128 /* bits 2: 128 bytes of 2-bit values a tile's block; its first row 16 fp32 scales, 16
                                * fp32 mins */
#define LLMC_Q2_PAIR_BYTES (2 * LLMC_Q2_TILE_BYTES)
#define LLMC_Q4_WIDE_ROWS 32 /* rows from which a product may take AMX-BF16 (see above) */
#ifndef LLMC_Q4_WINDOW_ROWS
#define LLMC_Q4_WINDOW_ROWS 2 /* rows from which a window takes effect (see above) */
#endif

typedef struct {
  int64_t M, K, N;   /* x [M, K]; W [K, N]; K a multiple of 32; gated: N a multiple of 32 */
  int gated;
  const float* x;
  const uint8_t* w;  /* packed: ceil(N / 32) pairs of tiles */
  const float* bias; /* [N] or NULL (gated: [N], gate then up) */
  float* y;          /* [M, N], gated [M, N / 2] */
  int threads;       /* the pool's threads: each streams one contiguous part of W; 0 = unknown: units claimed */
  int act_bits;      /* the activations' precision: 8 (one int8 level; 0 means 8) or 16 (two int8 levels) */
  int bits;          /* the weights': 4 (LLMC_Q4_TILE_BYTES a tile's block; 0 means 4), 8 (LLMC_Q8_TILE_BYTES) or 2
                      * (LLMC_Q2_TILE_BYTES, a row of scales and mins first) */
  int int8_prompts;  /* 1: prompts too take the int8 arithmetic above (the calibration graph, which measures what
                      * decode computes); 0: from LLMC_Q4_WIDE_ROWS rows on they may take AMX-BF16 (below) */
  float window;      /* act_bits 16, not gated: the second level only within this margin of a row's largest value
                      * (above); 0: everywhere */
  int act_rows;      /* 1 (act_bits 8): each row of x quantized on one grid for all its blocks, xscale = max(max
                      * |x[m]|, 1e-5) / 127 and xq = round(x * (127 / that max)) (BitNet's per-token int8
                      * activations, as transformers computes them: the model's own integers, so the products are
                      * its integer dot products times the weights' scales); never the AMX-BF16 path. 0: per block */
} llmc_q4_args;

/* Returns NULL on success, else a message naming the value and its limit. */
const char* llmc_q4_matmul(const llmc_q4_args* a, llmc_parallel_fn parallel, void* parallel_ctx);

enum { LLMC_Q4_PORTABLE = 0, LLMC_Q4_AVX2 = 1, LLMC_Q4_VNNI = 2, LLMC_Q4_AMX = 3 };

/* The path this CPU takes: AVX-512 VNNI, and AMX-BF16 for prompts where the CPU has it and the OS grants it
 * (LLMC_Q4_AMX), else AVX2 + FMA, else portable C. LLMC_KERNELS_GENERIC=1 forces the portable path,
 * LLMC_KERNELS_AVX2=1 the AVX2 one on a VNNI CPU, LLMC_KERNELS_NO_AMX=1 VNNI for every row count (tests run every
 * path on one machine). */
int llmc_q4_path(void);

#endif
