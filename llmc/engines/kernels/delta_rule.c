/* The gated delta rule over a run of tokens (see delta_rule.h). */
#include "delta_rule.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(LLMC_PORTABLE_ONLY)
#define LLMC_X86 1
#include <immintrin.h>

#include "vec_math.h"
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_V 1024 /* a value head's dims: the per-token vectors live on the stack */
#define MAX_K 1024 /* a key head's dims: the per-token decays live on the stack */

typedef struct {
  const llmc_delta_rule_args* a;
  int path;
} rule_job;

/* One (row, value head): its inputs' strides and the token's vectors. */
typedef struct {
  const float *q, *k, *v, *g, *beta;
  float *m, *out;
  int64_t qk_stride, v_stride, gb_stride, g_stride, K, V, S;
  int g_per_key; /* g [.., K] a token: one decay per row of M (Kimi's), else one for all of M */
  const float* A; /* [K, V] or NULL: Mamba-1's selective scan, M[i][j] decays by exp(g[j] A[i][j]), u = beta . v */
} unit;

/* Token t's decay of each row of M: dec[i] = exp(g_t) (or exp(g_t[i]) where g has one per key dim). */
static void decays(const unit* u, int64_t t, float* dec) {
  const float* g = u->g + t * u->g_stride;
  if (u->g_per_key) {
    for (int64_t i = 0; i < u->K; i++) dec[i] = expf(g[i]);
  } else {
    float d = expf(g[0]);
    for (int64_t i = 0; i < u->K; i++) dec[i] = d;
  }
}

static void unit_generic(const unit* u) {
  float kv[MAX_V], o[MAX_V], dec[MAX_K];
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    float beta = u->beta[t * u->gb_stride];
    decays(u, t, dec);
    for (int64_t j = 0; j < u->V; j++) kv[j] = 0.f;
    for (int64_t i = 0; i < u->K; i++) {
      float* row = u->m + i * u->V;
      for (int64_t j = 0; j < u->V; j++) {
        row[j] *= dec[i];
        kv[j] += k[i] * row[j];
      }
    }
    for (int64_t j = 0; j < u->V; j++) {
      kv[j] = beta * (v[j] - kv[j]);
      o[j] = 0.f;
    }
    for (int64_t i = 0; i < u->K; i++) {
      float* row = u->m + i * u->V;
      for (int64_t j = 0; j < u->V; j++) {
        row[j] += k[i] * kv[j];
        o[j] += q[i] * row[j];
      }
    }
    memcpy(u->out + t * u->v_stride, o, (size_t)u->V * sizeof(float));
  }
}


/* Without the delta (Mamba-2): M <- M exp(g) + k^T (beta v), o = q M: one pass of M a token. */
static void decay_generic(const unit* u) {
  float bv[MAX_V], o[MAX_V], dec[MAX_K];
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    float beta = u->beta[t * u->gb_stride];
    decays(u, t, dec);
    for (int64_t j = 0; j < u->V; j++) {
      bv[j] = beta * v[j];
      o[j] = 0.f;
    }
    for (int64_t i = 0; i < u->K; i++) {
      float* row = u->m + i * u->V;
      for (int64_t j = 0; j < u->V; j++) {
        row[j] = row[j] * dec[i] + k[i] * bv[j];
        o[j] += q[i] * row[j];
      }
    }
    memcpy(u->out + t * u->v_stride, o, (size_t)u->V * sizeof(float));
  }
}

/* Mamba-1's selective scan (a decay per element of M): M[i][j] <- M[i][j] exp(g[j] A[i][j]) + k[i] beta[j] v[j],
 * o = q M (g = beta = dt, one a value dim). */
static void scan_generic(const unit* u) {
  float bv[MAX_V], o[MAX_V];
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    const float *g = u->g + t * u->g_stride, *beta = u->beta + t * u->gb_stride;
    for (int64_t j = 0; j < u->V; j++) {
      bv[j] = beta[j] * v[j];
      o[j] = 0.f;
    }
    for (int64_t i = 0; i < u->K; i++) {
      float* row = u->m + i * u->V;
      const float* a = u->A + i * u->V;
      for (int64_t j = 0; j < u->V; j++) {
        row[j] = row[j] * expf(g[j] * a[j]) + k[i] * bv[j];
        o[j] += q[i] * row[j];
      }
    }
    memcpy(u->out + t * u->v_stride, o, (size_t)u->V * sizeof(float));
  }
}

