/* bf16 weight matrix product (see matmul_bf16.h for the contract and the packed layout).
 *
 * Why it exists: ONNX Runtime's CPU provider has no bf16 matrix product, and an fp32 engine reads 4 bytes a weight
 * per decode step where 2 hold a bf16 checkpoint's values exactly (and any fp32 one to 8 bits of mantissa). The
 * layout is vdpbf16ps' own (16 columns x 2 consecutive k per 64-byte register), so each load is one instruction's
 * operand, used by up to 4 rows of x before the next; a work unit is a pair of tiles (two independent chains per
 * row), and each of the session's threads takes one contiguous part of the weights (as the 4-bit product does).
 *
 * From AMX_MIN_ROWS rows on (prompts), where the CPU has AMX-BF16 and the OS grants its tiles, the same layout is
 * also AMX's B operand: 16 pairs of k x 16 columns is one 16 x 64-byte tile, so TDPBF16PS multiplies 16 rows of x
 * by a whole tile per instruction and accumulates over all of K in the C tiles (fp32), two row blocks by two tiles
 * at a time (each tile load used twice: amx_bf16.c, which also decides whether the tiles may be trusted).
 */
#include "matmul_bf16.h"

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

#define PAIR_TILES 2 /* tiles per work unit */
#define AMX_MIN_ROWS 4 /* fewer rows take the AVX-512 path (measured, one thread, SmolLM2's shapes: at 8 rows the tiles are ~2x faster, at 2-4 either way within noise) */
#define MAX_ROWS 4   /* rows of x per pass over a unit's weights */
#define PREFETCH_PAIRS 8     /* the AVX-512 path: pairs of k ahead of the loads, prefetching into L1 */
#define PREFETCH_PAIRS_L2 16 /* into L2 (prefetch.h) */
#define LOCAL_PARTS 64 /* parts (threads) whose taken flags live on the stack */

typedef struct {
  const llmc_bf16_args* a;
  const uint32_t* xb; /* [M, K / 2]: x rounded to bf16, two consecutive k per 32 bits */
  const float* xf;    /* the widened paths: [M, K] x rounded to bf16, as fp32 */
  int64_t tiles, units, parts;
  int path;
  int amx; /* this call runs on the AMX tiles */
  int l2;  /* the AVX-512 path's weight prefetches go to L2, not L1 (prefetch.h) */
  int64_t ahead; /* ... this many bf16 pairs ahead of its loads */
  unsigned char* taken; /* [parts]: 1 once a task has run the part */
} bf16_job;

#ifdef LLMC_X86
/* store_rows' gated form on AVX-512 (silu by llmc_silu512, as MatMulQ4's epilogue). */
__attribute__((target("avx512f"))) static void store_gated512(const llmc_bf16_args* a, int64_t m0, int rows,
                                                              int64_t g0, const float* acc) {
  int64_t half = a->N / 2;
  __m512 bg = a->bias ? _mm512_loadu_ps(a->bias + g0) : _mm512_setzero_ps();
  __m512 bu = a->bias ? _mm512_loadu_ps(a->bias + half + g0) : _mm512_setzero_ps();
  for (int m = 0; m < rows; m++) {
    __m512 g = _mm512_add_ps(_mm512_loadu_ps(acc + m * PAIR_TILES * LLMC_BF16_TILE), bg);
    __m512 up = _mm512_add_ps(_mm512_loadu_ps(acc + m * PAIR_TILES * LLMC_BF16_TILE + LLMC_BF16_TILE), bu);
    _mm512_storeu_ps(a->y + (m0 + m) * half + g0, _mm512_mul_ps(llmc_silu512(g), up));
  }
}
#endif

/* Columns n0 .. n0 + cols of rows m0 .. m0 + rows from acc [rows][PAIR_TILES * 16], plus the bias; gated: the unit's
 * gate tile and up tile -> its 16 outputs at n0 / 2, silu(gate) * up. */
