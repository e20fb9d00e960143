/* 4-, 8- and 2-bit weight matrix products (see matmul_q4.h for the contract and the packed layouts).
 *
 * Why it exists: ONNX Runtime's MatMulNBits has no per-block minimum (GGUF Q4_1's "scale + min"), so llmc's int4
 * graphs had to add it with extra nodes, and its int8-activation kernel unpacks the 4-bit weights once per row of
 * x (batch 8 costs ~6.5x batch 1). Here the layout is made for the instruction that does the work (AVX-512 VNNI
 * vpdpbusd: 16 columns x 4 consecutive k per register): each 64-byte load of nibbles becomes two such registers
 * with one shift and two ANDs, and each is used for up to 4 rows of x before the next is loaded; the min costs one
 * FMA per block with the block sums of x. The SwiGLU gate (silu(gate) * up) is applied to the tile pair
 * as it is stored.
 *
 * Three code paths, chosen at run time from the CPU: AVX-512 VNNI, AVX2 (vpmaddubsw pairs summed in 16 bits over a
 * block, then widened once: no overflow, 8 x 2 x 15 x 127 < 2^15) and portable C. Each runs one block loop for 1
 * or 2 activation levels (act_bits 8 or 16: the level is a constant of the inlined loop, so the one-level code is
 * today's): the second level is one more int8 dot product per weight register, its own scale in the epilogue.
 *
 * 8-bit weights (bits 8, ai.llmc.MatMulQ8: the 8-bit LM head, --quant int8 and the layers a quality target raises
 * to 8 bits) take the same loops with the weight width a constant too: each 64-byte load is one register of q in
 * 0..255 (vpdpbusd's unsigned operand), and the same epilogue (its scale and min per block and column). ONNX
 * Runtime's MatMulNBits, which ran them before, unpacks its weights once per row of x: SmolLM2's head took 3.4-5.6
 * ms at batch 8 against 1.5 here (0.9 against 0.8 at batch 1; docs/operators.md).
 *
 * 2-bit weights (bits 2, ai.llmc.MatMulQ2: BitNet's ternary layers) too: each 64-byte load is four registers of q in
 * 0..3 (a shift and a mask each), and the blocks' scaled dot products are summed before the column's one scale and
 * min meet them (the tiles hold those once, not per block).
 */
#include "matmul_q4.h"

#include "ahead.h"
#include "amx_bf16.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(LLMC_PORTABLE_ONLY)
#define LLMC_X86 1
#include <immintrin.h>

#include "prefetch.h"
#include "vec_math.h"
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define UNIT_TILES 2  /* columns per work unit: a pair of tiles (gated: one gate tile and its up tile) */
#define ROWS 8        /* rows of x per pass over a unit's weights (as passes of 4: the second reads them from L1;
                       * measured ~9 % faster at 8 rows than 8 rows x 1 tile, where each broadcast of x serves one
                       * tile) */
#define POOL_TASKS 16 /* tasks handed to the thread pool per call, each claiming units until none are left */
#define UNIT_COLS (UNIT_TILES * LLMC_Q4_TILE)
#define PREFETCH_BLOCKS 4    /* tile-pair blocks ahead of the loads, prefetching into L1 (further measured no faster) */
#define PREFETCH_BLOCKS_L2 8 /* into L2 (prefetch.h; EPYC VM: 2 slower at 8 rows, 16 no faster) */
#define PREFETCH_BYTES_L2X3 5120 /* into L2 at 5, 10 and 20 KiB (prefetch.h: LLMC_PREFETCH_L2X3) */
#ifndef WIDE_X_BYTES
#define WIDE_X_BYTES (768 << 10) /* wide: the bf16 rows of x one work item takes (see wide_row_block) */
#endif

typedef struct {
  const llmc_q4_args* a;
  int64_t units, blocks; /* units: the work items (tile pairs; wide: row blocks x tile pairs) */
  int64_t pairs;         /* tile pairs */
  int64_t row_block;     /* wide: rows of x per work item (their bf16 rows stay in L2 across the pairs) */
  int bits;            /* the weights': 4, 8 or 2 */
  int64_t tile_bytes;  /* LLMC_Q4_TILE_BYTES, LLMC_Q8_TILE_BYTES or LLMC_Q2_TILE_BYTES */
  int levels;          /* int8 activation levels: 1 (act_bits 8) or 2 (act_bits 16); wide: one bf16 level */
  const int8_t* xq;    /* [levels][M, K]: level l at xq + l M K */
  const float* xscale; /* [levels][M, blocks]: level l at xscale + l M blocks */
  const float* xsum;   /* [M, blocks]: the block sums of x as quantized, sum_l xscale_l sum(xq_l) */
  const float* xrow;   /* bits 2: [M], each row's xsum over its blocks (the min's term, once a row) */
  int path;      /* LLMC_Q4_VNNI, LLMC_Q4_AVX2 or LLMC_Q4_PORTABLE (the dot products' path for few rows) */
  int wide;      /* this call runs on AMX-BF16 (prompts): xb, not xq */
  int prefetch;  /* where the weights' streaming prefetches go (prefetch.h: llmc_prefetch_mode) */
  int64_t ahead; /* how far ahead of its loads a task prefetches the weights, in bytes (the nearest, for l2x3) */
  const uint16_t* xb;    /* wide: [M + LLMC_AMX_SPAN, K] x in bf16 (one level, act_bits 16 too: matmul_q4.h) */
  uint16_t* expand;      /* wide: per task, one unit's weights in bf16, [2 tiles][K / 2][32] */
  int64_t parts; /* contiguous parts, one per thread (0: units are claimed, or all run in this thread) */
  size_t next;   /* the next unit to claim (atomic) */
  struct part* part; /* [parts] */
} job;

/* Part p's units still to do, [front, back): front in the low 32 bits, back in the high (atomic). Its own thread
 * takes them from the front, a thread that has finished its own part from the back. One cache line each. */
typedef struct part {
  uint64_t range;
  char pad[56];
} part;

/* Tile t's block b in the packed weights (tiles of `bytes` a block). */
static inline const uint8_t* tile_block(const uint8_t* w, int64_t blocks, int64_t t, int64_t b, int64_t bytes) {
  return w + ((t / 2 * blocks + b) * 2 + t % 2) * bytes;
}

/* Tile t's block b of `bits`-bit weights (bits 2: each pair's first row is its columns' scales and mins). */
static inline const uint8_t* block_at(const uint8_t* w, int64_t blocks, int64_t t, int64_t b, int64_t bytes,
                                      const int bits) {
  return bits == 2 ? tile_block(w, blocks + 1, t, b + 1, bytes) : tile_block(w, blocks, t, b, bytes);
}

/* bits 2: tile t's 16 fp32 scales, then its 16 fp32 mins. */
static inline const float* q2_grid(const uint8_t* w, int64_t blocks, int64_t t) {
  return (const float*)tile_block(w, blocks + 1, t, 0, LLMC_Q2_TILE_BYTES);
}

/* ---------------------------------------------------------------- activations */

#define QGROUP 8 /* blocks of x quantized side by side (see block_stats) */

/* For G consecutive blocks of 32 at v: max |v| of each, G blocks side by side. (Quantizing x was ~30 % of a
 * one-thread K 1536, M 8 product when it also summed x; now less than half that.) */
static inline __attribute__((always_inline)) void block_stats(const float* v, const int G, float* amax) {
  for (int g = 0; g < G; g++) { /* the max in any order is the same: 8 lanes, which vectorize */
    float mx[8] = {0};
    for (int i = 0; i < LLMC_Q4_BLOCK; i += 8)
      for (int l = 0; l < 8; l++) {
        float f = fabsf(v[g * LLMC_Q4_BLOCK + i + l]);
        mx[l] = f > mx[l] ? f : mx[l];
      }
    float m = 0.f;
    for (int l = 0; l < 8; l++) m = mx[l] > m ? mx[l] : m;
    amax[g] = m;
  }
}

/* block_stats of n <= QGROUP blocks. */
static inline __attribute__((always_inline)) void group_stats(const float* v, int n, float* amax) {
  if (n == QGROUP)
    block_stats(v, QGROUP, amax);
  else
    for (int g = 0; g < n; g++) block_stats(v + g * LLMC_Q4_BLOCK, 1, amax + g);
}

/* v rounded to the nearest integer, ties to even: lrintf's in the default rounding mode for |v| < 2^22 (here |v| <=
 * 127), as plain float arithmetic, which vectorizes (lrintf's 64-bit result does not: quantizing took ~2x). */
static inline __attribute__((always_inline)) int32_t round_small(float v) { return (int32_t)((v + 12582912.f) - 12582912.f); /* 1.5 * 2^23 */ }

