/* Grouped-query attention over an in-place KV cache (see attention_kernel.h for the contract).
 *
 * Why it exists: ONNX Runtime's CPU GroupQueryAttention runs one small SGEMM per (row, query head) and packs that
 * head's K and V for each, so every KV head is read G times and packed as often. Here one work unit reads each
 * cached key and value once for all G query heads of its KV head (scores, online softmax, weighted sum), and a
 * long decode row is split along its keys so both cores stream it (the partial results are merged at the end). A
 * prompt's positions go in blocks (up to 16 query vectors: 5 positions x 3 heads for SmolLM2), each key row loaded
 * and widened once for the whole block and each value row once per 8 vectors, each vector masked to its own keys:
 * 30 layers of SmolLM2 attention over a 128 / 512 / 2,048-token prompt, 2 threads, 14.2 / 167-180 / 2,227-2,624 ms
 * one position at a time, 9.0-10.6 / 112-143 / 1,437-1,539 in blocks.
 * With a local window, a row reads only the keys in its window (and a long decode row's split covers that span).
 * With key_tiles (fp32 / fp16 caches) the keys of each 16 positions sit in the cache as [D][16], so a decode row
 * scores 16 keys per FMA with nothing to reduce across lanes and a prompt's packed keys are its groups widened.
 * An fp16 cache halves the bytes read; keys and values are widened to fp32 as they are loaded, and the arithmetic
 * is fp32, except for a prompt's over an fp16 or int8 cache where the CPU grants AMX-BF16 tiles: there each row's
 * keys and values are packed once per call into the tiles' layout as bf16 hi + lo (x ~ hi + lo to ~16 bits), and
 * a block's scores and weighted sums are tile products of hi.hi + lo.hi + hi.lo (~2^-17 of each product, under the
 * cache's own rounding); the softmax stays fp32. 30 layers of SmolLM2 over a 2,048-token prompt, 2 threads:
 * 1,350-1,510 ms in blocks on AVX-512, 905-1,100 on the tiles.
 *
 * Two code paths: AVX-512 (chosen at run time when the CPU has it) and portable C.
 */
#include "attention_kernel.h"

#include "amx_bf16.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(LLMC_PORTABLE_ONLY) /* the portable C alone elsewhere */
#define LLMC_X86 1
#include <immintrin.h>

#include "prefetch.h"
#include "vec_math.h"
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 128      /* keys scored, softmaxed and summed at a time (the scores stay in L1) */
#define SPLIT_KEYS 256 /* a one-token row with more cached keys than this is split into units of about this many */
#define MAX_SPLIT 16
#define MAX_GD 8192    /* G * D: the per-unit query and accumulator rows live on the stack */
#define MAX_VECTORS 16 /* query vectors a unit scores per key (a block of prompt rows' heads: see run_unit) */
#define POOL_TASKS 16 /* tasks handed to the thread pool per call, each claiming units until none are left */
#define FOLD_ROWS 64   /* int8 cache: groups x vectors up to which the value rows' scales go into the weights */
#define TILE_MAX_D 256 /* prompts' scores on AMX tiles: head sizes up to this (multiples of 32) */
#define TILE_MAX_BYTES ((size_t)256 << 20) /* ... and a call's packed keys and values up to this */
#define PV_WINDOWS (CHUNK / 32 + 1) /* windows of 32 keys a chunk overlaps */
#define TILE_MIN_ROWS 32 /* ... and prompts (or chunks of one) of at least this many positions */
#define K16_MAX_D 128   /* prompts' scores from keys packed 16 at a time (no AMX tiles): head sizes up to this */

typedef struct {
  const llmc_attention_args* a;
  int G, W, nsplit, split_len, avx512;
  int Gall, nchunk; /* a KV head's query heads, and the units they are split into, G (the last: the rest) each */
  int qb;   /* query positions per unit: 1, or a block of a prompt's (their G heads scored together per key) */
  int f16c; /* the CPU converts to fp16 (F16C) */
  int l2;   /* the keys' prefetches go to L2, not L1 (prefetch.h) */
  float* part; /* nsplit > 1: per (b, i, head, split) m, l, acc[D] */
  uint16_t* kt;   /* a prompt on AMX-BF16 tiles: every (row, KV head)'s keys packed (pack_keys), else NULL */
  uint16_t* vt;   /* ... and its values (pack_values) */
  size_t* kt_off; /* [B * Hkv]: where (b, h)'s packed keys start in kt, and its values in vt (or in k16) */
  float* k16;     /* a prompt on AVX-512 without the tiles: every (row, KV head)'s keys packed (pack_keys16) */
  size_t units;
  size_t next; /* the next unit to claim (atomic) */
} job;

static inline int new_of(const llmc_attention_args* a, int b) {
  return a->first_prompt ? a->seqlens[b] + 1 : a->new_lens ? a->new_lens[b] : a->S;
}
static inline int past_of(const llmc_attention_args* a, int b) {
  return a->first_prompt ? 0 : a->seqlens[b] + 1 - new_of(a, b);
}

/* ---------------------------------------------------------------- portable C */

/* A cache row: D fp32, D fp16, or D int8 followed by one fp16 scale per group of LLMC_KV_I8_GROUP values
 * (x = scale * q, scale = max |x| / 127 over the group). */
static inline int groups(int D) { return (D + LLMC_KV_I8_GROUP - 1) / LLMC_KV_I8_GROUP; }
static inline size_t row_bytes(int kind, int D) {
  return kind == LLMC_KV_F32 ? 4 * (size_t)D : kind == LLMC_KV_F16 ? 2 * (size_t)D : (size_t)(D + 2 * groups(D));
}
static inline float group_scale(const char* row, int D, int d) {
  _Float16 s;
  memcpy(&s, row + D + 2 * (d / LLMC_KV_I8_GROUP), 2);
  return (float)s;
}
static inline float load1(const char* row, int d, int kind, int D) {
  if (kind == LLMC_KV_F16) return (float)((const _Float16*)row)[d];
  if (kind == LLMC_KV_I8) return (float)((const int8_t*)row)[d] * group_scale(row, D, d);
  return ((const float*)row)[d];
}

/* Where one row's keys (or values) of one KV head live: contiguous rows (table NULL) or the blocks of a pool. */
typedef struct {
  const char* base;      /* slot layout: the head's first row; paged: the pool + head * block_size rows */
  const int32_t* table;  /* paged: the row's block table */
  size_t rb, block_step; /* bytes per cache row; paged: per block (Hkv * block_size rows) */
  int shift, mask;       /* paged: block_size = 1 << shift */
  int tiles;             /* keys of a key_tiles cache: row_at(t) of a multiple of 16 is its group [D][16] */
} rows_t;

static inline const char* row_at(const rows_t* r, int t) {
  if (!r->table) return r->base + (size_t)t * r->rb;
  return r->base + (size_t)r->table[t >> r->shift] * r->block_step + (size_t)(t & r->mask) * r->rb;
}

#define TILE_MASK (LLMC_KEY_TILE - 1)
/* Key t of a cache of `kind` (fp32 or fp16 with tiles) in fp32, whichever layout holds it. */
static void key_row(const rows_t* K, int t, int kind, int D, float* out) {
  if (!K->tiles) {
    const char* row = row_at(K, t);
    for (int d = 0; d < D; d++) out[d] = load1(row, d, kind, D);
    return;
  }
  const char* g = row_at(K, t & ~TILE_MASK);
  size_t r = (size_t)(t & TILE_MASK);
  for (int d = 0; d < D; d++)
    out[d] = kind == LLMC_KV_F16 ? (float)((const _Float16*)g)[(size_t)d * LLMC_KEY_TILE + r]
                                 : ((const float*)g)[(size_t)d * LLMC_KEY_TILE + r];
}

static inline float flushed_exp(float x) { return x < -80.f ? 0.f : expf(x); } /* see llmc_exp512 */

/* y = x * mul with the first 2R dims rotated at position pos (pairs (d, d + R), d < R; R = 0 or no table: none). */
static void rotate(const float* x, float* y, const float* cos, const float* sin, int pos, int D, int R, float mul) {
  int r = cos ? R : 0;
  if (r) {
    const float* c = cos + (size_t)pos * r;
    const float* s = sin + (size_t)pos * r;
    for (int d = 0; d < r; d++) {
      float x1 = x[d], x2 = x[d + r];
      y[d] = (x1 * c[d] - x2 * s[d]) * mul;
      y[d + r] = (x2 * c[d] + x1 * s[d]) * mul;
    }
  }
  for (int d = 2 * r; d < D; d++) y[d] = x[d] * mul;
}

/* Gemma 2's logit softcap over a chunk's n scores: s = cap * tanh(s / cap). Kept out of line (as the AVX-512 one):
 * without a softcap the loops below only test cap once per chunk and query head. */
static __attribute__((noinline)) void cap_scores(float* s, int n, float cap) {
  float inv = 1.f / cap;
  for (int t = 0; t < n; t++) s[t] = cap * tanhf(s[t] * inv);
}

/* Keys [t0, t1) of one KV head for G query heads q[G][D]: online softmax; m[G], l[G], acc[G][D] out. */
static void attend_generic(const float* q, const rows_t* K, const rows_t* V, int kind, int G, int D, int t0, int t1,
                           float softcap, float* m, float* l, float* acc) {
  float s[CHUNK * 64], key[1024];
  for (int g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.f;
  memset(acc, 0, sizeof(float) * G * D);
  for (int c0 = t0; c0 < t1; c0 += CHUNK) {
    int n = t1 - c0 < CHUNK ? t1 - c0 : CHUNK;
    for (int t = 0; t < n; t++) {
      key_row(K, c0 + t, kind, D, key);
      for (int g = 0; g < G; g++) {
        float dot = 0.f;
        for (int d = 0; d < D; d++) dot += q[g * D + d] * key[d];
        s[g * CHUNK + t] = dot;
      }
    }
    for (int g = 0; g < G; g++) {
      if (softcap > 0.f) cap_scores(s + g * CHUNK, n, softcap);
      float mx = m[g];
      for (int t = 0; t < n; t++) mx = s[g * CHUNK + t] > mx ? s[g * CHUNK + t] : mx;
      float corr = flushed_exp(m[g] - mx), sum = 0.f;
      for (int t = 0; t < n; t++) sum += (s[g * CHUNK + t] = flushed_exp(s[g * CHUNK + t] - mx));
      l[g] = l[g] * corr + sum;
      m[g] = mx;
      for (int d = 0; d < D; d++) acc[g * D + d] *= corr;
    }
    for (int t = 0; t < n; t++)
      for (int g = 0; g < G; g++) {
        const char* row = row_at(V, c0 + t);
        float p = s[g * CHUNK + t];
        for (int d = 0; d < D; d++) acc[g * D + d] += p * load1(row, d, kind, D);
      }
  }
}

/* ---------------------------------------------------------------- AVX-512 */
#ifdef LLMC_X86

#define AVX512 __attribute__((target("avx512f,f16c")))

/* group_scale with the F16C conversion (the portable one is a library call per scale). */
AVX512 static inline float group_scale_f16c(const char* row, int D, int d) {
  unsigned short h;
  memcpy(&h, row + D + 2 * (d / LLMC_KV_I8_GROUP), 2);
  return _cvtsh_ss(h);
}

/* Elements j .. j + 15 of a cache row (D values), as fp32. */
AVX512 static inline __m512 load16(const char* row, int j, int kind, int D) {
  if (kind == LLMC_KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(row + 2 * j)));
  if (kind == LLMC_KV_I8)
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + j)))),
                         _mm512_set1_ps(group_scale_f16c(row, D, j)));
  return _mm512_loadu_ps((const float*)row + j);
}

