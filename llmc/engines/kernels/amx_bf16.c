/* AMX-BF16 tiles for the matrix products' prompts (see amx_bf16.h). */
#include "amx_bf16.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(LLMC_PORTABLE_ONLY)
#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;

static _Thread_local int amx_configured;

/* Tiles 0, 1: A (two blocks of 16 rows x 32 bf16); 2, 3: B (two tiles' 16 pairs x 16 columns); 4..7: C (fp32,
 * [row block][tile]). All 16 rows x 64 bytes. */
TARGET_AMX void llmc_amx_configure(void) {
  if (amx_configured) return;
  amx_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = LLMC_AMX_ROWS;
  /* a compiler barrier: GCC 12 may drop the stores of colsb and rows as dead before _tile_loadconfig's asm (seen
   * once the function was no longer inlined: only the palette byte reached memory, and the tiles faulted) */
  __asm__ volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
  amx_configured = 1;
}

TARGET_AMX void llmc_amx_release(void) {
  if (!amx_configured) return;
  _tile_release();
  amx_configured = 0;
}

/* B streams from memory (decode: llmc_amx_bf16_rows16): the tiles of 8 steps ahead prefetched. */
static inline void prefetch_b(const uint16_t* w0, const uint16_t* w1, int64_t k0, int64_t K) {
  if (k0 + 8 * LLMC_AMX_K < K)
    for (int l = 0; l < 1024; l += 64) {
      _mm_prefetch((const char*)(w0 + (k0 + 8 * LLMC_AMX_K) * 16) + l, _MM_HINT_T0);
      _mm_prefetch((const char*)(w1 + (k0 + 8 * LLMC_AMX_K) * 16) + l, _MM_HINT_T0);
    }
}

/* Each pair of B tile loads is used by both row blocks, each A tile load by both tiles. */
TARGET_AMX void llmc_amx_bf16_rows(const char* x, int64_t stride, int64_t K, const uint16_t* w0, const uint16_t* w1,
                                   float* c) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t k0 = 0; k0 < K; k0 += LLMC_AMX_K) {
    _tile_loadd(2, w0 + k0 * 16, 64);
    _tile_loadd(3, w1 + k0 * 16, 64);
    _tile_loadd(0, x + k0 * 2, stride);
    _tile_loadd(1, x + LLMC_AMX_ROWS * stride + k0 * 2, stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
  _tile_stored(6, c + 512, 64);
  _tile_stored(7, c + 768, 64);
}

/* One row block: tiles 0 (A), 2, 3 (B), 4, 5 (C); the B streams prefetched (they come from memory: decode). */
TARGET_AMX void llmc_amx_bf16_rows16(const char* x, int64_t stride, int64_t K, const uint16_t* w0,
                                     const uint16_t* w1, float* c) {
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t k0 = 0; k0 < K; k0 += LLMC_AMX_K) {
    prefetch_b(w0, w1, k0, K);
    _tile_loadd(2, w0 + k0 * 16, 64);
    _tile_loadd(3, w1 + k0 * 16, 64);
    _tile_loadd(0, x + k0 * 2, stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
  }
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
}

/* Tiles 0, 1: A (q hi, lo); 2, 3: B (group 0's hi, lo); 6, 7: B (group 1's); 4, 5: C (group 0, 1). The two
 * groups' chains of products interleave (each tile product waits on the one before it into the same C). */
TARGET_AMX void llmc_amx_scores(const uint16_t* const* q, int D, const uint16_t* kt0, const uint16_t* kt1, float* c) {
  _tile_zero(4);
  _tile_zero(5);
  for (int db = 0; db < D / LLMC_AMX_K; db++) {
    const uint16_t *b0 = kt0 + db * 2 * 512, *b1 = kt1 + db * 2 * 512;
    _tile_loadd(0, q[0] + db * LLMC_AMX_K, D * 2);
    _tile_loadd(1, q[1] + db * LLMC_AMX_K, D * 2);
    _tile_loadd(2, b0, 64);
    _tile_loadd(6, b1, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 6);
    _tile_dpbf16ps(4, 1, 2);
    _tile_dpbf16ps(5, 1, 6);
    _tile_loadd(3, b0 + 512, 64);
    _tile_loadd(7, b1 + 512, 64);
    _tile_dpbf16ps(4, 0, 3);
    _tile_dpbf16ps(5, 0, 7);
  }
  _tile_stored(4, c, 128);
  _tile_stored(5, c + 16, 128);
}

/* Tiles 0, 1: A (p hi, lo); 2, 3: B (a column tile's hi, lo); 4..7: C, up to 4 column tiles (64 dims) a pass. */
TARGET_AMX void llmc_amx_values(const uint16_t* const* p, int64_t p_stride, int nw, const uint16_t* vt,
                                size_t window, int D, float* out) {
  for (int c0 = 0; c0 < D / 16; c0 += 4) {
    int nc = D / 16 - c0 < 4 ? D / 16 - c0 : 4;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int w = 0; w < nw; w++) {
      const uint16_t* b = vt + (size_t)w * window + (size_t)c0 * 2 * 512;
      _tile_loadd(0, p[0] + w * LLMC_AMX_K, p_stride);
      _tile_loadd(1, p[1] + w * LLMC_AMX_K, p_stride);
#define LLMC_VALUES_TILE(ct, c)              \
  if (ct < nc) {                             \
    _tile_loadd(2, b + ct * 1024, 64);       \
    _tile_loadd(3, b + ct * 1024 + 512, 64); \
    _tile_dpbf16ps(c, 0, 2);                 \
    _tile_dpbf16ps(c, 1, 2);                 \
    _tile_dpbf16ps(c, 0, 3);                 \
  }
      LLMC_VALUES_TILE(0, 4)
      LLMC_VALUES_TILE(1, 5)
      LLMC_VALUES_TILE(2, 6)
      LLMC_VALUES_TILE(3, 7)
#undef LLMC_VALUES_TILE
    }
    _tile_stored(4, out + c0 * 16, D * 4);
    if (nc > 1) _tile_stored(5, out + c0 * 16 + 16, D * 4);
    if (nc > 2) _tile_stored(6, out + c0 * 16 + 32, D * 4);
    if (nc > 3) _tile_stored(7, out + c0 * 16 + 48, D * 4);
  }
}

