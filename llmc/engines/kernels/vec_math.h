/* AVX-512 (and AVX2) math shared by the kernels (each includes it inside its x86 section). */
#ifndef LLMC_VEC_MATH_H
#define LLMC_VEC_MATH_H

#include <immintrin.h>

/* exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, 2^n by scalef), flushed to 0
 * below e^-80: a weight that small changes nothing, and as a denormal it would make every product it enters slow. */
__attribute__((target("avx512f"))) static inline __m512 llmc_exp512(__m512 x) {
  __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-80.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

/* llmc_exp512 on AVX2 (2^n from the exponent bits: n stays in [-126, 127] inside the clamps). */
__attribute__((target("avx2,fma"))) static inline __m256 llmc_exp256(__m256 x) {
  __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-80.f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), normal);
}

/* silu(g) = g sigmoid(g), sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (in
 * llmc_exp512's range, and never overflowing). */
__attribute__((target("avx512f"))) static inline __m512 llmc_silu512(__m512 g) {
  __m512 e = llmc_exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  __m512 one = _mm512_set1_ps(1.f);
  __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  __m512 num = _mm512_mask_mov_ps(one, neg, e);
  return _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e)));
}

#endif
