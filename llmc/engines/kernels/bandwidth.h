/* The read probe's loop (bandwidth.c), for llmc_read_gbs and for harnesses that read other buffers the same way
 * (scripts/stream_products.c). */
#ifndef LLMC_BANDWIDTH_H
#define LLMC_BANDWIDTH_H

#include <stddef.h>

/* Reads the n bytes at p (64-byte aligned; whole 256-byte steps) as the probe does: AVX-512 loads with software
 * prefetch where the CPU has them and LLMC_KERNELS_GENERIC is unset, else a portable loop. Returns a sum of what it
 * read, so that the reads are not dropped. */
double llmc_read_span(const char* p, size_t n);

#endif