/* One block of one level: q = round(v / s), s = amax / 127 (all 0 for amax 0); returns sum(q). */
static inline __attribute__((always_inline)) int32_t quantize_block(const float* v, float amax, int8_t* q) {
  float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < LLMC_Q4_BLOCK; i++) sum += q[i] = (int8_t)round_small(v[i] * inv);
  return sum;
}

/* x [M, K] -> per block of 32, `levels` int8 levels xq_l with their scales, and the block sums of x as quantized
 * (xsum = sum_l xscale_l sum(xq_l)): the min's term.
 * Level 1: xq_1 = round(x / s_1), s_1 = max |x| / 127; level 2 (act_bits 16) quantizes what is left the same way,
 * r = x - s_1 xq_1 -> xq_2, s_2 = max |r| / 127 (0 where r is): x ~ s_1 xq_1 + s_2 xq_2, ~15 bits.
 *
 * The whole product is of the quantized x: sum_k (scale q + min) x ~ scale sum_l xscale_l q.xq_l + min xsum, so
 * the error of the activations meets the weights themselves, which are centred on 0 (as in ONNX Runtime's
 * MatMulNBits, whose offsets take the quantized block sums). Meeting them centred on their block's grid instead
 * (the exact sums of x for the min: the form before) costs more wherever a block's midpoint is off 0: SmolLM2's
 * int4 engine had a mean KL of 3.8e-3 against fp32 that way, 3.1e-3 this way (686 positions).
 * (AVX2's 8-bit dot products are of the centred weights q - 128: that path adds the 128 xsum back.)
 * x's blocks are consecutive across rows (block mb = m blocks + b at x + 32 mb), so they go in groups of QGROUP. */
static inline __attribute__((always_inline)) void quantize_blocks(const llmc_q4_args* a, int levels, int8_t* xq,
                                                                     float* xscale, float* xsum, float* xsum1,
                                                                     const float* row_amax, int64_t first,
                                                                     int64_t end) {
  int64_t n = a->M * (a->K / LLMC_Q4_BLOCK), xq_level = a->M * a->K, kb = a->K / LLMC_Q4_BLOCK;
  for (int64_t b0 = first; b0 < end; b0 += QGROUP) {
    int g = n - b0 < QGROUP ? (int)(n - b0) : QGROUP;
    const float* x = a->x + b0 * LLMC_Q4_BLOCK;
    int8_t* q = xq + b0 * LLMC_Q4_BLOCK;
    float amax[QGROUP], sum[QGROUP], r[QGROUP * LLMC_Q4_BLOCK];
    group_stats(x, g, amax);
    for (int j = 0; row_amax && j < g; j++) amax[j] = row_amax[(b0 + j) / kb]; /* act_rows: the row's grid */
    for (int j = 0; j < g; j++) {
      const float* v = x + j * LLMC_Q4_BLOCK;
      int8_t* qj = q + j * LLMC_Q4_BLOCK;
      float s = amax[j] / 127.f;
      sum[j] = s * (float)quantize_block(v, amax[j], qj);
      xscale[b0 + j] = s;
      if (xsum1) xsum1[b0 + j] = sum[j];
      if (levels == 2)
        for (int i = 0; i < LLMC_Q4_BLOCK; i++) r[j * LLMC_Q4_BLOCK + i] = v[i] - s * (float)qj[i];
    }
    if (levels == 2) {
      group_stats(r, g, amax);
      for (int j = 0; j < g; j++) {
        float s = amax[j] / 127.f;
        sum[j] += s * (float)quantize_block(r + j * LLMC_Q4_BLOCK, amax[j], q + xq_level + j * LLMC_Q4_BLOCK);
        xscale[n + b0 + j] = s;
      }
    }
    for (int j = 0; j < g; j++) xsum[b0 + j] = sum[j];
  }
}

/* The same arithmetic three times, the same bits (no contraction into FMAs): plain C (portable), written for
 * AVX-512 registers (VNNI), and the C compiled for AVX2 (8 lanes where SSE2 took 4); each path's dot products take
 * the one their CPU has. */
#ifdef LLMC_X86
/* quantize_blocks in AVX-512 registers, a block (two registers) at a time: each element takes the C's operations,
 * in its order (the multiply, the two adds of round_small, the truncations to int32 and to int8; r = v - s q as a
 * multiply, then a subtraction), the maxima skip NaNs as the C's comparisons do, and the integer sums do not
 * depend on their order: the same bits. Compiled from the C, the calls of a decode step (one row: 18 or 48 blocks
 * each, 121 products) took ~1 ns a value in the calling thread while the pool's other threads waited. */
__attribute__((target("avx512f,avx512bw,avx512vl"), optimize("fp-contract=off"))) static void quantize_blocks512(
    const llmc_q4_args* a, int levels, int8_t* xq, float* xscale, float* xsum, float* xsum1, const float* row_amax,
    int64_t first, int64_t end) {
  int64_t n = a->M * (a->K / LLMC_Q4_BLOCK), xq_level = a->M * a->K, kb = a->K / LLMC_Q4_BLOCK;
  const __m512 magic = _mm512_set1_ps(12582912.f); /* round_small's 1.5 * 2^23 */
  const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff);
  for (int64_t b = first; b < end; b++) {
    __m512 v[2] = {_mm512_loadu_ps(a->x + b * LLMC_Q4_BLOCK), _mm512_loadu_ps(a->x + b * LLMC_Q4_BLOCK + 16)};
    float sum = 0.f;
    for (int l = 0; l < levels; l++) {
      __m512 mx = _mm512_setzero_ps(); /* max(f, mx): mx where f is NaN, as block_stats' f > mx ? f : mx */
      for (int h = 0; h < 2; h++)
        mx = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v[h]), abs_bits)), mx);
      float amax = row_amax ? row_amax[b / kb] : _mm512_reduce_max_ps(mx); /* act_rows: the row's grid */
      float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      __m512i q[2];
      for (int h = 0; h < 2; h++) { /* q as the int8 it is stored as (a NaN's INT_MIN truncates to 0, as in C) */
        __m128i q8 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(
            _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)), magic), magic)));
        _mm_storeu_si128((__m128i*)(xq + l * xq_level + b * LLMC_Q4_BLOCK + 16 * h), q8);
        q[h] = _mm512_cvtepi8_epi32(q8);
      }
      float part = s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
      sum = l == 0 ? part : sum + part;
      if (l == 0 && xsum1) xsum1[b] = part;
      xscale[l * n + b] = s;
      for (int h = 0; l + 1 < levels && h < 2; h++) /* the remainder, the next level's input */
        v[h] = _mm512_sub_ps(v[h], _mm512_mul_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(q[h])));
    }
    xsum[b] = sum;
  }
}
__attribute__((target("avx2"), optimize("fp-contract=off"))) static void quantize_blocks256(
    const llmc_q4_args* a, int levels, int8_t* xq, float* xscale, float* xsum, float* xsum1, const float* row_amax,
    int64_t first, int64_t end) {
  quantize_blocks(a, levels, xq, xscale, xsum, xsum1, row_amax, first, end);
}
#endif

typedef struct {
  const llmc_q4_args* a;
  int levels, path;
  int8_t* xq;
  float *xscale, *xsum, *xsum1; /* xsum1: the first level's block sums alone, or NULL (see window_pass) */
  const float* row_amax;        /* act_rows: each row's grid (max(max |x[m]|, 1e-5)); NULL: each block's own */
  size_t tasks;
} quantize_job;

/* Task t: its share of the blocks, in whole groups of QGROUP. */
static void quantize_task(void* data, size_t t) {
  const quantize_job* q = (const quantize_job*)data;
  int64_t n = q->a->M * (q->a->K / LLMC_Q4_BLOCK), groups = (n + QGROUP - 1) / QGROUP;
  int64_t first = groups * (int64_t)t / (int64_t)q->tasks * QGROUP;
  int64_t end = groups * ((int64_t)t + 1) / (int64_t)q->tasks * QGROUP;
  end = end < n ? end : n;
#ifdef LLMC_X86
  if (q->path == LLMC_Q4_VNNI) {
    quantize_blocks512(q->a, q->levels, q->xq, q->xscale, q->xsum, q->xsum1, q->row_amax, first, end);
    return;
  }
  if (q->path == LLMC_Q4_AVX2) {
    quantize_blocks256(q->a, q->levels, q->xq, q->xscale, q->xsum, q->xsum1, q->row_amax, first, end);
    return;
  }
#endif
  quantize_blocks(q->a, q->levels, q->xq, q->xscale, q->xsum, q->xsum1, q->row_amax, first, end);
}