#ifdef LLMC_X86
__attribute__((target("avx512f"))) static void unit_avx512(const unit* u) {
  float kv[MAX_V], o[MAX_V], dec[MAX_K];
  const int64_t V = u->V;
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    __m512 beta = _mm512_set1_ps(u->beta[t * u->gb_stride]);
    decays(u, t, dec);
    for (int64_t j = 0; j < V; j += 16) _mm512_storeu_ps(kv + j, _mm512_setzero_ps());
    for (int64_t i = 0; i < u->K; i++) { /* the decay, and k M */
      float* row = u->m + i * V;
      __m512 ki = _mm512_set1_ps(k[i]), decay = _mm512_set1_ps(dec[i]);
      for (int64_t j = 0; j < V; j += 16) {
        __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + j), decay);
        _mm512_storeu_ps(row + j, r);
        _mm512_storeu_ps(kv + j, _mm512_fmadd_ps(ki, r, _mm512_loadu_ps(kv + j)));
      }
    }
    for (int64_t j = 0; j < V; j += 16) {
      _mm512_storeu_ps(kv + j, _mm512_mul_ps(beta, _mm512_sub_ps(_mm512_loadu_ps(v + j), _mm512_loadu_ps(kv + j))));
      _mm512_storeu_ps(o + j, _mm512_setzero_ps());
    }
    for (int64_t i = 0; i < u->K; i++) { /* M + k^T u, and q M */
      float* row = u->m + i * V;
      __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
      for (int64_t j = 0; j < V; j += 16) {
        __m512 r = _mm512_fmadd_ps(ki, _mm512_loadu_ps(kv + j), _mm512_loadu_ps(row + j));
        _mm512_storeu_ps(row + j, r);
        _mm512_storeu_ps(o + j, _mm512_fmadd_ps(qi, r, _mm512_loadu_ps(o + j)));
      }
    }
    memcpy(u->out + t * u->v_stride, o, (size_t)V * sizeof(float));
  }
}

/* V = 128 (the published models' value heads): one pass of M a token, its three 128-wide vectors in registers.
 * Token t's update M + k_t^T u_t and its output q_t M are fused with token t + 1's decay and k_{t+1} M, row by row
 * (each row's part of those depends on that row only), so each row is loaded and stored once a token. */
#define V128 8
__attribute__((target("avx512f"))) static void unit_avx512_v128(const unit* u) {
  const int64_t K = u->K;
  __m512 uu[V128], acc[V128], mem[V128];
  const float *k = u->k, *v = u->v;
  float dec[MAX_K];
  decays(u, 0, dec);
#pragma GCC unroll 8
  for (int j = 0; j < V128; j++) mem[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < K; i++) { /* token 0's decay and k M */
    float* row = u->m + i * 128;
    __m512 ki = _mm512_set1_ps(k[i]), decay = _mm512_set1_ps(dec[i]);
#pragma GCC unroll 8
    for (int j = 0; j < V128; j++) {
      __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * j), decay);
      _mm512_storeu_ps(row + 16 * j, r);
      mem[j] = _mm512_fmadd_ps(ki, r, mem[j]);
    }
  }
  __m512 beta = _mm512_set1_ps(u->beta[0]);
#pragma GCC unroll 8
  for (int j = 0; j < V128; j++) uu[j] = _mm512_mul_ps(beta, _mm512_sub_ps(_mm512_loadu_ps(v + 16 * j), mem[j]));
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *kt = u->k + t * u->qk_stride;
    int next = t + 1 < u->S;
    const float* kn = next ? kt + u->qk_stride : kt;
    if (next)
      decays(u, t + 1, dec);
    else
      for (int64_t i = 0; i < K; i++) dec[i] = 1.f;
#pragma GCC unroll 8
    for (int j = 0; j < V128; j++) acc[j] = mem[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i++) {
      float* row = u->m + i * 128;
      __m512 ki = _mm512_set1_ps(kt[i]), qi = _mm512_set1_ps(q[i]), kni = _mm512_set1_ps(kn[i]);
      __m512 decay = _mm512_set1_ps(dec[i]);
#pragma GCC unroll 8
      for (int j = 0; j < V128; j++) {
        __m512 r = _mm512_fmadd_ps(ki, uu[j], _mm512_loadu_ps(row + 16 * j));
        acc[j] = _mm512_fmadd_ps(qi, r, acc[j]);
        r = _mm512_mul_ps(r, decay); /* (1 after the run's last token: the state stays as updated) */
        _mm512_storeu_ps(row + 16 * j, r);
        mem[j] = _mm512_fmadd_ps(kni, r, mem[j]);
      }
    }
    float* out = u->out + t * u->v_stride;
