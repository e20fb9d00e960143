/* llmc's ONNX Runtime custom operators (CPU), domain ai.llmc:
 *
 * CachedAttention / CachedAttentionF16Cache / CachedAttentionI8Cache (attention_kernel.h):
 * Inputs: qkv [B, S, (H + 2 Hkv) D] fp32, past_key, past_value [B, Hkv, L, D] (fp32, or fp16 for the F16Cache op;
 * int8 [B, Hkv, L, D + 2 ceil(D / 32)] for the I8Cache op: each row D int8 and an fp16 scale per 32 of them),
 * seqlens_k [B] int32, total_sequence_length [] int32, cos_cache, sin_cache [max_pos, R] fp32 (optional, both or
 * neither; R <= D/2: the first 2R dims of each q / k head are rotated, rotate-half within them, the rest pass
 * unchanged). Outputs: output [B, S, H D] fp32, present_key, present_value [B, Hkv, L, D]: bind them to the same
 * memory as the past inputs and nothing is copied; otherwise the past is copied into them first.
 * block_table [B, max_blocks] int32 (optional, after sin_cache): paged KV memory; then past and present are pools
 * [num_blocks, Hkv, block_size, D] shared by the batch's rows, row b's position t in block block_table[b][t / block_size]
 * (block_size a power of 2), so a cached prompt prefix is read where it is, from blocks other rows may share.
 * new_tokens [B] int32 (optional, after block_table): row b's new tokens in this run (1..S, right-padded to S) after
 * seqlens_k[b] + 1 - new_tokens[b] cached ones, so rows of different counts run together; without it, rows have S new
 * tokens each, or, when total_sequence_length == S, seqlens_k[b] + 1 of a first prompt.
 * sinks [H] fp32 (optional, after new_tokens): each query head's sink logit (GPT-OSS), one more term of every
 * softmax's denominator, exp(sink - max), whose value is 0.
 * kv_shared (int, default 0; 1: the layer reads another layer's cache, already written this run: qkv [B, S, H D]
 * holds Q alone, past_key / past_value are that cache, read only, and the node has no present outputs).
 * Attributes: num_heads, kv_num_heads (int), scale (float); optional, as GroupQueryAttention's: local_window_size
 * (int, default -1 = none; W >= 1: the query at position p sees keys p - W < t <= p only, and the kernel reads no
 * others), softcap (float, default 0 = off; c > 0: scores become c * tanh(score / c), after the scale); llmc's own:
 * key_tiles (int, default 0; 1, fp32 and fp16 caches: the keys of each 16 aligned positions held as [D][16] in their
 * rows' bytes, attention_kernel.h; the cache's length or block size a multiple of 16), attention_chunk_size (int,
 * default 0 = none; C >= 1: the query at position p sees the keys of its own block only, floor(p / C) * C <= t <= p:
 * Llama 4's chunked attention; not with local_window_size); index_topk, index_local, index_sink, index_heads (ints,
 * default 0 = none: Kolibri 1.1's indexed attention, each query's keys chosen past index_sink + index_topk +
 * index_local of them: attention_kernel.h).
 *
 * MatMulQ4 (matmul_q4.h): A [..., K] fp32, B uint8 [ceil(N / 32), K / 32, 640] (the packed 4-bit tiles), bias [N]
 * fp32 (optional) -> Y [..., N] fp32, or [..., N / 2] with gated = 1 (silu(gate) * up). Attributes: K, N, gated;
 * optional act_bits (default 8: int8 activations; 16: two int8 levels, ~15 bits, twice the integer work), window
 * (float, default 0; act_bits 16 without a gate: the second level only for the tiles within this margin of each
 * row's largest output, from LLMC_Q4_WINDOW_ROWS rows on: the LM head's batches), act_rows (default 0; 1, act_bits
 * 8: each row of A on one int8 grid, BitNet's per-token activations).
 *
 * MatMulQ8, MatMulQ2: MatMulQ4's inputs and attributes over 8-bit tiles, B uint8 [ceil(N / 32), K / 32, 1152], and
 * over 2-bit ones (a scale and min a column for all of K: BitNet's ternary layers), B uint8 [ceil(N / 32), K / 32 +
 * 1, 256] (its first row the scales and mins); MatMulQ2 takes no window.
 *
 * MatMulBF16 (matmul_bf16.h): A [..., K] fp32, B bfloat16 [ceil(N / 16), K / 2, 32] (the packed tiles), bias [N]
 * fp32 (optional) -> Y [..., N] fp32, or [..., N / 2] with the optional gated = 1 (silu(gate) * up, its tiles
 * alternating as MatMulQ4's). Attributes: K, N; optional gated (default 0).
 *
 * SkipRMSNorm (rms_norm.h): input, skip [..., D] fp32, gamma [D] -> Y = RMSNorm(input + skip) * gamma, and the sum
 * (optional output) [..., D] fp32. Attribute: epsilon (default 1e-5). ONNX Runtime's SkipSimplifiedLayerNormalization
 * without its unused outputs.
 *
 * GatedDeltaRule (delta_rule.h): q, k [B, S, Hk, K], v [B, S, H, V], g [B, S, H] (or [B, S, H, K]: a decay per key
 * dim), beta [B, S, H], state [B, H, K, V], all fp32
 * -> output [B, S, H, V] and the state after the run [B, H, K, V]: Qwen3.5's Gated DeltaNet recurrence, value head h
 * on key head h / (H / Hk). Optional state_rows [B] int32: the state is a pool [N, H, K, V] and row b's is its
 * state_rows[b]-th (bind the output to the pool's memory and nothing is copied). Attribute: delta (default 1; 0:
 * M <- M exp(g) + k^T (beta v) without the delta, Mamba-2's state-space recurrence). Optional A [H, K, V] (with
 * delta 0; g and beta then [B, S, H, V]): Mamba-1's selective scan, M[i][j] <- M[i][j] exp(g[j] A[i][j]) + k[i]
 * beta[j] v[j].
 *
 * ONNX Runtime's C API is reached only through the function table it hands RegisterCustomOps (its ABI is
 * append-only and versioned): the few entries used here are declared by their position in that table, for API
 * version 17 (ONNX Runtime 1.17, the first with KernelContext_ParallelFor), which any later runtime also serves.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ahead.h"
#include "attention_kernel.h"
#include "delta_rule.h"
#include "matmul_bf16.h"
#include "matmul_q4.h"
#include "ops_version.h"
#include "pool.h"
#include "prefetch.h"
#include "rms_norm.h"

#define EXPORT __attribute__((visibility("default")))
#define ORT_API_VERSION_USED 17

typedef struct OrtStatus OrtStatus;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtShape;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef void OrtApi; /* used only through the slots below */

enum { T_UNDEFINED = 0, T_FLOAT = 1, T_UINT8 = 2, T_INT8 = 3, T_INT32 = 6, T_FLOAT16 = 10, T_BFLOAT16 = 16 };
enum { IO_REQUIRED = 0, IO_OPTIONAL = 1 };
enum { ERR_FAIL = 1, ERR_INVALID_ARGUMENT = 2 };

