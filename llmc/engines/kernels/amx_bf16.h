/* AMX-BF16 tiles, shared by the matrix products' and attention's prompts: whether this process may use them, the
 * products' tile loop and attention's two. Internal to the operator library; the functions exist on x86-64 only
 * (the bf16 conversions everywhere).
 *
 * B operand layout (matmul_bf16.h's packed tiles, and what matmul_q4.c expands its blocks to): per tile of 16
 * columns, uint16 bf16 bits [K / 2][32]: pair p holds w[2p, j], w[2p + 1, j] side by side for j = 0..15, so 16 pairs
 * (32 k) are one 16 x 64-byte B tile. A operand: x rounded to bf16, [rows][K] with `stride` bytes a row.
 */
#ifndef LLMC_AMX_BF16_H
#define LLMC_AMX_BF16_H

#include <stdint.h>
#include <string.h>

#define LLMC_AMX_ROWS 16 /* rows of x per A tile */
#define LLMC_AMX_K 32    /* k per tile step: 16 pairs */
#define LLMC_AMX_SPAN (2 * LLMC_AMX_ROWS) /* rows of x per call of llmc_amx_bf16_rows: two A tiles */

/* AMX-BF16 usable: listed by the CPU (AMX-TILE, AMX-BF16, and AVX-512 BF16 for rounding x), its state enabled by
 * the OS (XCR0 bits 17, 18), the tiles granted to this process (arch_prctl), and one product computed right in a
 * child process (a VM may list AMX and fault on it: llama.cpp's AMX code dies with SIGILL on one of ours). Checked
 * once per process. */
int llmc_amx_bf16_usable(void);

/* This thread's tile configuration (8 tiles of 16 rows x 64 bytes), loaded once until llmc_amx_release. */
void llmc_amx_configure(void);
void llmc_amx_release(void);

/* Rows 0 .. LLMC_AMX_SPAN of x (`stride` bytes a row: rows past the caller's M are read and their products dropped
 * by the caller) times two B tile streams w0, w1 ([K / 2][32] each) over all of K, into c [2 row blocks][2 tiles]
 * [16 x 16] (fp32). K a multiple of LLMC_AMX_K; the thread configured. */
void llmc_amx_bf16_rows(const char* x, int64_t stride, int64_t K, const uint16_t* w0, const uint16_t* w1, float* c);

/* llmc_amx_bf16_rows for one row block (rows 0 .. LLMC_AMX_ROWS, into c's first [2 tiles][16 x 16]), its B
 * streams prefetched from memory ahead of the loads (decode's few rows). */
void llmc_amx_bf16_rows16(const char* x, int64_t stride, int64_t K, const uint16_t* w0, const uint16_t* w1, float* c);

/* Attention scores of a prompt (attention_kernel.c): 16 query vectors (A: q[0] hi, q[1] lo bf16 [16][D], D a
 * multiple of 32) against two groups of 16 keys (B: kt0, kt1, each [D / 32][2 levels: hi, lo][16 pairs][32]: pair
 * r of dims 2r, 2r + 1 for each of the 16 keys), hi.hi + lo.hi + hi.lo (the lo.lo term, ~2^-18 of each product, is
 * left out), into c [16][32] fp32 (the groups' keys side by side). The thread configured. */
void llmc_amx_scores(const uint16_t* const* q, int D, const uint16_t* kt0, const uint16_t* kt1, float* c);

/* Weighted sums of a prompt's values (attention_kernel.c): over nw windows of 32 keys, p[0] hi, p[1] lo bf16
 * [16 vectors][p_stride bytes] (the windows' weights side by side, window w's from element 32 w) times each
 * window's values (B: vt + w * window, each [D / 16][2 levels: hi, lo][16 key pairs][32]: pair r of keys 2r,
 * 2r + 1 for 16 dims), hi.hi + lo.hi + hi.lo, into out [16][D] fp32. D a multiple of 32; the thread configured. */
void llmc_amx_values(const uint16_t* const* p, int64_t p_stride, int nw, const uint16_t* vt, size_t window, int D,
                     float* out);

/* Rows 0 .. rows of row block blk of llmc_amx_bf16_rows' c, both tiles side by side: out [rows][32]. */
static inline void llmc_amx_rows_of(const float* c, int blk, int rows, float* out) {
  for (int m = 0; m < rows; m++)
    for (int t = 0; t < 2; t++)
      memcpy(out + m * 32 + t * 16, c + (blk * 2 + t) * LLMC_AMX_ROWS * 16 + m * 16, sizeof(float) * 16);
}

/* fp32 -> bf16 bits, to nearest, ties to even (x finite), and back. */
static inline uint16_t llmc_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN (quiet), as in vcvtneps2bf16 */
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float llmc_from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* n floats -> bf16 bits (to nearest, ties to even), 16 per instruction (AVX-512 BF16); with lo, also what each
 * leaves, rounded the same way (x ~ hi + lo to ~16 bits of mantissa). */
void llmc_bf16_round(const float* x, int64_t n, uint16_t* hi, uint16_t* lo);

#endif