/* 16 dims from d at y + d * stride, masked (stride > 1: a scatter). A whole 16 is stored unmasked: loads of what a
 * masked store wrote wait for it to reach the cache (no store forwarding), and the rotated vectors are read at once
 * (a decode row's scores, the cache row's conversion). */
AVX512 static inline void put16(float* y, int d, size_t stride, __mmask16 k, __m512 v) {
  if (stride == 1) {
    if (k == (__mmask16)0xffff)
      _mm512_storeu_ps(y + d, v);
    else
      _mm512_mask_storeu_ps(y + d, k, v);
    return;
  }
  __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                  _mm512_set1_epi32((int)stride));
  _mm512_mask_i32scatter_ps(y + (size_t)d * stride, k, at, v, 4);
}

/* rotate() 16 dims at a time, the same bits: each product, difference, sum and scaling rounded on its own as the
 * scalar code does (the empty asm statements keep the compiler from fusing a product into the next add; a test
 * holds the two paths' rotated keys to the same bits). y[d * stride]: stride > 1 writes the vector as a column of a
 * [D][stride] matrix (a prompt's packed-key scores take their vectors so for head sizes other than 64 and 128). */
#define NO_FUSE(v) __asm__("" : "+v"(v))
AVX512 static void rotate512(const float* x, float* y, const float* cos, const float* sin, int pos, int D, int R,
                             float mul, size_t stride) {
  int r = cos ? R : 0;
  __m512 vm = _mm512_set1_ps(mul);
  if (r) {
    const float* c = cos + (size_t)pos * r;
    const float* s = sin + (size_t)pos * r;
    for (int d = 0; d < r; d += 16) {
      __mmask16 k = r - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (r - d)) - 1);
      __m512 x1 = _mm512_maskz_loadu_ps(k, x + d), x2 = _mm512_maskz_loadu_ps(k, x + d + r);
      __m512 vc = _mm512_maskz_loadu_ps(k, c + d), vs = _mm512_maskz_loadu_ps(k, s + d);
      __m512 a = _mm512_mul_ps(x1, vc), b = _mm512_mul_ps(x2, vs), a2 = _mm512_mul_ps(x2, vc),
             b2 = _mm512_mul_ps(x1, vs);
      NO_FUSE(a);
      NO_FUSE(b);
      NO_FUSE(a2);
      NO_FUSE(b2);
      put16(y, d, stride, k, _mm512_mul_ps(_mm512_sub_ps(a, b), vm));
      put16(y, d + r, stride, k, _mm512_mul_ps(_mm512_add_ps(a2, b2), vm));
    }
  }
  for (int d = 2 * r; d < D; d += 16) {
    __mmask16 k = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1);
    put16(y, d, stride, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + d), vm));
  }
}
#undef NO_FUSE

/* Gemma 2's softcap over a chunk's n scores, 16 at a time: cap * tanh(x), x = s / cap, with
 * tanh |x| = (1 - e) / (1 + e), e = exp(-2 |x|) (an absolute error of about 1e-7 of cap, nothing to a softmax).
 * The scalar tanhf pass took 0.8 of the 1.1 ms a 4096-key decode row over 16 heads takes without it. */
AVX512 static __attribute__((noinline)) void cap_scores512(float* s, int n, float cap) {
  __m512 vcap = _mm512_set1_ps(cap), vinv = _mm512_set1_ps(-2.f / cap), one = _mm512_set1_ps(1.f);
  __m512i sign = _mm512_set1_epi32((int)0x80000000u);
  for (int t = 0; t < n; t += 16) {
    __mmask16 k = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
    __m512 x = _mm512_maskz_loadu_ps(k, s + t);
    __m512i sx = _mm512_and_si512(_mm512_castps_si512(x), sign);
    __m512 e = llmc_exp512(_mm512_mul_ps(_mm512_abs_ps(x), vinv)); /* exp(-2 |s| / cap) */
    __m512 th = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    th = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th), sx));
    _mm512_mask_storeu_ps(s + t, k, _mm512_mul_ps(vcap, th));
  }
}

/* One core keeps too few cache misses in flight to stream the cache at the memory's speed: keys are prefetched
 * this many rows ahead, and each key's value row while the key is scored (in paged memory a chunk's values sit in
 * blocks of 16 rows scattered over the pool, where the hardware prefetcher loses the stream at every block: one
 * decode row over 2,048 cached tokens, 30 layers, 2 cores: 6.0 -> 5.6 ms). Both go to L2 unless prefetch.h is told
 * otherwise (the keys: SmolLM2 int4 at batch 1 over 2,048 tokens 91.9 -> 106.9 tok/s on the EPYC VM). The values
 * went to L1 until 2026-12-04: a chunk's 16 KB of them, prefetched while its 16 KB of keys streamed through the
 * same 32 KB L1, held its miss buffers and were partly evicted before their sums; in L2 the kernel alone (one
 * decode row, SmolLM2's 30 layers over 2,048 fp16 keys in paged blocks, 2 threads, 3.3 MB streamed between
 * layers) 3.0-4.0 -> 2.2-2.8 ms, alternating builds (docs/performance_notes.md). A prefetch past the buffer's end is
 * harmless (it never faults). prefetch_row must be inlined: a helper that only prefetches has no effect GCC
 * keeps, and where attend_avx512 outgrew the inliner's limit, GCC deleted its calls (this kernel then ran with no
 * prefetch at all: one decode row over 2,048 fp16 keys, one thread, 225 -> 160 us a layer with them back;
 * tests/engines/test_kernel_prefetches.py reads the library for them). */
#define PREFETCH_ROWS 32
static inline __attribute__((always_inline)) void prefetch_row(const char* row, size_t bytes, int l2) { /* l2: into L2 (prefetch.h), else L1 */
  for (size_t b = 0; b < bytes; b += 64) llmc_prefetch(row + b, l2);
}

/* r[t] = the sum of v[t]'s 16 lanes, t < 16: a butterfly of lane-block shuffles and adds (46 instructions for the
 * 16 sums, where 16 separate reductions take about 130 and serialize on their latency). After the four levels lane
 * 4k + p holds v[4p + k]'s sum; the last permutation puts each sum at its t. */
AVX512 static inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; i++) /* 128-bit blocks 0-1: v[2i]'s halves summed; 2-3: v[2i+1]'s */
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++) /* block k: 4 partial sums of v[4i + k] */
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++) /* block k: 2 partials of v[8i + k], then 2 of v[8i + 4 + k] */
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}

/* acc[g][:] += sum over the chunk's n keys of p[g][t] * V[c0 + t][:], CB column blocks of 16 of V at a time so the
 * G x CB accumulators of those blocks stay in registers (G and CB constants in each expansion). Each accumulator
 * adds its keys in order, whatever CB is (the same bits), but a pass carries G x CB independent FMA chains: one
 * column block at a time, a decode row's 3 query heads a KV head (SmolLM2) were 3 chains of 4-cycle FMAs, and the
 * value pass took 32 % of the attention's samples at 8 rows over 200 cached keys. pstep > 0 (an int8 cache): the
 * weights of the dims in group k are at p + k pstep, already times each row's scale of that group, and the int8
 * values are widened unscaled (where each 16 values took a scalar load, conversion, broadcast and multiply of
 * their scale: one decode row over 2,048 cached tokens, 2 cores, 106 -> 98 us a layer, medians of 6). */
AVX512 static inline __attribute__((always_inline)) void sum_cols(const float* p, size_t pstep,
                                                                   const char* const* vrow, int kind, int D, int n,
                                                                   float* acc, int j, const int G, const int CB) {
  __m512 a[4][MAX_VECTORS];
  const float* pj[4];
  for (int c = 0; c < CB; c++) {
    pj[c] = pstep ? p + (size_t)((j + 16 * c) / LLMC_KV_I8_GROUP) * pstep : p;
    for (int g = 0; g < G; g++) a[c][g] = _mm512_loadu_ps(acc + g * D + j + 16 * c);
  }
  for (int t = 0; t < n; t++)
    for (int c = 0; c < CB; c++) {
      const char* row = vrow[t];
      int jc = j + 16 * c;
      __m512 vv = pstep ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + jc))))
                        : load16(row, jc, kind, D);
      for (int g = 0; g < G; g++) a[c][g] = _mm512_fmadd_ps(_mm512_set1_ps(pj[c][g * CHUNK + t]), vv, a[c][g]);
    }
  for (int c = 0; c < CB; c++)
    for (int g = 0; g < G; g++) _mm512_storeu_ps(acc + g * D + j + 16 * c, a[c][g]);
}

AVX512 static inline __attribute__((always_inline)) void sum_values(const float* p, size_t pstep,
                                                                     const char* const* vrow, int kind, int D, int n,
                                                                     float* acc, const int G) {
  const int CB = G <= 4 ? 4 : G <= 8 ? 2 : 1; /* up to 16 chains (and registers) of accumulators */
  int j = 0;
  for (; j + 16 * CB <= D; j += 16 * CB) sum_cols(p, pstep, vrow, kind, D, n, acc, j, G, CB);
  for (; j < D; j += 16) sum_cols(p, pstep, vrow, kind, D, n, acc, j, G, 1);
}

/* c[v * stride + 0..15] = the scores of 16 keys for NV query vectors, given transposed: qt[D][NV]:
 * keys packed [D][16] (pack_keys16), each packed row loaded once for the NV vectors, NV independent sums, none
 * reduced across lanes. The vectors' d-th elements sit side by side, so each FMA broadcasts its operand from a
 * constant offset of one pointer (from q[NV][D], the compiler spent an index computation, and with 16 vectors
 * reloads of spilled offsets, on every FMA: 48 % of attend_avx512's samples in a 2,048-token prefill). */
AVX512 static inline __attribute__((always_inline)) void scores16(const float* qt, int D, const float* kg, float* c,
                                                                   size_t stride, const int NV) {
  __m512 a[16];
  for (int v = 0; v < NV; v++) a[v] = _mm512_setzero_ps();
  for (int d = 0; d < D; d++, qt += NV, kg += 16) {
    __m512 k = _mm512_load_ps(kg);
    for (int v = 0; v < NV; v++) a[v] = _mm512_fmadd_ps(_mm512_set1_ps(qt[v]), k, a[v]);
  }
  for (int v = 0; v < NV; v++) _mm512_storeu_ps(c + v * stride, a[v]);
}

/* scores16 from the vectors as rows, q[NV][QD], for a head size QD known when compiled (64, 128): the operands sit
 * at constant offsets (v QD) from one pointer as in the columns' form, and the vectors need no transposing. With
 * the rotation on AVX-512 (rotate512), a 128-token prompt's attention over SmolLM2's shapes (15 query vectors a
 * unit) went 395-439 -> 345-365 us a layer on one thread, 294-318 -> 267-288 on two, alternating (EPYC VM): the
 * scalar rotation and the transposing loop had been ~15 % of it. */
AVX512 static inline __attribute__((always_inline)) void scores16_rows(const float* q, const int QD, const float* kg,
                                                                        float* c, size_t stride, const int NV) {
  __m512 a[16];
  for (int v = 0; v < NV; v++) a[v] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int d = 0; d < QD; d++, q++, kg += 16) {
    __m512 k = _mm512_load_ps(kg);
    for (int v = 0; v < NV; v++) a[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v * QD]), k, a[v]);
  }
  for (int v = 0; v < NV; v++) _mm512_storeu_ps(c + v * stride, a[v]);
}