/* x's blocks quantized, QUANTIZE_SPLIT_ROWS rows or more split over the pool's threads (in one thread a 128-token
 * prefill's took ~5 % of its samples while the other thread waited; from 8 rows on since llmc's own pool, whose call
 * costs less than ONNX Runtime's: SmolLM2's default int4 engine's 121 products at 8 rows, alternating, 12.56 / 10.89
 * / 10.60 -> 12.37 / 10.80 / 10.33 ms, and 10.97 / 15.18 / 13.02 -> 10.12 / 11.47 / 12.22 ms; at 4 rows within
 * noise). */
#define QUANTIZE_SPLIT_ROWS 8
static void quantize_rows(const llmc_q4_args* a, int levels, int path, int8_t* xq, float* xscale, float* xsum,
                          float* xsum1, float* row_amax, llmc_parallel_fn parallel, void* parallel_ctx) {
  for (int64_t m = 0; row_amax && m < a->M; m++) { /* act_rows: max(max |x[m]|, 1e-5), NaNs skipped as
                                                     * block_stats skips them */
    float mx = 1e-5f;
    for (int64_t k = 0; k < a->K; k++) {
      float v = fabsf(a->x[m * a->K + k]);
      mx = v > mx ? v : mx;
    }
    row_amax[m] = mx;
  }
  quantize_job q = {a, levels, path, xq, xscale, xsum, xsum1, row_amax, 1};
  if (parallel && a->threads > 1 && a->M >= QUANTIZE_SPLIT_ROWS) {
    q.tasks = (size_t)a->threads;
    parallel(parallel_ctx, quantize_task, q.tasks, &q);
  } else {
    quantize_task(&q, 0);
  }
}

/* ---------------------------------------------------------------- the epilogue, every path */

static inline float silu(float v) { return v / (1.f + expf(-v)); }

#ifdef LLMC_X86
/* store_unit's AVX-512 form: 16 columns a register, silu by llmc_silu512. Scalar expf took 15 % of a 2,048-token
 * prompt's prefill (SmolLM2, all-int4: 3.1 M gate outputs a layer), as much as the up and gate products' tiles. */
__attribute__((target("avx512f"))) static void store_unit512(const job* j, int64_t u, int64_t m0, int rows,
                                                            const float* buf) {
  const llmc_q4_args* a = j->a;
  int64_t n0 = u * UNIT_COLS;
  if (a->gated) {
    int64_t half = a->N / 2, g0 = u * LLMC_Q4_TILE;
    __m512 bg = a->bias ? _mm512_loadu_ps(a->bias + g0) : _mm512_setzero_ps();
    __m512 bu = a->bias ? _mm512_loadu_ps(a->bias + half + g0) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
      __m512 g = _mm512_add_ps(_mm512_loadu_ps(buf + m * UNIT_COLS), bg);
      __m512 up = _mm512_add_ps(_mm512_loadu_ps(buf + m * UNIT_COLS + LLMC_Q4_TILE), bu);
      _mm512_storeu_ps(a->y + (m0 + m) * half + g0, _mm512_mul_ps(llmc_silu512(g), up));
    }
    return;
  }
  int64_t cols = a->N - n0 < UNIT_COLS ? a->N - n0 : UNIT_COLS;
  for (int h = 0; h < UNIT_COLS; h += 16) {
    if (h >= cols) break;
    __mmask16 keep = cols - h >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - h)) - 1);
    __m512 bias = a->bias ? _mm512_maskz_loadu_ps(keep, a->bias + n0 + h) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++)
      _mm512_mask_storeu_ps(a->y + (m0 + m) * a->N + n0 + h, keep,
                            _mm512_add_ps(_mm512_loadu_ps(buf + m * UNIT_COLS + h), bias));
  }
}
#endif

/* Rows m0 .. m0 + rows of one unit, computed into buf [rows][UNIT_COLS]: add the bias, gate, store. */
static void store_unit(const job* j, int64_t u, int64_t m0, int rows, const float* buf) {
  const llmc_q4_args* a = j->a;
#ifdef LLMC_X86
  if (j->path == LLMC_Q4_VNNI) { /* (an AVX-512 CPU; the wide path is one) */
    store_unit512(j, u, m0, rows, buf);
    return;
  }
#endif
  int64_t n0 = u * UNIT_COLS;
  if (a->gated) { /* unit u = gate tile 2u, up tile 2u + 1 -> 16 outputs at 16 u */
    int64_t half = a->N / 2, g0 = u * LLMC_Q4_TILE;
    for (int m = 0; m < rows; m++)
      for (int c = 0; c < LLMC_Q4_TILE; c++) {
        float g = buf[m * UNIT_COLS + c], up = buf[m * UNIT_COLS + LLMC_Q4_TILE + c];
        if (a->bias) g += a->bias[g0 + c], up += a->bias[half + g0 + c];
        a->y[(m0 + m) * half + g0 + c] = silu(g) * up;
      }
    return;
  }
  int64_t cols = a->N - n0 < UNIT_COLS ? a->N - n0 : UNIT_COLS;
  for (int m = 0; m < rows; m++) {
    float* y = a->y + (m0 + m) * a->N + n0;
    for (int c = 0; c < cols; c++) y[c] = buf[m * UNIT_COLS + c] + (a->bias ? a->bias[n0 + c] : 0.f);
  }
}

/* ---------------------------------------------------------------- portable C */

static inline float half_to_float(const uint8_t* p) {
  _Float16 f;
  memcpy(&f, p, 2);
  return (float)f;
}

/* Row m's tile t over all blocks at L activation levels (a constant where inlined), added into acc [16]. */
static inline __attribute__((always_inline)) void tile_generic(const job* j, int64_t m, int64_t t, const int L,
                                                               float* acc) {
  const llmc_q4_args* a = j->a;
  int64_t blocks = j->blocks, xq_level = a->M * a->K, xs_level = a->M * blocks;
  float dsum[LLMC_Q4_TILE] = {0}; /* bits 2: sum_b d, scaled once (the scale is the column's for all of K) */
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* p = block_at(a->w, blocks, t, b, j->tile_bytes, j->bits);
    const int8_t* xq = j->xq + m * a->K + b * LLMC_Q4_BLOCK;
    int64_t mb = m * blocks + b;
    float xsum = j->xsum[mb];
    for (int c = 0; c < LLMC_Q4_TILE; c++) {
      float d = 0.f;
      for (int l = 0; l < L; l++) {
        const int8_t* r = xq + l * xq_level;
        int32_t dot = 0;
        if (j->bits == 8)
          for (int chunk = 0; chunk < 8; chunk++)
            for (int i = 0; i < 4; i++) dot += p[chunk * 64 + c * 4 + i] * r[4 * chunk + i];
        else if (j->bits == 2)
          for (int chunk = 0; chunk < 2; chunk++)
            for (int sh = 0; sh < 4; sh++)
              for (int i = 0; i < 4; i++) dot += ((p[chunk * 64 + c * 4 + i] >> (2 * sh)) & 3) * r[16 * chunk + 4 * sh + i];
        else
          for (int chunk = 0; chunk < 4; chunk++)
            for (int i = 0; i < 4; i++) {
              uint8_t byte = p[chunk * 64 + c * 4 + i];
              dot += (byte & 15) * r[8 * chunk + i] + (byte >> 4) * r[8 * chunk + 4 + i];
            }
        d += j->xscale[l * xs_level + mb] * (float)dot;
      }
      if (j->bits == 2) {
        dsum[c] += d;
        continue;
      }
      const uint8_t* grid = p + (j->bits == 8 ? 512 : 256); /* 16 scales, then 16 mins */
      acc[c] += half_to_float(grid + 2 * c) * d + half_to_float(grid + 32 + 2 * c) * xsum;
    }
  }
  if (j->bits == 2) {
    const float* grid = q2_grid(a->w, blocks, t);
    for (int c = 0; c < LLMC_Q4_TILE; c++) acc[c] += grid[c] * dsum[c] + grid[LLMC_Q4_TILE + c] * j->xrow[m];
  }
}

static inline __attribute__((always_inline)) void unit_generic_levels(const job* j, int64_t u, const int L) {
  float buf[ROWS * UNIT_COLS];
  for (int64_t m0 = 0; m0 < j->a->M; m0 += ROWS) {
    int rows = j->a->M - m0 < ROWS ? (int)(j->a->M - m0) : ROWS;
    memset(buf, 0, sizeof buf);
    for (int t = 0; t < UNIT_TILES; t++)
      for (int m = 0; m < rows; m++)
        tile_generic(j, m0 + m, u * UNIT_TILES + t, L, buf + m * UNIT_COLS + t * LLMC_Q4_TILE);
    store_unit(j, u, m0, rows, buf);
  }
}

