/* How fast the 4-bit and 8-bit products stream their weights, against the same bytes read by a plain loop: a C
 * loop of SmolLM2-135M's 121 decode products (30 layers of qkv, o, gate+up and down at 4 bits, the 8-bit head) on
 * llmc's pool, with nothing between them (no ONNX Runtime, attention, norms or Python), then the read probe's loop
 * (bandwidth.h: llmc_read_span) over the same buffer on the same pool: whole (each thread one half), and in the
 * products' chunks (one pool call a product, each thread half of it). Each figure is the median of the steps after
 * 10 of warm-up.
 *
 *   cd llmc/engines/kernels && gcc -O3 -std=gnu11 -fno-math-errno -I. ../../../scripts/stream_products.c \
 *       matmul_q4.c ahead.c amx_bf16.c pool.c bandwidth.c -o /tmp/stream_products -lpthread -lm
 *   for i in 1 2 3; do for p in l2 l2x3; do LLMC_PREFETCH=$p /tmp/stream_products 2 1 150; done; done
 *
 * Arguments: threads (2), rows of x (1: a batch-1 decode step), steps (150), activation bits (16: the default
 * engine's raised layers; 8). The VM's memory speed moves from minute to minute, so set each run against its own
 * probe and alternate the configurations (docs/performance_notes.md, 2026-12-04 s40). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "bandwidth.h"
#include "matmul_q4.h"
#include "harness.h"

typedef struct {
  int64_t K, N;
  int gated, bits;
  size_t off;
} product;

typedef struct {
  const char* p;
  size_t n;
  double sink[2];
} span;

static int threads = 2;

/* The read probe's loop over half of a span a task. */
static void read_half(void* data, size_t task) {
  span* s = (span*)data;
  size_t half = s->n / 2 / 256 * 256;
  s->sink[task & 1] = llmc_read_span(s->p + task * half, half);
}

static double median_after_warmup(double* t, int steps) { return llmc_probe_median(t + 10, steps - 10); }

int main(int argc, char** argv) {
  threads = argc > 1 ? atoi(argv[1]) : 2;
  int rows = argc > 2 ? atoi(argv[2]) : 1, steps = argc > 3 ? atoi(argv[3]) : 150;
  int act_bits = argc > 4 ? atoi(argv[4]) : 16;
  if (threads < 1 || rows < 1 || rows > 4096 || steps < 20) {
    fprintf(stderr, "usage: stream_products [threads >= 1] [rows 1-4096] [steps >= 20] [act bits 8|16]\n");
    return 2;
  }
  product p[121];
  int n = 0;
  size_t bytes = 0;
  for (int l = 0; l < 30; l++) {
    p[n++] = (product){576, 960, 0, 4, 0};
    p[n++] = (product){576, 576, 0, 4, 0};
    p[n++] = (product){576, 3072, 1, 4, 0};
    p[n++] = (product){1536, 576, 0, 4, 0};
  }
  p[n++] = (product){576, 49152, 0, 8, 0};
  for (int i = 0; i < n; i++) {
    p[i].off = bytes;
    bytes += (size_t)((p[i].N + 31) / 32) * (size_t)(p[i].K / 32) * 2 *
             (p[i].bits == 8 ? LLMC_Q8_TILE_BYTES : LLMC_Q4_TILE_BYTES);
  }
  uint8_t* w;
  if (posix_memalign((void**)&w, 2 << 20, bytes)) return 1;
  madvise(w, bytes, MADV_HUGEPAGE); /* as the engine's weights (llmc/engines/ort/weights.py) */
  for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)(i * 2654435761u >> 13);
  for (int i = 0; i < n; i++) { /* every block's fp16 scales and mins 2^-4: finite arithmetic */
    int64_t tile = p[i].bits == 8 ? LLMC_Q8_TILE_BYTES : LLMC_Q4_TILE_BYTES;
    int64_t blocks = (p[i].N + 31) / 32 * 2 * (p[i].K / 32);
    for (int64_t b = 0; b < blocks; b++) {
      uint16_t* g = (uint16_t*)(w + p[i].off + b * tile + (p[i].bits == 8 ? 512 : 256));
      for (int k = 0; k < 32; k++) g[k] = 0x2C00;
    }
  }
  float* x = malloc(sizeof(float) * (size_t)rows * 1536);
  float* y = malloc(sizeof(float) * (size_t)rows * 49152);
  double* t = malloc(sizeof(double) * (size_t)steps);
  if (!x || !y || !t) return 1;
  for (int i = 0; i < rows * 1536; i++) x[i] = (float)((i * 37) % 101) / 50.f - 1.f;

  for (int s = 0; s < steps; s++) {
    double t0 = llmc_probe_seconds();
    for (int i = 0; i < n; i++) {
      llmc_q4_args a = {.M = rows, .K = p[i].K, .N = p[i].N, .gated = p[i].gated, .x = x, .w = w + p[i].off,
                        .y = y, .threads = threads, .act_bits = act_bits, .bits = p[i].bits};
      const char* e = llmc_q4_matmul(&a, harness_on_pool, &threads);
      if (e) {
        fprintf(stderr, "%s\n", e);
        return 1;
      }
    }
    t[s] = llmc_probe_seconds() - t0;
  }
  double products = median_after_warmup(t, steps);
  for (int s = 0; s < steps; s++) {
    span whole = {(const char*)w, bytes, {0, 0}};
    double t0 = llmc_probe_seconds();
    llmc_pool_run(&threads, read_half, 2, &whole);
    t[s] = llmc_probe_seconds() - t0;
  }
  double probe = median_after_warmup(t, steps);
  for (int s = 0; s < steps; s++) {
    double t0 = llmc_probe_seconds();
    for (int i = 0; i < n; i++) {
      span chunk = {(const char*)w + p[i].off, (i + 1 < n ? p[i + 1].off : bytes) - p[i].off, {0, 0}};
      llmc_pool_run(&threads, read_half, 2, &chunk);
    }
    t[s] = llmc_probe_seconds() - t0;
  }
  double chunked = median_after_warmup(t, steps);
  const char* mode = getenv("LLMC_PREFETCH");
  printf("LLMC_PREFETCH=%s rows %d act_bits %d: %.1f MB; products %.3f ms = %.1f GB/s; probe %.1f GB/s whole, "
         "%.1f in the products' chunks; products / probe %.3f\n",
         mode ? mode : "(default)", rows, act_bits, (double)bytes / 1e6, products * 1e3, (double)bytes / products / 1e9,
         (double)bytes / probe / 1e9, (double)bytes / chunked / 1e9, probe / products);
  return 0;
}
