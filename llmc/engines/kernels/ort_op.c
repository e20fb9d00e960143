/* ai.llmc.CachedAttention / CachedAttentionF16Cache as an ONNX Runtime custom operator (CPU).
 *
 * Inputs: qkv [B, S, (H + 2 Hkv) D] fp32, past_key, past_value [B, Hkv, L, D] (fp32, or fp16 for the F16Cache op),
 * seqlens_k [B] int32, total_sequence_length [] int32, cos_cache, sin_cache [max_pos, D/2] fp32 (optional, both or
 * neither). Outputs: output [B, S, H D] fp32, present_key, present_value [B, Hkv, L, D]: bind them to the same
 * memory as the past inputs and nothing is copied; otherwise the past is copied into them first.
 * Attributes: num_heads, kv_num_heads (int), scale (float).
 *
 * ONNX Runtime's C API is reached only through the function table it hands RegisterCustomOps (its ABI is
 * append-only and versioned): the few entries used here are declared by their position in that table, for API
 * version 17 (ONNX Runtime 1.17, the first with KernelContext_ParallelFor), which any later runtime also serves.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention_kernel.h"

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

enum { T_UNDEFINED = 0, T_FLOAT = 1, T_INT32 = 6, T_FLOAT16 = 10 };
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
  int kv_type;
} AttentionOp;

typedef struct {
  const OrtApi* api;
  int64_t num_heads, kv_num_heads;
  float scale;
  int kv_f16;
} Kernel;

enum { IN_QKV, IN_PAST_K, IN_PAST_V, IN_SEQLENS, IN_TOTAL, IN_COS, IN_SIN, N_INPUTS };
enum { OUT_ATTN, OUT_PRESENT_K, OUT_PRESENT_V, N_OUTPUTS };

static const char* op_name(const OrtCustomOp* op) { return ((const AttentionOp*)op)->name; }
static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static size_t op_input_count(const OrtCustomOp* op) { (void)op; return N_INPUTS; }
static size_t op_output_count(const OrtCustomOp* op) { (void)op; return N_OUTPUTS; }
static int op_input_type(const OrtCustomOp* op, size_t i) {
  if (i == IN_PAST_K || i == IN_PAST_V) return ((const AttentionOp*)op)->kv_type;
  return i == IN_SEQLENS || i == IN_TOTAL ? T_INT32 : T_FLOAT;
}
static int op_output_type(const OrtCustomOp* op, size_t i) {
  return i == OUT_ATTN ? T_FLOAT : ((const AttentionOp*)op)->kv_type;
}
static int op_input_characteristic(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == IN_COS || i == IN_SIN ? IO_OPTIONAL : IO_REQUIRED;
}
static int op_output_characteristic(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return IO_REQUIRED; }
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

static OrtStatus* op_create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return fail(api, ERR_FAIL, "CachedAttention: out of memory");
  k->api = api;
  k->kv_f16 = ((const AttentionOp*)op)->kv_type == T_FLOAT16;
  OrtStatus* s = ((GetAttributeInt64_t)SLOT(api, KernelInfoGetAttribute_int64))(info, "num_heads", &k->num_heads);
  if (!s) s = ((GetAttributeInt64_t)SLOT(api, KernelInfoGetAttribute_int64))(info, "kv_num_heads", &k->kv_num_heads);
  if (!s) s = ((GetAttributeFloat_t)SLOT(api, KernelInfoGetAttribute_float))(info, "scale", &k->scale);
  if (!s && (k->num_heads < 1 || k->kv_num_heads < 1 || k->num_heads % k->kv_num_heads))
    s = fail(api, ERR_INVALID_ARGUMENT, "CachedAttention: num_heads must be a positive multiple of kv_num_heads");
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
  if (!s && n > 4) s = fail(api, ERR_INVALID_ARGUMENT, "CachedAttention: an input has more than 4 dimensions");
  if (!s) s = ((GetDimensions_t)SLOT(api, GetDimensions))(info, dims, n);
  ((ReleaseShape_t)SLOT(api, ReleaseTensorTypeAndShapeInfo))(info);
  if (s) return s;
  *rank = (int)n;
  return ((GetTensorMutableData_t)SLOT(api, GetTensorMutableData))((OrtValue*)v, data);
}

typedef struct {
  const OrtApi* api;
  const OrtKernelContext* ctx;
  OrtStatus* status;
} Pool;

static void run_parallel(void* pool_, void (*fn)(void*, size_t), size_t total, void* data) {
  Pool* pool = (Pool*)pool_;
  pool->status = ((ParallelFor_t)SLOT(pool->api, KernelContext_ParallelFor))(pool->ctx, fn, total, 0, data);
}

static OrtStatus* op_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  const OrtApi* api = k->api;
  GetInput_t get_input = (GetInput_t)SLOT(api, KernelContext_GetInput);
  void* data[N_INPUTS] = {0};
  int64_t dims[N_INPUTS][4];
  int rank[N_INPUTS];
  for (int i = 0; i < N_INPUTS; i++) {
    const OrtValue* v = NULL;
    CHECK(get_input(ctx, (size_t)i, &v));
    CHECK(tensor(api, v, &data[i], dims[i], &rank[i]));
  }
  char msg[256];
  int H = (int)k->num_heads, Hkv = (int)k->kv_num_heads;
  if (rank[IN_QKV] != 3 || rank[IN_PAST_K] != 4 || rank[IN_PAST_V] != 4 || rank[IN_SEQLENS] != 1 ||
      rank[IN_TOTAL] > 1 || rank[IN_TOTAL] < 0)
    return fail(api, ERR_INVALID_ARGUMENT, "CachedAttention: expected qkv [B, S, W], past [B, Hkv, L, D], "
                                           "seqlens_k [B], total_sequence_length []");
  int64_t B = dims[IN_QKV][0], S = dims[IN_QKV][1], W = dims[IN_QKV][2], D = dims[IN_PAST_K][3];
  int64_t L = dims[IN_PAST_K][2];
  if (memcmp(dims[IN_PAST_K], dims[IN_PAST_V], sizeof(dims[0])) || dims[IN_PAST_K][0] != B ||
      dims[IN_PAST_K][1] != Hkv || W != (H + 2 * Hkv) * D || dims[IN_SEQLENS][0] != B) {
    snprintf(msg, sizeof msg, "CachedAttention: qkv width %lld, past [%lld, %lld, %lld, %lld], seqlens_k [%lld] do "
             "not fit batch %lld, %d heads, %d KV heads", (long long)W, (long long)dims[IN_PAST_K][0],
             (long long)dims[IN_PAST_K][1], (long long)L, (long long)D, (long long)dims[IN_SEQLENS][0],
             (long long)B, H, Hkv);
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  if ((rank[IN_COS] < 0) != (rank[IN_SIN] < 0) ||
      (rank[IN_COS] >= 0 && (rank[IN_COS] != 2 || rank[IN_SIN] != 2 || dims[IN_COS][1] != D / 2 ||
                             memcmp(dims[IN_COS], dims[IN_SIN], 2 * sizeof(int64_t)))))
    return fail(api, ERR_INVALID_ARGUMENT, "CachedAttention: cos_cache and sin_cache must both be [max_pos, D/2]");

  GetOutput_t get_output = (GetOutput_t)SLOT(api, KernelContext_GetOutput);
  int64_t out_dims[3] = {B, S, H * D};
  OrtValue *out = NULL, *present[2] = {NULL, NULL};
  void *out_data = NULL, *present_data[2] = {NULL, NULL};
  GetTensorMutableData_t mutable_data = (GetTensorMutableData_t)SLOT(api, GetTensorMutableData);
  CHECK(get_output(ctx, OUT_ATTN, out_dims, 3, &out));
  CHECK(mutable_data(out, &out_data));
  size_t cache_bytes = (size_t)(B * Hkv * L * D) * (k->kv_f16 ? 2 : 4);
  for (int i = 0; i < 2; i++) {
    CHECK(get_output(ctx, OUT_PRESENT_K + i, dims[IN_PAST_K], 4, &present[i]));
    CHECK(mutable_data(present[i], &present_data[i]));
    if (present_data[i] != data[IN_PAST_K + i]) memcpy(present_data[i], data[IN_PAST_K + i], cache_bytes);
  }
  llmc_attention_args a = {
      .B = (int)B, .S = (int)S, .H = H, .Hkv = Hkv, .D = (int)D, .L = (int)L,
      .first_prompt = *(const int32_t*)data[IN_TOTAL] == S, .kv_f16 = k->kv_f16,
      .max_pos = rank[IN_COS] >= 0 ? (int)dims[IN_COS][0] : 0,
      .qkv = (const float*)data[IN_QKV], .k = present_data[0], .v = present_data[1],
      .seqlens = (const int32_t*)data[IN_SEQLENS], .cos = (const float*)data[IN_COS],
      .sin = (const float*)data[IN_SIN], .scale = k->scale, .out = (float*)out_data};
  Pool pool = {api, ctx, NULL};
  const char* err = llmc_attention(&a, run_parallel, &pool);
  if (pool.status) return pool.status;
  if (err) {
    snprintf(msg, sizeof msg, "CachedAttention: %s", err);
    return fail(api, ERR_INVALID_ARGUMENT, msg);
  }
  return NULL;
}

static AttentionOp make_op(const char* name, int kv_type) {
  AttentionOp op;
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

static AttentionOp ops[2];

EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(ORT_API_VERSION_USED);
  if (!api) { /* older than 1.17: say so through the first API version's CreateStatus */
    const OrtApi* v1 = base->GetApi(1);
    return v1 ? fail(v1, ERR_FAIL, "the llmc attention operator needs ONNX Runtime >= 1.17") : NULL;
  }
  if (!ops[0].name) {
    ops[0] = make_op("CachedAttention", T_FLOAT);
    ops[1] = make_op("CachedAttentionF16Cache", T_FLOAT16);
  }
  /* One domain object per registration: ONNX Runtime keeps a pointer to it in the session options. */
  OrtCustomOpDomain* d = NULL;
  CHECK(((CreateCustomOpDomain_t)SLOT(api, CreateCustomOpDomain))("ai.llmc", &d));
  for (int i = 0; i < 2; i++) CHECK(((CustomOpDomain_Add_t)SLOT(api, CustomOpDomain_Add))(d, &ops[i].base));
  return ((AddCustomOpDomain_t)SLOT(api, AddCustomOpDomain))(options, d);
}