static void unit_generic(const job* j, int64_t u) {
  if (j->levels == 2)
    unit_generic_levels(j, u, 2);
  else
    unit_generic_levels(j, u, 1);
}

/* ---------------------------------------------------------------- AVX-512 VNNI */

#ifdef LLMC_X86
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

static inline int32_t load4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

/* RM rows (from m0) x NT tiles (from t0) over all blocks with L activation levels and BITS-bit weights, into buf
 * [RM][UNIT_COLS] at tile offset `slot`. Every register of weights is used by the RM rows and L levels; NT > 1
 * gives the one-row case independent accumulation chains. */
static inline __attribute__((always_inline)) TARGET void tiles_vnni(const job* j, int64_t m0, int64_t t0, int slot,
                                                                     float* buf, const int RM, const int NT,
                                                                     const int L, const int BITS) {
  const int64_t tile_bytes = BITS == 8 ? LLMC_Q8_TILE_BYTES : BITS == 2 ? LLMC_Q2_TILE_BYTES : LLMC_Q4_TILE_BYTES;
  const int64_t blocks = j->blocks, K = j->a->K, xq_level = j->a->M * K, xs_level = j->a->M * blocks;
  const int8_t* xq = j->xq + m0 * K;
  const float* xscale = j->xscale + m0 * blocks;
  const float* xsum = j->xsum + m0 * blocks;
  const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
  __m512 acc[4][2]; /* [RM][NT], as the largest fixed sizes: as VLAs they were stack memory */
  for (int m = 0; m < RM; m++)
    for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
  __m512i dot[2][4][2]; /* [L][RM][NT] */
  /* bits 2, few rows: each shift's dot products their own chain, summed after the block (one chain took 8
   * vpdpbusd a tile's block of 128 bytes in a row: at one row their latency, not the bytes, bound the loop) */
  const int CHAINS = BITS != 2 || L != 1 ? 1 : RM * NT <= 2 ? 4 : RM * NT <= 4 ? 2 : 1;
  __m512i more[3][4][2]; /* [chain - 1][RM][NT] (one level) */
  /* bits 2 on one grid a row (act_rows): x's scale is the row's in every block, and the column's scale and min are
   * its own for all of K, so the integer dot products run on over all of K and meet the scales once (a block's
   * conversion and scaling were 3 of every 11 operations of 8 rows) */
  const int whole = BITS == 2 && L == 1 && j->a->act_rows;
  for (int64_t b = 0; b < blocks; b++) {
    for (int l = 0; (b == 0 || !whole) && l < L; l++)
      for (int m = 0; m < RM; m++)
        for (int t = 0; t < NT; t++) dot[l][m][t] = _mm512_setzero_si512();
    for (int h = 0; (b == 0 || !whole) && h + 1 < CHAINS; h++)
      for (int m = 0; m < RM; m++)
        for (int t = 0; t < NT; t++) more[h][m][t] = _mm512_setzero_si512();
    for (int c = 0; c < (BITS == 8 ? 8 : BITS == 2 ? 2 : 4); c++)
      for (int t = 0; t < NT; t++) {
        const uint8_t* p = block_at(j->a->w, blocks, t0 + t, b, tile_bytes, BITS) + c * 64;
        llmc_prefetch_stream(p, j->ahead, j->prefetch);
        __m512i raw = _mm512_loadu_si512(p);
        if (BITS == 2) { /* four registers of 4 consecutive k x 16 columns, 2 bits each */
          for (int sh = 0; sh < 4; sh++) {
            __m512i q = _mm512_and_si512(sh ? _mm512_srli_epi16(raw, 2 * sh) : raw, low2);
            for (int m = 0; m < RM; m++)
              for (int l = 0; l < L; l++) {
                const int8_t* r = xq + l * xq_level + m * K + b * LLMC_Q4_BLOCK + 16 * c + 4 * sh;
                int chain = sh % CHAINS;
                if (chain)
                  more[chain - 1][m][t] = _mm512_dpbusd_epi32(more[chain - 1][m][t], q, _mm512_set1_epi32(load4(r)));
                else
                  dot[l][m][t] = _mm512_dpbusd_epi32(dot[l][m][t], q, _mm512_set1_epi32(load4(r)));
              }
          }
          continue;
        }
        if (BITS == 8) { /* one register of 4 consecutive k x 16 columns */
          for (int m = 0; m < RM; m++)
            for (int l = 0; l < L; l++) {
              const int8_t* r = xq + l * xq_level + m * K + b * LLMC_Q4_BLOCK + 4 * c;
              dot[l][m][t] = _mm512_dpbusd_epi32(dot[l][m][t], raw, _mm512_set1_epi32(load4(r)));
            }
          continue;
        }
        __m512i lo = _mm512_and_si512(raw, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        for (int m = 0; m < RM; m++)
          for (int l = 0; l < L; l++) {
            const int8_t* r = xq + l * xq_level + m * K + b * LLMC_Q4_BLOCK + 8 * c;
            dot[l][m][t] = _mm512_dpbusd_epi32(dot[l][m][t], lo, _mm512_set1_epi32(load4(r)));
            dot[l][m][t] = _mm512_dpbusd_epi32(dot[l][m][t], hi, _mm512_set1_epi32(load4(r + 4)));
          }
      }
    if (whole) continue;
    for (int h = 0; h + 1 < CHAINS; h++)
      for (int m = 0; m < RM; m++)
        for (int t = 0; t < NT; t++) dot[0][m][t] = _mm512_add_epi32(dot[0][m][t], more[h][m][t]);
    for (int t = 0; BITS == 2 && t < NT; t++) /* the column's scale for all of K: the blocks' d summed first */
      for (int m = 0; m < RM; m++) {
        __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[0][m][t]), _mm512_set1_ps(xscale[m * blocks + b]));
        for (int l = 1; l < L; l++)
          d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[l][m][t]),
                              _mm512_set1_ps(xscale[l * xs_level + m * blocks + b]), d);
        acc[m][t] = _mm512_add_ps(acc[m][t], d);
      }
    for (int t = 0; BITS != 2 && t < NT; t++) {
      const uint8_t* p = tile_block(j->a->w, blocks, t0 + t, b, tile_bytes) + (BITS == 8 ? 512 : 256);
      llmc_prefetch_stream(p, j->ahead, j->prefetch); /* the block's scale and min line, as its values' lines */
      __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32)));
      for (int m = 0; m < RM; m++) {
        __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[0][m][t]), _mm512_set1_ps(xscale[m * blocks + b]));
        for (int l = 1; l < L; l++)
          d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[l][m][t]),
                              _mm512_set1_ps(xscale[l * xs_level + m * blocks + b]), d);
        acc[m][t] = _mm512_fmadd_ps(d, scale, acc[m][t]);
        acc[m][t] = _mm512_fmadd_ps(min, _mm512_set1_ps(xsum[m * blocks + b]), acc[m][t]);
      }
    }
  }
  for (int t = 0; whole && t < NT; t++)
    for (int m = 0; m < RM; m++) {
      __m512i sum = dot[0][m][t];
      for (int h = 0; h + 1 < CHAINS; h++) sum = _mm512_add_epi32(sum, more[h][m][t]);
      acc[m][t] = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xscale[m * blocks]));
    }
  for (int t = 0; BITS == 2 && t < NT; t++) {
    const float* grid = q2_grid(j->a->w, blocks, t0 + t);
    __m512 scale = _mm512_loadu_ps(grid), min = _mm512_loadu_ps(grid + LLMC_Q4_TILE);
    for (int m = 0; m < RM; m++)
      acc[m][t] = _mm512_fmadd_ps(acc[m][t], scale, _mm512_mul_ps(min, _mm512_set1_ps(j->xrow[m0 + m])));
  }
  for (int m = 0; m < RM; m++)
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(buf + m * UNIT_COLS + (slot + t) * LLMC_Q4_TILE, acc[m][t]);
}

static inline __attribute__((always_inline)) TARGET void unit_vnni_levels(const job* j, int64_t u, const int L,
                                                                           const int BITS) {
  int64_t t0 = u * UNIT_TILES, M = j->a->M;
  float buf[ROWS * UNIT_COLS];
  for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
    int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS, m = 0;
    for (; L == 2 && rows - m >= 4; m += 4) { /* two levels: one tile at a time (4 x 2 x 2 dot registers spill) */
      tiles_vnni(j, m0 + m, t0, 0, buf + m * UNIT_COLS, 4, 1, L, BITS);
      tiles_vnni(j, m0 + m, t0 + 1, 1, buf + m * UNIT_COLS, 4, 1, L, BITS);
    }
    for (; rows - m >= 4; m += 4) tiles_vnni(j, m0 + m, t0, 0, buf + m * UNIT_COLS, 4, 2, L, BITS);
    for (; rows - m >= 2; m += 2) tiles_vnni(j, m0 + m, t0, 0, buf + m * UNIT_COLS, 2, 2, L, BITS);
    for (; m < rows; m++) tiles_vnni(j, m0 + m, t0, 0, buf + m * UNIT_COLS, 1, 2, L, BITS);
    store_unit(j, u, m0, rows, buf);
  }
}

