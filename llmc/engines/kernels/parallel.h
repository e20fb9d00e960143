/* How llmc's kernels are handed a thread pool (ONNX Runtime's intra-op pool in ort_op.c). */
#ifndef LLMC_PARALLEL_H
#define LLMC_PARALLEL_H

#include <stddef.h>

/* Runs fn(data, i) for i in [0, total), possibly on several threads; NULL where a kernel takes one means "run
 * them in this thread". */
typedef void (*llmc_parallel_fn)(void* ctx, void (*fn)(void*, size_t), size_t total, void* data);

#endif