static void store_rows(const llmc_bf16_args* a, int64_t m0, int rows, int64_t n0, const float* acc, int avx512) {
  if (a->gated) {
    int64_t half = a->N / 2, g0 = n0 / 2;
#ifdef LLMC_X86
    if (avx512) {
      store_gated512(a, m0, rows, g0, acc);
      return;
    }
#endif
    (void)avx512;
    for (int m = 0; m < rows; m++)
      for (int c = 0; c < LLMC_BF16_TILE; c++) {
        float g = acc[m * PAIR_TILES * LLMC_BF16_TILE + c], up = acc[m * PAIR_TILES * LLMC_BF16_TILE + LLMC_BF16_TILE + c];
        if (a->bias) g += a->bias[g0 + c], up += a->bias[half + g0 + c];
        a->y[(m0 + m) * half + g0 + c] = g / (1.f + expf(-g)) * up;
      }
    return;
  }
  int64_t cols = a->N - n0 < PAIR_TILES * LLMC_BF16_TILE ? a->N - n0 : PAIR_TILES * LLMC_BF16_TILE;
  for (int m = 0; m < rows; m++)
    for (int64_t c = 0; c < cols; c++)
      a->y[(m0 + m) * a->N + n0 + c] = acc[m * PAIR_TILES * LLMC_BF16_TILE + c] + (a->bias ? a->bias[n0 + c] : 0.f);
}

/* ---------------------------------------------------------------- portable C */

static void unit_generic(const bf16_job* j, int64_t u) {
  const llmc_bf16_args* a = j->a;
  int64_t pairs = a->K / 2, t0 = u * PAIR_TILES;
  int nt = j->tiles - t0 < PAIR_TILES ? (int)(j->tiles - t0) : PAIR_TILES;
  float acc[PAIR_TILES * LLMC_BF16_TILE];
  for (int64_t m = 0; m < a->M; m++) {
    memset(acc, 0, sizeof acc);
    const uint32_t* x = j->xb + m * pairs;
    for (int t = 0; t < nt; t++) {
      const uint16_t* w = a->w + (t0 + t) * pairs * 2 * LLMC_BF16_TILE;
      for (int64_t p = 0; p < pairs; p++) {
        float x0 = llmc_from_bf16((uint16_t)(x[p] & 0xFFFFu)), x1 = llmc_from_bf16((uint16_t)(x[p] >> 16));
        for (int c = 0; c < LLMC_BF16_TILE; c++) {
          float* s = acc + t * LLMC_BF16_TILE + c;
          *s += llmc_from_bf16(w[p * 32 + 2 * c]) * x0;
          *s += llmc_from_bf16(w[p * 32 + 2 * c + 1]) * x1;
        }
      }
    }
    store_rows(a, m, 1, t0 * LLMC_BF16_TILE, acc, 0);
  }
}

/* ---------------------------------------------------------------- AVX-512 BF16 */

#ifdef LLMC_X86
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* RM rows (from m0) x NT tiles (from t0) over all of K into acc [RM][PAIR_TILES * 16]. */
static inline __attribute__((always_inline)) TARGET void rows_avx512(const bf16_job* j, int64_t m0, int64_t t0,
                                                                      float* out, const int RM, const int NT) {
  const llmc_bf16_args* a = j->a;
  const int64_t pairs = a->K / 2;
  const uint32_t* x = j->xb + m0 * pairs;
  __m512 acc[MAX_ROWS][PAIR_TILES];
  for (int m = 0; m < RM; m++)
    for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
  const uint16_t* w[PAIR_TILES];
  for (int t = 0; t < NT; t++) w[t] = a->w + (t0 + t) * pairs * 2 * LLMC_BF16_TILE;
  for (int64_t p = 0; p < pairs; p++) {
    __m512i wv[PAIR_TILES];
    for (int t = 0; t < NT; t++) {
      llmc_prefetch(w[t] + (p + j->ahead) * 32, j->l2);
      wv[t] = _mm512_loadu_si512(w[t] + p * 32);
    }
    for (int m = 0; m < RM; m++) {
      __m512i xv = _mm512_set1_epi32((int)x[m * pairs + p]);
      for (int t = 0; t < NT; t++)
        acc[m][t] = _mm512_dpbf16_ps(acc[m][t], (__m512bh)wv[t], (__m512bh)xv);
    }
  }
  for (int m = 0; m < RM; m++)
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(out + m * PAIR_TILES * LLMC_BF16_TILE + t * LLMC_BF16_TILE,
                                                  acc[m][t]);
}