/* Unit u through levels_fn(j, u, L, BITS) expanded with the job's activation levels and weight bits as constants
 * (each path's unit_*_levels is written once and inlined four ways). */
#define BY_LEVELS_AND_BITS(levels_fn, j, u)                                                  \
  ((j)->bits == 8   ? ((j)->levels == 2 ? levels_fn(j, u, 2, 8) : levels_fn(j, u, 1, 8))   \
   : (j)->bits == 2 ? ((j)->levels == 2 ? levels_fn(j, u, 2, 2) : levels_fn(j, u, 1, 2)) \
                    : ((j)->levels == 2 ? levels_fn(j, u, 2, 4) : levels_fn(j, u, 1, 4)))

static TARGET void unit_vnni(const job* j, int64_t u) { BY_LEVELS_AND_BITS(unit_vnni_levels, j, u); }

/* ---------------------------------------------------------------- AVX2 */

#define TARGET2 __attribute__((target("avx2,fma,f16c")))

/* RM rows x NT tiles (RM * NT <= 2: 16 registers) x L levels, as tiles_vnni: each tile is two registers of 8
 * columns. 8-bit weights: vpmaddubsw's pairs of q (0..255) x int8 could overflow 16 bits, so the weights are centred
 * (q - 128, in -127..127: GGUF Q8_0's values) and multiplied as |w| x sign(x, w) (llama.cpp's trick), each pair
 * widened to 32 bits at once: the dot products are of the centred weights, so the epilogue adds 128 xsum. */
static inline __attribute__((always_inline)) TARGET2 void tiles_avx2(const job* j, int64_t m0, int64_t t0,
                                                                      float* buf, const int RM, const int NT,
                                                                      const int L, const int BITS) {
  const int64_t blocks = j->blocks, K = j->a->K, xq_level = j->a->M * K, xs_level = j->a->M * blocks;
  const int64_t tile_bytes = BITS == 8 ? LLMC_Q8_TILE_BYTES : BITS == 2 ? LLMC_Q2_TILE_BYTES : LLMC_Q4_TILE_BYTES;
  const int8_t* xq = j->xq + m0 * K;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), zero8 = _mm256_set1_epi8((char)0x80);
  const __m256i low2 = _mm256_set1_epi8(0x03);
  __m256 acc[2][2][2]; /* [RM][NT][2] */
  for (int m = 0; m < RM; m++)
    for (int t = 0; t < NT; t++) acc[m][t][0] = acc[m][t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    __m256i dot[2][2][2][2]; /* [L][RM][NT][2]: 16-bit sums of (column, k pair) over the block (8-bit: 32-bit
                              * sums per column) */
    for (int l = 0; l < L; l++)
      for (int m = 0; m < RM; m++)
        for (int t = 0; t < NT; t++) dot[l][m][t][0] = dot[l][m][t][1] = _mm256_setzero_si256();
    for (int c = 0; c < (BITS == 8 ? 8 : BITS == 2 ? 2 : 4); c++)
      for (int t = 0; t < NT; t++) {
        const uint8_t* p = block_at(j->a->w, blocks, t0 + t, b, tile_bytes, BITS) + c * 64;
        llmc_prefetch_stream(p, j->ahead, j->prefetch);
        for (int h = 0; h < 2; h++) {
          __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 32 * h));
          if (BITS == 2) { /* 8 pairs of q (0..3) x int8 a block per column pair: |sums| <= 8 x 762 */
            for (int sh = 0; sh < 4; sh++) {
              __m256i q = _mm256_and_si256(sh ? _mm256_srli_epi16(raw, 2 * sh) : raw, low2);
              for (int m = 0; m < RM; m++)
                for (int l = 0; l < L; l++) {
                  const int8_t* r = xq + l * xq_level + m * K + b * LLMC_Q4_BLOCK + 16 * c + 4 * sh;
                  dot[l][m][t][h] = _mm256_add_epi16(dot[l][m][t][h],
                                                     _mm256_maddubs_epi16(q, _mm256_set1_epi32(load4(r))));
                }
            }
            continue;
          }
          if (BITS == 8) {
            __m256i w = _mm256_xor_si256(raw, zero8), aw = _mm256_abs_epi8(w);
            for (int m = 0; m < RM; m++)
              for (int l = 0; l < L; l++) {
                const int8_t* r = xq + l * xq_level + m * K + b * LLMC_Q4_BLOCK + 4 * c;
                __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(load4(r)), w));
                dot[l][m][t][h] = _mm256_add_epi32(dot[l][m][t][h], _mm256_madd_epi16(pairs, ones));
              }
            continue;
          }
          __m256i lo = _mm256_and_si256(raw, low4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          for (int m = 0; m < RM; m++)
            for (int l = 0; l < L; l++) {
              const int8_t* r = xq + l * xq_level + m * K + b * LLMC_Q4_BLOCK + 8 * c;
              __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(r))),
                                           _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(r + 4))));
              dot[l][m][t][h] = _mm256_add_epi16(dot[l][m][t][h], s);
            }
        }
      }
    for (int t = 0; BITS == 2 && t < NT; t++) /* the column's scale for all of K: the blocks' d summed first */
      for (int h = 0; h < 2; h++)
        for (int m = 0; m < RM; m++) {
          int64_t mb = (m0 + m) * blocks + b;
          __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[0][m][t][h], ones)),
                                   _mm256_set1_ps(j->xscale[mb]));
          for (int l = 1; l < L; l++)
            d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[l][m][t][h], ones)),
                                _mm256_set1_ps(j->xscale[l * xs_level + mb]), d);
          acc[m][t][h] = _mm256_add_ps(acc[m][t][h], d);
        }
    for (int t = 0; BITS != 2 && t < NT; t++) {
      const uint8_t* p = tile_block(j->a->w, blocks, t0 + t, b, tile_bytes) + (BITS == 8 ? 512 : 256);
      llmc_prefetch_stream(p, j->ahead, j->prefetch); /* the block's scale and min line, as its values' lines */
      for (int h = 0; h < 2; h++) {
        __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
        __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 32 + 16 * h)));
        for (int m = 0; m < RM; m++) {
          int64_t mb = (m0 + m) * blocks + b;
          __m256 d = _mm256_set1_ps(BITS == 8 ? 128.f * j->xsum[mb] : 0.f); /* the centred weights' 128 back */
          for (int l = 0; l < L; l++) {
            __m256i sums = BITS == 8 ? dot[l][m][t][h] : _mm256_madd_epi16(dot[l][m][t][h], ones);
            d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(j->xscale[l * xs_level + mb]), d);
          }
          acc[m][t][h] = _mm256_fmadd_ps(d, scale, acc[m][t][h]);
          acc[m][t][h] = _mm256_fmadd_ps(min, _mm256_set1_ps(j->xsum[mb]), acc[m][t][h]);
        }
      }
    }
  }
  for (int t = 0; BITS == 2 && t < NT; t++) {
    const float* grid = q2_grid(j->a->w, blocks, t0 + t);
    for (int h = 0; h < 2; h++) {
      __m256 scale = _mm256_loadu_ps(grid + 8 * h), min = _mm256_loadu_ps(grid + LLMC_Q4_TILE + 8 * h);
      for (int m = 0; m < RM; m++)
        acc[m][t][h] = _mm256_fmadd_ps(acc[m][t][h], scale, _mm256_mul_ps(min, _mm256_set1_ps(j->xrow[m0 + m])));
    }
  }
  for (int m = 0; m < RM; m++)
    for (int t = 0; t < NT; t++)
      for (int h = 0; h < 2; h++) _mm256_storeu_ps(buf + m * UNIT_COLS + t * LLMC_Q4_TILE + 8 * h, acc[m][t][h]);
}