#pragma GCC unroll 8
    for (int j = 0; j < V128; j++) _mm512_storeu_ps(out + 16 * j, acc[j]);
    if (next) {
      const float* vn = u->v + (t + 1) * u->v_stride;
      beta = _mm512_set1_ps(u->beta[(t + 1) * u->gb_stride]);
#pragma GCC unroll 8
      for (int j = 0; j < V128; j++) uu[j] = _mm512_mul_ps(beta, _mm512_sub_ps(_mm512_loadu_ps(vn + 16 * j), mem[j]));
    }
  }
}

__attribute__((target("avx2,fma"))) static void unit_avx2(const unit* u) {
  float kv[MAX_V], o[MAX_V], dec[MAX_K];
  const int64_t V = u->V;
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    __m256 beta = _mm256_set1_ps(u->beta[t * u->gb_stride]);
    decays(u, t, dec);
    for (int64_t j = 0; j < V; j += 8) _mm256_storeu_ps(kv + j, _mm256_setzero_ps());
    for (int64_t i = 0; i < u->K; i++) {
      float* row = u->m + i * V;
      __m256 ki = _mm256_set1_ps(k[i]), decay = _mm256_set1_ps(dec[i]);
      for (int64_t j = 0; j < V; j += 8) {
        __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + j), decay);
        _mm256_storeu_ps(row + j, r);
        _mm256_storeu_ps(kv + j, _mm256_fmadd_ps(ki, r, _mm256_loadu_ps(kv + j)));
      }
    }
    for (int64_t j = 0; j < V; j += 8) {
      _mm256_storeu_ps(kv + j, _mm256_mul_ps(beta, _mm256_sub_ps(_mm256_loadu_ps(v + j), _mm256_loadu_ps(kv + j))));
      _mm256_storeu_ps(o + j, _mm256_setzero_ps());
    }
    for (int64_t i = 0; i < u->K; i++) {
      float* row = u->m + i * V;
      __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
      for (int64_t j = 0; j < V; j += 8) {
        __m256 r = _mm256_fmadd_ps(ki, _mm256_loadu_ps(kv + j), _mm256_loadu_ps(row + j));
        _mm256_storeu_ps(row + j, r);
        _mm256_storeu_ps(o + j, _mm256_fmadd_ps(qi, r, _mm256_loadu_ps(o + j)));
      }
    }
    memcpy(u->out + t * u->v_stride, o, (size_t)V * sizeof(float));
  }
}

/* decay_generic's loop, a block of up to 8 vectors of V at a time (beta v and q M in registers). */
__attribute__((target("avx512f"))) static void decay_avx512(const unit* u) {
  const int64_t V = u->V;
  float dec[MAX_K];
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    __m512 beta = _mm512_set1_ps(u->beta[t * u->gb_stride]);
    decays(u, t, dec);
    for (int64_t j0 = 0; j0 < V; j0 += 128) {
      int n = (int)((V - j0 < 128 ? V - j0 : 128) / 16);
      __m512 bv[8], acc[8];
      for (int j = 0; j < n; j++) {
        bv[j] = _mm512_mul_ps(beta, _mm512_loadu_ps(v + j0 + 16 * j));
        acc[j] = _mm512_setzero_ps();
      }
      for (int64_t i = 0; i < u->K; i++) {
        float* row = u->m + i * V + j0;
        __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]), decay = _mm512_set1_ps(dec[i]);
        for (int j = 0; j < n; j++) {
          __m512 r = _mm512_fmadd_ps(ki, bv[j], _mm512_mul_ps(_mm512_loadu_ps(row + 16 * j), decay));
          _mm512_storeu_ps(row + 16 * j, r);
          acc[j] = _mm512_fmadd_ps(qi, r, acc[j]);
        }
      }
      for (int j = 0; j < n; j++) _mm512_storeu_ps(u->out + t * u->v_stride + j0 + 16 * j, acc[j]);
    }
  }
}

