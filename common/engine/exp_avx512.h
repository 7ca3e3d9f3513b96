#ifndef SPECSERVE_COMMON_ENGINE_EXP_AVX512_H_
#define SPECSERVE_COMMON_ENGINE_EXP_AVX512_H_

// exp(x) on 16 float lanes, shared by the AVX-512 softmax (kernels.cc) and
// the small-head attention kernel. Internal to common/engine: callers must
// themselves be compiled for (or dispatched to) AVX-512F.

#include <immintrin.h>

namespace specserve {
namespace kernels {

/// exp(x) per lane: range reduction x = n ln2 + r, |r| <= ln2/2, degree-6
/// polynomial for e^r (Cephes expf coefficients), scaled by 2^n. The same
/// operations in the same order as kernels.cc's 8-lane Exp8, so both give
/// the same bits for the same input. Lanes at or below -88.376 (including
/// -inf, a masked score) give exactly 0; inputs above 88.376 are clamped.
__attribute__((target("avx512f"))) inline __m512 Exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f);
  const __m512 lo = _mm512_set1_ps(-88.3762626647949f);
  const __mmask16 above_lo = _mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  __m512i e = _mm512_cvtps_epi32(n);
  e = _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(above_lo, p, _mm512_castsi512_ps(e));
}

}  // namespace kernels
}  // namespace specserve

#endif  // SPECSERVE_COMMON_ENGINE_EXP_AVX512_H_