typedef struct {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

/* Positions in ONNX Runtime's OrtApi function table. */
enum {
  API_CreateStatus = 0,
  API_CreateCustomOpDomain = 26,
  API_CustomOpDomain_Add = 27,
  API_AddCustomOpDomain = 28,
  API_GetTensorMutableData = 51,
  API_GetTensorElementType = 60,
  API_GetDimensionsCount = 61,
  API_GetDimensions = 62,
  API_GetTensorTypeAndShape = 65,
  API_KernelInfoGetAttribute_float = 85,
  API_KernelInfoGetAttribute_int64 = 86,
  API_KernelContext_GetInput = 90,
  API_KernelContext_GetOutput = 91,
  API_ReleaseStatus = 93,
  API_ReleaseTensorTypeAndShapeInfo = 99,
  API_GetSessionConfigEntry = 238,
  API_KernelContext_ParallelFor = 274,
};
#define SLOT(api, name) (((void* const*)(api))[API_##name])

typedef OrtStatus* (*CreateStatus_t)(int code, const char* msg);
typedef OrtStatus* (*CreateCustomOpDomain_t)(const char* domain, OrtCustomOpDomain** out);
typedef OrtStatus* (*CustomOpDomain_Add_t)(OrtCustomOpDomain* domain, const void* op);
typedef OrtStatus* (*AddCustomOpDomain_t)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
typedef OrtStatus* (*GetTensorMutableData_t)(OrtValue* value, void** out);
typedef OrtStatus* (*GetTensorElementType_t)(const OrtShape* info, int* out);
typedef OrtStatus* (*GetDimensionsCount_t)(const OrtShape* info, size_t* out);
typedef OrtStatus* (*GetDimensions_t)(const OrtShape* info, int64_t* dims, size_t n);
typedef OrtStatus* (*GetTensorTypeAndShape_t)(const OrtValue* value, OrtShape** out);
typedef OrtStatus* (*GetAttributeFloat_t)(const OrtKernelInfo* info, const char* name, float* out);
typedef OrtStatus* (*GetAttributeInt64_t)(const OrtKernelInfo* info, const char* name, int64_t* out);
typedef OrtStatus* (*GetInput_t)(const OrtKernelContext* ctx, size_t index, const OrtValue** out);
typedef OrtStatus* (*GetOutput_t)(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t n, OrtValue** out);
typedef void (*ReleaseStatus_t)(OrtStatus* status);
typedef OrtStatus* (*GetSessionConfigEntry_t)(const OrtSessionOptions* options, const char* key, char* value,
                                              size_t* size);
typedef void (*ReleaseShape_t)(OrtShape* info);
typedef OrtStatus* (*ParallelFor_t)(const OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t total,
                                    size_t num_batch, void* data);

/* ONNX Runtime's OrtCustomOp, through the members of version 17. */
typedef struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const struct OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp* op);
  int (*GetInputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp* op);
  int (*GetOutputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const struct OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                               void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
  OrtStatus* (*InferOutputShapeFn)(const struct OrtCustomOp* op, OrtShapeInferContext* ctx);
  int (*GetStartVersion)(const struct OrtCustomOp* op);
  int (*GetEndVersion)(const struct OrtCustomOp* op);
} OrtCustomOp;

typedef struct {
  OrtCustomOp base;
  const char* name;
  int kv_type; /* attention: the cache's element type; matmul: its weights' (T_UINT8: MatMulQ4/Q8, T_BFLOAT16) */
  int bits;    /* MatMulQ4 4, MatMulQ8 8 */
  int threads; /* the session's intra-op threads (its "llmc.threads" config entry), 0 when not given */
  int own_pool; /* 1: the kernels' parallel calls go to llmc's pool of `threads` (pool.h), else ONNX Runtime's */
} LlmcOp;

/* The thread count of the pool an op's kernels hand their parallel calls to: llmc's (> 0) or ONNX Runtime's (0). */
static int pool_threads_of(const OrtCustomOp* op) {
  const LlmcOp* o = (const LlmcOp*)op;
  return o->own_pool ? o->threads : 0;
}

typedef struct {
  const OrtApi* api;
  int64_t num_heads, kv_num_heads, local_window_size, key_tiles, attention_chunk_size, kv_shared;
  int64_t index_topk, index_local, index_sink, index_heads;
  float scale, softcap;
  int kv_kind; /* LLMC_KV_* */
  int pool_threads; /* llmc's pool of this many threads, or 0: ONNX Runtime's (Pool below) */
} Kernel;

enum { IN_QKV, IN_PAST_K, IN_PAST_V, IN_SEQLENS, IN_TOTAL, IN_COS, IN_SIN, IN_BLOCKS, IN_NEW, IN_SINKS, N_INPUTS };
enum { OUT_ATTN, OUT_PRESENT_K, OUT_PRESENT_V, N_OUTPUTS };

static const char* op_name(const OrtCustomOp* op) { return ((const LlmcOp*)op)->name; }
static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static size_t op_input_count(const OrtCustomOp* op) { (void)op; return N_INPUTS; }
static size_t op_output_count(const OrtCustomOp* op) { (void)op; return N_OUTPUTS; }
static int op_input_type(const OrtCustomOp* op, size_t i) {
  if (i == IN_PAST_K || i == IN_PAST_V) return ((const LlmcOp*)op)->kv_type;
  return i == IN_SEQLENS || i == IN_TOTAL || i == IN_BLOCKS || i == IN_NEW ? T_INT32 : T_FLOAT;
}
static int op_output_type(const OrtCustomOp* op, size_t i) {
  return i == OUT_ATTN ? T_FLOAT : ((const LlmcOp*)op)->kv_type;
}
static int op_input_characteristic(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == IN_COS || i == IN_SIN || i == IN_BLOCKS || i == IN_NEW || i == IN_SINKS ? IO_OPTIONAL : IO_REQUIRED;
}
/* (present_key / present_value: absent from a kv_shared node, which writes no cache) */
static int op_output_characteristic(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == OUT_ATTN ? IO_REQUIRED : IO_OPTIONAL;
}
static int op_memory_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; /* default */ }
static int op_start_version(const OrtCustomOp* op) { (void)op; return 1; }
static int op_end_version(const OrtCustomOp* op) { (void)op; return 2147483647; }

static OrtStatus* fail(const OrtApi* api, int code, const char* msg) {
  return ((CreateStatus_t)SLOT(api, CreateStatus))(code, msg);
}

#define CHECK(call)                   \
  do {                                \
    OrtStatus* status_ = (call);      \
    if (status_) return status_;      \
  } while (0)

/* An optional attribute: its value, or `fallback` when the node has none. */
static int64_t optional_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t v = fallback;
  OrtStatus* s = ((GetAttributeInt64_t)SLOT(api, KernelInfoGetAttribute_int64))(info, name, &v);
  if (s) ((ReleaseStatus_t)SLOT(api, ReleaseStatus))(s), v = fallback;
  return v;
}
static float optional_float(const OrtApi* api, const OrtKernelInfo* info, const char* name, float fallback) {
  float v = fallback;
  OrtStatus* s = ((GetAttributeFloat_t)SLOT(api, KernelInfoGetAttribute_float))(info, name, &v);
  if (s) ((ReleaseStatus_t)SLOT(api, ReleaseStatus))(s), v = fallback;
  return v;
}

