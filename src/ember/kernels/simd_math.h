// Vector math shared by the kernels' translation units (cpu_kernels.cpp,
// linear_amx.cpp). One definition each, so that an epilogue fused into a matmul
// gives the same bits as the standalone kernel it replaces.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace ember_simd {

// exp(x) in float32: 2^(x log2 e) as 2^n * p(f), p a degree-6 polynomial of
// 2^f on [-0.5, 0.5]; relative error ~2e-7 for |x| < 10, up to ~5e-6 near
// |x| = 87 (ln 2 is not split), plenty for softmax and SiLU. Below -87 it
// returns ~0; above 88.7 it overflows to inf, as std::exp does; NaN stays NaN.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);  // operands in this order: a NaN passes through
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180916e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// SwiGLU's activation, 16 lanes: silu(g) * u = g / (1 + exp(-g)) * u.
inline __m512 silu_mul_ps(__m512 g, __m512 u) {
  const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(sig, u);
}

}  // namespace ember_simd

#endif