static inline __attribute__((always_inline)) TARGET2 void unit_avx2_levels(const job* j, int64_t u, const int L,
                                                                            const int BITS) {
  int64_t t0 = u * UNIT_TILES, M = j->a->M;
  float buf[ROWS * UNIT_COLS];
  for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
    int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS, m = 0;
    for (; rows - m >= 2; m += 2) {
      tiles_avx2(j, m0 + m, t0, buf + m * UNIT_COLS, 2, 1, L, BITS);
      tiles_avx2(j, m0 + m, t0 + 1, buf + m * UNIT_COLS + LLMC_Q4_TILE, 2, 1, L, BITS);
    }
    if (m < rows) tiles_avx2(j, m0 + m, t0, buf + m * UNIT_COLS, 1, 2, L, BITS);
    store_unit(j, u, m0, rows, buf);
  }
}

static TARGET2 void unit_avx2(const job* j, int64_t u) { BY_LEVELS_AND_BITS(unit_avx2_levels, j, u); }

/* ---------------------------------------------------------------- AMX-BF16 (prompts) */

#define TARGET_WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,f16c")))

/* Tile t's blocks expanded to bf16(scale q + min) in AMX-BF16's B layout: out [K / 2][32], pair p = k / 2 holding
 * its two k side by side per column (amx_bf16.h). Each 64-byte load of the packed layout is 16 columns x 4
 * consecutive k (4 bits: x 2, low and high nibbles); byte i of each column's 4 is one k. One vpermb (AVX-512 VBMI,
 * which every AMX CPU has) moves a pair row's bytes for 8 columns into the fp32 lanes (column c, k even / odd at
 * lanes 2c, 2c + 1, the other bytes zeroed), so the two conversions of 8 columns each are the pair row as it is
 * stored (where shifting each k into place, then interleaving the bf16 with vpermw, took 11 instructions a pair
 * row for 8 here: the expansion was 16 % of a 128-token prompt's samples in perf with one bf16 level of x). */
static inline __attribute__((always_inline)) TARGET_WIDE void expand_tile(const job* j, int64_t t, uint16_t* out,
                                                                           const int BITS) {
  const int64_t tile_bytes = BITS == 8 ? LLMC_Q8_TILE_BYTES : LLMC_Q4_TILE_BYTES;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __mmask64 first_byte = 0x1111111111111111ull; /* byte 0 of each fp32 lane */
  __m512i pick[2][2]; /* [k pair i / 2 of the 4][columns 0-7, 8-15]: lane L <- byte 4 (8 half + L / 2) + i + L % 2 */
  for (int i = 0; i < 2; i++)
    for (int half = 0; half < 2; half++) {
      uint8_t idx[64] = {0};
      for (int lane = 0; lane < 16; lane++) idx[4 * lane] = (uint8_t)(4 * (8 * half + lane / 2) + 2 * i + lane % 2);
      pick[i][half] = _mm512_loadu_si512(idx);
    }
  const __m512i col_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i col_hi = _mm512_add_epi32(col_lo, _mm512_set1_epi32(8));
  for (int64_t b = 0; b < j->blocks; b++) {
    const uint8_t* p = tile_block(j->a->w, j->blocks, t, b, tile_bytes);
    const uint8_t* grid = p + (BITS == 8 ? 512 : 256);
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)grid));
    __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(grid + 32)));
    __m512 s[2] = {_mm512_permutexvar_ps(col_lo, scale), _mm512_permutexvar_ps(col_hi, scale)};
    __m512 m[2] = {_mm512_permutexvar_ps(col_lo, min), _mm512_permutexvar_ps(col_hi, min)};
    uint16_t* o = out + b * (LLMC_Q4_BLOCK / 2) * 32;
    for (int c = 0; c < (BITS == 8 ? 8 : 4); c++) {
      __m512i raw = _mm512_loadu_si512(p + c * 64), quads[2];
      int nq = BITS == 8 ? 1 : 2;
      if (BITS == 8) {
        quads[0] = raw; /* k 4c .. 4c + 3 */
      } else {
        quads[0] = _mm512_and_si512(raw, low4);                      /* k 8c .. 8c + 3 */
        quads[1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4); /* k 8c + 4 .. 8c + 7 */
      }
      for (int h = 0; h < nq; h++)
        for (int i = 0; i < 2; i++) {
          __m512 w[2];
          for (int half = 0; half < 2; half++)
            w[half] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(first_byte, pick[i][half], quads[h])), s[half],
                m[half]);
          int64_t pair = (BITS == 8 ? 2 * c : 4 * c + 2 * h) + i;
          _mm512_storeu_si512(o + pair * 32, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
        }
    }
  }
}

/* Work item i: tile pair u = i % pairs for the rows of row block i / pairs. The pair's two tiles are expanded into
 * `scratch`, then 2 x 16 rows at a time on the tiles (rows past M are read from xb's spare rows and dropped). */
static TARGET_WIDE void unit_wide(const job* j, int64_t i, uint16_t* scratch) {
  const llmc_q4_args* a = j->a;
  int64_t u = i % j->pairs, first = i / j->pairs * j->row_block;
  int64_t end = first + j->row_block < a->M ? first + j->row_block : a->M;
  const int64_t stride = a->K * 2; /* bytes per row of xb */
  uint16_t* w1 = scratch + a->K * 16;
  if (j->bits == 8) {
    expand_tile(j, u * UNIT_TILES, scratch, 8);
    expand_tile(j, u * UNIT_TILES + 1, w1, 8);
  } else {
    expand_tile(j, u * UNIT_TILES, scratch, 4);
    expand_tile(j, u * UNIT_TILES + 1, w1, 4);
  }
  __attribute__((aligned(64))) float c[4 * LLMC_AMX_ROWS * LLMC_Q4_TILE];
  float buf[LLMC_AMX_ROWS * UNIT_COLS];
  /* the next pair's weights (this task's next item, mostly) into L2, a share before each span's tiles */
  const char* next = u + 1 < j->pairs ? (const char*)tile_block(a->w, j->blocks, (u + 1) * UNIT_TILES, 0, j->tile_bytes)
                                      : NULL;
  int64_t next_bytes = j->blocks * 2 * j->tile_bytes, spans = (end - first + LLMC_AMX_SPAN - 1) / LLMC_AMX_SPAN;
  int64_t share = (next_bytes / 64 + spans - 1) / spans * 64, fetched = 0;
  llmc_amx_configure();
  for (int64_t m0 = first; m0 < end; m0 += LLMC_AMX_SPAN) {
    for (int64_t stop = fetched + share; next && fetched < stop && fetched < next_bytes; fetched += 64)
      _mm_prefetch(next + fetched, _MM_HINT_T1);
    llmc_amx_bf16_rows((const char*)j->xb + m0 * stride, stride, a->K, scratch, w1, c);
    for (int blk = 0; blk < 2; blk++) {
      int64_t r0 = m0 + blk * LLMC_AMX_ROWS;
      if (r0 >= end) break;
      int rows = end - r0 < LLMC_AMX_ROWS ? (int)(end - r0) : LLMC_AMX_ROWS;
      llmc_amx_rows_of(c, blk, rows, buf);
      store_unit(j, u, r0, rows, buf);
    }
  }
}

static int cpu_path(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return LLMC_Q4_VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return LLMC_Q4_AVX2;
  return LLMC_Q4_PORTABLE;
}
#endif

/* The dot products' path (few rows), as the environment overrides it now. */
static int dot_path(void) {
#ifdef LLMC_X86
  const char* generic = getenv("LLMC_KERNELS_GENERIC");
  const char* avx2 = getenv("LLMC_KERNELS_AVX2");
  int path = cpu_path();
  if (generic && *generic && *generic != '0') return LLMC_Q4_PORTABLE;
  if (avx2 && *avx2 && *avx2 != '0' && path == LLMC_Q4_VNNI) return LLMC_Q4_AVX2;
  return path;
#else
  return LLMC_Q4_PORTABLE;
#endif
}

/* A prompt on the VNNI path may take the AMX-BF16 tiles (asked only of prompts: decode's calls never look). */
static int tiles_allowed(void) {
#ifdef LLMC_X86
  const char* no_amx = getenv("LLMC_KERNELS_NO_AMX");
  __builtin_cpu_init();
  return !(no_amx && *no_amx && *no_amx != '0') && llmc_amx_bf16_usable() && __builtin_cpu_supports("avx512vbmi");
#else
  return 0;
#endif
}

int llmc_q4_path(void) {
  int path = dot_path();
  return path == LLMC_Q4_VNNI && tiles_allowed() ? LLMC_Q4_AMX : path;
}

/* Rows of x per work item on the wide path: as many as keep their bf16 rows within WIDE_X_BYTES (in L2 while
 * the item's task passes the tile pairs), in whole spans. Over all of M at once, a long prompt's x was read again
 * from memory for every pair: a 2,048-token prompt's products re-read ~13 GB of it in SmolLM2's 30 layers (from
 * this VM's 300 MB L3, so the blocks alone measured 1.0x for the all-int4 engine and 1.16x for the default
 * there). Each item expands its pair's weights again. */