static OrtStatus* op_create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return fail(api, ERR_FAIL, "CachedAttention: out of memory");
  k->api = api;
  k->pool_threads = pool_threads_of(op);
  int kv_type = ((const LlmcOp*)op)->kv_type;
  k->kv_kind = kv_type == T_FLOAT16 ? LLMC_KV_F16 : kv_type == T_INT8 ? LLMC_KV_I8 : LLMC_KV_F32;
  OrtStatus* s = ((GetAttributeInt64_t)SLOT(api, KernelInfoGetAttribute_int64))(info, "num_heads", &k->num_heads);
  if (!s) s = ((GetAttributeInt64_t)SLOT(api, KernelInfoGetAttribute_int64))(info, "kv_num_heads", &k->kv_num_heads);
  if (!s) s = ((GetAttributeFloat_t)SLOT(api, KernelInfoGetAttribute_float))(info, "scale", &k->scale);
  if (!s && (k->num_heads < 1 || k->kv_num_heads < 1 || k->num_heads % k->kv_num_heads))
    s = fail(api, ERR_INVALID_ARGUMENT, "CachedAttention: num_heads must be a positive multiple of kv_num_heads");
  if (!s) {
    char msg[160];
    k->local_window_size = optional_int(api, info, "local_window_size", -1);
    k->attention_chunk_size = optional_int(api, info, "attention_chunk_size", 0);
    k->softcap = optional_float(api, info, "softcap", 0.f);
    k->key_tiles = optional_int(api, info, "key_tiles", 0);
    k->kv_shared = optional_int(api, info, "kv_shared", 0);
    k->index_topk = optional_int(api, info, "index_topk", 0);
    k->index_local = optional_int(api, info, "index_local", 0);
    k->index_sink = optional_int(api, info, "index_sink", 0);
    k->index_heads = optional_int(api, info, "index_heads", 0);
    if (k->index_topk < 0 || k->index_topk > 1 << 24 || k->index_local < 0 || k->index_local > 1 << 24 ||
        k->index_sink < 0 || k->index_sink > 1 << 24 || k->index_heads < 0 || k->index_heads > 1 << 16) {
      snprintf(msg, sizeof msg, "CachedAttention: index_topk %lld, index_local %lld, index_sink %lld, index_heads "
               "%lld: each must be in [0, 2^24] (heads [0, 2^16])", (long long)k->index_topk,
               (long long)k->index_local, (long long)k->index_sink, (long long)k->index_heads);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    } else if (k->kv_shared != 0 && k->kv_shared != 1) {
      snprintf(msg, sizeof msg, "CachedAttention: kv_shared %lld: must be 0 (the layer's own cache, written) or 1 "
               "(another layer's, read only; qkv holds Q alone)", (long long)k->kv_shared);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    } else if (k->key_tiles != 0 && k->key_tiles != 1) {
      snprintf(msg, sizeof msg, "CachedAttention: key_tiles %lld: must be 0 (rows) or 1 (groups of 16 positions)",
               (long long)k->key_tiles);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    } else if (k->key_tiles && k->kv_kind == LLMC_KV_I8) {
      s = fail(api, ERR_INVALID_ARGUMENT, "CachedAttention: key_tiles 1: an fp32 or fp16 cache only (CachedAttentionI8Cache holds rows)");
    } else if (k->attention_chunk_size < 0 || (k->attention_chunk_size > 0 && k->local_window_size > 0)) {
      snprintf(msg, sizeof msg, "CachedAttention: attention_chunk_size %lld: must be 0 (none) or positive, and not "
               "with local_window_size", (long long)k->attention_chunk_size);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    } else if (k->local_window_size == 0 || k->local_window_size < -1) {
      snprintf(msg, sizeof msg, "CachedAttention: local_window_size %lld: must be -1 (no window) or at least 1",
               (long long)k->local_window_size);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    } else if (!(k->softcap >= 0.f) || k->softcap > FLT_MAX) {
      snprintf(msg, sizeof msg, "CachedAttention: softcap %g: must be 0 (off) or positive and finite",
               (double)k->softcap);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    }
  }
  if (s) {
    free(k);
    return s;
  }
  *out = k;
  return NULL;
}

static void op_destroy(void* kernel) { free(kernel); }

/* The input's data and dims (up to 4); rank -1 when the optional input is absent. */
static OrtStatus* tensor(const OrtApi* api, const OrtValue* v, void** data, int64_t* dims, int* rank) {
  *rank = -1;
  if (!v) return NULL;
  OrtShape* info = NULL;
  size_t n = 0;
  CHECK(((GetTensorTypeAndShape_t)SLOT(api, GetTensorTypeAndShape))(v, &info));
  OrtStatus* s = ((GetDimensionsCount_t)SLOT(api, GetDimensionsCount))(info, &n);
  if (!s && n > 4) s = fail(api, ERR_INVALID_ARGUMENT, "llmc operator: an input has more than 4 dimensions");
  if (!s) s = ((GetDimensions_t)SLOT(api, GetDimensions))(info, dims, n);
  ((ReleaseShape_t)SLOT(api, ReleaseTensorTypeAndShapeInfo))(info);
  if (s) return s;
  *rank = (int)n;
  return ((GetTensorMutableData_t)SLOT(api, GetTensorMutableData))((OrtValue*)v, data);
}

/* The node's first n inputs: data, dims (up to 4) and rank (-1 for an absent optional input). */
static OrtStatus* inputs(const OrtApi* api, const OrtKernelContext* ctx, int n, void** data, int64_t (*dims)[4],
                         int* rank) {
  GetInput_t get_input = (GetInput_t)SLOT(api, KernelContext_GetInput);
  for (int i = 0; i < n; i++) {
    const OrtValue* v = NULL;
    CHECK(get_input(ctx, (size_t)i, &v));
    CHECK(tensor(api, v, &data[i], dims[i], &rank[i]));
  }
  return NULL;
}

typedef struct {
  const OrtApi* api;
  const OrtKernelContext* ctx;
  OrtStatus* status;
  int threads; /* llmc's pool of this many threads (pool.h), or 0: ONNX Runtime's intra-op pool */
} Pool;

static void run_parallel(void* pool_, void (*fn)(void*, size_t), size_t total, void* data) {
  Pool* pool = (Pool*)pool_;
  if (pool->threads) {
    llmc_pool_run(&pool->threads, fn, total, data);
    return;
  }
  pool->status = ((ParallelFor_t)SLOT(pool->api, KernelContext_ParallelFor))(pool->ctx, fn, total, 0, data);
}

/* A kernel's outcome as the op's status: the thread pool's error, else the kernel's message (named by op). */
static OrtStatus* outcome(const Pool* pool, const char* op, const char* err) {
  char msg[256];
  if (pool->status) return pool->status;
  if (!err) return NULL;
  snprintf(msg, sizeof msg, "%s: %s", op, err);
  return fail(pool->api, ERR_INVALID_ARGUMENT, msg);
}

