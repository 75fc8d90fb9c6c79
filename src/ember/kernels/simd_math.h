// Vector math shared by the kernels' translation units (cpu_kernels.cpp,
// linear_amx.cpp). One definition each, so that an epilogue fused into a matmul
// gives the same bits as the standalone kernel it replaces, and one exp
// polynomial for both vector widths.
#pragma once

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace ember_simd {

// exp(x) = 2^(x log2 e) = 2^n * p(f), n the nearest integer and f the rest:
// p is this degree-6 polynomial of 2^f on [-0.5, 0.5] (highest degree first),
// evaluated by Horner's rule with one fma a step.
constexpr float LOG2E = 1.44269504088896341f;
constexpr float EXP_POLY[7] = {1.5353362e-4f, 1.3398874e-3f, 9.6180916e-3f, 5.5503406e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.f};

}  // namespace ember_simd
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace ember_simd {

// exp(x) in float32, 16 lanes (EXP_POLY, 2^n by scalef): relative error ~2e-7
// for |x| < 10, up to ~5e-6 near |x| = 87 (ln 2 is not split), plenty for
// softmax and SiLU. Below -87 it returns ~0; above 88.7 it overflows to inf, as
// std::exp does; NaN stays NaN.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);  // operands in this order: a NaN passes through
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(LOG2E));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_POLY[i]));
  return _mm512_scalef_ps(p, n);
}

// SwiGLU's activation, 16 lanes: silu(g) * u = g / (1 + exp(-g)) * u.
inline __m512 silu_mul_ps(__m512 g, __m512 u) {
  const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(sig, u);
}

}  // namespace ember_simd

#endif

#if defined(__AVX2__) && defined(__FMA__)
namespace ember_simd {

// exp(x), 8 lanes: EXP_POLY, with 2^n built in the exponent bits. x is clamped
// to [-87, 88.3] so that n stays a normal exponent; NaN passes through (max/min
// return their second operand when one is NaN).
inline __m256 exp8_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), x);
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(LOG2E));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_POLY[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace ember_simd
#endif