static TARGET void unit_avx512(const bf16_job* j, int64_t u) {
  const llmc_bf16_args* a = j->a;
  int64_t t0 = u * PAIR_TILES;
  int nt = j->tiles - t0 < PAIR_TILES ? (int)(j->tiles - t0) : PAIR_TILES;
  float acc[MAX_ROWS * PAIR_TILES * LLMC_BF16_TILE];
  for (int64_t m0 = 0; m0 < a->M;) {
    int rows = a->M - m0 >= 4 ? 4 : a->M - m0 >= 2 ? 2 : 1;
    if (nt == 2) {
      if (rows == 4) rows_avx512(j, m0, t0, acc, 4, 2);
      else if (rows == 2) rows_avx512(j, m0, t0, acc, 2, 2);
      else rows_avx512(j, m0, t0, acc, 1, 2);
    } else {
      if (rows == 4) rows_avx512(j, m0, t0, acc, 4, 1);
      else if (rows == 2) rows_avx512(j, m0, t0, acc, 2, 1);
      else rows_avx512(j, m0, t0, acc, 1, 1);
    }
    store_rows(a, m0, rows, t0 * LLMC_BF16_TILE, acc, 1);
    m0 += rows;
  }
}


/* ---------------------------------------------------------------- widened: AVX-512F, AVX2 (no BF16 instructions) */

/* Where the CPU has no vdpbf16ps (an AVX-512 CPU without AVX512_BF16, as a hypervisor may mask it; AVX2 CPUs), each
 * 32-bit lane of the packed layout widens to its two fp32 weights with one shift (k even, the low half) and one
 * mask (k odd, the high half), and two FMAs per lane add them in the order Intel documents for vdpbf16ps (odd k,
 * then even) times x rounded to bf16: every product is exact in fp32, so the sums follow its documented arithmetic
 * (denormals aside, which it flushes; the tests hold the two to fp32's last bits, the widened paths to each other's
 * bits). Twice the arithmetic instructions of vdpbf16ps per weight; a decode step stays bound by the
 * weights' bytes, a prompt's by the FMAs, with up to 8 rows per pass over a unit's weights on AVX-512 (16
 * accumulators: each widened weight register used 8 times). */
#define WIDE_ROWS_512 8
#define WIDE_ROWS_256 4
#define TARGET_F __attribute__((target("avx512f")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))

/* x rounded to bf16 to nearest, ties to even (llmc_to_bf16's arithmetic, NaN kept), as fp32. */
static TARGET_F void round_f512(const float* x, int64_t n, float* out) {
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), hi = _mm512_set1_epi32((int)0xFFFF0000u);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    _mm512_storeu_ps(out + i, _mm512_mask_mov_ps(_mm512_castsi512_ps(_mm512_and_si512(r, hi)), nan, v));
  }
  for (; i < n; i++) out[i] = llmc_from_bf16(llmc_to_bf16(x[i]));
}

static inline __attribute__((always_inline)) TARGET_F void rows_f512(const bf16_job* j, int64_t m0, int64_t t0,
                                                                    float* out, const int RM, const int NT) {
  const llmc_bf16_args* a = j->a;
  const int64_t pairs = a->K / 2;
  const float* x = j->xf + m0 * a->K;
  const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
  __m512 acc[WIDE_ROWS_512][PAIR_TILES];
  for (int m = 0; m < RM; m++)
    for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
  const uint16_t* w[PAIR_TILES];
  for (int t = 0; t < NT; t++) w[t] = a->w + (t0 + t) * pairs * 2 * LLMC_BF16_TILE;
  for (int64_t p = 0; p < pairs; p++) {
    __m512 we[PAIR_TILES], wo[PAIR_TILES];
    for (int t = 0; t < NT; t++) {
      llmc_prefetch(w[t] + (p + j->ahead) * 32, j->l2);
      __m512i v = _mm512_loadu_si512(w[t] + p * 32);
      we[t] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[t] = _mm512_castsi512_ps(_mm512_and_si512(v, odd));
    }
    for (int m = 0; m < RM; m++) {
      __m512 xe = _mm512_set1_ps(x[m * a->K + 2 * p]), xo = _mm512_set1_ps(x[m * a->K + 2 * p + 1]);
      for (int t = 0; t < NT; t++) acc[m][t] = _mm512_fmadd_ps(we[t], xe, _mm512_fmadd_ps(wo[t], xo, acc[m][t]));
    }
  }
  for (int m = 0; m < RM; m++)
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(out + m * PAIR_TILES * LLMC_BF16_TILE + t * LLMC_BF16_TILE,
                                                  acc[m][t]);
}