static OrtStatus* op_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  const OrtApi* api = k->api;
  void* data[N_INPUTS] = {0};
  int64_t dims[N_INPUTS][4];
  int rank[N_INPUTS];
  CHECK(inputs(api, ctx, N_INPUTS, data, dims, rank));
  char msg[256];
  int H = (int)k->num_heads, Hkv = (int)k->kv_num_heads;
  if (rank[IN_QKV] != 3 || rank[IN_PAST_K] != 4 || rank[IN_PAST_V] != 4 || rank[IN_SEQLENS] != 1 ||
      rank[IN_TOTAL] > 1 || rank[IN_TOTAL] < 0)
    return fail(api, ERR_INVALID_ARGUMENT, "CachedAttention: expected qkv [B, S, W], past [B, Hkv, L, D], "
                                           "seqlens_k [B], total_sequence_length []");
  int64_t B = dims[IN_QKV][0], S = dims[IN_QKV][1], W = dims[IN_QKV][2];
  int64_t D = dims[IN_PAST_K][3]; /* int8 rows: D values, then 2 bytes of scale per group of LLMC_KV_I8_GROUP */
  if (k->kv_kind == LLMC_KV_I8) /* the D with D + 2 ceil(D / group) = the row's width (it grows with D) */
    while (D > 0 && D + 2 * ((D + LLMC_KV_I8_GROUP - 1) / LLMC_KV_I8_GROUP) > dims[IN_PAST_K][3]) D--;
  int paged = rank[IN_BLOCKS] >= 0;
  if (paged && (rank[IN_BLOCKS] != 2 || dims[IN_BLOCKS][0] != B)) {
    snprintf(msg, sizeof msg, "CachedAttention: block_table must be [B, max_blocks] with B = %lld", (long long)B);
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  if (rank[IN_NEW] >= 0 && (rank[IN_NEW] != 1 || dims[IN_NEW][0] != B)) {
    snprintf(msg, sizeof msg, "CachedAttention: new_tokens must be [B] with B = %lld", (long long)B);
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  if (rank[IN_SINKS] >= 0 && (rank[IN_SINKS] != 1 || dims[IN_SINKS][0] != H)) {
    snprintf(msg, sizeof msg, "CachedAttention: sinks must be [H] with H = %d", H);
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  int64_t L = paged ? dims[IN_BLOCKS][1] * dims[IN_PAST_K][2] : dims[IN_PAST_K][2];
  if (memcmp(dims[IN_PAST_K], dims[IN_PAST_V], sizeof(dims[0])) || (!paged && dims[IN_PAST_K][0] != B) ||
      dims[IN_PAST_K][1] != Hkv || W != (H + (k->kv_shared ? 0 : 2 * Hkv)) * D || dims[IN_SEQLENS][0] != B) {
    snprintf(msg, sizeof msg, "CachedAttention: qkv width %lld, past [%lld, %lld, %lld, %lld], seqlens_k [%lld] do "
             "not fit batch %lld, %d heads, %d KV heads%s", (long long)W, (long long)dims[IN_PAST_K][0],
             (long long)dims[IN_PAST_K][1], (long long)L, (long long)D, (long long)dims[IN_SEQLENS][0],
             (long long)B, H, Hkv, k->kv_shared ? " (kv_shared: qkv holds Q alone)" : "");
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  if ((rank[IN_COS] < 0) != (rank[IN_SIN] < 0) ||
      (rank[IN_COS] >= 0 && (rank[IN_COS] != 2 || rank[IN_SIN] != 2 || dims[IN_COS][1] < 1 ||
                             dims[IN_COS][1] > D / 2 || memcmp(dims[IN_COS], dims[IN_SIN], 2 * sizeof(int64_t))))) {
    if (rank[IN_COS] == 2 && rank[IN_SIN] == 2)
      snprintf(msg, sizeof msg, "CachedAttention: cos_cache [%lld, %lld] and sin_cache [%lld, %lld] must both be "
               "[max_pos, R] with 1 <= R <= D/2 = %lld", (long long)dims[IN_COS][0], (long long)dims[IN_COS][1],
               (long long)dims[IN_SIN][0], (long long)dims[IN_SIN][1], (long long)(D / 2));
    else
      snprintf(msg, sizeof msg, "CachedAttention: cos_cache and sin_cache must both be [max_pos, R] with 1 <= R <= "
               "D/2 = %lld", (long long)(D / 2));
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }

  GetOutput_t get_output = (GetOutput_t)SLOT(api, KernelContext_GetOutput);
  int64_t out_dims[3] = {B, S, H * D};
  OrtValue *out = NULL, *present[2] = {NULL, NULL};
  void *out_data = NULL, *present_data[2] = {NULL, NULL};
  GetTensorMutableData_t mutable_data = (GetTensorMutableData_t)SLOT(api, GetTensorMutableData);
  CHECK(get_output(ctx, OUT_ATTN, out_dims, 3, &out));
  CHECK(mutable_data(out, &out_data));
  size_t item = k->kv_kind == LLMC_KV_F32 ? 4 : k->kv_kind == LLMC_KV_F16 ? 2 : 1;
  size_t cache_bytes = (size_t)(dims[IN_PAST_K][0] * Hkv * dims[IN_PAST_K][2]) * (size_t)dims[IN_PAST_K][3] * item;
  for (int i = 0; i < 2; i++) {
    if (k->kv_shared) { /* (another layer's cache, read where it is) */
      present_data[i] = data[IN_PAST_K + i];
      continue;
    }
    CHECK(get_output(ctx, OUT_PRESENT_K + i, dims[IN_PAST_K], 4, &present[i]));
    CHECK(mutable_data(present[i], &present_data[i]));
    if (present_data[i] != data[IN_PAST_K + i]) memcpy(present_data[i], data[IN_PAST_K + i], cache_bytes);
  }
  llmc_attention_args a = {
      .B = (int)B, .S = (int)S, .H = H, .Hkv = Hkv, .D = (int)D, .L = (int)L,
      /* with new_tokens every row says its own count: no first-prompt form to infer */
      .first_prompt = rank[IN_NEW] < 0 && *(const int32_t*)data[IN_TOTAL] == S, .kv_kind = k->kv_kind,
      .max_pos = rank[IN_COS] >= 0 ? (int)dims[IN_COS][0] : 0, .R = rank[IN_COS] >= 0 ? (int)dims[IN_COS][1] : 0,
      /* a window at least as long as any cache is no window */
      .window = k->local_window_size > 0 && k->local_window_size < L ? (int)k->local_window_size : 0,
      /* (a block at least as long as any cache: every key is in the query's) */
      .chunk_size = k->attention_chunk_size > 0 && k->attention_chunk_size < L ? (int)k->attention_chunk_size : 0,
      .softcap = k->softcap,
      .qkv = (const float*)data[IN_QKV], .k = present_data[0], .v = present_data[1],
      .seqlens = (const int32_t*)data[IN_SEQLENS], .cos = (const float*)data[IN_COS],
      .sin = (const float*)data[IN_SIN], .scale = k->scale, .out = (float*)out_data,
      .block_table = paged ? (const int32_t*)data[IN_BLOCKS] : NULL,
      .block_size = paged ? (int)dims[IN_PAST_K][2] : 0, .max_blocks = paged ? (int)dims[IN_BLOCKS][1] : 0,
      .num_blocks = paged ? (int)dims[IN_PAST_K][0] : 0,
      .new_lens = rank[IN_NEW] >= 0 ? (const int32_t*)data[IN_NEW] : NULL, .key_tiles = (int)k->key_tiles,
      .sinks = rank[IN_SINKS] >= 0 ? (const float*)data[IN_SINKS] : NULL, .kv_shared = (int)k->kv_shared,
      .index_topk = (int)k->index_topk, .index_local = (int)k->index_local, .index_sink = (int)k->index_sink,
      .index_heads = (int)k->index_heads};
  Pool pool = {api, ctx, NULL, k->pool_threads};
  const char* err = llmc_attention(&a, run_parallel, &pool);
  return outcome(&pool, "CachedAttention", err);
}


/* ---------------------------------------------------------------- MatMulQ4, MatMulQ8, MatMulBF16 */

typedef struct {
  const OrtApi* api;
  int64_t K, N, gated, act_bits, int8_prompts, act_rows;
  float window; /* MatMulQ4 / MatMulQ8 with act_bits 16: the second level's margin (matmul_q4.h) */
  int threads;
  int pool_threads; /* as Kernel's */
  int bf16; /* MatMulBF16, else MatMulQ4 / MatMulQ8 */
  int bits; /* MatMulQ4 4, MatMulQ8 8, MatMulQ2 2 */
  const char* name; /* the operator's */
} MatMulKernel;

enum { MM_A, MM_B, MM_BIAS, MM_INPUTS };

static size_t mm_input_count(const OrtCustomOp* op) { (void)op; return MM_INPUTS; }
static size_t mm_output_count(const OrtCustomOp* op) { (void)op; return 1; }
static int mm_input_type(const OrtCustomOp* op, size_t i) {
  return i == MM_B ? ((const LlmcOp*)op)->kv_type : T_FLOAT; /* B: the weights' type */
}
static int mm_output_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return T_FLOAT; }
static int mm_input_characteristic(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == MM_BIAS ? IO_OPTIONAL : IO_REQUIRED;
}

static OrtStatus* mm_create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  MatMulKernel* k = (MatMulKernel*)calloc(1, sizeof(MatMulKernel));
  if (!k) return fail(api, ERR_FAIL, "MatMul: out of memory");
  k->api = api;
  k->threads = ((const LlmcOp*)op)->threads;
  k->pool_threads = pool_threads_of(op);
  k->bf16 = ((const LlmcOp*)op)->kv_type == T_BFLOAT16;
  k->bits = ((const LlmcOp*)op)->bits;
  const char* name = ((const LlmcOp*)op)->name;
  k->name = name;
  GetAttributeInt64_t get = (GetAttributeInt64_t)SLOT(api, KernelInfoGetAttribute_int64);
  OrtStatus* s = get(info, "K", &k->K);
  if (!s) s = get(info, "N", &k->N);
  if (k->bf16) {
    if (!s) k->gated = optional_int(api, info, "gated", 0) != 0;
    if (!s && (k->K <= 0 || k->K % 2 || k->N <= 0 || (k->gated && k->N % (2 * LLMC_BF16_TILE))))
      s = fail(api, ERR_INVALID_ARGUMENT, "MatMulBF16: K must be positive and even, N positive (gated: a multiple of 32)");
    if (s) {
      free(k);
      return s;
    }
    *out = k;
    return NULL;
  }
  if (!s) s = get(info, "gated", &k->gated);
  if (!s && (k->K <= 0 || k->K % LLMC_Q4_BLOCK || k->N <= 0 || (k->gated && k->N % (2 * LLMC_Q4_TILE)))) {
    char msg[128];
    snprintf(msg, sizeof msg, "%s: K must be a positive multiple of 32, N positive (gated: a multiple of 32)", name);
    s = fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  if (!s) {
    k->act_bits = optional_int(api, info, "act_bits", 8);
    k->int8_prompts = optional_int(api, info, "int8_prompts", 0) != 0;
    if (k->act_bits != 8 && k->act_bits != 16) {
      char msg[128];
      snprintf(msg, sizeof msg, "%s: act_bits %lld: must be 8 (int8 activations) or 16 (two int8 levels)", name,
               (long long)k->act_bits);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    }
  }
  if (!s) {
    k->act_rows = optional_int(api, info, "act_rows", 0);
    if (k->act_rows != 0 && (k->act_rows != 1 || k->act_bits != 8)) {
      char msg[128];
      snprintf(msg, sizeof msg, "%s: act_rows %lld: must be 0 (a grid per block) or 1 (a grid per row, act_bits 8)",
               name, (long long)k->act_rows);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    }
  }
  if (!s) {
    k->window = optional_float(api, info, "window", 0.f);
    if (!(k->window >= 0.f) || isinf(k->window) ||
        (k->window > 0.f && (k->act_bits != 16 || k->gated || k->bits == 2))) {
      char msg[160];
      snprintf(msg, sizeof msg, "%s: window %g: must be a finite margin >= 0, and 0 unless act_bits is 16 without "
               "a gate (act_bits %lld, gated %lld)", name, (double)k->window, (long long)k->act_bits,
               (long long)k->gated);
      s = fail(api, ERR_INVALID_ARGUMENT, msg);
    }
  }
  if (s) {
    free(k);
    return s;
  }
  *out = k;
  return NULL;
}

static OrtStatus* mm_compute(void* kernel, OrtKernelContext* ctx) {
  const MatMulKernel* k = (const MatMulKernel*)kernel;
  const OrtApi* api = k->api;
  void* data[MM_INPUTS] = {0};
  int64_t dims[MM_INPUTS][4];
  int rank[MM_INPUTS];
  CHECK(inputs(api, ctx, MM_INPUTS, data, dims, rank));
  char msg[256];
  const char* name = k->name;
  /* B's shape: Q4 / Q8 / Q2 [pairs of tiles, blocks (Q2: + its grid's row), pair bytes]; bf16 [tiles, K / 2, 32] */
  int64_t b0 = k->bf16 ? (k->N + LLMC_BF16_TILE - 1) / LLMC_BF16_TILE
                       : (k->N + 2 * LLMC_Q4_TILE - 1) / (2 * LLMC_Q4_TILE);
  int64_t b1 = k->bf16 ? k->K / 2 : k->K / LLMC_Q4_BLOCK + (k->bits == 2);
  int64_t b2 = k->bf16     ? 2 * LLMC_BF16_TILE
               : k->bits == 8 ? LLMC_Q8_PAIR_BYTES
               : k->bits == 2 ? LLMC_Q2_PAIR_BYTES
                              : LLMC_Q4_PAIR_BYTES;
  if (rank[MM_A] < 1 || dims[MM_A][rank[MM_A] - 1] != k->K || rank[MM_B] != 3 || dims[MM_B][0] != b0 ||
      dims[MM_B][1] != b1 || dims[MM_B][2] != b2 ||
      (rank[MM_BIAS] >= 0 && (rank[MM_BIAS] != 1 || dims[MM_BIAS][0] != k->N))) {
    snprintf(msg, sizeof msg, "%s: expected A [..., %lld], B [%lld, %lld, %lld], bias [%lld] for K %lld, N %lld",
             name, (long long)k->K, (long long)b0, (long long)b1, (long long)b2, (long long)k->N,
             (long long)k->K, (long long)k->N);
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  int64_t out_dims[4], M = 1;
  for (int i = 0; i < rank[MM_A] - 1; i++) out_dims[i] = dims[MM_A][i], M *= dims[MM_A][i];
  out_dims[rank[MM_A] - 1] = k->gated ? k->N / 2 : k->N;
  OrtValue* out = NULL;
  void* out_data = NULL;
  CHECK(((GetOutput_t)SLOT(api, KernelContext_GetOutput))(ctx, 0, out_dims, (size_t)rank[MM_A], &out));
  CHECK(((GetTensorMutableData_t)SLOT(api, GetTensorMutableData))(out, &out_data));
  Pool pool = {api, ctx, NULL, k->pool_threads};
  const char* err;
  if (k->bf16) {
    llmc_bf16_args a = {.M = M, .K = k->K, .N = k->N, .x = (const float*)data[MM_A], .w = (const uint16_t*)data[MM_B],
                        .bias = (const float*)data[MM_BIAS], .y = (float*)out_data, .threads = k->threads,
                        .gated = (int)k->gated};
    err = llmc_bf16_matmul(&a, run_parallel, &pool);
  } else {
    llmc_q4_args a = {.M = M, .K = k->K, .N = k->N, .gated = (int)k->gated, .x = (const float*)data[MM_A],
                      .w = (const uint8_t*)data[MM_B], .bias = (const float*)data[MM_BIAS], .y = (float*)out_data,
                      .threads = k->threads, .act_bits = (int)k->act_bits, .bits = k->bits,
                      .int8_prompts = (int)k->int8_prompts, .window = k->window, .act_rows = (int)k->act_rows};
    err = llmc_q4_matmul(&a, run_parallel, &pool);
  }
  return outcome(&pool, name, err);
}

/* ---------------------------------------------------------------- SkipRMSNorm */

typedef struct {
  const OrtApi* api;
  float eps;
  int pool_threads; /* as Kernel's */
  int delta;        /* (GatedDeltaRule's attribute) */
} NormKernel;

enum { RN_X, RN_SKIP, RN_GAMMA, RN_INPUTS };

static size_t rn_input_count(const OrtCustomOp* op) { (void)op; return RN_INPUTS; }
static size_t rn_output_count(const OrtCustomOp* op) { (void)op; return 2; }
static int rn_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return T_FLOAT; }
static int rn_characteristic(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return IO_REQUIRED; }
static int rn_output_characteristic(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 1 ? IO_OPTIONAL : IO_REQUIRED; /* the sum: absent where nothing reads it (the last block's) */
}

static OrtStatus* rn_create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  NormKernel* k = (NormKernel*)calloc(1, sizeof(NormKernel));
  if (!k) return fail(api, ERR_FAIL, "SkipRMSNorm: out of memory");
  k->api = api;
  k->pool_threads = pool_threads_of(op);
  k->eps = optional_float(api, info, "epsilon", 1e-5f);
  if (!(k->eps >= 0.f)) {
    free(k);
    return fail(api, ERR_INVALID_ARGUMENT, "SkipRMSNorm: epsilon must not be negative");
  }
  *out = k;
  return NULL;
}

static OrtStatus* rn_compute(void* kernel, OrtKernelContext* ctx) {
  const NormKernel* k = (const NormKernel*)kernel;
  const OrtApi* api = k->api;
  void* data[RN_INPUTS] = {0};
  int64_t dims[RN_INPUTS][4];
  int rank[RN_INPUTS];
  CHECK(inputs(api, ctx, RN_INPUTS, data, dims, rank));
  int same = rank[RN_X] >= 1 && rank[RN_SKIP] == rank[RN_X];
  for (int i = 0; same && i < rank[RN_X]; i++) same = dims[RN_SKIP][i] == dims[RN_X][i];
  int64_t D = rank[RN_X] >= 1 ? dims[RN_X][rank[RN_X] - 1] : 0, M = 1;
  if (!same || rank[RN_GAMMA] != 1 || dims[RN_GAMMA][0] != D) {
    char msg[160];
    snprintf(msg, sizeof msg, "SkipRMSNorm: expected input and skip of one shape [..., D] and gamma [D], D = %lld",
             (long long)D);
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  for (int i = 0; i < rank[RN_X] - 1; i++) M *= dims[RN_X][i];
  void* out[2] = {NULL, NULL};
  for (size_t o = 0; o < 2; o++) {
    OrtValue* v = NULL;
    CHECK(((GetOutput_t)SLOT(api, KernelContext_GetOutput))(ctx, o, dims[RN_X], (size_t)rank[RN_X], &v));
    if (v) CHECK(((GetTensorMutableData_t)SLOT(api, GetTensorMutableData))(v, &out[o]));
  }
  llmc_rms_norm_args a = {.M = M, .D = D, .x = (const float*)data[RN_X], .skip = (const float*)data[RN_SKIP],
                          .gamma = (const float*)data[RN_GAMMA], .eps = k->eps, .y = (float*)out[0],
                          .sum = (float*)out[1]};
  Pool pool = {api, ctx, NULL, k->pool_threads};
  return outcome(&pool, "SkipRMSNorm", llmc_skip_rms_norm(&a, run_parallel, &pool));
}

/* ---------------------------------------------------------------- GatedDeltaRule */

enum { DR_Q, DR_K, DR_V, DR_G, DR_BETA, DR_STATE, DR_ROWS, DR_A, DR_INPUTS };

static size_t dr_input_count(const OrtCustomOp* op) { (void)op; return DR_INPUTS; }
static size_t dr_output_count(const OrtCustomOp* op) { (void)op; return 2; }
static int dr_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == DR_ROWS ? T_INT32 : T_FLOAT; }
static int dr_input_characteristic(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == DR_ROWS || i == DR_A ? IO_OPTIONAL : IO_REQUIRED;
}
static int dr_required(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return IO_REQUIRED; }

static OrtStatus* dr_create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  int64_t delta = optional_int(api, info, "delta", 1);
  if (delta != 0 && delta != 1) return fail(api, ERR_INVALID_ARGUMENT, "GatedDeltaRule: delta must be 0 or 1");
  NormKernel* k = (NormKernel*)calloc(1, sizeof(NormKernel)); /* (its api, pool and delta are all this op keeps) */
  if (!k) return fail(api, ERR_FAIL, "GatedDeltaRule: out of memory");
  k->api = api;
  k->delta = (int)delta;
  k->pool_threads = pool_threads_of(op);
  *out = k;
  return NULL;
}