/* c[v * stride + 0..15] = the scores of the 16 keys of a key_tiles group kg ([QD][16] fp16 or fp32, as the cache
 * holds them) for NV query vectors q[NV][QD]: each dim of the 16 keys loaded and widened once for the NV vectors,
 * nothing reduced across lanes (the rows' loop spends ~9 of its ~55 operations a key and 3 vectors on hsum16 and
 * the stores and loads of its unreduced products). Up to 8 vectors take two sums each (even and odd dims): a
 * decode row's 3 vectors are then 6 chains of FMAs, not 3 waiting on their latency. */
AVX512 static inline __attribute__((always_inline)) void scores16_tiles(const float* q, const int QD, const char* kg,
                                                                         const int f16, float* c, size_t stride,
                                                                         const int NV) {
  __m512 a[16], e[8];
  const int two = NV <= 8;
  for (int v = 0; v < NV; v++) a[v] = _mm512_setzero_ps();
  for (int v = 0; two && v < NV; v++) e[v] = _mm512_setzero_ps();
#define TILE_DIM(d) (f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(kg + (size_t)(d) * 32))) \
                         : _mm512_loadu_ps((const float*)kg + (size_t)(d) * 16))
  if (two) {
    for (int d = 0; d < QD; d += 2) {
      __m512 k0 = TILE_DIM(d), k1 = TILE_DIM(d + 1);
      for (int v = 0; v < NV; v++) {
        a[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v * QD + d]), k0, a[v]);
        e[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v * QD + d + 1]), k1, e[v]);
      }
    }
    for (int v = 0; v < NV; v++) a[v] = _mm512_add_ps(a[v], e[v]);
  } else {
    for (int d = 0; d < QD; d++) {
      __m512 k = TILE_DIM(d);
      for (int v = 0; v < NV; v++) a[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v * QD + d]), k, a[v]);
    }
  }
#undef TILE_DIM
  for (int v = 0; v < NV; v++) _mm512_storeu_ps(c + v * stride, a[v]);
}

/* Keys [t0, t1) of one KV head for G query vectors q[G][D] (with packed keys k16 and a head size other than 64 and
 * 128: q[D][G], the vectors as columns, as run_unit rotates them) (a decode row's query heads, or a block of prompt
 * rows' heads: MAX_VECTORS at most), each seeing keys [lo[g], hi[g]) of them (lo NULL: all of them); online softmax;
 * m[G], l[G], acc[G][D] out. A chunk's keys outside a vector's range score -inf (weight 0). */
AVX512 static void attend_avx512(const float* q, const rows_t* K, const rows_t* V, int kind, int G, int D, int t0,
                                 int t1, const int* lo, const int* hi, float softcap, float* m, float* l,
                                 float* acc, const uint16_t* kt, const uint16_t* vt, const float* k16, int l2) {
  float s[CHUNK * 64] __attribute__((aligned(64)));
  float folded[CHUNK * FOLD_ROWS] __attribute__((aligned(64))); /* int8 cache: per group, the weights x its scales */
  __m512 xs[MAX_VECTORS * 16]; /* D = 64: per vector, the products of up to 16 keys before their reduction */
  const char *krow[CHUNK], *vrow[CHUNK]; /* the chunk's key and value rows (contiguous, or across its blocks) */
  int nv = D / 16;
  size_t rb = row_bytes(kind, D), kt_group = (size_t)(D / LLMC_AMX_K) * 2 * 512;
  for (int g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.f;
  memset(acc, 0, sizeof(float) * G * D);
  uint16_t qhl[2][MAX_VECTORS * TILE_MAX_D] __attribute__((aligned(64))); /* kt: the vectors' hi and lo, 0 past G */
  const uint16_t* qt[2] = {qhl[0], qhl[1]};
  if (kt) {
    for (int lv = 0; lv < 2; lv++) memset(qhl[lv] + G * D, 0, sizeof(uint16_t) * (size_t)(MAX_VECTORS - G) * D);
    llmc_bf16_round(q, (int64_t)G * D, qhl[0], qhl[1]);
    llmc_amx_configure();
  }
  int tiles = !kt && !k16 && K->tiles; /* (a prompt's keys packed, k16 or AMX's, come from the cache's groups) */
  if (!kt && !k16) /* the first key rows, which the loop's prefetches (PREFETCH_ROWS ahead of it) never reach */
    for (int t = tiles ? t0 & ~TILE_MASK : t0; t < t1 && t < t0 + PREFETCH_ROWS; t++) prefetch_row(row_at(K, t), rb, l2);
  for (int c0 = t0; c0 < t1; c0 += CHUNK) {
    int n = t1 - c0 < CHUNK ? t1 - c0 : CHUNK;
    for (int t = 0; !kt && t < n;) { /* a block's rows are contiguous: one table lookup per run of them, not per
                                      * row (a C harness, one decode row over 2,048 fp16 or int8 keys in blocks of
                                      * 64, one thread, the cache in L3: the kernel 6 % shorter) */
      int at = c0 + t, run = K->table ? K->mask + 1 - (at & K->mask) : n - t;
      run = run < n - t ? run : n - t;
      const char *kr = row_at(K, at), *vr = row_at(V, at);
      for (int i = 0; i < run; i++, t++, kr += rb, vr += rb) krow[t] = kr, vrow[t] = vr;
    }
    if (k16 || tiles) { /* the chunk's scores 16 keys at a time from a multiple of 16: a group inside the chunk
                         * straight into s, one across its edges through c */
      for (int kg = c0 / 16 * 16; kg < c0 + n; kg += 16) {
        float c[64 * 16] __attribute__((aligned(64)));
        int inside = kg >= c0 && kg + 16 <= c0 + n;
        float* dst = inside ? s + (kg - c0) : c;
        size_t stride = inside ? CHUNK : 16;
        if (tiles) {
          const char* tg = row_at(K, kg);
          int f16 = kind == LLMC_KV_F16;
          if (kg + PREFETCH_ROWS < t1 || !K->table) /* the group PREFETCH_ROWS keys on (a table only in range), */
            prefetch_row(row_at(K, kg + PREFETCH_ROWS), LLMC_KEY_TILE * rb, l2);
          for (int t = kg < c0 ? c0 : kg; t < kg + 16 && t < c0 + n; t++) /* and the group's value rows: all at
                                                                           * once (spread over the scores' steps, a
                                                                           * batch-8 step was ~1-2 % longer) */
            prefetch_row(vrow[t - c0], rb, l2);
          for (int v0 = 0; v0 < G; v0 += 16) { /* (G up to 64 on a decode row) */
            const float* qv = q + (size_t)v0 * D;
            float* dv = dst + v0 * stride;
#define TSCORES(NV)                                                        \
  case NV:                                                                 \
    if (D == 64) f16 ? scores16_tiles(qv, 64, tg, 1, dv, stride, NV) : scores16_tiles(qv, 64, tg, 0, dv, stride, NV); \
    else if (D == 128) f16 ? scores16_tiles(qv, 128, tg, 1, dv, stride, NV) : scores16_tiles(qv, 128, tg, 0, dv, stride, NV); \
    else scores16_tiles(qv, D, tg, f16, dv, stride, NV);                   \
    break;
            switch (G - v0) {
              TSCORES(1) TSCORES(2) TSCORES(3) TSCORES(4) TSCORES(5) TSCORES(6) TSCORES(7) TSCORES(8)
              TSCORES(9) TSCORES(10) TSCORES(11) TSCORES(12) TSCORES(13) TSCORES(14) TSCORES(15) default: TSCORES(16)
            }
#undef TSCORES
          }
        } else {
          const float* g0 = k16 + (size_t)(kg / 16) * D * 16;
#define SCORES(NV) \
  case NV:                                                \
    if (D == 64) scores16_rows(q, 64, g0, dst, stride, NV);   \
    else if (D == 128) scores16_rows(q, 128, g0, dst, stride, NV); \
    else scores16(q, D, g0, dst, stride, NV);                 \
    break;
          switch (G) {
            SCORES(1) SCORES(2) SCORES(3) SCORES(4) SCORES(5) SCORES(6) SCORES(7) SCORES(8)
            SCORES(9) SCORES(10) SCORES(11) SCORES(12) SCORES(13) SCORES(14) SCORES(15) default: SCORES(16)
          }
#undef SCORES
        }
        if (inside) continue;
        int from = kg > c0 ? kg : c0, to = kg + 16 < c0 + n ? kg + 16 : c0 + n;
        for (int g = 0; g < G; g++)
          memcpy(s + g * CHUNK + (from - c0), c + g * 16 + (from - kg), sizeof(float) * (size_t)(to - from));
      }
    }
    if (kt) { /* the chunk's scores on the tiles, 32 keys at a time from a multiple of 32 (vt: its values too) */
      for (int kp = c0 / 32 * 32; kp < c0 + n; kp += 32) {
        float c[MAX_VECTORS * 32] __attribute__((aligned(64)));
        const uint16_t* g0 = kt + (size_t)(kp / 16) * kt_group;
        llmc_amx_scores(qt, D, g0, g0 + kt_group, c);
        int from = kp > c0 ? kp : c0, to = kp + 32 < c0 + n ? kp + 32 : c0 + n;
        for (int g = 0; g < G; g++)
          memcpy(s + g * CHUNK + (from - c0), c + g * 32 + (from - kp), sizeof(float) * (size_t)(to - from));
      }
    }
    for (int t = 0; !kt && !k16 && !tiles && t < n; t++) {
      const char* row = krow[t];
      if (t + PREFETCH_ROWS < n) /* the chunk's own rows; past its end: the next chunk's (a table only in range) */
        prefetch_row(krow[t + PREFETCH_ROWS], rb, l2);
      else if (!K->table || c0 + t + PREFETCH_ROWS < t1)
        prefetch_row(row_at(K, c0 + t + PREFETCH_ROWS), rb, l2);
      prefetch_row(vrow[t], rb, l2); /* the key's value row, summed after the chunk's softmax */
      if (nv == 4 && G <= MAX_VECTORS) { /* D = 64: the key row in 4 registers, reused by every query vector;
                                          * each one's 16 unreduced products per 16 keys reduced together (hsum16) */
        __m512 k0 = load16(row, 0, kind, D), k1 = load16(row, 16, kind, D), k2 = load16(row, 32, kind, D),
               k3 = load16(row, 48, kind, D);
        for (int g = 0; g < G; g++) {
          const float* qg = q + g * 64;
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qg), k0);
          x = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), k1, x);
          x = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 32), k2, x);
          xs[g * 16 + (t & 15)] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 48), k3, x);
        }
        if ((t & 15) == 15 || t == n - 1) {
          int base = t & ~15, cnt = t - base + 1;
          __mmask16 keep = cnt == 16 ? (__mmask16)0xffff : (__mmask16)((1u << cnt) - 1);
          for (int g = 0; g < G; g++) {
            for (int z = cnt; z < 16; z++) xs[g * 16 + z] = _mm512_setzero_ps();
            _mm512_mask_storeu_ps(s + g * CHUNK + base, keep, hsum16(xs + g * 16));
          }
        }
      } else {
        for (int g = 0; g < G; g++) {
          __m512 x = _mm512_setzero_ps();
          for (int j = 0; j < nv; j++)
            x = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * j), load16(row, 16 * j, kind, D), x);
          s[g * CHUNK + t] = _mm512_reduce_add_ps(x);
        }
      }
    }
    for (int g = 0; g < G; g++) {
      float* sg = s + g * CHUNK;
      int a0 = lo ? lo[g] - c0 : 0, a1 = lo ? hi[g] - c0 : n; /* the vector's keys in the chunk */
      a0 = a0 < 0 ? 0 : a0, a1 = a1 > n ? n : a1;
      if (a0 >= a1) { /* none: the vector skips the chunk (weight 0 for the value sums) */
        memset(sg, 0, sizeof(float) * n);
        continue;
      }
      if (softcap > 0.f) cap_scores512(sg, n, softcap);
      for (int t = 0; t < a0; t++) sg[t] = -INFINITY; /* the others weigh 0 (after the softcap, which is finite) */
      for (int t = a1; t < n; t++) sg[t] = -INFINITY;
      __m512 vmax = _mm512_set1_ps(m[g]);
      int t = 0;
      for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sg + t));
      __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
      if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, sg + t));
      float mx = _mm512_reduce_max_ps(vmax);
      __m512 vm = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
      for (t = 0; t + 16 <= n; t += 16) {
        __m512 e = llmc_exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), vm));
        _mm512_storeu_ps(sg + t, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      if (tail) {
        __m512 e = llmc_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + t), vm));
        _mm512_mask_storeu_ps(sg + t, tail, e);
        vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
      }
      float corr = flushed_exp(m[g] - mx);
      l[g] = l[g] * corr + _mm512_reduce_add_ps(vsum);
      m[g] = mx;
      if (corr != 1.f) {
        __m512 vc = _mm512_set1_ps(corr);
        for (int j = 0; j < nv; j++)
          _mm512_storeu_ps(acc + g * D + 16 * j, _mm512_mul_ps(vc, _mm512_loadu_ps(acc + g * D + 16 * j)));
      }
    }
    if (vt) { /* the chunk's weighted sums on the tiles, per window of 32 keys from a multiple of 32 */
      /* each vector's weights from key 32 w0 on, 0 outside the chunk (and the vectors past G all 0) */
      int w0 = c0 / 32, nw = (c0 + n + 31) / 32 - w0, span = nw * 32;
      float row[PV_WINDOWS * 32] __attribute__((aligned(64)));
      uint16_t ph[2][MAX_VECTORS * PV_WINDOWS * 32] __attribute__((aligned(64)));
      float out[MAX_VECTORS * TILE_MAX_D] __attribute__((aligned(64)));
      memset(row, 0, sizeof row);
      for (int g = 0; g < G; g++) {
        memcpy(row + (c0 - 32 * w0), s + g * CHUNK, sizeof(float) * (size_t)n);
        llmc_bf16_round(row, span, ph[0] + g * span, ph[1] + g * span);
      }
      for (int lv = 0; lv < 2; lv++)
        memset(ph[lv] + G * span, 0, sizeof(uint16_t) * (size_t)((MAX_VECTORS - G) * span));
      const uint16_t* p[2] = {ph[0], ph[1]};
      llmc_amx_values(p, span * 2, nw, vt + (size_t)w0 * ((size_t)D / 16 * 2 * 512), (size_t)D / 16 * 2 * 512, D,
                      out);
      for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d += 16)
          _mm512_storeu_ps(acc + g * D + d, _mm512_add_ps(_mm512_loadu_ps(acc + g * D + d),
                                                          _mm512_load_ps(out + g * D + d)));
    } else if (G <= MAX_VECTORS) { /* every vector's accumulators in registers per pass over the chunk's values */
      const float* ps = s;
      size_t pstep = 0;
      if (kind == LLMC_KV_I8 && groups(D) * G <= FOLD_ROWS) { /* the weights times each value row's group scales */
        for (int k = 0; k < groups(D); k++) {
          float sv[CHUNK] __attribute__((aligned(64)));
          for (int t = 0; t < n; t++) sv[t] = group_scale_f16c(vrow[t], D, k * LLMC_KV_I8_GROUP);
          for (int g = 0; g < G; g++)
            for (int t = 0; t < n; t += 16) {
              __mmask16 keep = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
              _mm512_mask_storeu_ps(folded + (k * G + g) * CHUNK + t, keep,
                                    _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, s + g * CHUNK + t),
                                                  _mm512_maskz_loadu_ps(keep, sv + t)));
            }
        }
        ps = folded, pstep = (size_t)G * CHUNK;
      }
      /* all the unit's vectors in one pass over each value row (a prompt's block: 15 for 3 heads a KV head, where
       * two passes of 8 and 7 loaded and widened every row twice), the fp16 cache's widening inlined */
