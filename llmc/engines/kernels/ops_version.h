/* The version of llmc's operators: what their inputs, attributes and arithmetic are. An engine records the version
 * it was built with and refuses a library of another one. Raise it whenever an operator's contract changes. */
#ifndef LLMC_OPS_VERSION_H
#define LLMC_OPS_VERSION_H
/* 2: CachedAttention's local_window_size, softcap and partial rotary; 3: MatMulQ4's act_bits (16: two int8 levels);
 * 4: CachedAttention's block_table (paged KV memory); 5: MatMulBF16; 6: CachedAttention's new_tokens (rows of
 * different counts after a past in one run) */
#define LLMC_OPS_VERSION "6"
/* The versions whose graphs this library still runs: 6 only added an optional input. */
#define LLMC_OPS_SERVES "5 6"
#endif