__attribute__((target("avx2,fma"))) static void decay_avx2(const unit* u) {
  const int64_t V = u->V;
  float dec[MAX_K];
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    __m256 beta = _mm256_set1_ps(u->beta[t * u->gb_stride]);
    decays(u, t, dec);
    for (int64_t j0 = 0; j0 < V; j0 += 64) {
      int n = (int)((V - j0 < 64 ? V - j0 : 64) / 8);
      __m256 bv[8], acc[8];
      for (int j = 0; j < n; j++) {
        bv[j] = _mm256_mul_ps(beta, _mm256_loadu_ps(v + j0 + 8 * j));
        acc[j] = _mm256_setzero_ps();
      }
      for (int64_t i = 0; i < u->K; i++) {
        float* row = u->m + i * V + j0;
        __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]), decay = _mm256_set1_ps(dec[i]);
        for (int j = 0; j < n; j++) {
          __m256 r = _mm256_fmadd_ps(ki, bv[j], _mm256_mul_ps(_mm256_loadu_ps(row + 8 * j), decay));
          _mm256_storeu_ps(row + 8 * j, r);
          acc[j] = _mm256_fmadd_ps(qi, r, acc[j]);
        }
      }
      for (int j = 0; j < n; j++) _mm256_storeu_ps(u->out + t * u->v_stride + j0 + 8 * j, acc[j]);
    }
  }
}

/* scan_generic's loop, a block of up to 8 vectors of V at a time (beta v, dt and q M in registers). */
__attribute__((target("avx512f"))) static void scan_avx512(const unit* u) {
  const int64_t V = u->V;
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    const float *g = u->g + t * u->g_stride, *beta = u->beta + t * u->gb_stride;
    for (int64_t j0 = 0; j0 < V; j0 += 128) {
      int n = (int)((V - j0 < 128 ? V - j0 : 128) / 16);
      __m512 bv[8], dt[8], acc[8];
      for (int j = 0; j < n; j++) {
        bv[j] = _mm512_mul_ps(_mm512_loadu_ps(beta + j0 + 16 * j), _mm512_loadu_ps(v + j0 + 16 * j));
        dt[j] = _mm512_loadu_ps(g + j0 + 16 * j);
        acc[j] = _mm512_setzero_ps();
      }
      for (int64_t i = 0; i < u->K; i++) {
        float* row = u->m + i * V + j0;
        const float* a = u->A + i * V + j0;
        __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        for (int j = 0; j < n; j++) {
          __m512 decay = llmc_exp512(_mm512_mul_ps(dt[j], _mm512_loadu_ps(a + 16 * j)));
          __m512 r = _mm512_fmadd_ps(ki, bv[j], _mm512_mul_ps(_mm512_loadu_ps(row + 16 * j), decay));
          _mm512_storeu_ps(row + 16 * j, r);
          acc[j] = _mm512_fmadd_ps(qi, r, acc[j]);
        }
      }
      for (int j = 0; j < n; j++) _mm512_storeu_ps(u->out + t * u->v_stride + j0 + 16 * j, acc[j]);
    }
  }
}

__attribute__((target("avx2,fma"))) static void scan_avx2(const unit* u) {
  const int64_t V = u->V;
  for (int64_t t = 0; t < u->S; t++) {
    const float *q = u->q + t * u->qk_stride, *k = u->k + t * u->qk_stride, *v = u->v + t * u->v_stride;
    const float *g = u->g + t * u->g_stride, *beta = u->beta + t * u->gb_stride;
    for (int64_t j0 = 0; j0 < V; j0 += 64) {
      int n = (int)((V - j0 < 64 ? V - j0 : 64) / 8);
      __m256 bv[8], dt[8], acc[8];
      for (int j = 0; j < n; j++) {
        bv[j] = _mm256_mul_ps(_mm256_loadu_ps(beta + j0 + 8 * j), _mm256_loadu_ps(v + j0 + 8 * j));
        dt[j] = _mm256_loadu_ps(g + j0 + 8 * j);
        acc[j] = _mm256_setzero_ps();
      }
      for (int64_t i = 0; i < u->K; i++) {
        float* row = u->m + i * V + j0;
        const float* a = u->A + i * V + j0;
        __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
        for (int j = 0; j < n; j++) {
          __m256 decay = llmc_exp256(_mm256_mul_ps(dt[j], _mm256_loadu_ps(a + 8 * j)));
          __m256 r = _mm256_fmadd_ps(ki, bv[j], _mm256_mul_ps(_mm256_loadu_ps(row + 8 * j), decay));
          _mm256_storeu_ps(row + 8 * j, r);
          acc[j] = _mm256_fmadd_ps(qi, r, acc[j]);
        }
      }
      for (int j = 0; j < n; j++) _mm256_storeu_ps(u->out + t * u->v_stride + j0 + 8 * j, acc[j]);
    }
  }
}
#endif

static int env_on(const char* name) {
  const char* v = getenv(name);
  return v && *v && *v != '0';
}