static OrtStatus* dr_compute(void* kernel, OrtKernelContext* ctx) {
  const NormKernel* k = (const NormKernel*)kernel;
  const OrtApi* api = k->api;
  void* data[DR_INPUTS] = {0};
  int64_t dims[DR_INPUTS][4];
  int rank[DR_INPUTS];
  CHECK(inputs(api, ctx, DR_INPUTS, data, dims, rank));
  int pooled = rank[DR_ROWS] >= 0;
  int64_t B = dims[DR_V][0], S = dims[DR_V][1], H = dims[DR_V][2], V = dims[DR_V][3];
  int64_t Hk = dims[DR_Q][2], K = dims[DR_Q][3];
  int scan = rank[DR_A] >= 0;                /* (Mamba-1's selective scan: g and beta one a value dim, A) */
  int per_key = !scan && rank[DR_G] == 4; /* (Kimi Delta Attention: a decay per key dim) */
  int ok = rank[DR_Q] == 4 && rank[DR_K] == 4 && rank[DR_V] == 4 && (rank[DR_G] == 3 || rank[DR_G] == 4) &&
           rank[DR_BETA] == (scan ? 4 : 3) && rank[DR_STATE] == 4 && (!per_key || dims[DR_G][3] == K);
  if (ok && scan) {
    ok = rank[DR_G] == 4 && dims[DR_G][3] == V && dims[DR_BETA][3] == V && rank[DR_A] == 3 && dims[DR_A][0] == H &&
         dims[DR_A][1] == K && dims[DR_A][2] == V && !k->delta;
  }
  for (int d = 0; ok && d < 4; d++) ok = dims[DR_K][d] == dims[DR_Q][d];
  ok = ok && dims[DR_Q][0] == B && dims[DR_Q][1] == S;
  for (int i = DR_G; ok && i <= DR_BETA; i++) ok = dims[i][0] == B && dims[i][1] == S && dims[i][2] == H;
  ok = ok && (pooled ? rank[DR_ROWS] == 1 && dims[DR_ROWS][0] == B : dims[DR_STATE][0] == B) &&
       dims[DR_STATE][1] == H && dims[DR_STATE][2] == K && dims[DR_STATE][3] == V;
  if (!ok) {
    return fail(api, ERR_INVALID_ARGUMENT, "GatedDeltaRule: expected q, k [B, S, Hk, K], v [B, S, H, V], g [B, S, "
                                           "H] or [B, S, H, K], beta [B, S, H] and state [B, H, K, V] (a pool [N, "
                                           "H, K, V] with state_rows [B]); with A [H, K, V] (delta 0), g and beta "
                                           "[B, S, H, V]");
  }
  void* out[2] = {NULL, NULL};
  for (size_t o = 0; o < 2; o++) {
    OrtValue* v = NULL;
    const int64_t* shape = o == 0 ? dims[DR_V] : dims[DR_STATE];
    CHECK(((GetOutput_t)SLOT(api, KernelContext_GetOutput))(ctx, o, shape, 4, &v));
    CHECK(((GetTensorMutableData_t)SLOT(api, GetTensorMutableData))(v, &out[o]));
  }
  llmc_delta_rule_args a = {.B = B, .S = S, .Hk = Hk, .H = H, .K = K, .V = V, .q = (const float*)data[DR_Q],
                            .k = (const float*)data[DR_K], .v = (const float*)data[DR_V],
                            .g = (const float*)data[DR_G], .beta = (const float*)data[DR_BETA],
                            .state = (const float*)data[DR_STATE], .out = (float*)out[0], .state_out = (float*)out[1],
                            .rows = pooled ? (const int32_t*)data[DR_ROWS] : NULL, .N = dims[DR_STATE][0],
                            .delta = k->delta, .g_per_key = per_key,
                            .A = scan ? (const float*)data[DR_A] : NULL};
  Pool pool = {api, ctx, NULL, k->pool_threads};
  return outcome(&pool, "GatedDeltaRule", llmc_delta_rule(&a, run_parallel, &pool));
}