#define SUM(GG)                                                                                 \
  case GG:                                                                                      \
    if (kind == LLMC_KV_F16 && !pstep) sum_values(ps, 0, vrow, LLMC_KV_F16, D, n, acc, GG);     \
    else sum_values(ps, pstep, vrow, kind, D, n, acc, GG);                                      \
    break;
      switch (G) {
        SUM(1) SUM(2) SUM(3) SUM(4) SUM(5) SUM(6) SUM(7) SUM(8)
        SUM(9) SUM(10) SUM(11) SUM(12) SUM(13) SUM(14) SUM(15) default: SUM(16)
      }
#undef SUM
    } else {
      for (int t = 0; t < n; t++) {
        const char* row = vrow[t];
        for (int j = 0; j < nv; j++) {
          __m512 vv = load16(row, 16 * j, kind, D);
          for (int g = 0; g < G; g++) {
            float* a = acc + g * D + 16 * j;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(s[g * CHUNK + t]), vv, _mm512_loadu_ps(a)));
          }
        }
      }
    }
  }
}

#endif /* LLMC_X86 */

/* ---------------------------------------------------------------- the op */

#ifdef LLMC_X86
/* x -> fp16 with F16C, rounding to nearest even as the portable conversion does (that one is a library call per
 * value, 1.5 M of them for a 128-token prompt into SmolLM2's cache: the int4 engine's TTFT went 114 -> 100 ms). */
__attribute__((target("avx,f16c"))) static void to_f16_f16c(char* row, const float* x, int D) {
  int d = 0;
  for (; d + 8 <= D; d += 8)
    _mm_storeu_si128((__m128i*)(row + 2 * d), _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT));
  for (; d < D; d++) {
    unsigned short h = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
    memcpy(row + 2 * d, &h, 2);
  }
}
#endif

/* An int8 cache holds each key times H, the 32-point Hadamard matrix scaled to be orthonormal (H = H^T, H H = I), on
 * every whole 32 of its dims (a head size's remainder past the last 32 as it is), and every query vector meets those
 * keys multiplied by the same H: (H q) . (H k) = q . k, the same scores up to fp32 rounding. The rotary leaves a few
 * of a key's channels far larger than the rest; each int8 group's scale is set by its largest value, so those few
 * left the others a coarse grid. H spreads every channel over its 32, and the keys' rounding error is what the int8
 * cache's answers lost: SmolLM2 in transformers, its keys and values rounded as the cache rounds them, 673 positions
 * of 8 prompts, mean next-token KL against fp32 5.2e-4 (keys alone 4.3e-4, values alone 7.6e-5) -> 2.0e-4 with the
 * keys through H (over whole heads of 64: 2.7e-4; docs/quantization.md). The values stay as they are (through H
 * as well: 1.9e-4). Five butterfly passes, w = 1, 2, 4, 8, 16 in this order on both paths (the same bits), then
 * the scaling; stride: the dims' spacing in x. */
#define HADAMARD_N 32
#define HADAMARD_SCALE 0.17677669529663688f /* 1 / sqrt(32) */
static void hadamard_groups(float* x, int D, size_t stride) {
  for (int d0 = 0; d0 + HADAMARD_N <= D; d0 += HADAMARD_N) {
    float g[HADAMARD_N];
    for (int k = 0; k < HADAMARD_N; k++) g[k] = x[(size_t)(d0 + k) * stride];
    for (int w = 1; w < HADAMARD_N; w *= 2)
      for (int i = 0; i < HADAMARD_N; i += 2 * w)
        for (int k = i; k < i + w; k++) {
          float u = g[k], v = g[k + w];
          g[k] = u + v, g[k + w] = u - v;
        }
    for (int k = 0; k < HADAMARD_N; k++) x[(size_t)(d0 + k) * stride] = g[k] * HADAMARD_SCALE;
  }
}

#ifdef LLMC_X86
/* One butterfly pass of span w < 16 within each 16 lanes: lane i gets v[i] + v[i + w] where bit w of i is 0, else
 * v[i - w] - v[i] (swapped: v with each lane's partner). */
AVX512 static inline __m512 butterfly16(__m512 v, __m512 swapped, __mmask16 upper) {
  return _mm512_mask_sub_ps(_mm512_add_ps(v, swapped), upper, swapped, v);
}

/* hadamard_groups for contiguous dims on AVX-512, the same bits: each 32 in two registers. (The portable loop cost
 * ~100 ns a vector: +7-11 % on a decode layer's attention over an int8 cache, one thread, in a C harness.) */
AVX512 static void hadamard_groups512(float* x, int D) {
  const __m512i swap2 = _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const __m512i swap8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512 scale = _mm512_set1_ps(HADAMARD_SCALE);
  for (int d0 = 0; d0 + HADAMARD_N <= D; d0 += HADAMARD_N) {
    __m512 h[2] = {_mm512_loadu_ps(x + d0), _mm512_loadu_ps(x + d0 + 16)};
    for (int r = 0; r < 2; r++) {
      h[r] = butterfly16(h[r], _mm512_permute_ps(h[r], 0xB1), 0xAAAA);                       /* w = 1 */
      h[r] = butterfly16(h[r], _mm512_permutexvar_ps(swap2, h[r]), 0xCCCC);                  /* w = 2 */
      h[r] = butterfly16(h[r], _mm512_shuffle_f32x4(h[r], h[r], 0xB1), 0xF0F0);              /* w = 4 */
      h[r] = butterfly16(h[r], _mm512_permutexvar_ps(swap8, h[r]), 0xFF00);                  /* w = 8 */
    }
    _mm512_storeu_ps(x + d0, _mm512_mul_ps(_mm512_add_ps(h[0], h[1]), scale));              /* w = 16 */
    _mm512_storeu_ps(x + d0 + 16, _mm512_mul_ps(_mm512_sub_ps(h[0], h[1]), scale));
  }
}
#endif

/* hadamard_groups on the job's path (the same bits either way). */
static inline void hadamard_for(const job* j, float* x, int D, size_t stride) {
#ifdef LLMC_X86
  if (j->avx512 && stride == 1) {
    hadamard_groups512(x, D);
    return;
  }
#endif
  hadamard_groups(x, D, stride);
}

