/* Reading ahead: llmc's idle pool workers fetch the next decode product's weights while the caller runs what lies
 * between two products (the norms, the residual adds, ONNX Runtime's own nodes, the Python of a decode step).
 *
 * Why: a decode step at batch 1 streams ~100 MB of weights (SmolLM2 int4) in ~120 products, and between them the
 * caller runs ~0.5 ms of work that reads almost nothing from memory while the workers wait for the next call: the
 * memory sits idle for an eighth of the step. The products come in the same order every step, so each one learns
 * which product ran after it last time; when a product hands its tasks to the pool it points the workers at that
 * successor, and after their share of each call (this product's, the attention's, a norm's) they prefetch into L2
 * the part of the successor's weights each of them will stream (its own contiguous part: llmc_ahead_own_part), then
 * the part of the product after it, up to LLMC_AHEAD_KB KiB (default 2048) ahead, stopping as soon as the next
 * call comes. Measured on the EPYC VM, SmolLM2's default int4 engine at batch 1, one process switching it on and
 * off every 64 steps, the medians of 10 rounds: a step 3.92 -> 3.70 ms (4 MB ahead), 4.18 -> 3.95 (2 MB), the
 * session's run alone 5-8 % faster; the bf16 engine 9.83 -> 9.22 ms; batch 8, bound by the dot products, within
 * noise (docs/performance_notes.md).
 *
 * The successor is only a hint: the table keeps any product's weights by address (a prefetch of an address freed
 * since never faults), and a wrong or missing successor costs only the prefetches. The results never depend on it.
 * LLMC_AHEAD_KB=0 turns it off.
 */
#ifndef LLMC_AHEAD_H
#define LLMC_AHEAD_H

#include <stddef.h>
#include <stdint.h>

/* A product on llmc's pool says so right before its parallel call: its packed weights w, laid out as `units` work
 * units of unit_bytes each in order, split into `parts` contiguous parts (part p: units [units p / parts,
 * units (p + 1) / parts)), one per thread. */
void llmc_ahead_before(const void* w, int64_t unit_bytes, int64_t units, int64_t parts);

/* The part that task `task` of a call of `parts` parts streams first: the part of the pool thread running it (the
 * one its idle time read ahead) where that is one of them, else part `task`. Other parts are taken as the call's
 * split allows (each product makes sure every part is run once). */
int64_t llmc_ahead_own_part(size_t task, int64_t parts);

/* Sets the bytes a worker reads ahead, in KiB (0: off), in place of LLMC_AHEAD_KB (A/B runs in one process). */
void llmc_ahead_set_kb(int64_t kb);
/* The bytes a worker reads ahead now, in KiB (0: off). */
int64_t llmc_ahead_kb(void);

/* Bytes the workers have prefetched ahead in this process (tests, diagnostics). */
int64_t llmc_ahead_bytes(void);

/* The weights of the product learned to run after the one with weights w (NULL: none yet; tests). */
const void* llmc_ahead_successor(const void* w);

#endif