static LlmcOp make_op(const char* name, int kv_type) {
  LlmcOp op;
  memset(&op, 0, sizeof op);
  op.base.version = ORT_API_VERSION_USED;
  op.base.GetName = op_name;
  op.base.GetExecutionProviderType = op_provider;
  op.base.GetInputType = op_input_type;
  op.base.GetInputTypeCount = op_input_count;
  op.base.GetOutputType = op_output_type;
  op.base.GetOutputTypeCount = op_output_count;
  op.base.KernelDestroy = op_destroy;
  op.base.GetInputCharacteristic = op_input_characteristic;
  op.base.GetOutputCharacteristic = op_output_characteristic;
  op.base.GetInputMemoryType = op_memory_type;
  op.base.CreateKernelV2 = op_create_kernel;
  op.base.KernelComputeV2 = op_compute;
  op.base.GetStartVersion = op_start_version;
  op.base.GetEndVersion = op_end_version;
  op.name = name;
  op.kv_type = kv_type;
  return op;
}

static LlmcOp make_matmul_op(const char* name, int weight_type, int bits) {
  LlmcOp op = make_op(name, weight_type);
  op.bits = bits;
  op.base.GetInputType = mm_input_type;
  op.base.GetInputTypeCount = mm_input_count;
  op.base.GetOutputType = mm_output_type;
  op.base.GetOutputTypeCount = mm_output_count;
  op.base.GetInputCharacteristic = mm_input_characteristic;
  op.base.CreateKernelV2 = mm_create_kernel;
  op.base.KernelComputeV2 = mm_compute;
  return op;
}