static void store_row(char* row, const float* x, int D, int kind, int f16c) {
#ifdef LLMC_X86
  if (kind == LLMC_KV_F16 && f16c) {
    to_f16_f16c(row, x, D);
    return;
  }
#endif
  (void)f16c;
  if (kind == LLMC_KV_F16) {
    _Float16* h = (_Float16*)row;
    for (int d = 0; d < D; d++) h[d] = (_Float16)x[d];
  } else if (kind == LLMC_KV_I8) {
    for (int d0 = 0; d0 < D; d0 += LLMC_KV_I8_GROUP) {
      int d1 = d0 + LLMC_KV_I8_GROUP < D ? d0 + LLMC_KV_I8_GROUP : D;
      float amax = 0.f;
      for (int d = d0; d < d1; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
      _Float16 scale = (_Float16)(amax / 127.f);
      float inv = (float)scale > 0.f ? 1.f / (float)scale : 0.f; /* the stored scale: q * scale ~ x */
      for (int d = d0; d < d1; d++) {
        long v = lrintf(x[d] * inv);
        ((int8_t*)row)[d] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
      }
      memcpy(row + D + 2 * (d0 / LLMC_KV_I8_GROUP), &scale, 2);
    }
  } else {
    memcpy(row, x, sizeof(float) * D);
  }
}

/* Cache row of (row b, KV head h, position t) in k or v: [B, Hkv, L, row], or a block of the pool. */
static inline char* cache_row(const llmc_attention_args* a, void* base, int b, int h, int t) {
  size_t rb = row_bytes(a->kv_kind, a->D);
  if (!a->block_table) return (char*)base + (((size_t)b * a->Hkv + h) * a->L + t) * rb;
  int block = a->block_table[(size_t)b * a->max_blocks + t / a->block_size];
  return (char*)base + (((size_t)block * a->Hkv + h) * a->block_size + t % a->block_size) * rb;
}

/* Key t of (row b, KV head h) into its key_tiles group: dim d at element 16 d + t % 16 of the group's rows. */
static void store_key_tiled(const llmc_attention_args* a, int b, int h, int t, const float* x, int f16c) {
  char* g = cache_row(a, a->k, b, h, t & ~TILE_MASK);
  size_t r = (size_t)(t & TILE_MASK);
  if (a->kv_kind == LLMC_KV_F16) { /* (typed stores: a memcpy of a run-time size was a call per dim) */
    uint16_t row[1024];
    store_row((char*)row, x, a->D, a->kv_kind, f16c);
    for (int d = 0; d < a->D; d++) ((uint16_t*)g)[(size_t)d * LLMC_KEY_TILE + r] = row[d];
  } else {
    for (int d = 0; d < a->D; d++) ((float*)g)[(size_t)d * LLMC_KEY_TILE + r] = x[d];
  }
}

static rows_t head_rows(const llmc_attention_args* a, const void* base, int b, int h) {
  rows_t r = {0};
  r.rb = row_bytes(a->kv_kind, a->D);
  if (!a->block_table) {
    r.base = (const char*)base + ((size_t)b * a->Hkv + h) * a->L * r.rb;
    return r;
  }
  r.base = (const char*)base + (size_t)h * a->block_size * r.rb;
  r.table = a->block_table + (size_t)b * a->max_blocks;
  r.block_step = (size_t)a->Hkv * a->block_size * r.rb;
  while ((1 << r.shift) < a->block_size) r.shift++;
  r.mask = a->block_size - 1;
  return r;
}

/* rotate() on the job's path (the same bits either way); stride > 1 (columns) only on AVX-512, where packed keys
 * are. */
static inline void rotate_for(const job* j, const float* x, float* y, int pos, float mul, size_t stride) {
  const llmc_attention_args* a = j->a;
#ifdef LLMC_X86
  if (j->avx512) {
    rotate512(x, y, a->cos, a->sin, pos, a->D, a->R, mul, stride);
    return;
  }
#endif
  (void)stride; /* (1: k16 is AVX-512's) */
  rotate(x, y, a->cos, a->sin, pos, a->D, a->R, mul);
}

/* New K (rotated) and V of every valid token into the cache (none where the cache is another layer's: kv_shared);
 * zeros for the padded query rows' output. */
static void write_new(const job* j) {
  const llmc_attention_args* a = j->a;
  int D = a->D;
  float tmp[1024];
  for (int b = 0; b < a->B; b++) {
    int past = past_of(a, b), n = new_of(a, b);
    for (int i = 0; i < a->S; i++) {
      const float* src = a->qkv + ((size_t)b * a->S + i) * j->W;
      if (i >= n) {
        memset(a->out + ((size_t)b * a->S + i) * a->H * D, 0, sizeof(float) * a->H * D);
        continue;
      }
      for (int h = 0; h < a->Hkv && !a->kv_shared; h++) {
        rotate_for(j, src + (size_t)(a->H + h) * D, tmp, past + i, 1.f, 1);
        if (a->kv_kind == LLMC_KV_I8) hadamard_for(j, tmp, D, 1);
        if (a->key_tiles)
          store_key_tiled(a, b, h, past + i, tmp, j->f16c);
        else
          store_row(cache_row(a, a->k, b, h, past + i), tmp, D, a->kv_kind, j->f16c);
        store_row(cache_row(a, a->v, b, h, past + i), src + (size_t)(a->H + a->Hkv + h) * D, D, a->kv_kind, j->f16c);
      }
    }
  }
}

#ifdef LLMC_X86
/* Row b's keys of KV head h (all past + new of them, rotated, as the cache holds them) in AMX-BF16's B layout for
 * llmc_amx_scores: per group of 16 keys, [D / 32][hi, lo][16 pairs][16 keys][2] (hi = bf16(k), lo = bf16(k - hi));
 * the groups past the last key, to an even count, are 0. */
/* Row t of `rows` (a cache of `kind`) widened to fp32 and split into bf16 hi + lo. */
AVX512 static inline void row_hilo(const rows_t* rows, int t, int kind, int D, uint16_t (*hl)[TILE_MAX_D]) {
  float row[TILE_MAX_D] __attribute__((aligned(64)));
  if (rows->tiles) { /* key t's dims out of its group: 16 apart (fp32 or fp16) */
    const char* g = row_at(rows, t & ~TILE_MASK);
    size_t r = (size_t)(t & TILE_MASK);
    for (int d = 0; d < D; d++)
      row[d] = kind == LLMC_KV_F16 ? _cvtsh_ss(((const unsigned short*)g)[(size_t)d * LLMC_KEY_TILE + r])
                                   : ((const float*)g)[(size_t)d * LLMC_KEY_TILE + r];
  } else {
    const char* r = row_at(rows, t);
    for (int d = 0; d < D; d += 16) _mm512_store_ps(row + d, load16(r, d, kind, D));
  }
  llmc_bf16_round(row, D, hl[0], hl[1]);
}

AVX512 static void pack_keys(const job* j, int b, int h, uint16_t* out) {
  const llmc_attention_args* a = j->a;
  int D = a->D, keys = past_of(a, b) + new_of(a, b);
  size_t group = (size_t)(D / LLMC_AMX_K) * 2 * 512;
  rows_t K = head_rows(a, a->k, b, h);
  K.tiles = a->key_tiles;
  uint16_t hl[2][TILE_MAX_D];
  memset(out + (size_t)(keys / 32 * 2) * group, 0, sizeof(uint16_t) * 2 * group); /* the last pair's tail */
  for (int t = 0; t < keys; t++) {
    row_hilo(&K, t, a->kv_kind, D, hl);
    uint16_t* g = out + (size_t)(t / 16) * group + (t % 16) * 2;
    for (int lv = 0; lv < 2; lv++)
      for (int d = 0; d < D; d += 2) {
        uint16_t* at = g + (size_t)((d / LLMC_AMX_K) * 2 + lv) * 512 + (d % LLMC_AMX_K) / 2 * 32;
        at[0] = hl[lv][d], at[1] = hl[lv][d + 1];
      }
  }
}

/* Row b's values of KV head h in AMX-BF16's B layout for llmc_amx_values: per window of 32 keys, [D / 16 column
 * tiles][hi, lo][16 key pairs][16 dims][2]; the window past the last key 0. */
AVX512 static void pack_values(const job* j, int b, int h, uint16_t* out) {
  const llmc_attention_args* a = j->a;
  int D = a->D, keys = past_of(a, b) + new_of(a, b);
  size_t window = (size_t)D / 16 * 2 * 512;
  rows_t V = head_rows(a, a->v, b, h);
  uint16_t hl[2][TILE_MAX_D];
  memset(out + (size_t)(keys / 32) * window, 0, sizeof(uint16_t) * window);
  for (int t = 0; t < keys; t++) {
    row_hilo(&V, t, a->kv_kind, D, hl);
    uint16_t* w = out + (size_t)(t / 32) * window + (t % 32) / 2 * 32 + t % 2;
    for (int lv = 0; lv < 2; lv++)
      for (int d = 0; d < D; d++) w[(size_t)((d / 16) * 2 + lv) * 512 + (d % 16) * 2] = hl[lv][d];
  }
}
#endif

#ifdef LLMC_X86
/* Row b's keys of KV head h in fp32, per group of 16 keys [D][16 keys] (scores16); the last group's keys past the
 * row's 0. A prompt's block of positions scores every key of its range this way with D products of 16 keys for
 * each of its vectors, where the row-by-row loop reduces 16 products per key and vector across lanes (hsum16). */
AVX512 static void pack_keys16(const job* j, int b, int h, float* out) {
  const llmc_attention_args* a = j->a;
  int D = a->D, keys = past_of(a, b) + new_of(a, b);
  rows_t K = head_rows(a, a->k, b, h);
  memset(out + (size_t)(keys / 16) * D * 16, 0, sizeof(float) * (size_t)D * 16); /* the last group's tail */
  for (int t0 = 0; t0 < keys; t0 += 16) {
    float* g = out + (size_t)(t0 / 16) * D * 16;
    if (a->key_tiles) { /* the cache's group is this layout already: widened, the keys past the row's masked to 0 */
      const char* kg = row_at(&K, t0);
      __mmask16 keep = keys - t0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (keys - t0)) - 1);
      for (int d = 0; d < D; d++)
        _mm512_store_ps(g + (size_t)d * 16,
                        _mm512_maskz_mov_ps(keep, a->kv_kind == LLMC_KV_F16
                                                      ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(kg + (size_t)d * 32)))
                                                      : _mm512_loadu_ps((const float*)kg + (size_t)d * 16)));
      continue;
    }
    for (int t = t0; t < keys && t < t0 + 16; t++) {
      const char* r = row_at(&K, t);
      for (int d = 0; d < D; d += 16) {
        float row[16] __attribute__((aligned(64)));
        _mm512_store_ps(row, load16(r, d, a->kv_kind, D));
        for (int e = 0; e < 16; e++) g[(size_t)(d + e) * 16 + (t - t0)] = row[e];
      }
    }
  }
}
#endif

static void pack_task(void* data, size_t i) {
#ifdef LLMC_X86
  const job* j = (const job*)data;
  if (j->k16) {
    pack_keys16(j, (int)(i / j->a->Hkv), (int)(i % j->a->Hkv), j->k16 + j->kt_off[i]);
    return;
  }
  pack_keys(j, (int)(i / j->a->Hkv), (int)(i % j->a->Hkv), j->kt + j->kt_off[i]);
  pack_values(j, (int)(i / j->a->Hkv), (int)(i % j->a->Hkv), j->vt + j->kt_off[i]);
#else
  (void)data, (void)i;
#endif
}

/* A query head's sink (attention_kernel.h) in a softmax denominator whose terms are taken against m: exp(sink - m),
 * or 0 without sinks. (A sink far above every score makes it inf, and the output the limit, 0.) */
/* How many of row b's new tokens from i0 on (at most rows) the dense pass computes: an indexed layer's queries that
 * see more keys than its budget are the index pass's alone (index_pass). */
static inline int dense_rows(const llmc_attention_args* a, int b, int i0, int rows) {
  if (a->index_topk <= 0) return rows;
  int budget = a->index_sink + a->index_topk + a->index_local, keep = budget - past_of(a, b) - i0;
  return keep < 0 ? 0 : keep < rows ? keep : rows;
}

static inline float sink_term(const llmc_attention_args* a, int head, float m) {
  return a->sinks ? expf(a->sinks[head] - m) : 0.f;
}

/* Unit u: (row b, block of qb query positions from i0, KV head h, key split sp). Blocks are visited in zigzag order
 * (0, last, 1, last - 1, ...) so a contiguous range of units carries short and long causal rows alike. Position i's
 * keys are [lo, keys): all its causal keys, or its window's; split sp takes split_len of them from lo on. A block's
 * positions (prompts, AVX-512) are scored together: each key row is loaded once for the qb x G query vectors, each
 * value row once per 8 of them, each vector masked to its own keys. */
