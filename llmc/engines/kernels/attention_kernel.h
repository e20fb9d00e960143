/* Grouped-query attention over an in-place KV cache: the computation, independent of ONNX Runtime.
 *
 * Inputs follow com.microsoft.GroupQueryAttention as llmc's graphs use it:
 *   qkv   [B, S, (H + 2 Hkv) D] fp32: packed Q, K, V of the new tokens
 *   k, v  [B, Hkv, L, D] fp32 or fp16, or [B, Hkv, L, D + 2 ceil(D / 32)] int8: each row D int8, then one fp16
 *         scale per group of 32 of them (x = scale * q, scale = max |x| / 127 over the group), an int8 cache's keys
 *         times the 32-point orthonormal Hadamard matrix on each whole 32 of their dims (hadamard_groups; the
 *         queries meet them through it too); the new K (rotated) and V are written at their positions
 *   seqlens[b] = tokens of row b after this step - 1
 *   first prompt (total_sequence_length == S): row b has seqlens[b] + 1 new tokens (right-padded), no past;
 *   otherwise row b has S new tokens after seqlens[b] + 1 - S cached ones, or, with new_lens, new_lens[b] new
 *   tokens (right-padded to S) after seqlens[b] + 1 - new_lens[b] cached ones (first_prompt is then 0).
 *   cos, sin [max_pos, R] (rotary, rotate-half form within each head's first 2R dims: pairs (d, d + R) for d < R;
 *         dims 2R .. D-1 pass unchanged; R = D/2 rotates the whole head) or NULL
 *   window > 0: the query at absolute position p sees keys t with p - window < t <= p only (window keys, itself
 *         included: GroupQueryAttention's local_window_size, transformers' sliding_window), and reads no others;
 *         0: all keys up to p
 *   softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2); 0: off
 *   sinks [H] or NULL: query head h's softmax over its keys takes one more term, exp(sinks[h] - max), whose value
 *         is 0 (GPT-OSS's attention sinks: weights that need not sum to 1)
 *   out   [B, S, H D] fp32; padded query rows get zeros.
 *   key_tiles (fp32 and fp16 caches): the keys of each 16 aligned positions 16i .. 16i + 15 of a KV head are held
 *         in their 16 rows' bytes as [D][16] (dim d of position 16i + r at element 16 d + r) instead of row by row;
 *         the values stay rows. A decode row's scores then take 16 keys per product with nothing to reduce across
 *         lanes (attention_kernel.c). Needs L (slot layout) or block_size (paged) a multiple of 16.
 *   kv_shared 1: qkv holds Q alone [B, S, H D], and k, v are another layer's cache that already holds every key and
 *         value the rows attend, this run's too (Gemma 4's KV-shared layers): nothing is written, only read.
 *   index_topk > 0 (Kolibri 1.1's indexed attention; no rotary, window, chunk, sinks or softcap): a query at position p
 *         seeing more than index_sink + index_topk + index_local keys (p + 1 of them) attends to keys 0 ..
 *         index_sink - 1, to its last index_local (p - index_local < t <= p) and to the index_topk others whose
 *         routing score sum_{h < index_heads} relu(nvfp4(q_h) . k[t]) is highest (query heads 0 .. index_heads - 1,
 *         all of KV head 0: index_heads <= H / Hkv; KV head 0's keys as cached; ties: the earlier key; nvfp4: E2M1
 *         values with an E4M3 scale per 16 dims, D a multiple of 16). The cache's keys and values are the layer's as
 *         the graph gives them (NVFP4-rounded there). Fewer keys: all of them.
 *   block_table [B, max_blocks] int32 or NULL: paged KV memory. Then k, v are pools [num_blocks, Hkv, block_size,
 *         row] shared by all rows, and position t of row b sits in block block_table[b][t / block_size] at
 *         t % block_size (L = max_blocks * block_size; block_size a power of 2); blocks holding a row's cached
 *         prefix may be shared with other rows: only positions from the row's past on are written.
 */
#ifndef LLMC_ATTENTION_KERNEL_H
#define LLMC_ATTENTION_KERNEL_H

#include <stddef.h>
#include <stdint.h>

#include "parallel.h"

enum { LLMC_KV_F32 = 0, LLMC_KV_F16 = 1, LLMC_KV_I8 = 2 };
#ifndef LLMC_KV_I8_GROUP
#define LLMC_KV_I8_GROUP 32 /* int8 cache: values per fp16 scale (a multiple of 16) */
#endif

typedef struct {
  int B, S, H, Hkv, D, L, first_prompt, kv_kind, max_pos; /* kv_kind: LLMC_KV_* */
  int R;      /* cos / sin row width, 1 .. D/2 (unused without them) */
  int window; /* 0: no window */
  int chunk_size; /* 0: none; else the query at position p sees only the keys of its own block of chunk_size positions,
                   * floor(p / chunk_size) * chunk_size <= t <= p (Llama 4's chunked attention); not with a window */
  const float* qkv;
  void* k;
  void* v;
  const int32_t* seqlens;
  const float* cos;
  const float* sin;
  float scale;
  float softcap; /* 0: off */
  float* out;
  const int32_t* block_table; /* NULL: k, v are [B, Hkv, L, row] */
  int block_size, max_blocks, num_blocks;
  const int32_t* new_lens; /* NULL: S new tokens per row (or the first-prompt form); else row b's count, 1..S */
  int key_tiles;           /* 1: keys in groups of 16 positions [D][16] (see above); 0: rows */
  const float* sinks;      /* NULL, or [H]: each query head's sink logit (see above) */
  int kv_shared;           /* 1: qkv is Q alone and the cache is only read (see above) */
  int index_topk, index_local, index_sink, index_heads; /* index_topk 0: none; else the key selection above */
} llmc_attention_args;

#define LLMC_KEY_TILE 16 /* positions per group of a key_tiles cache */

/* Returns NULL on success, else a message naming the value and its limit. `parallel` runs fn(data, i) for
 * i in [0, total) (ONNX Runtime's intra-op pool); NULL runs them in this thread. */
const char* llmc_attention(const llmc_attention_args* a, llmc_parallel_fn parallel, void* parallel_ctx);

/* 1 when the AVX-512 path is used (the CPU has it and LLMC_KERNELS_GENERIC is unset). */
int llmc_attention_uses_avx512(void);

#endif
