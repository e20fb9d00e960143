/* The version of llmc's operators: what their inputs, attributes and arithmetic are. An engine records the version
 * it was built with and refuses a library of another one. Raise it whenever an operator's contract changes. */
#ifndef LLMC_OPS_VERSION_H
#define LLMC_OPS_VERSION_H
/* 2: CachedAttention's local_window_size, softcap and partial rotary; 3: MatMulQ4's act_bits (16: two int8 levels);
 * 4: CachedAttention's block_table (paged KV memory); 5: MatMulBF16; 6: CachedAttention's new_tokens (rows of
 * different counts after a past in one run); 7: MatMulQ8 (8-bit scale + min weights: the head, --quant int8, raised
 * layers), and MatMulQ4's min met by the quantized block sums of x (closer to x @ W: older engines gain from it);
 * 8: MatMulQ4 / MatMulQ8's prompts on AMX-BF16 tiles where the CPU has them (older engines gain from it too), and
 * their int8_prompts attribute (1: every row on the int8 arithmetic: the calibration graph); 9: act_bits 16 on those
 * tiles is one bf16 level, as act_bits 8 (the two levels' second pass of the tiles is gone); 10: MatMulBF16's gated
 * attribute (SwiGLU in its epilogue); 11: SkipRMSNorm; 12: CachedAttention's int8 cache holds its keys times a
 * 32-point Hadamard matrix (attention_kernel.c; older engines gain from it: a cache lives only in its process); 13: CachedAttention's key_tiles attribute (keys in
 * groups of 16 positions as [D][16]); 14: MatMulQ4 / MatMulQ8's window attribute (act_bits 16's second level only
 * near each row's largest output: the LM head's batches); 15: CachedAttention's sinks (GPT-OSS); 16: CachedAttention
 * takes any number of query heads a KV head (more than 64, or than 8192 floats of their rows: latent attention); 17:
 * CachedAttention's attention_chunk_size attribute (Llama 4's chunked attention); 18: GatedDeltaRule (Qwen3.5); 19: GatedDeltaRule's delta attribute (0: Mamba-2); 20: its g of one decay per
 * key dim (Kimi Delta Attention); 21: its optional input A (Mamba-1's selective scan: a decay per channel and state
 * element); 22: CachedAttention's kv_shared attribute (a layer reading another layer's cache: Gemma 4's KV-shared
 * layers) and its present outputs optional; 23: CachedAttention's index_topk / index_local / index_sink /
 * index_heads attributes (Kolibri 1.1's indexed attention: each query's keys chosen by routing scores); 24: MatMulQ4 /
 * MatMulQ8's act_rows attribute (each row of x on one int8 grid: BitNet's per-token activations); 25: MatMulQ2 (2-bit
 * weights with a scale and min a column: BitNet's ternary layers) */
#define LLMC_OPS_VERSION "25"
/* The versions whose graphs this library still runs: 6, 7 and 8 only added an optional input, an operator and an
 * optional attribute; 9 and 12 changed no graph, 10, 13 and 14 added an optional attribute, 11 an operator, 15 an
 * optional input, 16 only shapes that 15 refused, 17 an optional attribute, 18 an operator, 19 an optional attribute, 20 a shape 19 refused, 21 an optional input, 22, 23 and 24 optional attributes, 25 an operator. */
#define LLMC_OPS_SERVES "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25"
#endif
