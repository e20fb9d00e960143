/* What a decode step's attention costs against what its keys and values take to read: llmc's attention operator
 * (attention_kernel.c) over SmolLM2-135M's shapes (30 layers, 9 query heads over 3 KV heads of 64, paged fp16 cache
 * in blocks of 64 with keys in groups of 16: the default engine's), one new token a row, on llmc's pool, with nothing
 * between the layers (no products, ONNX Runtime or Python). Each step is timed three ways, one after the other:
 *   cold   every layer its own pools (47 MB at 2,048 tokens: past the last-level cache, as in the engine);
 *   hot    every layer layer 0's pools (they stay in cache: the kernel's arithmetic alone);
 *   read   the read probe's loop (bandwidth.h: llmc_read_span) over the same pools, half a pool a thread.
 * Each figure is the median of the steps after 10 of warm-up. cold against read is how far the operator is from
 * the memory; hot against cold is how much of it is its arithmetic.
 *
 *   cd llmc/engines/kernels && gcc -O3 -std=gnu11 -fno-math-errno -I. ../../../scripts/bench_decode_attention.c \
 *       attention_kernel.c amx_bf16.c pool.c ahead.c bandwidth.c -o /tmp/bench_decode_attention -lpthread -lm
 *   /tmp/bench_decode_attention 2 1 2048 60      # threads, rows (the batch), cached tokens a row, steps
 *
 * The VM's memory and its cores' speed move from minute to minute: compare figures of one run, and alternate the
 * configurations (docs/performance_notes.md, 2026-12-07 s67). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "attention_kernel.h"
#include "bandwidth.h"
#include "harness.h"

#define LAYERS 30
#define HEADS 9
#define KV_HEADS 3
#define DIM 64
#define BLOCK 64

typedef struct {
  const char* p[2];
  size_t n;
  double sink[2];
} pools_t;

/* The read probe's loop over half of the K and V pools a task. */
static void read_half(void* data, size_t task) {
  pools_t* s = (pools_t*)data;
  size_t half = s->n / 2 / 256 * 256;
  s->sink[task & 1] = llmc_read_span(s->p[0] + task * half, half) + llmc_read_span(s->p[1] + task * half, half);
}

static char* pool_of(size_t bytes, unsigned seed) {
  uint16_t* p;
  if (posix_memalign((void**)&p, 2 << 20, bytes)) return NULL;
  madvise(p, bytes, MADV_HUGEPAGE); /* as the engine's pools (numpy's large arrays) */
  for (size_t i = 0; i < bytes / 2; i++) /* fp16 values in [1, 2): finite scores */
    p[i] = (uint16_t)(0x3c00 | ((i * 2654435761u + seed) >> 7 & 0x3ff));
  return (char*)p;
}

static double median_after_warmup(double* t, int steps) { return llmc_probe_median(t + 10, steps - 10); }