static void run_unit(void* data, size_t u) {
  const job* j = (const job*)data;
  const llmc_attention_args* a = j->a;
  int D = a->D, G = j->G, qb = j->qb, nblocks = (a->S + qb - 1) / qb;
  int sp = (int)(u % j->nsplit);
  size_t r = u / j->nsplit;
  int chunk = (int)(r % j->nchunk);
  r /= j->nchunk;
  int h = (int)(r % a->Hkv);
  r /= a->Hkv;
  int z = (int)(r % nblocks), b = (int)(r / nblocks);
  int first_head = h * j->Gall + chunk * G; /* this unit's query heads: first_head .. + G */
  if (G > j->Gall - chunk * G) G = j->Gall - chunk * G;
  if (G <= 0) return;
  int i0 = ((z & 1) ? nblocks - 1 - z / 2 : z / 2) * qb;
  int n = new_of(a, b), past = past_of(a, b);
  int rows = dense_rows(a, b, i0, n - i0 < qb ? n - i0 : qb);
  if (rows <= 0) return;
  float q[MAX_GD], acc[MAX_GD], m[64], l[64];
  int lo[64], hi[64], t0 = 0, t1 = 0;
  for (int ri = 0; ri < rows; ri++) {
    int i = i0 + ri, keys = past + i + 1;
    int first = a->chunk_size > 0 ? (keys - 1) / a->chunk_size * a->chunk_size
                : a->window > 0 && keys > a->window ? keys - a->window : 0;
    int k0 = first + sp * j->split_len, k1 = k0 + j->split_len < keys ? k0 + j->split_len : keys;
    const float* src = a->qkv + ((size_t)b * a->S + i) * j->W;
    for (int g = 0; g < G; g++) {
      /* (the packed keys' scores take the vectors as columns of q [D][rows * G] where the head size is not one
       * scores16_rows is compiled for) */
      int columns = j->k16 && D != 64 && D != 128;
      float* qv = columns ? q + ri * G + g : q + (ri * G + g) * D;
      size_t stride = columns ? (size_t)rows * G : 1;
      rotate_for(j, src + (size_t)(first_head + g) * D, qv, past + i, a->scale, stride);
      if (a->kv_kind == LLMC_KV_I8) hadamard_for(j, qv, D, stride); /* the keys' H */
      lo[ri * G + g] = k0, hi[ri * G + g] = k1;
    }
    if (ri == 0) t0 = k0, t1 = k1;
    t0 = k0 < t0 ? k0 : t0, t1 = k1 > t1 ? k1 : t1;
  }
  int nvec = rows * G;
  (void)lo, (void)hi; /* (the portable path takes one position per unit) */
  rows_t Kr = head_rows(a, a->k, b, h), Vr = head_rows(a, a->v, b, h);
  Kr.tiles = a->key_tiles;
  const rows_t *K = &Kr, *V = &Vr;
  if (t0 >= t1) {
    for (int g = 0; g < nvec; g++) m[g] = -INFINITY, l[g] = 0.f;
    memset(acc, 0, sizeof(float) * nvec * D);
#ifdef LLMC_X86
  } else if (j->avx512) {
    attend_avx512(q, K, V, a->kv_kind, nvec, D, t0, t1, qb > 1 ? lo : NULL, hi, a->softcap, m, l, acc,
                  j->kt ? j->kt + j->kt_off[(size_t)b * a->Hkv + h] : NULL,
                  j->kt ? j->vt + j->kt_off[(size_t)b * a->Hkv + h] : NULL,
                  j->k16 ? j->k16 + j->kt_off[(size_t)b * a->Hkv + h] : NULL, j->l2);
#endif
  } else { /* (qb 1) */
    attend_generic(q, K, V, a->kv_kind, G, D, t0, t1, a->softcap, m, l, acc);
  }
  for (int ri = 0; ri < rows; ri++)
    for (int g = 0; g < G; g++) {
      int v = ri * G + g, head = first_head + g;
      size_t cell = ((size_t)b * a->S + i0 + ri) * a->H + head;
      if (j->nsplit == 1) {
        float inv = 1.f / (l[v] + sink_term(a, head, m[v]));
        for (int d = 0; d < D; d++) a->out[cell * D + d] = acc[v * D + d] * inv;
      } else {
        float* p = j->part + (cell * j->nsplit + sp) * (D + 2);
        p[0] = m[v], p[1] = l[v];
        memcpy(p + 2, acc + v * D, sizeof(float) * D);
      }
    }
}

static void merge_splits(const job* j) {
  const llmc_attention_args* a = j->a;
  int D = a->D;
  for (int b = 0; b < a->B; b++)
    for (int i = 0; i < dense_rows(a, b, 0, new_of(a, b)); i++)
      for (int head = 0; head < a->H; head++) {
        size_t cell = ((size_t)b * a->S + i) * a->H + head;
        const float* p = j->part + cell * j->nsplit * (D + 2);
        float mx = -INFINITY, total = 0.f;
        for (int sp = 0; sp < j->nsplit; sp++) mx = p[sp * (D + 2)] > mx ? p[sp * (D + 2)] : mx;
        float* o = a->out + cell * D;
        memset(o, 0, sizeof(float) * D);
        for (int sp = 0; sp < j->nsplit; sp++) {
          const float* ps = p + sp * (D + 2);
          if (ps[1] == 0.f) continue;
          float w = flushed_exp(ps[0] - mx);
          total += ps[1] * w;
          for (int d = 0; d < D; d++) o[d] += ps[2 + d] * w;
        }
        float inv = 1.f / (total + sink_term(a, head, mx));
        for (int d = 0; d < D; d++) o[d] *= inv;
      }
}

/* A pool task: claims units until none are left, so the cores stay busy whatever the units cost and however the
 * pool splits the tasks (measured: one pool task per unit left a core idle part of the time). */
static void run_units(void* data, size_t task) {
  job* j = (job*)data;
  (void)task;
  for (size_t u; (u = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->units;) run_unit(j, u);
#ifdef LLMC_X86
  if (j->kt) llmc_amx_release();
#endif
}

/* ---------------------------------------------------------------- indexed attention (Kolibri 1.1) */

/* The E4M3 value nearest s in [2^-9, 448] (ties to even): 3 mantissa bits, steps of 2^-9 below 2^-6. */
static float e4m3_round(float s) {
  int e;
  (void)frexpf(s, &e); /* s = f 2^e, f in [0.5, 1) */
  e = e - 1 < -6 ? -6 : e - 1;
  float step = ldexpf(1.f, e - 3);
  return nearbyintf(s / step) * step;
}

/* x[D] (D a multiple of 16) rounded to NVFP4 and back, as Kolibri 1.1's module rounds its routing queries: per 16
 * values an E4M3 scale max |x| / 6 (clamped to [2^-9, 448]), each value over it the nearest E2M1 magnitude (steps of
 * 0.5 below 2, 1 below 4, 2 up to 6; ties to even). */
static void nvfp4_round(const float* x, float* y, int D) {
  for (int g = 0; g < D; g += 16) {
    float amax = 0.f;
    for (int d = 0; d < 16; d++) amax = fmaxf(amax, fabsf(x[g + d]));
    float s = amax / 6.f;
    s = e4m3_round(s < 0x1p-9f ? 0x1p-9f : s > 448.f ? 448.f : s);
    for (int d = 0; d < 16; d++) {
      float v = x[g + d] / s, m = fminf(fabsf(v), 6.f);
      float step = m < 2.f ? 0.5f : m < 4.f ? 1.f : 2.f;
      y[g + d] = copysignf(nearbyintf(m / step) * step, v) * s;
    }
  }
}

/* Key t ranks before key u: a higher score, or the same and earlier. */
static inline int ranks_before(const float* score, int t, int u) {
  return score[t] > score[u] || (score[t] == score[u] && t < u);
}

/* Reorder idx[0 .. n) so that its first k are the k best by ranks_before (quickselect; n > k > 0). */
static void select_best(int* idx, int n, int k, const float* score) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, pivot = idx[mid];
    idx[mid] = idx[hi];
    idx[hi] = pivot;
    int store = lo;
    for (int i = lo; i < hi; i++)
      if (ranks_before(score, idx[i], pivot)) {
        int t = idx[i];
        idx[i] = idx[store];
        idx[store++] = t;
      }
    idx[hi] = idx[store];
    idx[store] = pivot;
    if (store == k - 1 || store == k) return; /* (the first k are then the best k) */
    if (store < k) lo = store + 1;
    else hi = store - 1;
  }
}

static int ascending(const void* x, const void* y) { return *(const int*)x - *(const int*)y; }

/* Routing scores (portable): score[t] = sum over heads h of relu(q[h] . k[t]), KV head 0's keys t in [first, last). */
static void route_scores(const rows_t* K, int kind, int D, const float* q, int heads, int first, int last,
                         float* score, float* kbuf) {
  for (int t = first; t < last; t++) {
    key_row(K, t, kind, D, kbuf);
    float sum = 0.f;
    for (int h = 0; h < heads; h++) {
      float dot = 0.f;
      for (int d = 0; d < D; d++) dot += q[(size_t)h * D + d] * kbuf[d];
      sum += dot > 0.f ? dot : 0.f;
    }
    score[t] = sum;
  }
}

/* Each of the G rows of count scores sc [G][count] as its softmax. */
static void softmax_rows(float* sc, int G, int count) {
  for (int g = 0; g < G; g++) {
    float* p = sc + (size_t)g * count;
    float m = -INFINITY, total = 0.f;
    for (int i = 0; i < count; i++) m = p[i] > m ? p[i] : m;
    for (int i = 0; i < count; i++) total += p[i] = flushed_exp(p[i] - m);
    for (int i = 0; i < count; i++) p[i] /= total;
  }
}

/* G query heads q [G][D] of one KV head over its keys idx[0 .. count) (portable): out [G][D], sc [G][count]. */
static void attend_chosen(const rows_t* K, const rows_t* V, int kind, int D, const float* q, int G, const int* idx,
                          int count, float scale, float* kbuf, float* sc, float* out) {
  for (int i = 0; i < count; i++) {
    key_row(K, idx[i], kind, D, kbuf);
    for (int g = 0; g < G; g++) {
      float dot = 0.f;
      for (int d = 0; d < D; d++) dot += q[(size_t)g * D + d] * kbuf[d];
      sc[(size_t)g * count + i] = dot * scale;
    }
  }
  memset(out, 0, sizeof(float) * (size_t)G * D);
  softmax_rows(sc, G, count);
  for (int i = 0; i < count; i++) {
    const char* vr = row_at(V, idx[i]);
    for (int d = 0; d < D; d++) kbuf[d] = load1(vr, d, kind, D);
    for (int g = 0; g < G; g++)
      for (int d = 0; d < D; d++) out[(size_t)g * D + d] += sc[(size_t)g * count + i] * kbuf[d];
  }
}

#ifdef LLMC_X86
/* route_scores on AVX-512: a key_tiles cache's whole groups of 16 keys 16 at a time ([D][16]: no reduction across
 * lanes), other keys one row at a time. */