static TARGET_F void unit_f512(const bf16_job* j, int64_t u) {
  const llmc_bf16_args* a = j->a;
  int64_t t0 = u * PAIR_TILES;
  int nt = j->tiles - t0 < PAIR_TILES ? (int)(j->tiles - t0) : PAIR_TILES;
  float acc[WIDE_ROWS_512 * PAIR_TILES * LLMC_BF16_TILE];
  for (int64_t m0 = 0; m0 < a->M;) {
    int64_t left = a->M - m0;
    int rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
#define F512(R)                                             \
  if (rows == R) {                                          \
    if (nt == 2) rows_f512(j, m0, t0, acc, R, 2);           \
    else rows_f512(j, m0, t0, acc, R, 1);                   \
  }
    F512(8) F512(4) F512(2) F512(1)
#undef F512
    store_rows(a, m0, rows, t0 * LLMC_BF16_TILE, acc, 1);
    m0 += rows;
  }
}

/* AVX2: each 64-byte pair row as two 8-column halves; RM rows x one tile per pass (8 accumulators of 16 registers). */
static inline __attribute__((always_inline)) TARGET_AVX2 void rows_avx2(const bf16_job* j, int64_t m0,
                                                                       const uint16_t* w, float* out, const int RM) {
  const llmc_bf16_args* a = j->a;
  const int64_t pairs = a->K / 2;
  const float* x = j->xf + m0 * a->K;
  const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
  __m256 acc[WIDE_ROWS_256][2];
  for (int m = 0; m < RM; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; p++) {
    __m256 we[2], wo[2];
    for (int h = 0; h < 2; h++) {
      __m256i v = _mm256_loadu_si256((const __m256i*)(w + p * 32 + h * 16));
      we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      wo[h] = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
    }
    for (int m = 0; m < RM; m++) {
      __m256 xe = _mm256_broadcast_ss(x + m * a->K + 2 * p), xo = _mm256_broadcast_ss(x + m * a->K + 2 * p + 1);
      for (int h = 0; h < 2; h++) acc[m][h] = _mm256_fmadd_ps(we[h], xe, _mm256_fmadd_ps(wo[h], xo, acc[m][h]));
    }
  }
  for (int m = 0; m < RM; m++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + m * PAIR_TILES * LLMC_BF16_TILE + h * 8, acc[m][h]);
}

static TARGET_AVX2 void unit_avx2(const bf16_job* j, int64_t u) {
  const llmc_bf16_args* a = j->a;
  const int64_t pairs = a->K / 2, t0 = u * PAIR_TILES;
  int nt = j->tiles - t0 < PAIR_TILES ? (int)(j->tiles - t0) : PAIR_TILES;
  float acc[WIDE_ROWS_256 * PAIR_TILES * LLMC_BF16_TILE];
  for (int64_t m0 = 0; m0 < a->M;) {
    int64_t left = a->M - m0;
    int rows = left >= 4 ? 4 : left >= 2 ? 2 : 1;
    for (int t = 0; t < nt; t++) {
      const uint16_t* w = a->w + (t0 + t) * pairs * 2 * LLMC_BF16_TILE;
      float* o = acc + t * LLMC_BF16_TILE;
      if (rows == 4) rows_avx2(j, m0, w, o, 4);
      else if (rows == 2) rows_avx2(j, m0, w, o, 2);
      else rows_avx2(j, m0, w, o, 1);
    }
    store_rows(a, m0, rows, t0 * LLMC_BF16_TILE, acc, 0);
    m0 += rows;
  }
}

/* ---------------------------------------------------------------- AMX-BF16 */

