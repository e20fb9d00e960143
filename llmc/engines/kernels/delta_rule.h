/* The gated delta rule over a run of tokens (Qwen3.5's Gated DeltaNet), fp32, the recurrent form.
 *
 * ai.llmc.GatedDeltaRule's kernel. For each row b and value head h, on its state M [K, V] (key head h / (H / Hk)
 * gives its q and k), token by token:
 *   M <- M exp(g_t);  u = beta_t (v_t - k_t M);  M <- M + k_t^T u;  o_t = q_t M
 * (q and k as the graph gives them: L2-normed, q times K^-0.5). A padded token has g = beta = 0: M unchanged.
 * Without the delta (`delta` 0: Mamba-2's state-space recurrence, k = B, q = C, v = x, beta = dt, g = dt A):
 *   M <- M exp(g_t) + k_t^T (beta_t v_t);  o_t = q_t M
 * With g of one value per key dim (Kimi Delta Attention), M <- diag(exp(g_t)) M: row i decays by exp(g_t[i]).
 * With A [H, K, V] (Mamba-1's selective scan: a decay per channel and state element; k = B, q = C, v = x, g = beta =
 * dt, each [.., V], one a channel): M[i][j] <- M[i][j] exp(g_t[j] A[i][j]) + k_t[i] beta_t[j] v_t[j], o_t = q_t M.
 * Each (b, h) is one pool task: its M (64 KiB at K = V = 128) stays in the core's L2 over the run, two passes of it a
 * token. What ONNX Runtime ran before it: a Loop of ~12 nodes a token (llmc/graph/linear_attention.py).
 */
#ifndef LLMC_DELTA_RULE_H
#define LLMC_DELTA_RULE_H

#include <stdint.h>

#include "parallel.h"

typedef struct {
  int64_t B, S, Hk, H, K, V; /* rows, tokens, key heads, value heads, key dim, value dim */
  const float* q;            /* [B, S, Hk, K] */
  const float* k;            /* [B, S, Hk, K] */
  const float* v;            /* [B, S, H, V] */
  const float* g;            /* [B, S, H]: the log of each token's decay; with g_per_key [B, S, H, K], one per row of M */
  const float* beta;         /* [B, S, H] */
  const float* state;        /* [B, H, K, V]: before the run; with `rows`, a pool [N, H, K, V] */
  float* out;                /* [B, S, H, V] */
  float* state_out;          /* as `state`: after the run (may be `state` itself: then nothing is copied) */
  const int32_t* rows;       /* [B] or NULL: row b's state is the pool's rows[b] (the engines' slots, in place) */
  int64_t N;                 /* the pool's states (with `rows`) */
  int delta;                 /* 1: the delta rule; 0: without the delta (u = beta v: Mamba-2) */
  int g_per_key;             /* g has a decay per key dim (Kimi Delta Attention): M's row i decays by exp(g[.., i]) */
  const float* A;            /* [H, K, V] or NULL: Mamba-1's selective scan (delta 0), g and beta [B, S, H, V] (both
                                dt): M[i][j] <- M[i][j] exp(g[j] A[i][j]) + k[i] beta[j] v[j] */
} llmc_delta_rule_args;

/* Returns NULL on success, else a message naming the value and its limit. */
const char* llmc_delta_rule(const llmc_delta_rule_args* a, llmc_parallel_fn parallel, void* parallel_ctx);

/* The path llmc_delta_rule takes for V: 2 AVX-512, 1 AVX2, 0 portable (LLMC_KERNELS_GENERIC / LLMC_KERNELS_AVX2
 * force the others). */
int llmc_delta_rule_path(int64_t V);

#endif