/* One 16 x 16 x 32 product on the tiles against the plain sum (run in a child process: see amx_bf16.h). */
static TARGET_AMX int amx_computes(void) {
  __attribute__((aligned(64))) uint16_t x[LLMC_AMX_ROWS * LLMC_AMX_K], w[LLMC_AMX_K * 16];
  __attribute__((aligned(64))) float c[LLMC_AMX_ROWS * 16];
  for (int i = 0; i < LLMC_AMX_ROWS * LLMC_AMX_K; i++) x[i] = llmc_to_bf16((float)(i % 7) - 3.f);
  for (int i = 0; i < LLMC_AMX_K * 16; i++) w[i] = llmc_to_bf16((float)(i % 5) - 2.f);
  llmc_amx_configure();
  _tile_loadd(0, x, LLMC_AMX_K * 2);
  _tile_loadd(2, w, 64);
  _tile_zero(4);
  _tile_dpbf16ps(4, 0, 2);
  _tile_stored(4, c, 64);
  llmc_amx_release();
  for (int m = 0; m < LLMC_AMX_ROWS; m++)
    for (int n = 0; n < 16; n++) {
      float want = 0.f;
      for (int k = 0; k < LLMC_AMX_K; k++)
        want += llmc_from_bf16(x[m * LLMC_AMX_K + k]) * llmc_from_bf16(w[(k / 2) * 32 + 2 * n + k % 2]);
      if (c[m * 16 + n] != want) return 0;
    }
  return 1;
}

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_check(void) {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22))) return 0;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512bf16"))
    return 0;
  if (!__get_cpuid_count(1, 0, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return 0; /* OSXSAVE */
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return 0;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
  fflush(NULL);
  pid_t child = fork();
  if (child < 0) return 0;
  if (child == 0) _exit(amx_computes() ? 0 : 1);
  int status = 0;
  while (waitpid(child, &status, 0) < 0)
    if (errno != EINTR) return 0;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

int llmc_amx_bf16_usable(void) {
  static int usable = -1;
  if (usable < 0) usable = amx_check();
  return usable;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void llmc_bf16_round(const float* x, int64_t n,
                                                                                     uint16_t* hi, uint16_t* lo) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    _mm256_storeu_si256((__m256i*)(hi + i), h);
    if (lo) {
      __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm256_storeu_si256((__m256i*)(lo + i), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
    }
  }
  for (; i < n; i++) {
    hi[i] = llmc_to_bf16(x[i]);
    if (lo) lo[i] = llmc_to_bf16(x[i] - llmc_from_bf16(hi[i]));
  }
}
#endif