/* The unit's two tiles for all rows, 2 x 16 rows at a time (rows past M are read from xb's spare rows and
 * dropped); a last unit of one tile repeats its product as the second (dropped: store_rows stops at N). The last
 * 16 rows or fewer take one row block (llmc_amx_bf16_rows16): batch 8's decode did twice the tile products on
 * padding rows and waited on its weights' loads from memory, 1.4-1.5x as long a step as with one block and its
 * prefetches (SmolLM2 bf16, medians of 60 steps, interleaved: 29.9 -> 21.4, 31.7 -> 22.1, 22.0 -> 15.0 ms; the
 * AVX-512 path 27-35 ms). */
static void unit_amx(const bf16_job* j, int64_t u) {
  const llmc_bf16_args* a = j->a;
  const int64_t t0 = u * PAIR_TILES, pairs = a->K / 2, stride = a->K * 2; /* bytes per row of xb */
  const uint16_t* w0 = a->w + t0 * pairs * 2 * LLMC_BF16_TILE;
  const uint16_t* w1 = t0 + 1 < j->tiles ? w0 + pairs * 2 * LLMC_BF16_TILE : w0;
  __attribute__((aligned(64))) float c[4 * LLMC_AMX_ROWS * LLMC_BF16_TILE];
  float acc[LLMC_AMX_ROWS * PAIR_TILES * LLMC_BF16_TILE];
  llmc_amx_configure();
  for (int64_t m0 = 0; m0 < a->M; m0 += LLMC_AMX_SPAN) {
    const char* x = (const char*)j->xb + m0 * stride;
    if (a->M - m0 <= LLMC_AMX_ROWS) /* decode's batch: one row block, its weights prefetched */
      llmc_amx_bf16_rows16(x, stride, a->K, w0, w1, c);
    else
      llmc_amx_bf16_rows(x, stride, a->K, w0, w1, c);
    for (int blk = 0; blk < 2; blk++) {
      int64_t r0 = m0 + blk * LLMC_AMX_ROWS;
      if (r0 >= a->M) break;
      int rows = a->M - r0 < LLMC_AMX_ROWS ? (int)(a->M - r0) : LLMC_AMX_ROWS;
      llmc_amx_rows_of(c, blk, rows, acc);
      store_rows(a, r0, rows, t0 * LLMC_BF16_TILE, acc, 1);
    }
  }
}