int main(int argc, char** argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 2, rows = argc > 2 ? atoi(argv[2]) : 1;
  int context = argc > 3 ? atoi(argv[3]) : 2048, steps = argc > 4 ? atoi(argv[4]) : 60;
  if (threads < 1 || rows < 1 || rows > 64 || context < 1 || context > 65536 || steps < 20) {
    fprintf(stderr, "usage: bench_decode_attention [threads >= 1] [rows 1-64] [context 1-65536] [steps >= 20]\n");
    return 2;
  }
  int max_blocks = (context + steps + BLOCK - 1) / BLOCK, blocks = max_blocks * rows;
  size_t bytes = (size_t)blocks * KV_HEADS * BLOCK * DIM * 2; /* one pool: [blocks, Hkv, BLOCK, D] fp16 */
  char *k[LAYERS], *v[LAYERS];
  for (int l = 0; l < LAYERS; l++)
    if (!(k[l] = pool_of(bytes, 2u * l)) || !(v[l] = pool_of(bytes, 2u * l + 1))) return 1;
  int32_t* table = malloc(sizeof(int32_t) * (size_t)blocks);
  int32_t* seqlens = malloc(sizeof(int32_t) * (size_t)rows);
  float* qkv = malloc(sizeof(float) * (size_t)rows * (HEADS + 2 * KV_HEADS) * DIM);
  float* out = malloc(sizeof(float) * (size_t)rows * HEADS * DIM);
  double *cold = malloc(sizeof(double) * steps), *hot = malloc(sizeof(double) * steps),
         *read = malloc(sizeof(double) * steps);
  if (!table || !seqlens || !qkv || !out || !cold || !hot || !read) return 1;
  for (int i = 0; i < blocks; i++) table[i] = i; /* row b's blocks b * max_blocks .. in order */
  for (int i = 0; i < rows * (HEADS + 2 * KV_HEADS) * DIM; i++) qkv[i] = (float)((i * 37) % 1000) / 1000.f - 0.5f;
  pools_t probe = {.n = bytes};
  double sink = 0.;
  for (int s = 0; s < steps; s++) {
    double* times[2] = {cold, hot};
    for (int pass = 0; pass < 2; pass++) {
      for (int b = 0; b < rows; b++) seqlens[b] = context + s; /* cached + this token - 1 */
      double t0 = llmc_probe_seconds();
      for (int l = 0; l < LAYERS; l++) {
        int at = pass ? 0 : l;
        llmc_attention_args a = {.B = rows, .S = 1, .H = HEADS, .Hkv = KV_HEADS, .D = DIM, .L = max_blocks * BLOCK,
                                 .kv_kind = LLMC_KV_F16, .qkv = qkv, .k = k[at], .v = v[at], .seqlens = seqlens,
                                 .scale = 0.125f, .out = out, .block_table = table, .block_size = BLOCK,
                                 .max_blocks = max_blocks, .num_blocks = blocks, .key_tiles = 1};
        const char* err = llmc_attention(&a, threads > 1 ? harness_on_pool : NULL, &threads);
        if (err) {
          fprintf(stderr, "llmc_attention: %s\n", err);
          return 1;
        }
      }
      times[pass][s] = llmc_probe_seconds() - t0;
    }
    double t0 = llmc_probe_seconds();
    for (int l = 0; l < LAYERS; l++) {
      probe.p[0] = k[l], probe.p[1] = v[l];
      if (threads > 1)
        harness_on_pool(&threads, read_half, 2, &probe);
      else
        read_half(&probe, 0), read_half(&probe, 1);
      sink += probe.sink[0] + probe.sink[1];
    }
    read[s] = llmc_probe_seconds() - t0;
  }
  for (int i = 0; i < rows * HEADS * DIM; i++)
    if (!(out[i] > -1e30f && out[i] < 1e30f)) { /* (finite: weighted sums of values in [1, 2)) */
      fprintf(stderr, "attention output %d is %g\n", i, (double)out[i]);
      return 1;
    }
  double mb = 2. * LAYERS * (double)bytes / 1e6, kv = 2. * LAYERS * rows * KV_HEADS * (context + steps / 2.) * DIM * 2 / 1e6;
  double c = median_after_warmup(cold, steps), h = median_after_warmup(hot, steps), r = median_after_warmup(read, steps);
  printf("%d thread(s), %d row(s), %d cached tokens a row (+%d steps): a step's attention reads %.1f MB\n", threads,
         rows, context, steps, kv);
  printf("  cold (the engine's case) %7.3f ms = %5.1f GB/s, %6.1f us a layer\n", c * 1e3, kv / c / 1e3,
         c * 1e6 / LAYERS);
  printf("  hot (in cache)           %7.3f ms = %5.1f GB/s, %6.1f us a layer\n", h * 1e3, kv / h / 1e3,
         h * 1e6 / LAYERS);
  printf("  read probe               %7.3f ms = %5.1f GB/s over the pools' %.1f MB\n", r * 1e3, mb / r / 1e3, mb);
  if (sink == 1.2345) printf("%g\n", sink); /* (keeps the probe's reads) */
  return 0;
}