static LlmcOp make_norm_op(void) {
  LlmcOp op = make_op("SkipRMSNorm", T_FLOAT);
  op.base.GetInputType = rn_type;
  op.base.GetInputTypeCount = rn_input_count;
  op.base.GetOutputType = rn_type;
  op.base.GetOutputTypeCount = rn_output_count;
  op.base.GetInputCharacteristic = rn_characteristic;
  op.base.GetOutputCharacteristic = rn_output_characteristic;
  op.base.CreateKernelV2 = rn_create_kernel;
  op.base.KernelComputeV2 = rn_compute;
  return op;
}

static LlmcOp make_delta_rule_op(void) {
  LlmcOp op = make_op("GatedDeltaRule", T_FLOAT);
  op.base.GetInputType = dr_input_type;
  op.base.GetInputTypeCount = dr_input_count;
  op.base.GetOutputType = rn_type;
  op.base.GetOutputTypeCount = dr_output_count;
  op.base.GetInputCharacteristic = dr_input_characteristic;
  op.base.GetOutputCharacteristic = dr_required;
  op.base.CreateKernelV2 = dr_create_kernel;
  op.base.KernelComputeV2 = dr_compute;
  return op;
}

#define N_OPS 9
#define MAX_THREADS 256
/* one set per thread count and pool (ONNX Runtime's, llmc's): ONNX Runtime keeps pointers to them */
static LlmcOp op_sets[2][MAX_THREADS + 1][N_OPS];

/* A session config entry's value into value[size] ("" where the session has none). */
static void session_entry(const OrtApi* api, const OrtSessionOptions* options, const char* key, char* value,
                          size_t size) {
  OrtStatus* s = ((GetSessionConfigEntry_t)SLOT(api, GetSessionConfigEntry))(options, key, value, &size);
  if (s) {
    ((ReleaseStatus_t)SLOT(api, ReleaseStatus))(s);
    value[0] = 0;
  }
}

/* The session's "llmc.threads" entry (llmc's engines set it to the session's threads), else 0. */
static int session_threads(const OrtApi* api, const OrtSessionOptions* options) {
  char value[16];
  session_entry(api, options, "llmc.threads", value, sizeof value);
  int n = atoi(value);
  return n > 0 && n <= MAX_THREADS ? n : 0;
}

/* 1 where the session's "llmc.pool" entry is "llmc": the kernels run their parallel calls on llmc's pool of
 * "llmc.threads" threads (pool.h; the session itself then has one intra-op thread), else on ONNX Runtime's. */