static int cpu_has_bf16(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
#endif

static int env_on(const char* name) {
  const char* v = getenv(name);
  return v && *v && *v != '0';
}

int llmc_bf16_path(void) {
#ifdef LLMC_X86
  __builtin_cpu_init();
  int f512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (env_on("LLMC_KERNELS_GENERIC")) return LLMC_BF16_PORTABLE;
  if (env_on("LLMC_KERNELS_AVX2")) return avx2 ? LLMC_BF16_AVX2 : LLMC_BF16_PORTABLE;
  if (!cpu_has_bf16() || env_on("LLMC_KERNELS_NO_BF16"))
    return f512 ? LLMC_BF16_AVX512F : avx2 ? LLMC_BF16_AVX2 : LLMC_BF16_PORTABLE;
  return !env_on("LLMC_KERNELS_NO_AMX") && llmc_amx_bf16_usable() ? LLMC_BF16_AMX : LLMC_BF16_AVX512;
#else
  return LLMC_BF16_PORTABLE;
#endif
}

/* The units of part p of W. */
static void run_units(const bf16_job* j, int64_t p) {
  int64_t first = j->units * p / j->parts, end = j->units * (p + 1) / j->parts;
  for (int64_t u = first; u < end; u++) {
#ifdef LLMC_X86
    if (j->amx) {
      unit_amx(j, u);
      continue;
    }
    if (j->path == LLMC_BF16_AVX512 || j->path == LLMC_BF16_AMX) {
      unit_avx512(j, u);
      continue;
    }
    if (j->path == LLMC_BF16_AVX512F) {
      unit_f512(j, u);
      continue;
    }
    if (j->path == LLMC_BF16_AVX2) {
      unit_avx2(j, u);
      continue;
    }
#endif
    unit_generic(j, u);
  }
}

/* A task runs its pool thread's own contiguous part of W (the one its idle time read ahead: ahead.h), else part
 * `task`, then any part no task has taken (a worker may join a call late): each part once. */
static void run_part(void* data, size_t task) {
  bf16_job* j = (bf16_job*)data;
  int64_t own = llmc_ahead_own_part(task, j->parts);
  for (int64_t i = 0; i < j->parts; i++) {
    int64_t p = (own + i) % j->parts;
    if (!__atomic_exchange_n(&j->taken[p], 1, __ATOMIC_ACQ_REL)) run_units(j, p);
  }
#ifdef LLMC_X86
  if (j->amx) llmc_amx_release();
#endif
}

const char* llmc_bf16_matmul(const llmc_bf16_args* a, llmc_parallel_fn parallel, void* parallel_ctx) {
  static _Thread_local char msg[128];
  if (a->K <= 0 || a->K % 2 || a->N <= 0 || (a->gated && a->N % (PAIR_TILES * LLMC_BF16_TILE))) {
    snprintf(msg, sizeof msg, "K %lld must be positive and even, N %lld positive%s", (long long)a->K, (long long)a->N,
             a->gated ? " and a multiple of 32 (gated)" : "");
    return msg;
  }
  if (a->M <= 0) return NULL;
  int path = llmc_bf16_path();
  int widened = path == LLMC_BF16_AVX512F || path == LLMC_BF16_AVX2;
  /* x in bf16 (the widened paths: rounded, as fp32); + LLMC_AMX_SPAN spare rows: the AMX path's A tiles read
   * whole row blocks past M (those rows are dropped) */
  void* xbuf = widened ? malloc((size_t)(a->M * a->K) * sizeof(float))
                       : calloc((size_t)((a->M + LLMC_AMX_SPAN) * a->K), sizeof(uint16_t));
  if (!xbuf) return "out of memory for the bf16 activations";
  uint32_t* xb = widened ? NULL : (uint32_t*)xbuf;
  bf16_job j = {a, xb, widened ? (const float*)xbuf : NULL, (a->N + LLMC_BF16_TILE - 1) / LLMC_BF16_TILE, 0, 1, path,
                path == LLMC_BF16_AMX && a->M >= AMX_MIN_ROWS && a->K % LLMC_AMX_K == 0};
  j.units = (j.tiles + PAIR_TILES - 1) / PAIR_TILES;
#ifdef LLMC_X86
  j.l2 = path != LLMC_BF16_PORTABLE && !j.amx && llmc_prefetch_l2();
  j.ahead = j.l2 ? PREFETCH_PAIRS_L2 : PREFETCH_PAIRS;
  if (path == LLMC_BF16_AVX512F)
    round_f512(a->x, a->M * a->K, (float*)xbuf);
  else if (path == LLMC_BF16_AVX2)
    for (int64_t i = 0; i < a->M * a->K; i++) ((float*)xbuf)[i] = llmc_from_bf16(llmc_to_bf16(a->x[i]));
  else if (path != LLMC_BF16_PORTABLE)
    llmc_bf16_round(a->x, a->M * a->K, (uint16_t*)xb, NULL);
  else
#endif
    for (int64_t i = 0; i < a->M * a->K; i++) ((uint16_t*)xb)[i] = llmc_to_bf16(a->x[i]);
  j.parts = parallel && a->threads > 1 && j.units >= 2 ? (a->threads < j.units ? a->threads : j.units) : 1;
  unsigned char taken[LOCAL_PARTS] = {0}; /* (a decode call allocates nothing for its split) */
  j.taken = j.parts <= LOCAL_PARTS ? taken : calloc((size_t)j.parts, 1);
  if (!j.taken) {
    free(xbuf);
    return "out of memory for the work split";
  }
  if (j.parts > 1) {
    if (!j.amx) llmc_ahead_before(a->w, 2 * a->K * LLMC_BF16_TILE * (int64_t)sizeof(uint16_t), j.units, j.parts);
    parallel(parallel_ctx, run_part, (size_t)j.parts, &j);
  } else {
    run_part(&j, 0);
  }
  if (j.taken != taken) free(j.taken);
  free(xbuf);
  return NULL;
}