static int64_t wide_row_block(int64_t M, int64_t K) {
  int64_t rows = WIDE_X_BYTES / (K * 2) / LLMC_AMX_SPAN * LLMC_AMX_SPAN;
  rows = rows < LLMC_AMX_SPAN ? LLMC_AMX_SPAN : rows;
  return rows < M ? rows : M;
}

/* Unit u in task `task` (its own expansion scratch on the wide path). */
static void run_unit(const job* j, int64_t u, size_t task) {
#ifdef LLMC_X86
  if (j->wide) {
    unit_wide(j, u, j->expand + (int64_t)task * j->a->K * 32);
    return;
  }
  if (j->path == LLMC_Q4_VNNI) {
    unit_vnni(j, u);
    return;
  }
  if (j->path == LLMC_Q4_AVX2) {
    unit_avx2(j, u);
    return;
  }
#endif
  (void)task;
  unit_generic(j, u);
}

/* The end of a task: its thread's tiles handed back to the OS's lazy state. */
static void end_task(const job* j) {
#ifdef LLMC_X86
  if (j->wide) llmc_amx_release();
#else
  (void)j;
#endif
}

/* Takes part p's next unit from its front (or, back = 1, its back); -1 when none is left. */
static int64_t take(part* p, int back) {
  uint64_t r = __atomic_load_n(&p->range, __ATOMIC_RELAXED);
  for (;;) {
    uint32_t front = (uint32_t)r, end = (uint32_t)(r >> 32);
    if (front >= end) return -1;
    uint64_t next = back ? r - ((uint64_t)1 << 32) : r + 1;
    if (__atomic_compare_exchange_n(&p->range, &r, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
      return back ? (int64_t)end - 1 : (int64_t)front;
  }
}

/* A task streams one contiguous part of W (as the hardware prefetchers like it: measured 10-15 % more bandwidth at
 * one row than units claimed one at a time, which interleave the threads' reads): its pool thread's own, which that
 * thread's idle time read ahead (ahead.h), else part `task`. Then it helps with the others' from their ends: two
 * cores of a VM stream at different speeds (measured: the faster one waited ~3.5 us of a 20 us layer for the
 * other), and a worker may join a call late. */
static void run_part(void* data, size_t task) {
  job* j = (job*)data;
  int64_t own = llmc_ahead_own_part(task, j->parts);
  for (int64_t u; (u = take(&j->part[own], 0)) >= 0;) run_unit(j, u, task);
  for (int64_t i = 1; i < j->parts; i++)
    for (int64_t u; (u = take(&j->part[(own + i) % j->parts], 1)) >= 0;) run_unit(j, u, task);
  end_task(j);
}

/* Without the thread count: tasks claim units until none are left. */
static void run_units(void* data, size_t task) {
  job* j = (job*)data;
  for (;;) {
    int64_t u = (int64_t)__atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    if (u >= j->units) break;
    run_unit(j, u, task);
  }
  end_task(j);
}

/* ---------------------------------------------------------------- the second level within a window */

/* Row m's tile t at two levels (j: levels 2, xsum the two levels' block sums) over the one-level values in y, plus
 * the bias: act_bits 16's bits for that tile (a row's tile takes the same operations whatever the rows and tiles
 * around it in a pass). */
#ifdef LLMC_X86
static TARGET void window_tile_vnni(const job* j, int64_t m, int64_t t, float* buf) {
  if (j->bits == 8)
    tiles_vnni(j, m, t, 0, buf, 1, 1, 2, 8);
  else
    tiles_vnni(j, m, t, 0, buf, 1, 1, 2, 4);
}
static TARGET2 void window_tile_avx2(const job* j, int64_t m, int64_t t, float* buf) {
  if (j->bits == 8)
    tiles_avx2(j, m, t, buf, 1, 1, 2, 8);
  else
    tiles_avx2(j, m, t, buf, 1, 1, 2, 4);
}
#endif

static void window_tile(const job* j, int64_t m, int64_t t) {
  float buf[UNIT_COLS] = {0};
#ifdef LLMC_X86
  if (j->path == LLMC_Q4_VNNI)
    window_tile_vnni(j, m, t, buf);
  else if (j->path == LLMC_Q4_AVX2)
    window_tile_avx2(j, m, t, buf);
  else
#endif
    tile_generic(j, m, t, 2, buf);
  const llmc_q4_args* a = j->a;
  int64_t n0 = t * LLMC_Q4_TILE, cols = a->N - n0 < LLMC_Q4_TILE ? a->N - n0 : LLMC_Q4_TILE;
  for (int64_t c = 0; c < cols; c++) a->y[m * a->N + n0 + c] = buf[c] + (a->bias ? a->bias[n0 + c] : 0.f);
}

/* Row y [N]'s tiles holding a value >= its largest (NaNs skipped) minus `window`, into hits; returns their count. */
static int64_t hit_tiles(const float* y, int64_t N, float window, int32_t* hits) {
  float top = -INFINITY;
  for (int64_t i = 0; i < N; i++) top = y[i] > top ? y[i] : top;
  float floor = top - window;
  int64_t count = 0;
  for (int64_t n0 = 0; n0 < N; n0 += LLMC_Q4_TILE) {
    int hit = 0;
    for (int64_t c = n0; c < N && c < n0 + LLMC_Q4_TILE; c++) hit |= y[c] >= floor;
    if (hit) hits[count++] = (int32_t)(n0 / LLMC_Q4_TILE);
  }
  return count;
}

#ifdef LLMC_X86
/* hit_tiles in AVX-512 registers (the order of a max does not change it; vmaxps keeps its second operand where the
 * first is NaN, as the C's comparison does). */
__attribute__((target("avx512f"))) static int64_t hit_tiles512(const float* y, int64_t N, float window,
                                                               int32_t* hits) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t full = N / LLMC_Q4_TILE * LLMC_Q4_TILE;
  __mmask16 tail = (__mmask16)((1u << (N - full)) - 1);
  for (int64_t i = 0; i < full; i += 16) mx = _mm512_max_ps(_mm512_loadu_ps(y + i), mx);
  if (tail) mx = _mm512_mask_max_ps(mx, tail, _mm512_maskz_loadu_ps(tail, y + full), mx);
  __m512 floor = _mm512_set1_ps(_mm512_reduce_max_ps(mx) - window);
  int64_t count = 0;
  for (int64_t i = 0; i < full; i += 16)
    if (_mm512_cmp_ps_mask(_mm512_loadu_ps(y + i), floor, _CMP_GE_OQ)) hits[count++] = (int32_t)(i / 16);
  if (tail && _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, y + full), floor, _CMP_GE_OQ))
    hits[count++] = (int32_t)(full / 16);
  return count;
}
#endif

typedef struct {
  const job* j; /* levels 2 */
  int32_t* hits; /* [M][tiles] */
} window_job;

/* Task m: row m's tiles holding a one-level value within the window of its largest, again at two levels. */
static void window_row(void* data, size_t task) {
  const window_job* w = (const window_job*)data;
  const llmc_q4_args* a = w->j->a;
  int64_t m = (int64_t)task, tiles = (a->N + LLMC_Q4_TILE - 1) / LLMC_Q4_TILE;
  int32_t* hits = w->hits + m * tiles;
  int64_t count;
#ifdef LLMC_X86
  if (w->j->path == LLMC_Q4_VNNI)
    count = hit_tiles512(a->y + m * a->N, a->N, a->window, hits);
  else
#endif
    count = hit_tiles(a->y + m * a->N, a->N, a->window, hits);
  for (int64_t i = 0; i < count; i++) window_tile(w->j, m, hits[i]);
}