AVX512 static void route_scores512(const rows_t* K, int kind, int D, const float* q, int heads, int first, int last,
                                   float* score, float* kbuf) {
  for (int t = first; t < last;) {
    if (K->tiles && !(t & TILE_MASK) && t + LLMC_KEY_TILE <= last) {
      const char* g = row_at(K, t);
      __m512 sum = _mm512_setzero_ps();
      for (int h0 = 0; h0 < heads; h0 += 8) {
        int nh = heads - h0 < 8 ? heads - h0 : 8;
        __m512 acc[8];
        for (int h = 0; h < nh; h++) acc[h] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
          __m512 k = load16(g, d * LLMC_KEY_TILE, kind, D);
          for (int h = 0; h < nh; h++) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[(size_t)(h0 + h) * D + d]), k, acc[h]);
        }
        for (int h = 0; h < nh; h++) sum = _mm512_add_ps(sum, _mm512_max_ps(acc[h], _mm512_setzero_ps()));
      }
      _mm512_storeu_ps(score + t, sum);
      t += LLMC_KEY_TILE;
      continue;
    }
    if (K->tiles)
      key_row(K, t, kind, D, kbuf);
    else
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(kbuf + d, load16(row_at(K, t), d, kind, D));
    float sum = 0.f;
    for (int h = 0; h < heads; h++) {
      __m512 acc = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)h * D + d), _mm512_loadu_ps(kbuf + d), acc);
      float dot = _mm512_reduce_add_ps(acc);
      sum += dot > 0.f ? dot : 0.f;
    }
    score[t++] = sum;
  }
}

/* attend_chosen on AVX-512. */
AVX512 static void attend_chosen512(const rows_t* K, const rows_t* V, int kind, int D, const float* q, int G,
                                    const int* idx, int count, float scale, float* kbuf, float* sc, float* out) {
  for (int i = 0; i < count; i++) {
    if (K->tiles)
      key_row(K, idx[i], kind, D, kbuf);
    else
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(kbuf + d, load16(row_at(K, idx[i]), d, kind, D));
    for (int g = 0; g < G; g++) {
      __m512 acc = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)g * D + d), _mm512_loadu_ps(kbuf + d), acc);
      sc[(size_t)g * count + i] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  softmax_rows(sc, G, count);
  memset(out, 0, sizeof(float) * (size_t)G * D);
  for (int i = 0; i < count; i++) {
    const char* vr = row_at(V, idx[i]);
    for (int d = 0; d < D; d += 16) {
      __m512 v = load16(vr, d, kind, D);
      for (int g = 0; g < G; g++) {
        float* o = out + (size_t)g * D + d;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(sc[(size_t)g * count + i]), v, _mm512_loadu_ps(o)));
      }
    }
  }
}
#endif

/* Routing scores of query (b, s) over KV head 0's candidate keys [t0, t1) into score[t] (its first `index_heads` heads
 * rounded to NVFP4 into q [heads][D]; kbuf [D]). */
static void index_route(const job* j, int b, int s, int t0, int t1, float* score, float* q, float* kbuf) {
  const llmc_attention_args* a = j->a;
  int D = a->D;
  const float* row = a->qkv + ((size_t)b * a->S + s) * j->W;
  for (int h = 0; h < a->index_heads; h++) {
    nvfp4_round(row + (size_t)h * D, q + (size_t)h * D, D);
    if (a->kv_kind == LLMC_KV_I8) hadamard_for(j, q + (size_t)h * D, D, 1); /* (the cache's keys are rotated) */
  }
  rows_t K = head_rows(a, a->k, b, 0);
  K.tiles = a->key_tiles;
#ifdef LLMC_X86
  if (j->avx512)
    route_scores512(&K, a->kv_kind, D, q, a->index_heads, t0, t1, score, kbuf);
  else
#endif
    route_scores(&K, a->kv_kind, D, q, a->index_heads, t0, t1, score, kbuf);
}

/* The keys query (b, s) attends, into idx (ascending chosen ones, then the sinks and the local ones): their count. */
static int index_choose(const llmc_attention_args* a, int b, int s, const float* score, int* idx) {
  int len = past_of(a, b) + s + 1, first = a->index_sink, last = len - a->index_local;
  for (int t = first; t < last; t++) idx[t - first] = t;
  select_best(idx, last - first, a->index_topk, score);
  int count = a->index_topk;
  qsort(idx, (size_t)count, sizeof(int), ascending);
  for (int t = 0; t < first; t++) idx[count++] = t;
  for (int t = last; t < len; t++) idx[count++] = t;
  return count;
}

/* KV head kvh's query heads of query (b, s) over the keys idx[0 .. count), written to the output. work:
 * attend_floats(a). */
static void index_attend(const job* j, int b, int s, int kvh, const int* idx, int count, float* work) {
  const llmc_attention_args* a = j->a;
  int D = a->D, G = a->H / a->Hkv;
  float *kbuf = work, *qg = kbuf + D, *acc = qg + (size_t)G * D, *sc = acc + (size_t)G * D; /* sc: [G][count] */
  rows_t K = head_rows(a, a->k, b, kvh), V = head_rows(a, a->v, b, kvh);
  K.tiles = a->key_tiles;
  memcpy(qg, a->qkv + ((size_t)b * a->S + s) * j->W + (size_t)kvh * G * D, sizeof(float) * (size_t)G * D);
  if (a->kv_kind == LLMC_KV_I8)
    for (int g = 0; g < G; g++) hadamard_for(j, qg + (size_t)g * D, D, 1);
#ifdef LLMC_X86
  if (j->avx512)
    attend_chosen512(&K, &V, a->kv_kind, D, qg, G, idx, count, a->scale, kbuf, sc, acc);
  else
#endif
    attend_chosen(&K, &V, a->kv_kind, D, qg, G, idx, count, a->scale, kbuf, sc, acc);
  memcpy(a->out + ((size_t)b * a->S + s) * a->H * D + (size_t)kvh * G * D, acc, sizeof(float) * (size_t)G * D);
}

/* index_attend's scratch: a key, G queries and outputs, the chosen keys' scores [G][budget]. */
static size_t attend_floats(const llmc_attention_args* a) {
  int G = a->H / a->Hkv, budget = a->index_sink + a->index_topk + a->index_local;
  return (size_t)(1 + 2 * G) * a->D + (size_t)G * budget;
}

/* The queries past the budget, (b, s) packed as b * S + s, and how their work is shared: with as many of them as
 * tasks or more, a task takes whole queries (scores, choice, every KV head); with fewer (decode rows), each query's
 * routing scores are split over `parts` key ranges and its KV heads over the tasks. */
typedef struct {
  const job* j;
  const int* queries;
  int nq, parts;
  size_t tasks, per_task; /* per_task: floats of a task's scratch (its routing queries and a key, then attend's) */
  float* scores;          /* [nq][L] when split, else [tasks][L] */
  int* idx;               /* the same */
  int* counts;            /* [nq]: the chosen keys of each query, when split */
  float* work;            /* [tasks][per_task] */
} index_job;

static void whole_queries(void* data, size_t task) {
  const index_job* x = (const index_job*)data;
  const llmc_attention_args* a = x->j->a;
  float *score = x->scores + task * (size_t)a->L, *work = x->work + task * x->per_task;
  int* idx = x->idx + task * (size_t)a->L;
  for (size_t u = task; u < (size_t)x->nq; u += x->tasks) {
    int b = x->queries[u] / a->S, s = x->queries[u] % a->S, len = past_of(a, b) + s + 1;
    index_route(x->j, b, s, a->index_sink, len - a->index_local, score, work, work + (size_t)a->index_heads * a->D);
    int count = index_choose(a, b, s, score, idx);
    for (int kvh = 0; kvh < a->Hkv; kvh++) index_attend(x->j, b, s, kvh, idx, count, work);
  }
}

static void route_parts(void* data, size_t task) { /* (split) task: (query, key range) units */
  const index_job* x = (const index_job*)data;
  const llmc_attention_args* a = x->j->a;
  float* work = x->work + task * x->per_task;
  for (size_t u = task; u < (size_t)x->nq * x->parts; u += x->tasks) {
    int qi = (int)(u / x->parts), part = (int)(u % x->parts);
    int b = x->queries[qi] / a->S, s = x->queries[qi] % a->S, len = past_of(a, b) + s + 1;
    int first = a->index_sink, n = len - a->index_local - first, step = (n + x->parts - 1) / x->parts;
    int t0 = first + part * step, t1 = t0 + step < first + n ? t0 + step : first + n;
    if (t0 < t1)
      index_route(x->j, b, s, t0, t1, x->scores + (size_t)qi * a->L, work, work + (size_t)a->index_heads * a->D);
  }
}

static void attend_heads(void* data, size_t task) { /* (split) task: (query, KV head) units */
  const index_job* x = (const index_job*)data;
  const llmc_attention_args* a = x->j->a;
  for (size_t u = task; u < (size_t)x->nq * a->Hkv; u += x->tasks) {
    int qi = (int)(u / a->Hkv), kvh = (int)(u % a->Hkv);
    index_attend(x->j, x->queries[qi] / a->S, x->queries[qi] % a->S, kvh, x->idx + (size_t)qi * a->L,
                 x->counts[qi], x->work + task * x->per_task);
  }
}

static void run_tasks(llmc_parallel_fn parallel, void* ctx, void (*fn)(void*, size_t), size_t tasks, void* data) {
  if (parallel)
    parallel(ctx, fn, tasks, data);
  else
    for (size_t t = 0; t < tasks; t++) fn(data, t);
}

/* Every query past the budget computed over its chosen keys, on the pool's threads; an error when the scratch cannot
 * be had (the dense pass left those queries out). */
static const char* index_pass(const job* j, llmc_parallel_fn parallel, void* parallel_ctx) {
  const llmc_attention_args* a = j->a;
  index_job x = {.j = j};
  int* queries = (int*)malloc(sizeof(int) * (size_t)a->B * a->S);
  if (!queries) return "out of memory for the indexed attention's queries";
  for (int b = 0; b < a->B; b++)
    for (int s = dense_rows(a, b, 0, new_of(a, b)); s < new_of(a, b); s++) queries[x.nq++] = b * a->S + s;
  x.queries = queries;
  int split = x.nq < POOL_TASKS && parallel;
  x.tasks = split ? POOL_TASKS : (size_t)x.nq < POOL_TASKS ? (size_t)x.nq : POOL_TASKS;
  x.parts = split ? (POOL_TASKS + x.nq - 1) / x.nq : 1;
  size_t rows = split ? (size_t)x.nq : x.tasks; /* score and index rows of L */
  x.per_task = (size_t)(a->index_heads + 1) * a->D + attend_floats(a);
  x.scores = (float*)malloc(sizeof(float) * rows * (size_t)a->L);
  x.idx = (int*)malloc(sizeof(int) * rows * (size_t)a->L);
  x.counts = (int*)malloc(sizeof(int) * (size_t)(x.nq > 0 ? x.nq : 1));
  x.work = (float*)malloc(sizeof(float) * x.tasks * x.per_task);
  const char* err = x.scores && x.idx && x.counts && x.work ? NULL : "out of memory for the indexed attention's key scores";
  if (!err && x.nq > 0 && split) {
    run_tasks(parallel, parallel_ctx, route_parts, x.tasks, &x);
    for (int qi = 0; qi < x.nq; qi++)
      x.counts[qi] = index_choose(a, queries[qi] / a->S, queries[qi] % a->S, x.scores + (size_t)qi * a->L,
                                  x.idx + (size_t)qi * a->L);
    run_tasks(parallel, parallel_ctx, attend_heads, x.tasks, &x);
  } else if (!err && x.nq > 0) {
    run_tasks(parallel, parallel_ctx, whole_queries, x.tasks, &x);
  }
  free(queries);
  free(x.scores);
  free(x.idx);
  free(x.counts);
  free(x.work);
  return err;
}

static int portable_forced(void) { /* LLMC_KERNELS_GENERIC=1: the portable C only (tests run both paths) */
  const char* generic = getenv("LLMC_KERNELS_GENERIC");
  return generic && *generic && *generic != '0';
}