static int session_own_pool(const OrtApi* api, const OrtSessionOptions* options) {
  char value[16];
  session_entry(api, options, "llmc.pool", value, sizeof value);
  return !strcmp(value, "llmc");
}

/* The operators' contract version (ops_version.h): engines record it and refuse a library of another. */
EXPORT const char* llmc_ops_version(void) { return LLMC_OPS_VERSION; }
/* The contract versions whose graphs this library runs (space separated): its changes since them only add. */
EXPORT const char* llmc_ops_serves(void) { return LLMC_OPS_SERVES; }

/* The code paths this CPU takes: attention (1 AVX-512, 0 portable) and the 4-bit product (llmc_q4_path). */
EXPORT int llmc_ops_attention_path(void) { return llmc_attention_uses_avx512(); }
EXPORT int llmc_ops_q4_path(void) { return llmc_q4_path(); }
EXPORT int llmc_ops_bf16_path(void) { return llmc_bf16_path(); }
/* Where the AVX2 / AVX-512 paths' streaming prefetches (MatMulQ4/Q8's and MatMulBF16's weights at decode, decode
 * attention's keys) go: 0 L1, 1 L2, 2 L2 at three distances for the 4-bit and 8-bit products' weights (prefetch.h:
 * llmc_prefetch_mode; the portable paths prefetch nothing). */
EXPORT int llmc_ops_prefetch_mode(void) {
#if defined(__x86_64__) || defined(__i386__)
  return llmc_prefetch_mode();
#else
  return 0;
#endif
}

/* llmc's pool (pool.h) checked for tests: `calls` calls on `threads` threads, of `small` and `large` tasks in turn
 * (the race between a finished call and the next, larger one), each task counting its runs; returns the number of
 * tasks not run exactly once per call that had them (0: all were; -1: bad arguments). */
static void pool_check_task(void* runs, size_t i) { __atomic_add_fetch((long*)runs + i, 1, __ATOMIC_RELAXED); }
EXPORT long llmc_ops_pool_check_alternating(int threads, int calls, int small, int large) {
  if (threads < 1 || calls < 0 || small < 0 || large < small) return -1;
  long* runs = (long*)calloc((size_t)large + 1, sizeof(long)); /* (+ 1: never calloc(0)) */
  if (!runs) return -1;
  for (int k = 0; k < calls; k++) llmc_pool_run(&threads, pool_check_task, (size_t)(k % 2 ? large : small), runs);
  long wrong = 0;
  for (int i = 0; i < large; i++) wrong += runs[i] != (i < small ? calls : calls / 2);
  free(runs);
  return wrong;
}
/* `calls` calls of `total` tasks each. */
EXPORT long llmc_ops_pool_check(int threads, int calls, int total) {
  return llmc_ops_pool_check_alternating(threads, calls, total, total);
}
/* The pool's workers started in this process. */
EXPORT int llmc_ops_pool_workers(void) { return llmc_pool_workers(); }

/* The bytes the workers have prefetched ahead in this process, and the bytes they read ahead (KiB, 0: off). */
EXPORT long long llmc_ops_ahead_bytes(void) { return llmc_ahead_bytes(); }
EXPORT void llmc_ops_ahead_set_kb(long long kb) { llmc_ahead_set_kb(kb); }
EXPORT long long llmc_ops_ahead_kb(void) { return llmc_ahead_kb(); }
/* Reading ahead (ahead.h) checked for tests: three 4-bit products A, B, C of K 64 and `n` columns in turn on llmc's
 * pool of `threads` threads, `rounds` times, the caller busy for `gap_us` between two (as it is with the norms).
 * Returns the bytes the workers prefetched ahead meanwhile; -1 when a product failed, -2 for bad arguments, -3 when
 * B and C are not what A and B learned to run next (reading ahead is off: LLMC_AHEAD_KB=0). */
EXPORT long long llmc_ops_ahead_check(int threads, int rounds, int n, int gap_us) {
  if (threads < 1 || rounds < 1 || n < 32 || n % 32 || gap_us < 0) return -2;
  const int64_t K = 64;
  size_t w_bytes = (size_t)(n / 32 * (K / LLMC_Q4_BLOCK) * LLMC_Q4_PAIR_BYTES);
  uint8_t* w = (uint8_t*)calloc(3, w_bytes);
  float* x = (float*)calloc((size_t)K, sizeof(float));
  float* y = (float*)calloc((size_t)n, sizeof(float));
  long long before = llmc_ahead_bytes(), result = -1;
  if (!w || !x || !y) goto done;
  for (int r = 0; r < rounds; r++)
    for (int i = 0; i < 3; i++) {
      llmc_q4_args a = {.M = 1, .K = K, .N = n, .x = x, .w = w + i * w_bytes, .y = y, .threads = threads};
      Pool pool = {NULL, NULL, NULL, threads}; /* llmc's pool (run_parallel needs no ONNX Runtime there) */
      if (llmc_q4_matmul(&a, run_parallel, &pool)) goto done;
      struct timespec t0, t;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      do clock_gettime(CLOCK_MONOTONIC, &t);
      while ((t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000 < gap_us);
    }
  result = llmc_ahead_successor(w) == w + w_bytes && llmc_ahead_successor(w + w_bytes) == w + 2 * w_bytes
               ? llmc_ahead_bytes() - before : -3;
done:
  free(w);
  free(x);
  free(y);
  return result;
}

EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(ORT_API_VERSION_USED);
  if (!api) { /* older than 1.17: say so through the first API version's CreateStatus */
    const OrtApi* v1 = base->GetApi(1);
    return v1 ? fail(v1, ERR_FAIL, "llmc's operators need ONNX Runtime >= 1.17") : NULL;
  }
  int threads = session_threads(api, options), own = threads > 1 && session_own_pool(api, options);
  LlmcOp* ops = op_sets[own][threads];
  if (!ops[0].name) {
    ops[0] = make_op("CachedAttention", T_FLOAT);
    ops[1] = make_op("CachedAttentionF16Cache", T_FLOAT16);
    ops[3] = make_op("CachedAttentionI8Cache", T_INT8);
    ops[2] = make_matmul_op("MatMulQ4", T_UINT8, 4);
    ops[4] = make_matmul_op("MatMulBF16", T_BFLOAT16, 0);
    ops[5] = make_matmul_op("MatMulQ8", T_UINT8, 8);
    ops[6] = make_norm_op();
    ops[7] = make_delta_rule_op();
    ops[8] = make_matmul_op("MatMulQ2", T_UINT8, 2);
    for (int i = 0; i < N_OPS; i++) ops[i].threads = threads, ops[i].own_pool = own;
  }
  /* One domain object per registration: ONNX Runtime keeps a pointer to it in the session options. */
  OrtCustomOpDomain* d = NULL;
  CHECK(((CreateCustomOpDomain_t)SLOT(api, CreateCustomOpDomain))("ai.llmc", &d));
  for (int i = 0; i < N_OPS; i++) CHECK(((CustomOpDomain_Add_t)SLOT(api, CustomOpDomain_Add))(d, &ops[i].base));
  return ((AddCustomOpDomain_t)SLOT(api, AddCustomOpDomain))(options, d);
}