const char* llmc_q4_matmul(const llmc_q4_args* a, llmc_parallel_fn parallel, void* parallel_ctx) {
  static _Thread_local char msg[160];
  if (a->K <= 0 || a->K % LLMC_Q4_BLOCK || a->N <= 0 || (a->gated && a->N % (2 * LLMC_Q4_TILE))) {
    snprintf(msg, sizeof msg, "K %lld must be a positive multiple of %d and N %lld positive%s", (long long)a->K,
             LLMC_Q4_BLOCK, (long long)a->N, a->gated ? " and a multiple of 32 (gated)" : "");
    return msg;
  }
  if (a->act_bits != 0 && a->act_bits != 8 && a->act_bits != 16) {
    snprintf(msg, sizeof msg, "act_bits %d must be 8 (int8 activations) or 16 (two int8 levels)", a->act_bits);
    return msg;
  }
  if (a->bits != 0 && a->bits != 4 && a->bits != 8 && a->bits != 2) {
    snprintf(msg, sizeof msg, "bits %d must be 4 or 8 (scale + min blocks) or 2 (a scale and min a column)", a->bits);
    return msg;
  }
  if (a->bits == 2 && a->window > 0.f) {
    snprintf(msg, sizeof msg, "window %g applies to 4- and 8-bit weights, not 2-bit ones", (double)a->window);
    return msg;
  }
  if (!(a->window >= 0.f) || isinf(a->window)) {
    snprintf(msg, sizeof msg, "window %g must be a finite margin >= 0 (0: off)", (double)a->window);
    return msg;
  }
  if (a->window > 0.f && (a->act_bits != 16 || a->gated)) {
    snprintf(msg, sizeof msg, "window %g applies to act_bits 16 without a gate (got act_bits %d, gated %d)",
             (double)a->window, a->act_bits, a->gated);
    return msg;
  }
  if (a->act_rows != 0 && (a->act_rows != 1 || a->act_bits == 16)) {
    snprintf(msg, sizeof msg, "act_rows %d must be 0 (a grid per block) or 1 (a grid per row, act_bits 8; got %d)",
             a->act_rows, a->act_bits);
    return msg;
  }
  if (a->M <= 0) return NULL;
  int levels = a->act_bits == 16 ? 2 : 1, bits = a->bits == 8 || a->bits == 2 ? a->bits : 4, path = dot_path();
  int wide = path == LLMC_Q4_VNNI && !a->int8_prompts && !a->act_rows && bits != 2 && a->M >= LLMC_Q4_WIDE_ROWS &&
             tiles_allowed();
  int windowed = levels == 2 && a->window > 0.f && !wide && a->M >= LLMC_Q4_WINDOW_ROWS;
  int64_t blocks = a->K / LLMC_Q4_BLOCK;
  int64_t pairs = (a->N + UNIT_COLS - 1) / UNIT_COLS, row_block = wide ? wide_row_block(a->M, a->K) : a->M;
  int64_t units = pairs * ((a->M + row_block - 1) / row_block);
  int64_t parts = parallel && a->threads > 1 && units >= 2 && units <= (int64_t)UINT32_MAX /* part.range */
                      ? (a->threads < units ? a->threads : units) : 0;
  part* part_of = NULL;
  if (parts && posix_memalign((void**)&part_of, sizeof(part), sizeof(part) * (size_t)parts))
    return "out of memory for the work split";
  /* int8: [levels] xscale, xsum, [levels] xq; wide: xb with LLMC_AMX_SPAN spare rows (zeroed: read by the
   * last span's A tiles, their products dropped), then one unit's expanded weights per task (64-byte aligned) */
  int64_t tasks = parts ? parts : parallel && units >= 2 && a->threads != 1 ? POOL_TASKS : 1;
  size_t xb_bytes = (size_t)((a->M + LLMC_AMX_SPAN) * a->K) * sizeof(uint16_t);
  size_t expand_bytes = (size_t)a->K * 32 * sizeof(uint16_t);
  size_t bytes = wide ? xb_bytes + 64 + (size_t)tasks * expand_bytes
                      : (size_t)levels * ((size_t)(a->M * a->K) + sizeof(float) * (size_t)(a->M * blocks)) +
                            sizeof(float) * (size_t)(a->M * blocks) + (a->act_rows ? sizeof(float) * (size_t)a->M : 0) +
                            (bits == 2 ? sizeof(float) * (size_t)a->M : 0);
  int64_t tiles = (a->N + LLMC_Q4_TILE - 1) / LLMC_Q4_TILE;
  if (windowed) /* the first level's block sums, then each row's tiles in its window */
    bytes += sizeof(float) * (size_t)(a->M * blocks) + sizeof(int32_t) * (size_t)(a->M * tiles);
  void* scratch = malloc(bytes);
  if (!scratch) {
    free(part_of);
    return "out of memory for the quantized activations";
  }
  int64_t tile_bytes = bits == 8 ? LLMC_Q8_TILE_BYTES : bits == 2 ? LLMC_Q2_TILE_BYTES : LLMC_Q4_TILE_BYTES;
  int64_t unit_bytes = (blocks + (bits == 2)) * 2 * tile_bytes; /* a tile pair's (bits 2: with its grid's row) */
  job j = {.a = a, .units = units, .blocks = blocks, .pairs = pairs, .row_block = row_block, .bits = bits,
           .tile_bytes = tile_bytes, .levels = levels, .path = path, .wide = wide, .parts = parts, .part = part_of};
  job j2; /* windowed: the second pass, at two levels over the tiles in each row's window */
  window_job wj = {0};
#ifdef LLMC_X86
  j.prefetch = path != LLMC_Q4_PORTABLE && !wide ? llmc_prefetch_mode() : LLMC_PREFETCH_L1;
  /* a prompt's row blocks after the first read a unit's weights from cache: one distance (on the EPYC VM, SmolLM2's
   * 121 products at 128 rows in a C loop, five alternating runs: 112-134 ms with one, 111-138 with three, medians
   * 116 and 134; a decode step's products streamed faster with three: prefetch.h) */
  if (j.prefetch == LLMC_PREFETCH_L2X3 && a->M > ROWS) j.prefetch = LLMC_PREFETCH_L2;
  j.ahead = j.prefetch == LLMC_PREFETCH_L2X3 ? PREFETCH_BYTES_L2X3
                                              : (j.prefetch ? PREFETCH_BLOCKS_L2 : PREFETCH_BLOCKS) * 2 * tile_bytes;
#endif
  if (wide) {
#ifdef LLMC_X86
    uint16_t* xb = (uint16_t*)scratch;
    j.xb = xb;
    llmc_bf16_round(a->x, a->M * a->K, xb, NULL);
    memset(xb + a->M * a->K, 0, sizeof(uint16_t) * (size_t)(LLMC_AMX_SPAN * a->K));
    uintptr_t e = (uintptr_t)((char*)scratch + xb_bytes);
    j.expand = (uint16_t*)((e + 63) & ~(uintptr_t)63);
#endif
  } else {
    float* xscale = (float*)scratch;
    float* xsum = xscale + levels * a->M * blocks;
    int8_t* xq = (int8_t*)(xsum + a->M * blocks);
    float* xsum1 = windowed ? (float*)(xq + levels * a->M * a->K) : NULL;
    float* row_amax = a->act_rows ? (float*)(xq + levels * a->M * a->K) : NULL; /* (never windowed: act_bits 8) */
    quantize_rows(a, levels, path, xq, xscale, xsum, xsum1, row_amax, parallel, parallel_ctx);
    if (bits == 2) { /* (never windowed) */
      float* xrow = (float*)(xq + levels * a->M * a->K) + (a->act_rows ? a->M : 0);
      for (int64_t m = 0; m < a->M; m++) {
        float total = 0.f;
        for (int64_t b = 0; b < blocks; b++) total += xsum[m * blocks + b];
        xrow[m] = total;
      }
      j.xrow = xrow;
    }
    j.xq = xq, j.xscale = xscale, j.xsum = windowed ? xsum1 : xsum;
    if (windowed) { /* every tile at the first level first: act_bits 8's values */
      j.levels = 1;
      j2 = j;
      j2.levels = 2, j2.xsum = xsum, j2.parts = 0, j2.part = NULL;
#ifdef LLMC_X86
      j2.prefetch = LLMC_PREFETCH_L2, j2.ahead = PREFETCH_BLOCKS * 2 * tile_bytes; /* the tile's own next blocks */
#endif
      wj.j = &j2, wj.hits = (int32_t*)(xsum1 + a->M * blocks);
    }
  }
  if (parts) {
    for (int64_t p = 0; p < parts; p++) { /* contiguous parts as equal as units allow */
      uint64_t front = (uint64_t)(units * p / parts), back = (uint64_t)(units * (p + 1) / parts);
      part_of[p].range = front | back << 32;
    }
    if (!wide) llmc_ahead_before(a->w, unit_bytes, units, parts);
    parallel(parallel_ctx, run_part, (size_t)parts, &j);
  } else if (!parallel || units < 2 || a->threads == 1) {
    for (int64_t u = 0; u < units; u++) run_unit(&j, u, 0);
    end_task(&j);
  } else {
    parallel(parallel_ctx, run_units, units < POOL_TASKS ? (size_t)units : POOL_TASKS, &j);
  }
  if (windowed && parallel && a->threads != 1)
    parallel(parallel_ctx, window_row, (size_t)a->M, &wj);
  else
    for (int64_t m = 0; windowed && m < a->M; m++) window_row(&wj, (size_t)m);
  free(part_of);
  free(scratch);
  return NULL;
}