int llmc_attention_uses_avx512(void) {
#ifdef LLMC_X86
  __builtin_cpu_init();
  return !portable_forced() && __builtin_cpu_supports("avx512f");
#else
  return 0;
#endif
}

static int uses_f16c(void) {
#ifdef LLMC_X86
  __builtin_cpu_init();
  return !portable_forced() && __builtin_cpu_supports("f16c");
#else
  return 0;
#endif
}

static _Thread_local char err_buf[256];

/* A prompt of TILE_MIN_ROWS positions or more goes to AMX-BF16 tiles (q, k, the weights and v each as bf16 hi +
 * lo: ~2^-17 of each product, below an fp16 cache's own rounding; an fp32 cache keeps fp32 arithmetic) where the
 * CPU grants them, the head size is a multiple of 32 up to TILE_MAX_D, and LLMC_KERNELS_NO_AMX is not set. Fewer
 * positions stay on the FMAs: packing each key and value costs about what one block of positions spends on it. */
static int prompt_tiles(const llmc_attention_args* a) {
#ifdef LLMC_X86
  const char* no_amx = getenv("LLMC_KERNELS_NO_AMX");
  return a->S >= TILE_MIN_ROWS && a->kv_kind != LLMC_KV_F32 && a->D % LLMC_AMX_K == 0 && a->D <= TILE_MAX_D &&
         !(no_amx && *no_amx && *no_amx != '0') && llmc_amx_bf16_usable();
#else
  (void)a;
  return 0;
#endif
}

/* A prompt's keys packed 16 at a time for its AVX-512 scores (no tiles; LLMC_KERNELS_NO_PACKED_KEYS=1: the
 * row-by-row loop, which tests compare it with). */
static int prompt_keys16(const llmc_attention_args* a) {
  const char* off = getenv("LLMC_KERNELS_NO_PACKED_KEYS");
  return a->S >= TILE_MIN_ROWS && a->D <= K16_MAX_D && !(off && *off && *off != '0');
}

const char* llmc_attention(const llmc_attention_args* a, llmc_parallel_fn parallel, void* parallel_ctx) {
  if (a->H % a->Hkv) return "num_heads must be a multiple of kv_num_heads";
  if (a->D > 1024 || a->D % 2) {
    snprintf(err_buf, sizeof err_buf, "head size %d: must be even and at most 1024", a->D);
    return err_buf;
  }
  if (a->D > MAX_GD) {
    snprintf(err_buf, sizeof err_buf, "head size %d: at most %d", a->D, MAX_GD);
    return err_buf;
  }
  if (a->cos && (a->R < 1 || a->R > a->D / 2)) {
    snprintf(err_buf, sizeof err_buf, "rotary table width %d: must be 1 .. head size / 2 = %d", a->R, a->D / 2);
    return err_buf;
  }
  if (a->window < 0) {
    snprintf(err_buf, sizeof err_buf, "window %d: must be 0 (none) or positive", a->window);
    return err_buf;
  }
  if (a->chunk_size < 0 || (a->chunk_size > 0 && a->window > 0)) {
    snprintf(err_buf, sizeof err_buf, "chunk size %d: must be 0 (none) or positive, and not with a window (%d)",
             a->chunk_size, a->window);
    return err_buf;
  }
  if (!(a->softcap >= 0.f) || isinf(a->softcap)) {
    snprintf(err_buf, sizeof err_buf, "softcap %g: must be 0 (off) or positive and finite", (double)a->softcap);
    return err_buf;
  }
  if (a->block_table && (a->block_size < 1 || (a->block_size & (a->block_size - 1)) || a->max_blocks < 1 ||
                        a->L != a->max_blocks * a->block_size)) {
    snprintf(err_buf, sizeof err_buf, "block size %d, %d blocks per row: a power of 2 and at least 1 block",
             a->block_size, a->max_blocks);
    return err_buf;
  }
  if (a->key_tiles && (a->kv_kind == LLMC_KV_I8 || (a->block_table ? a->block_size : a->L) % LLMC_KEY_TILE)) {
    if (a->kv_kind == LLMC_KV_I8) return "key tiles: an fp32 or fp16 cache only (an int8 cache holds rows)";
    snprintf(err_buf, sizeof err_buf, "key tiles: %s %d must be a multiple of %d", a->block_table ? "block size" : "cache length",
             a->block_table ? a->block_size : a->L, LLMC_KEY_TILE);
    return err_buf;
  }
  if (a->index_topk < 0 || (a->index_topk > 0 && (a->index_local < 1 || a->index_sink < 0 || a->index_heads < 1 ||
                                                  a->index_heads > a->H / a->Hkv || a->D % 16 || a->cos ||
                                                  a->window || a->chunk_size || a->sinks || a->softcap > 0.f))) {
    snprintf(err_buf, sizeof err_buf, "indexed attention (topk %d, local %d, sink %d, heads %d): topk, local and "
             "heads at least 1 (heads at most the %d query heads of a KV head), sink at least 0, a head size that is "
             "a multiple of 16, and no rotary, window, chunk, sinks or softcap", a->index_topk, a->index_local,
             a->index_sink, a->index_heads, a->H / a->Hkv);
    return err_buf;
  }
  int max_keys = 0;
  for (int b = 0; b < a->B; b++) {
    int past = past_of(a, b), n = new_of(a, b);
    if (past < 0 || n < 1 || n > a->S) {
      snprintf(err_buf, sizeof err_buf, "seqlens_k[%d] = %d does not fit %d new tokens", b, a->seqlens[b], a->S);
      return err_buf;
    }
    if (past + n > a->L || (a->cos && past + n > a->max_pos)) {
      snprintf(err_buf, sizeof err_buf, "row %d needs %d positions: the cache holds %d, the rotary table %d", b,
               past + n, a->L, a->max_pos);
      return err_buf;
    }
    max_keys = past + n > max_keys ? past + n : max_keys;
    if (a->block_table) /* every block the row reads or writes is in the pool */
      for (int i = 0; i < (past + n + a->block_size - 1) / a->block_size; i++) {
        int block = a->block_table[(size_t)b * a->max_blocks + i];
        if (block < 0 || block >= a->num_blocks) {
          snprintf(err_buf, sizeof err_buf, "block_table[%d][%d] = %d is outside the pool of %d blocks", b, i, block,
                   a->num_blocks);
          return err_buf;
        }
      }
  }
  int max_span = a->window > 0 && a->window < max_keys ? a->window : max_keys; /* the most keys a row reads */
  if (a->chunk_size > 0 && a->chunk_size < max_span) max_span = a->chunk_size;
  job j = {.a = a, .G = a->H / a->Hkv, .W = (a->H + (a->kv_shared ? 0 : 2 * a->Hkv)) * a->D, .nsplit = 1,
           .split_len = max_span, .qb = 1};
  /* a unit holds up to 64 query heads' rows (and G x D <= MAX_GD): more a KV head (latent attention's one KV head
   * under every query head) go to several units, each reading the head's keys for its share */
  j.Gall = j.G;
  if (j.G > 64 || j.G * a->D > MAX_GD) {
    int most = MAX_GD / a->D < 64 ? MAX_GD / a->D : 64;
    j.nchunk = (j.Gall + most - 1) / most;
    j.G = (j.Gall + j.nchunk - 1) / j.nchunk; /* (even shares) */
  } else {
    j.nchunk = 1;
  }
  j.avx512 = a->D % 16 == 0 && llmc_attention_uses_avx512();
  j.f16c = uses_f16c();
#ifdef LLMC_X86
  j.l2 = j.avx512 && llmc_prefetch_l2();
#endif
  if (a->S == 1 && max_span > SPLIT_KEYS) {
    j.nsplit = (max_span + SPLIT_KEYS - 1) / SPLIT_KEYS;
    if (j.nsplit > MAX_SPLIT) j.nsplit = MAX_SPLIT;
    j.split_len = ((max_span + j.nsplit - 1) / j.nsplit + 15) / 16 * 16;
    j.part = (float*)malloc(sizeof(float) * (size_t)a->B * a->H * j.nsplit * (a->D + 2));
    if (!j.part) return "out of memory for the split attention's partial results";
  }
  /* a prompt's positions in blocks of up to MAX_VECTORS query vectors (1 position for G > MAX_VECTORS / 2) */
  j.qb = j.avx512 && a->S > 1 && j.G * 2 <= MAX_VECTORS ? MAX_VECTORS / j.G : 1;
  if (j.qb > 8) j.qb = 8;
  while (j.qb > 1 && j.qb * j.G * a->D > MAX_GD) j.qb--; /* (the unit's query and accumulator rows) */
  write_new(&j);
  if (j.qb > 1 && prompt_tiles(a)) { /* (failing the allocation, the scores stay on AVX-512) */
    size_t group = (size_t)(a->D / LLMC_AMX_K) * 2 * 512, total = 0;
    j.kt_off = (size_t*)malloc(sizeof(size_t) * (size_t)a->B * a->Hkv);
    for (int b = 0; j.kt_off && b < a->B; b++)
      for (int h = 0; h < a->Hkv; h++) {
        j.kt_off[(size_t)b * a->Hkv + h] = total;
        total += (size_t)((past_of(a, b) + new_of(a, b)) / 32 + 1) * 2 * group;
      }
    j.kt = j.kt_off && 2 * total * sizeof(uint16_t) <= TILE_MAX_BYTES ? (uint16_t*)malloc(sizeof(uint16_t) * 2 * total)
                                                                     : NULL;
    j.vt = j.kt ? j.kt + total : NULL;
    if (j.kt && parallel)
      parallel(parallel_ctx, pack_task, (size_t)a->B * a->Hkv, &j);
    else
      for (size_t i = 0; j.kt && i < (size_t)a->B * a->Hkv; i++) pack_task(&j, i);
  }
  if (j.qb > 1 && !j.kt && prompt_keys16(a)) { /* (failing the allocation, the row-by-row loop) */
    size_t total = 0;
    if (!j.kt_off) j.kt_off = (size_t*)malloc(sizeof(size_t) * (size_t)a->B * a->Hkv);
    for (int b = 0; j.kt_off && b < a->B; b++)
      for (int h = 0; h < a->Hkv; h++) {
        j.kt_off[(size_t)b * a->Hkv + h] = total;
        total += (size_t)((past_of(a, b) + new_of(a, b)) / 16 + 1) * (size_t)a->D * 16;
      }
    j.k16 = j.kt_off && total * sizeof(float) <= TILE_MAX_BYTES ? (float*)aligned_alloc(64, sizeof(float) * total)
                                                                 : NULL;
    if (j.k16 && parallel)
      parallel(parallel_ctx, pack_task, (size_t)a->B * a->Hkv, &j);
    else
      for (size_t i = 0; j.k16 && i < (size_t)a->B * a->Hkv; i++) pack_task(&j, i);
  }
  j.units = (size_t)a->B * ((a->S + j.qb - 1) / j.qb) * a->Hkv * j.nchunk * j.nsplit;
  if (parallel)
    parallel(parallel_ctx, run_units, j.units < POOL_TASKS ? j.units : POOL_TASKS, &j);
  else
    run_units(&j, 0);
  if (j.nsplit > 1) merge_splits(&j);
  /* (the queries seeing more keys than the budget, which the dense pass left out: their chosen keys' attention) */
  const char* err = a->index_topk > 0 && max_keys > a->index_sink + a->index_topk + a->index_local
                        ? index_pass(&j, parallel, parallel_ctx)
                        : NULL;
  free(j.part);
  free(j.kt);
  free(j.k16);
  free(j.kt_off);
  return err;
}
