/* What the machine probes (bandwidth.c, matrix_peak.c) time their passes with and take the median of. */
#ifndef LLMC_PROBE_CLOCK_H
#define LLMC_PROBE_CLOCK_H

#include <stdlib.h>
#include <time.h>

static inline double llmc_probe_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int llmc_probe_by_value(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* The median of n values (sorted in place). */
static inline double llmc_probe_median(double* v, int n) {
  qsort(v, (size_t)n, sizeof(double), llmc_probe_by_value);
  return v[n / 2];
}

#endif