int llmc_delta_rule_path(int64_t V) {
#ifdef LLMC_X86
  if (env_on("LLMC_KERNELS_GENERIC")) return 0;
  __builtin_cpu_init();
  int avx2 = V % 8 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (env_on("LLMC_KERNELS_AVX2")) return avx2 ? 1 : 0;
  if (V % 16 == 0 && __builtin_cpu_supports("avx512f")) return 2;
  return avx2 ? 1 : 0;
#else
  (void)V;
  return 0;
#endif
}

static void unit_task(void* data, size_t task) {
  const rule_job* j = (const rule_job*)data;
  const llmc_delta_rule_args* a = j->a;
  int64_t b = (int64_t)task / a->H, h = (int64_t)task % a->H, kh = h / (a->H / a->Hk);
  int64_t at = a->rows ? a->rows[b] : b; /* (its state's place: its slot in a pool) */
  float* m = a->state_out + (at * a->H + h) * a->K * a->V;
  const float* before = a->state + (at * a->H + h) * a->K * a->V;
  if (m != before) memcpy(m, before, (size_t)(a->K * a->V) * sizeof(float));
  /* a token's g and beta: one value a head, or g one a key dim (Kimi), or both one a value dim (Mamba-1's scan) */
  int64_t g_width = a->A ? a->V : a->g_per_key ? a->K : 1, beta_width = a->A ? a->V : 1;
  unit u = {.q = a->q + (b * a->S * a->Hk + kh) * a->K, .k = a->k + (b * a->S * a->Hk + kh) * a->K,
            .v = a->v + (b * a->S * a->H + h) * a->V,
            .g = a->g + (b * a->S * a->H + h) * g_width, .beta = a->beta + (b * a->S * a->H + h) * beta_width,
            .m = m, .out = a->out + (b * a->S * a->H + h) * a->V, .qk_stride = a->Hk * a->K,
            .v_stride = a->H * a->V, .gb_stride = a->H * beta_width, .g_stride = a->H * g_width, .K = a->K,
            .V = a->V, .S = a->S, .g_per_key = a->g_per_key, .A = a->A ? a->A + h * a->K * a->V : NULL};
#ifdef LLMC_X86
  if (a->A) {
    if (j->path == 2)
      scan_avx512(&u);
    else if (j->path == 1)
      scan_avx2(&u);
    else
      scan_generic(&u);
    return;
  }
  if (!a->delta) {
    if (j->path == 2)
      decay_avx512(&u);
    else if (j->path == 1)
      decay_avx2(&u);
    else
      decay_generic(&u);
    return;
  }
  if (j->path == 2) {
    if (a->V == 128 && a->S > 0)
      unit_avx512_v128(&u);
    else
      unit_avx512(&u);
    return;
  }
  if (j->path == 1) {
    unit_avx2(&u);
    return;
  }
#endif
  if (a->A) {
    scan_generic(&u);
    return;
  }
  if (!a->delta) {
    decay_generic(&u);
    return;
  }
  unit_generic(&u);
}

const char* llmc_delta_rule(const llmc_delta_rule_args* a, llmc_parallel_fn parallel, void* parallel_ctx) {
  static _Thread_local char msg[160];
  if (a->B < 0 || a->S < 0 || a->Hk <= 0 || a->H <= 0 || a->H % a->Hk || a->K <= 0 || a->V <= 0 || a->V > MAX_V ||
      a->K > MAX_K) {
    snprintf(msg, sizeof msg, "value heads %lld must be a multiple of key heads %lld, dims K %lld and V %lld "
             "positive, each at most %d", (long long)a->H, (long long)a->Hk, (long long)a->K, (long long)a->V, MAX_V);
    return msg;
  }
  if (a->A && (a->delta || a->g_per_key)) {
    snprintf(msg, sizeof msg, "a decay per element (A) runs without the delta (delta 0) and with g one a value dim");
    return msg;
  }
  if (a->rows) {
    for (int64_t b = 0; b < a->B; b++) {
      if (a->rows[b] < 0 || a->rows[b] >= a->N) {
        snprintf(msg, sizeof msg, "state_rows[%lld] = %d is outside the pool's %lld states", (long long)b,
                 a->rows[b], (long long)a->N);
        return msg;
      }
    }
    if (a->state_out != a->state) /* (a pool not bound in place: the rows this run leaves are the input's) */
      memcpy(a->state_out, a->state, (size_t)(a->N * a->H * a->K * a->V) * sizeof(float));
  }
  rule_job j = {a, llmc_delta_rule_path(a->V)};
  size_t tasks = (size_t)(a->B * a->H);
  if (parallel && tasks >= 2)
    parallel(parallel_ctx, unit_task, tasks, &j);
  else
    for (size_t t = 0; t < tasks; t++) unit_task(&j, t);
  return NULL;
}
