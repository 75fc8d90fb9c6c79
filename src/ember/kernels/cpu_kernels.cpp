// Fused CPU kernels for Ember's decoder (see cpu.py for when they are used).
//
// Each kernel replaces a chain of small ATen ops whose dispatch overhead, not
// their arithmetic, dominates a decode step on a small model. Every kernel
// reads and writes plain contiguous tensors; accumulation is in float32.
//
// Layouts (the same as model/llama.py):
//   activations  (T, D) row-major, float32 residual stream
//   qkv          (T, (H + 2 KV) * Hd), q heads then k heads then v heads
//   rotary       interleaved pairs: dims (2j, 2j+1) rotate by pos * theta_j
//   KV cache     (num_slots, KV, Hd) per layer, float32 or float16; slot = block * block_size + offset

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include "linear_amx.h"
#include "simd_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define EMBER_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 machines (e.g. Zen 3): the attention and SiLU loops have 8-wide twins.
#include <immintrin.h>
#define EMBER_AVX2 1
#endif

using torch::Tensor;
using BF16 = c10::BFloat16;
// A float16 KV cache (EngineConfig.kv_cache_dtype): half the bytes of float32.
using Half = at::Half;

// linear_lanes.cpp: the batch-invariant linears.
Tensor linear_w8a16(Tensor x, Tensor w, Tensor scale);
bool swiglu_w8a16(Tensor act, Tensor x, Tensor w, Tensor scale);
Tensor linear_f32_lanes(Tensor x, Tensor w);
Tensor lanes_rows(Tensor w, Tensor scale, Tensor ids);
std::string set_w8a16_ceiling(const std::string& path);
bool amx_available();
bool vnni_available();
bool set_w8a16_prefetch(bool on);

namespace {

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <typename T>
inline void store(T* p, int64_t i, float v) {
  p[i] = static_cast<T>(v);
}

// Into a float16 KV cache: saturated at float16's largest finite value, where a
// plain conversion overflows to infinity (and one infinite key turns its
// sequence's attention into NaN). Values in range keep their bits; NaN stays
// NaN. The torch path and restored blocks do the same (model/kv_values.py).
constexpr float HALF_MAX = 65504.f;
inline void store(Half* p, int64_t i, float v) {
  p[i] = static_cast<Half>(std::clamp(v, -HALF_MAX, HALF_MAX));
}

// Calls fn with a typed pointer for a float32 or bfloat16 tensor.
template <typename Fn>
void with_ptr(const Tensor& t, Fn fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(t.data_ptr<float>());
  } else if (t.scalar_type() == at::kBFloat16) {
    fn(t.data_ptr<BF16>());
  } else {
    TORCH_CHECK(false, "ember kernels support float32 and bfloat16, got ", t.scalar_type());
  }
}

// Calls fn with a typed pointer to KV cache memory: float32 (the default) or
// float16 (opt-in). The kernels read float16 values converted to float32, which
// is exact, and then do float32's arithmetic: a float16 cache changes what is
// stored, never how it is used.
template <typename Fn>
void with_kv_ptr(const Tensor& t, Fn fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(t.data_ptr<float>());
  } else if (t.scalar_type() == at::kHalf) {
    fn(t.data_ptr<Half>());
  } else {
    TORCH_CHECK(false, "ember kernels support a float32 or float16 KV cache, got ", t.scalar_type());
  }
}

// with_kv_ptr for a layer's K and V caches, which share one dtype.
template <typename Fn>
void with_kv(const Tensor& k, const Tensor& v, Fn fn) {
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "the K and V caches must have one dtype");
  with_kv_ptr(k, [&](auto* kp) { fn(kp, v.data_ptr<std::remove_pointer_t<decltype(kp)>>()); });
}

void check_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

template <typename X, typename O>
void norm_rows(const X* x, const float* w, O* out, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const X* xr = x + r * d;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) {
        float v = load(xr, i);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
      O* o = out + r * d;
      for (int64_t i = 0; i < d; ++i) store(o, i, load(xr, i) * inv * w[i]);
    }
  });
}

}  // namespace

// out = x * rsqrt(mean(x^2) + eps) * w, row by row. x float32 (T, D); out float32 or bf16.
void rmsnorm(Tensor out, Tensor x, Tensor w, double eps) {
  check_contiguous(x, "x");
  check_contiguous(out, "out");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rmsnorm takes float32 x and w");
  const int64_t d = x.size(-1);
  const int64_t rows = x.numel() / d;
  with_ptr(out, [&](auto* o) { norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), o, rows, d, static_cast<float>(eps)); });
}

// residual += delta (in place), then out = rmsnorm(residual). Fuses a layer's
// residual connection with the next normalisation: one pass instead of five ops.
void add_rmsnorm(Tensor out, Tensor residual, Tensor delta, Tensor w, double eps) {
  check_contiguous(residual, "residual");
  check_contiguous(delta, "delta");
  check_contiguous(out, "out");
  TORCH_CHECK(residual.scalar_type() == at::kFloat, "residual must be float32");
  const int64_t d = residual.size(-1);
  const int64_t rows = residual.numel() / d;
  float* res = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float e = static_cast<float>(eps);
  with_ptr(delta, [&](auto* dp) {
    with_ptr(out, [&](auto* op) {
      at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          float* xr = res + r * d;
          float sum = 0.f;
          for (int64_t i = 0; i < d; ++i) {
            float v = xr[i] + load(dp + r * d, i);
            xr[i] = v;
            sum += v * v;
          }
          const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + e);
          for (int64_t i = 0; i < d; ++i) store(op + r * d, i, xr[i] * inv * wp[i]);
        }
      });
    });
  });
}

// Rotates q and k of each token, writes rotated k and v to the cache at the
// token's slot, and returns q (T, H, Hd) float32. Adds the q/k/v bias first when given.
// Tokens are split 4 per task: a 16-row decode step runs on both threads (with
// 16 per task it ran on one while the other waited, ~0.6 ms of a ~22 ms step).
constexpr int64_t ROPE_GRAIN = 4;
Tensor rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor k_cache, Tensor v_cache,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, c10::optional<Tensor> bias) {
  check_contiguous(qkv, "qkv");
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  const int64_t tokens = qkv.size(0);
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  TORCH_CHECK(qkv.size(1) == width, "qkv has the wrong width");
  const int64_t half = head_dim / 2;
  Tensor q_out = torch::empty({tokens, num_heads, head_dim}, qkv.options().dtype(at::kFloat));
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* qo = q_out.data_ptr<float>();
  const int64_t kv_width = num_kv_heads * head_dim;
  with_kv(k_cache, v_cache, [&](auto* kc, auto* vc) {
    with_ptr(qkv, [&](auto* src) {
      at::parallel_for(0, tokens, ROPE_GRAIN, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const auto* row = src + t * width;
          const float* c = cp + pos[t] * half;
          const float* s = sp + pos[t] * half;
          auto value = [&](int64_t i) { return load(row, i) + (bp ? bp[i] : 0.f); };
          // Head h's interleaved pairs rotated into dst (the rotation in float32,
          // then rounded once to the destination's type).
          auto rotate = [&](int64_t h, auto* dst) {
            const int64_t base = h * head_dim;
            for (int64_t j = 0; j < half; ++j) {
              const float x0 = value(base + 2 * j), x1 = value(base + 2 * j + 1);
              store(dst, 2 * j, x0 * c[j] - x1 * s[j]);
              store(dst, 2 * j + 1, x0 * s[j] + x1 * c[j]);
            }
          };
          // q heads, then k heads (written straight into the cache).
          for (int64_t h = 0; h < num_heads; ++h) rotate(h, qo + (t * num_heads + h) * head_dim);
          for (int64_t h = 0; h < num_kv_heads; ++h) rotate(num_heads + h, kc + slot[t] * kv_width + h * head_dim);
          const int64_t v_base = (num_heads + num_kv_heads) * head_dim;
          auto* vdst = vc + slot[t] * kv_width;
          for (int64_t i = 0; i < kv_width; ++i) store(vdst, i, value(v_base + i));
        }
      });
    });
  });
  return q_out;
}

// Decode attention straight from the paged cache: one query token per sequence,
// grouped-query heads, softmax in float32. No gather of the context, no mask.
//
// Work is split flash-decoding style: each task is (sequence, kv head, a span
// of the context), so one long sequence still spreads over every thread; each
// task keeps its own running max, sum and unnormalised output, and the spans
// are merged exactly afterwards (rescaled by exp(max_span - max_all)).
namespace {

// Context tokens per span (rounded up to whole KV blocks). Fixed, so that a
// sequence's attention is computed and merged the same way whatever else is in
// the batch and however many threads there are: batch-invariant, down to
// rounding. 64 tokens give a lone 200-token decode 12 tasks for two threads.
constexpr int64_t ATTENTION_SPAN = 64;
// The longest span (ATTENTION_SPAN rounded up to whole blocks) the kernels take.
constexpr int64_t MAX_SPAN = 1024;
// Rows of one sequence that walk their spans together in a prompt (paged_attention).
constexpr int64_t ATTENTION_TILE = 16;
// Rows of one paged_attention call on one block table before that sequence's
// keys are transposed for them (span_scores_transposed). Transposing a
// 1,000-token context costs ~50 us a call and each row saves ~1 us of it
// (measured: 64 rows 0.98x, 128 rows 1.03x, 256 rows 1.06x, a 488-row chunk
// 1.08x), so short prompts, speculative verification and decode rows keep
// span_scores.
constexpr int64_t TRANSPOSED_MIN_ROWS = 128;

#ifdef EMBER_AVX512
using ember_simd::exp_ps;
#endif

#ifdef EMBER_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of v's lanes. A max is exact, so any order gives the scalar loop's.
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

using ember_simd::exp8_ps;
#endif

// row[t] = exp(row[t] - mx) in place, and their sum: in vector lanes, then
// across them, in a fixed order for a given length (softmax in attention and
// in sample_rows).
float exp_shifted_sum(float* row, int64_t len, float mx) {
  float sum = 0.f;
  int64_t t = 0;
#ifdef EMBER_AVX512
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (; t + 16 <= len; t += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + t), vmx));
    _mm512_storeu_ps(row + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t < len) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + t), vmx));
    _mm512_mask_storeu_ps(row + t, tail, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, e));
    t = len;
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(EMBER_AVX2)
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(row + t), vmx));
    _mm256_storeu_ps(row + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum8(vsum);  // the tail (under 8 tokens) follows in the scalar loop
#endif
  for (; t < len; ++t) {
    row[t] = std::exp(row[t] - mx);
    sum += row[t];
  }
  return sum;
}

struct AttentionSpan {
  int64_t seq, kv_head, begin, end;
};

// A cache row as float32 for the plain loops and the warm-tier packer: a
// float32 row itself, a float16 row widened into buf (head_dim <= 512). They
// then run one float32 code for both caches, so a float16 cache gives the bits
// of a float32 cache holding its values (converting inside the attention loops
// let the compiler contract or vectorise the two differently).
inline const float* float_row(const float* row, int64_t, float*) { return row; }
inline const float* float_row(const Half* row, int64_t head_dim, float* buf) {
  for (int64_t j = 0; j < head_dim; ++j) buf[j] = static_cast<float>(row[j]);
  return buf;
}

// Rows of one head are head_dim floats every kv_width floats, in blocks
// scattered over the pool: the hardware prefetcher does not follow them, so
// the loops below ask for the row PREFETCH_AHEAD tokens on.
constexpr int64_t PREFETCH_AHEAD = 8;

template <typename KV>
inline void prefetch_row(const KV* row, int64_t head_dim) {
#if defined(EMBER_AVX512) || defined(EMBER_AVX2)
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(KV)); byte += 64) _mm_prefetch(bytes + byte, _MM_HINT_T0);
#endif
}

// The span kernels are written once over a float vector of VW lanes: 16 with
// AVX-512, 8 with AVX2.
#if defined(EMBER_AVX512)
#define EMBER_SIMD 1
using VecF = __m512;
constexpr int VW = 16;
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF vset1(float x) { return _mm512_set1_ps(x); }
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vfmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VecF v) { return _mm512_reduce_add_ps(v); }
inline VecF vload_kv(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload_kv(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#elif defined(EMBER_AVX2)
#define EMBER_SIMD 1
using VecF = __m256;
constexpr int VW = 8;
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF vset1(float x) { return _mm256_set1_ps(x); }
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vfmadd(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VecF v) { return hsum8(v); }
inline VecF vload_kv(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload_kv(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

#ifdef EMBER_SIMD
// G query heads share a kv head; C = head_dim / VW. The queries (G x C vectors)
// and, in values(), the G x 1 accumulators of one VW-wide chunk stay in
// registers across the whole span (with AVX-512; AVX2's 16 registers spill the
// queries to L1): accumulating in memory instead made every token wait on a
// store-to-load round trip (measured 4x slower).
#ifdef EMBER_AVX2
// hsum8 of eight vectors at once: lane i of the result is hsum8(v[i]), bit for
// bit (the same tree: lo + hi halves, then lanes 0+2 and 1+3, then those two),
// in 7 adds and 14 shuffles instead of 8 x (3 adds + 3 shuffles) and 8 stores.
inline __m256 hsum8x8(const __m256 v[8]) {
  __m256 halves[4];  // [hsum halves of v[i] | of v[i + 4]]
  for (int i = 0; i < 4; ++i)
    halves[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20), _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
  __m256 pairs[2];  // [v[2j]: lanes 0+2, 1+3; v[2j+1]: the same | v[2j+4], v[2j+5]]
  for (int j = 0; j < 2; ++j) {
    const __m256 a = halves[2 * j], b = halves[2 * j + 1];
    pairs[j] = _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif
#ifdef EMBER_AVX512
// _mm512_reduce_add_ps of eight vectors at once: lane i of the result is
// _mm512_reduce_add_ps(v[i]), bit for bit. That intrinsic's tree (GCC's and
// Clang's headers alike) is: the 256-bit halves added, then the 128-bit halves,
// then lanes 0+2 and 1+3, then those two. Here every step runs on two or four
// vectors' partials at once: 16 shuffles and 8 adds for eight sums, against 8
// dependent chains of 4 shuffles and 4 adds ending in a scalar store each (the
// prompt's scores waited on those chains: 2/3 of its attention time).
inline __m256 reduce_add_8x16(const __m512 v[8]) {
  __m512 halves[4];  // 128-bit lanes: [v[i] 256-bit sum (2 lanes) | v[i + 4]'s (2 lanes)]
  for (int i = 0; i < 4; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[i], v[i + 4], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 quads[2];  // 128-bit lanes: the 128-bit sums of v[j], v[j + 4], v[j + 1], v[j + 5] (j = 0, 2)
  for (int j = 0; j < 2; ++j) {
    const __m512 a = halves[2 * j], b = halves[2 * j + 1];
    quads[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // Per 128-bit lane: [lanes 0+2, 1+3 of quads[0] | of quads[1]]: lane k holds v[k'] then v[k' + 2],
  // k' = 0, 4, 1, 5 for k = 0..3; the last step adds each pair and puts v[0..7] in order.
  const __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i first = _mm512_setr_epi32(0, 8, 2, 10, 4, 12, 6, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i second = _mm512_setr_epi32(1, 9, 3, 11, 5, 13, 7, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_add_ps(_mm512_permutexvar_ps(first, pairs), _mm512_permutexvar_ps(second, pairs)));
}
#endif

// One score per (head, token): d = q[0] * k[0], then d = fma(q[c], k[c], d) for
// the chunks in order, then vsum(d) * scale. With AVX2, eight tokens at a time:
// eight independent chains per head (one token's three chains waited on the FMA
// latency) and their sums in one hsum8x8; the same arithmetic per score, the
// same bits. The queries stay in registers with AVX-512; AVX2's 16 registers
// leave them in L1.
template <int G, int C, typename KV>
void span_scores(const float* qb, const KV* kc, const int64_t* rows, int64_t len, float scale, float* scores, bool prefetch) {
  int64_t t = 0;
#ifdef EMBER_AVX2
  const __m256 vscale = _mm256_set1_ps(scale);
  for (; t + 8 <= len; t += 8) {
    for (int i = 0; i < 8; ++i)
      if (prefetch && t + 8 + i < len) prefetch_row(kc + rows[t + 8 + i], C * VW);
    const KV* k[8];
    for (int i = 0; i < 8; ++i) k[i] = kc + rows[t + i];
    for (int g = 0; g < G; ++g) {
      const float* qg = qb + g * C * VW;
      __m256 d[8];
      const __m256 q0 = vload(qg);
      for (int i = 0; i < 8; ++i) d[i] = vmul(q0, vload_kv(k[i]));
      for (int c = 1; c < C; ++c) {
        const __m256 qc = vload(qg + c * VW);
        for (int i = 0; i < 8; ++i) d[i] = vfmadd(qc, vload_kv(k[i] + c * VW), d[i]);
      }
      vstore(scores + g * len + t, _mm256_mul_ps(hsum8x8(d), vscale));
    }
  }
#endif
  VecF q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = vload(qb + g * C * VW + c * VW);
#ifdef EMBER_AVX512
  // Eight tokens at a time, their sums in one reduce_add_8x16: the same bits as the loop below.
  const __m256 vscale = _mm256_set1_ps(scale);
  for (; t + 8 <= len; t += 8) {
    for (int i = 0; i < 8; ++i)
      if (prefetch && t + PREFETCH_AHEAD + i < len) prefetch_row(kc + rows[t + PREFETCH_AHEAD + i], C * VW);
    const KV* k[8];
    for (int i = 0; i < 8; ++i) k[i] = kc + rows[t + i];
    for (int g = 0; g < G; ++g) {
      VecF d[8];
      for (int i = 0; i < 8; ++i) d[i] = vmul(q[g][0], vload_kv(k[i]));
      for (int c = 1; c < C; ++c)
        for (int i = 0; i < 8; ++i) d[i] = vfmadd(q[g][c], vload_kv(k[i] + c * VW), d[i]);
      _mm256_storeu_ps(scores + g * len + t, _mm256_mul_ps(reduce_add_8x16(d), vscale));
    }
  }
#endif
  for (; t < len; ++t) {
    if (prefetch && t + PREFETCH_AHEAD < len) prefetch_row(kc + rows[t + PREFETCH_AHEAD], C * VW);
    const KV* k = kc + rows[t];
    VecF kv[C];
    for (int c = 0; c < C; ++c) kv[c] = vload_kv(k + c * VW);
    for (int g = 0; g < G; ++g) {
      VecF d = vmul(q[g][0], kv[0]);
      for (int c = 1; c < C; ++c) d = vfmadd(q[g][c], kv[c], d);
      scores[g * len + t] = vsum(d) * scale;
    }
  }
}

// Every accumulator sums its tokens in order (acc = fma(p_t, v_t, acc)). With
// AVX-512 all G x C accumulators advance together, token by token: G x C
// independent chains keep the FMA units busy, where one chunk at a time left G
// chains waiting on the FMA latency (measured 2x slower). With AVX2 as many
// chunks advance together as fit 15 of its 16 registers with the G broadcast
// probabilities (the values are read straight from L1 by the fma): 4 for this
// model's G = 3, 12 chains (two chunks' 6 chains measured 1.3x slower on AMD
// Zen 3, one chunk's 3 another 1.5x). Any order of the chunks gives each
// accumulator the same sequence.
template <int G, int C, typename KV>
void span_values(const KV* vc, const int64_t* rows, int64_t len, const float* probs, float* acc, bool prefetch) {
  // Chunks advanced together: every chunk with AVX-512 where G x C accumulators
  // and the loaded values fit its 32 registers; with AVX2 the most (8, 4, 2 or 1)
  // whose accumulators and the G broadcasts fit 15 of its 16.
  constexpr int AVX2_CHUNKS = (8 * G + G <= 15 && C % 8 == 0) ? 8 : (4 * G + G <= 15 && C % 4 == 0) ? 4 : (2 * G + G <= 15 && C % 2 == 0) ? 2 : 1;
  constexpr int CHUNKS = VW == 16 ? (G * C + 2 * C <= 28 ? C : 1) : AVX2_CHUNKS;
  for (int c0 = 0; c0 < C; c0 += CHUNKS) {
    VecF a[CHUNKS][G];
    for (int c = 0; c < CHUNKS; ++c)
      for (int g = 0; g < G; ++g) a[c][g] = vzero();
    for (int64_t t = 0; t < len; ++t) {
      if (prefetch && c0 == 0 && t + PREFETCH_AHEAD < len) prefetch_row(vc + rows[t + PREFETCH_AHEAD], C * VW);
      VecF p[G];
      for (int g = 0; g < G; ++g) p[g] = vset1(probs[g * len + t]);
      const KV* v = vc + rows[t] + c0 * VW;
      for (int c = 0; c < CHUNKS; ++c)
        for (int g = 0; g < G; ++g) a[c][g] = vfmadd(p[g], vload_kv(v + c * VW), a[c][g]);
    }
    for (int c = 0; c < CHUNKS; ++c)
      for (int g = 0; g < G; ++g) vstore(acc + g * C * VW + (c0 + c) * VW, a[c][g]);
  }
}

#ifdef EMBER_AVX512
// Two rows of one tile (len_a <= len_b) against the same span's values, each
// value vector loaded once for both rows (one row at a time spent 7 loads per 12
// multiply-adds; 1.18x in a scratch benchmark, 1.03x on a prompt chunk's attention). Per row exactly
// span_values' arithmetic (acc = fma(p_t, v_t, acc), t in order from zero): the
// same bits as two span_values calls. After len_a tokens row b goes on alone.
// 2 x G x C accumulators, C values and two broadcasts must fit 32 registers.
template <int G, int C, typename KV>
void span_values_pair(const KV* vc, const int64_t* rows, int64_t len_a, const float* probs_a, float* acc_a, int64_t len_b,
                      const float* probs_b, float* acc_b, bool prefetch) {
  static_assert(2 * G * C + C + 2 <= 32, "the pair's accumulators must stay in registers");
  VecF a[C][G], b[C][G];
  for (int c = 0; c < C; ++c)
    for (int g = 0; g < G; ++g) a[c][g] = b[c][g] = vzero();
  int64_t t = 0;
  for (; t < len_a; ++t) {
    if (prefetch && t + PREFETCH_AHEAD < len_b) prefetch_row(vc + rows[t + PREFETCH_AHEAD], C * VW);
    const KV* v = vc + rows[t];
    VecF vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload_kv(v + c * VW);
    for (int g = 0; g < G; ++g) {
      const VecF pa = vset1(probs_a[g * len_a + t]), pb = vset1(probs_b[g * len_b + t]);
      for (int c = 0; c < C; ++c) {
        a[c][g] = vfmadd(pa, vv[c], a[c][g]);
        b[c][g] = vfmadd(pb, vv[c], b[c][g]);
      }
    }
  }
  for (; t < len_b; ++t) {
    if (prefetch && t + PREFETCH_AHEAD < len_b) prefetch_row(vc + rows[t + PREFETCH_AHEAD], C * VW);
    const KV* v = vc + rows[t];
    for (int g = 0; g < G; ++g) {
      const VecF pb = vset1(probs_b[g * len_b + t]);
      for (int c = 0; c < C; ++c) b[c][g] = vfmadd(pb, vload_kv(v + c * VW), b[c][g]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int g = 0; g < G; ++g) {
      vstore(acc_a + g * C * VW + c * VW, a[c][g]);
      vstore(acc_b + g * C * VW + c * VW, b[c][g]);
    }
}
#endif

#ifdef EMBER_AVX512
// Scores of a prompt tile from its span's keys transposed in pieces of 32
// tokens (transpose_span_keys' layout): sixteen tokens per vector, so no score
// needs a horizontal sum of its own. Also writes max_out[g], the largest of head
// g's scores (a max is exact: the m softmax_span would find).
//
// Bit for bit span_scores' arithmetic. There, lane j of a token's d holds
// q[j] k[j], then fma(q[j + 16c], k[j + 16c]) for the chunks c in order, and
// _mm512_reduce_add_ps (or reduce_add_8x16, the same tree) adds lanes j and
// j + 8, then j and j + 4, then 0 + 2 and 1 + 3, then those two. Here p_j, one
// vector over sixteen tokens, runs lane j's chain, and the p_j are added in
// that tree: quad q of REDUCE_TREE sums to ((p_a + p_b) + (p_c + p_d)), and the
// four quads to (quad 0 + quad 1) + (quad 2 + quad 3). Two token vectors share
// each query broadcast; 2 x 4 x G accumulators must fit the 32 registers. Every
// load's offset within a piece is a constant, and every loop is unrolled so the
// accumulators are registers (GCC left the quad loop rolled, p[] in memory, and
// the kernel slower than span_scores).
constexpr int64_t KEYS_PIECE = 32;
// Tokens of a span's transposed keys, len rounded up to whole pieces.
constexpr int64_t keys_padded(int64_t len) { return (len + KEYS_PIECE - 1) / KEYS_PIECE * KEYS_PIECE; }
constexpr int REDUCE_TREE[4][4] = {{0, 8, 4, 12}, {2, 10, 6, 14}, {1, 9, 5, 13}, {3, 11, 7, 15}};

template <int G, int C>
void span_scores_transposed(const float* qb, const float* kt, int64_t len, float scale, float* scores, float* max_out) {
  static_assert(2 * 4 * G + 3 <= 32, "the accumulators must stay in registers");
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vmax[G];
  for (int g = 0; g < G; ++g) vmax[g] = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += KEYS_PIECE, kt += C * 16 * KEYS_PIECE) {
    __m512 quads[2][G][4];
    #pragma GCC unroll 16
    for (int quad = 0; quad < 4; ++quad) {
      __m512 p[2][G][4];
      #pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
        #pragma GCC unroll 16
        for (int i = 0; i < 4; ++i) {
          const int d = REDUCE_TREE[quad][i] + 16 * c;
          const __m512 k0 = _mm512_loadu_ps(kt + d * KEYS_PIECE), k1 = _mm512_loadu_ps(kt + d * KEYS_PIECE + 16);
          #pragma GCC unroll 16
          for (int g = 0; g < G; ++g) {
            const __m512 q = _mm512_set1_ps(qb[g * C * 16 + d]);
            p[0][g][i] = c == 0 ? _mm512_mul_ps(q, k0) : _mm512_fmadd_ps(q, k0, p[0][g][i]);
            p[1][g][i] = c == 0 ? _mm512_mul_ps(q, k1) : _mm512_fmadd_ps(q, k1, p[1][g][i]);
          }
        }
      #pragma GCC unroll 16
      for (int w = 0; w < 2; ++w)
        #pragma GCC unroll 16
        for (int g = 0; g < G; ++g)
          quads[w][g][quad] = _mm512_add_ps(_mm512_add_ps(p[w][g][0], p[w][g][1]), _mm512_add_ps(p[w][g][2], p[w][g][3]));
    }
    for (int w = 0; w < 2 && t + 16 * w < len; ++w) {
      const int64_t left = len - t - 16 * w;
      for (int g = 0; g < G; ++g) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(quads[w][g][0], quads[w][g][1]), _mm512_add_ps(quads[w][g][2], quads[w][g][3]));
        float* out = scores + g * len + t + 16 * w;
        // A masked store only for the tail: exp_span's loads cannot take
        // their data from a masked store in flight, and waited for it.
        const __m512 score = _mm512_mul_ps(sum, vscale);
        if (left >= 16) {
          _mm512_storeu_ps(out, score);
          vmax[g] = _mm512_max_ps(score, vmax[g]);
        } else {
          const __mmask16 tail = static_cast<__mmask16>((1u << left) - 1);
          _mm512_mask_storeu_ps(out, tail, score);
          vmax[g] = _mm512_mask_max_ps(vmax[g], tail, score, vmax[g]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) max_out[g] = _mm512_reduce_max_ps(vmax[g]);
}

// r[j] = lane j of r[0..15]: a 16 x 16 float transpose in registers.
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// The span's keys transposed in pieces of KEYS_PIECE tokens: dimension d of key
// t at kt[(t / KEYS_PIECE) * head_dim * KEYS_PIECE + d * KEYS_PIECE + t % KEYS_PIECE],
// zeros after the len-th key up to the piece's end (span_scores_transposed reads
// whole pieces). head_dim a multiple of 16; kt holds head_dim x len rounded up
// to whole pieces.
template <typename KV>
void transpose_span_keys(const KV* kc, const int64_t* rows, int64_t len, int64_t head_dim, float* kt) {
  for (int64_t t0 = 0; t0 < keys_padded(len); t0 += 16) {
    float* piece = kt + (t0 / KEYS_PIECE) * head_dim * KEYS_PIECE + t0 % KEYS_PIECE;
    for (int64_t i = 0; i < 16; ++i)
      if (t0 + 16 + i < len) prefetch_row(kc + rows[t0 + 16 + i], head_dim);
    for (int64_t c = 0; c < head_dim; c += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = t0 + i < len ? vload_kv(kc + rows[t0 + i] + c) : _mm512_setzero_ps();
      transpose16x16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(piece + (c + j) * KEYS_PIECE, r[j]);
    }
  }
}

using TransposedScoresFn = void (*)(const float*, const float*, int64_t, float, float*, float*);

// The transposed-keys scores for this shape, if there are some (head_dim 64 or 128, group <= 3).
TransposedScoresFn transposed_scores_kernel(int64_t group, int64_t head_dim) {
  if (head_dim == 64 && group == 1) return span_scores_transposed<1, 4>;
  if (head_dim == 64 && group == 2) return span_scores_transposed<2, 4>;
  if (head_dim == 64 && group == 3) return span_scores_transposed<3, 4>;
  if (head_dim == 128 && group == 1) return span_scores_transposed<1, 8>;
  if (head_dim == 128 && group == 2) return span_scores_transposed<2, 8>;
  if (head_dim == 128 && group == 3) return span_scores_transposed<3, 8>;
  return nullptr;
}
#endif

template <typename KV>
using ScoresFn = void (*)(const float*, const KV*, const int64_t*, int64_t, float, float*, bool);
template <typename KV>
using ValuesFn = void (*)(const KV*, const int64_t*, int64_t, const float*, float*, bool);

template <int C, typename KV>
bool pick_span_kernels(int64_t group, ScoresFn<KV>* scores, ValuesFn<KV>* values) {
  switch (group) {
#define EMBER_GROUP(G) \
  case G:              \
    *scores = span_scores<G, C, KV>; \
    *values = span_values<G, C, KV>; \
    return true;
    EMBER_GROUP(1) EMBER_GROUP(2) EMBER_GROUP(3) EMBER_GROUP(4) EMBER_GROUP(5) EMBER_GROUP(6) EMBER_GROUP(7) EMBER_GROUP(8)
#undef EMBER_GROUP
    default:
      return false;
  }
}

// The register-blocked kernels for this shape, if there are some (head_dim 64 or 128, group <= 8).
template <typename KV>
bool span_kernels(int64_t group, int64_t head_dim, ScoresFn<KV>* scores, ValuesFn<KV>* values) {
  if (head_dim == 64) return pick_span_kernels<64 / VW, KV>(group, scores, values);
  if (head_dim == 128) return pick_span_kernels<128 / VW, KV>(group, scores, values);
  return false;
}
#endif

// The cache offsets of the context tokens begin .. end - 1 of one kv head,
// walked block by block (no division per token). Writes end - begin offsets.
void span_rows(const int64_t* table, int64_t begin, int64_t end, int64_t kv_offset, int64_t kv_width, int64_t block_size,
               int64_t* rows) {
  int64_t block = begin / block_size, within = begin % block_size;
  for (int64_t t = 0; t < end - begin; ++t) {
    rows[t] = (table[block] * block_size + within) * kv_width + kv_offset;
    if (++within == block_size) {
      within = 0;
      ++block;
    }
  }
}

#ifdef EMBER_AVX512
// One tile of a many-row paged_attention call: its block table, its rows and
// their longest context.
struct TileTable {
  const int64_t* table;
  int64_t rows, longest;
};

// The context keys of the sequences that many rows of one paged_attention call
// attend to (a prompt chunk's), transposed span by span once per call in
// transpose_span_keys' layout and shared by all their tiles (transposing per
// tile and span cost a third of what the transposed scores save).
struct TransposedKeys {
  int64_t piece_floats = 0;         // per (span, kv head): head_dim x span_len rounded up to whole pieces
  int64_t num_kv_heads = 0;
  std::vector<int64_t> first_span;  // per tile: its table's first span in keys, or -1; empty: none transposed
  std::unique_ptr<float[]> keys;  // uninitialised: transpose_span_keys writes every float read

  // Span i's keys for kv head kv_head of the tile's sequence, or nullptr.
  const float* span(int64_t tile, int64_t i, int64_t kv_head) const {
    if (first_span.empty() || first_span[tile] < 0) return nullptr;
    return keys.get() + ((first_span[tile] + i) * num_kv_heads + kv_head) * piece_floats;
  }
};

// Transposes the keys of every table that at least TRANSPOSED_MIN_ROWS rows of
// the call share (fewer would not repay it), up to its longest row's context.
template <typename KV>
TransposedKeys transpose_tile_keys(const std::vector<TileTable>& tiles, const KV* kc, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t span_len) {
  TransposedKeys out;
  out.num_kv_heads = num_kv_heads;
  out.piece_floats = head_dim * keys_padded(span_len);
  out.first_span.assign(tiles.size(), -1);
  struct Work {
    const int64_t* table;
    int64_t span, len;  // the span's index and its tokens
  };
  // The tiles of each table side by side (a table's rows may come in several
  // runs): sorted, not compared pairwise, since a decode batch has a tile a row.
  std::vector<size_t> order(tiles.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return std::less<const int64_t*>()(tiles[a].table, tiles[b].table); });
  std::vector<Work> work;  // one per transposed span, each table's in order
  for (size_t first = 0, last = 0; first < order.size(); first = last) {
    const int64_t* table = tiles[order[first]].table;
    int64_t rows = 0, longest = 0;
    for (last = first; last < order.size() && tiles[order[last]].table == table; ++last) {
      rows += tiles[order[last]].rows;
      longest = std::max(longest, tiles[order[last]].longest);
    }
    if (rows < TRANSPOSED_MIN_ROWS) continue;
    for (size_t j = first; j < last; ++j) out.first_span[order[j]] = static_cast<int64_t>(work.size());
    for (int64_t begin = 0, i = 0; begin < longest; begin += span_len, ++i) work.push_back({table, i, std::min(longest - begin, span_len)});
  }
  out.keys.reset(new float[work.size() * num_kv_heads * out.piece_floats]);
  const int64_t kv_width = num_kv_heads * head_dim;
  at::parallel_for(0, static_cast<int64_t>(work.size()) * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::array<int64_t, MAX_SPAN> rows;
    for (int64_t item = begin; item < end; ++item) {
      const Work& w = work[item / num_kv_heads];
      const int64_t kvh = item % num_kv_heads;
      span_rows(w.table, w.span * span_len, w.span * span_len + w.len, kvh * head_dim, kv_width, block_size, rows.data());
      transpose_span_keys(kc, rows.data(), w.len, head_dim, out.keys.get() + item * out.piece_floats);
    }
  });
  return out;
}
#endif

// Per head of the group, given m = the max of its span's scores: l = sum of
// exp(score - m), the scores left as exp(score - m). Every way of computing a
// span's scores ends here (a max is exact: any order finds the same m).
__attribute__((noinline)) void exp_span(float* scores, int64_t len, int64_t group, const float* m, float* l_out) {
  for (int64_t g = 0; g < group; ++g) l_out[g] = exp_shifted_sum(scores + g * len, len, m[g]);
}

// Per head of the group: m = max of its span's scores, then exp_span.
__attribute__((noinline)) void softmax_span(float* scores, int64_t len, int64_t group, float* m_out, float* l_out) {
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * len;
    float mx = row[0];
    int64_t t0 = 1;
#ifdef EMBER_AVX512
    // The max is exact in any order: 16 (or 8) lanes, then across them (one
    // scalar chain of dependent max instructions was half of this function's
    // time); with AVX-512 the tail is a masked vector too.
    {
      __m512 vmx = _mm512_set1_ps(mx);
      for (; t0 + 16 <= len; t0 += 16) vmx = _mm512_max_ps(_mm512_loadu_ps(row + t0), vmx);
      if (t0 < len) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (len - t0)) - 1);
        vmx = _mm512_mask_max_ps(vmx, tail, _mm512_maskz_loadu_ps(tail, row + t0), vmx);
        t0 = len;
      }
      mx = _mm512_reduce_max_ps(vmx);
    }
#elif defined(EMBER_AVX2)
    {
      __m256 vmx = _mm256_set1_ps(mx);
      for (; t0 + 8 <= len; t0 += 8) vmx = _mm256_max_ps(_mm256_loadu_ps(row + t0), vmx);
      mx = hmax8(vmx);
    }
#endif
    for (int64_t t = t0; t < len; ++t) mx = std::max(mx, row[t]);
    m_out[g] = mx;
  }
  exp_span(scores, len, group, m_out, l_out);
}

// The first half of a span: scores = q.k * scale for the group's heads, then,
// per head, m = max and l = sum exp(score - m), the scores left as exp(score - m).
// ``prefetch`` asks for the span's keys ahead; false when an earlier row of the
// same tile has just brought them into L1. It never changes a result.
template <typename KV>
__attribute__((noinline)) void score_span(const float* qb, const KV* kc, const int64_t* rows, int64_t len, int64_t group,
                                          int64_t head_dim, float scale, float* scores, float* m_out, float* l_out, bool prefetch) {
#ifdef EMBER_SIMD
  ScoresFn<KV> fast_scores = nullptr;
  ValuesFn<KV> fast_values = nullptr;
  if (span_kernels(group, head_dim, &fast_scores, &fast_values)) {
    fast_scores(qb, kc, rows, len, scale, scores, prefetch);
  } else
#endif
  {
    float widened[512];
    for (int64_t t = 0; t < len; ++t) {
      const float* k = float_row(kc + rows[t], head_dim, widened);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qb + g * head_dim;
        float dot = 0.f;
        for (int64_t j = 0; j < head_dim; ++j) dot += qg[j] * k[j];
        scores[g * len + t] = dot * scale;
      }
    }
  }
  softmax_span(scores, len, group, m_out, l_out);
}

// The second half: acc (group, Hd) = sum over the span's tokens of p_t v_t,
// p = score_span's exp(score - m); ``prefetch`` as in score_span, for the values.
template <typename KV>
__attribute__((noinline)) void value_span(const KV* vc, const int64_t* rows, int64_t len, int64_t group, int64_t head_dim,
                                          const float* probs, float* acc, bool prefetch) {
#ifdef EMBER_SIMD
  ScoresFn<KV> fast_scores = nullptr;
  ValuesFn<KV> fast_values = nullptr;
  if (span_kernels(group, head_dim, &fast_scores, &fast_values)) {
    fast_values(vc, rows, len, probs, acc, prefetch);
    return;
  }
#endif
  std::fill(acc, acc + group * head_dim, 0.f);
  float widened[512];
  for (int64_t t = 0; t < len; ++t) {
    if (prefetch && t + PREFETCH_AHEAD < len) prefetch_row(vc + rows[t + PREFETCH_AHEAD], head_dim);
    const float* v = float_row(vc + rows[t], head_dim, widened);
    for (int64_t g = 0; g < group; ++g) {
      const float p = probs[g * len + t];
      float* a = acc + g * head_dim;
      for (int64_t j = 0; j < head_dim; ++j) a[j] += p * v[j];
    }
  }
}

// value_span for two rows of a tile at once (span_values_pair) where a pair
// kernel fits this shape; false otherwise (the caller runs value_span twice).
// The same bits as value_span on each row.
template <typename KV>
bool value_span_pair(const KV* vc, const int64_t* rows, int64_t group, int64_t head_dim, int64_t len_a, const float* probs_a,
                     float* acc_a, int64_t len_b, const float* probs_b, float* acc_b, bool prefetch) {
#ifdef EMBER_AVX512
  if (len_a > len_b) return value_span_pair(vc, rows, group, head_dim, len_b, probs_b, acc_b, len_a, probs_a, acc_a, prefetch);
  void (*pair)(const KV*, const int64_t*, int64_t, const float*, float*, int64_t, const float*, float*, bool) = nullptr;
  if (head_dim == 64 && group == 1) pair = span_values_pair<1, 4, KV>;
  if (head_dim == 64 && group == 2) pair = span_values_pair<2, 4, KV>;
  if (head_dim == 64 && group == 3) pair = span_values_pair<3, 4, KV>;
  if (head_dim == 128 && group == 1) pair = span_values_pair<1, 8, KV>;
  if (pair == nullptr) return false;
  pair(vc, rows, len_a, probs_a, acc_a, len_b, probs_b, acc_b, prefetch);
  return true;
#else
  (void)vc, (void)rows, (void)group, (void)head_dim, (void)len_a, (void)probs_a, (void)acc_a, (void)len_b, (void)probs_b, (void)acc_b,
      (void)prefetch;
  return false;
#endif
}

// One span of one (row, kv head): score_span, then value_span. Writes acc
// (group, Hd), m (group) and l (group). Every way paged_attention schedules a
// span runs these two functions on the same arguments: the same bits.
template <typename KV>
void attend_span(const float* qb, const KV* kc, const KV* vc, const int64_t* table, const AttentionSpan& span, int64_t group,
                 int64_t head_dim, int64_t kv_width, int64_t block_size, float scale, float* scores, float* acc, float* m_out,
                 float* l_out) {
  const int64_t len = span.end - span.begin;
  std::array<int64_t, MAX_SPAN> rows;  // len <= MAX_SPAN, checked by paged_attention
  span_rows(table, span.begin, span.end, span.kv_head * head_dim, kv_width, block_size, rows.data());
  score_span(qb, kc, rows.data(), len, group, head_dim, scale, scores, m_out, l_out, true);
  value_span(vc, rows.data(), len, group, head_dim, scores, acc, true);
}

}  // namespace

namespace {

// Merges the n span partials of one (query, kv head), in span order, into the
// group's output heads. One function (never inlined) for both ways of
// scheduling the spans below, so both produce the same bits.
template <typename O>
__attribute__((noinline)) void merge_spans(const float* partial, int64_t n, int64_t group, int64_t head_dim, O* out) {
  const int64_t stride = group * (head_dim + 2);
  for (int64_t g = 0; g < group; ++g) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, partial[i * stride + group * head_dim + g]);
    float total = 0.f;
    float merged[512];  // head_dim <= 512, checked by the caller
    std::fill(merged, merged + head_dim, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const float* part = partial + i * stride;
      const float w = std::exp(part[group * head_dim + g] - mx);
      total += w * part[group * (head_dim + 1) + g];
      for (int64_t d = 0; d < head_dim; ++d) merged[d] += w * part[g * head_dim + d];
    }
    const float inv = n > 0 ? 1.f / total : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) store(out + g * head_dim, d, merged[d] * inv);
  }
}

}  // namespace

// Causal attention straight from the paged cache, one query token per row of q
// (T, H, Hd): row i attends to the first context_lens[i] tokens of block table
// row table_rows[i] (row i itself when table_rows is absent). A decode step
// has one row per sequence; a prompt chunk has one row per token, all on the
// sequence's table, with context_lens = position + 1.
//
// Invariant (batch and chunk invariance): a row's result depends only on its
// query, its context and the cache, never on the other rows. Its context is
// cut into spans at fixed positions (multiples of ATTENTION_SPAN), each span
// is computed by attend_span and the spans are merged in order by
// merge_spans, whether the spans of all rows are spread over the threads (few
// rows: decode) or each thread takes whole (row, kv head) tasks (many rows:
// prefill, no shared partial buffer).
void paged_attention(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, c10::optional<Tensor> table_rows,
                     Tensor context_lens, int64_t block_size, double scale) {
  check_contiguous(q, "q");
  check_contiguous(out, "out");
  check_contiguous(block_tables, "block_tables");
  check_contiguous(context_lens, "context_lens");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention: q must be float32");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(context_lens.numel() == batch, "paged_attention: one context length per query row");
  const int64_t* rows_of = nullptr;
  Tensor rows_tensor;
  if (table_rows.has_value()) {
    rows_tensor = table_rows->contiguous();
    TORCH_CHECK(rows_tensor.numel() == batch && rows_tensor.scalar_type() == at::kLong, "paged_attention: table_rows must be int64 (T,)");
    rows_of = rows_tensor.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(block_tables.size(0) == batch, "paged_attention: one block table row per query without table_rows");
  }
  const float* qp = q.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const int64_t kv_width = num_kv_heads * head_dim;
  auto table_of = [&](int64_t b) { return tables + (rows_of ? rows_of[b] : b) * max_blocks; };

  TORCH_CHECK(block_size > 0 && head_dim <= 512, "paged_attention: block_size must be positive, head_dim at most 512");
  if (batch == 0 || num_kv_heads == 0) return;
  const int64_t span_len = ((ATTENTION_SPAN + block_size - 1) / block_size) * block_size;
  TORCH_CHECK(span_len <= MAX_SPAN, "paged_attention: block_size at most ", MAX_SPAN);
  // Per span: acc (group, Hd), then m (group), then l (group).
  const int64_t stride = group * (head_dim + 2);
  const int64_t tasks = batch * num_kv_heads;

  // The same code for a float32 and a float16 cache: only the loads differ.
  with_kv(k_cache, v_cache, [&](const auto* kc, const auto* vc) {
    with_ptr(out, [&](auto* op) {
      if (tasks >= 4 * at::get_num_threads()) {
        // Many rows: whole (tile, kv head) tasks per thread, partials in a local
        // buffer. A tile is up to ATTENTION_TILE consecutive rows on the same
        // block table (a prompt chunk's tokens); its task walks the spans
        // outermost and every row that reaches a span attends to it while the
        // span's keys and values are in cache (row by row, each row re-read its
        // whole context from L3). Each (row, span) is still one attend_span call
        // and each row one merge_spans: the same bits as any other schedule.
        // A prompt chunk's rows grow in context: tiles are dealt in zigzag order
        // (first, last, second, second to last, ...), so every thread's
        // contiguous share holds short and long rows alike (in row order, the
        // last thread did 3x the first one's work on a fresh 512-token chunk).
        std::vector<int64_t> tile_start{0};
        for (int64_t b = 1; b < batch; ++b)
          if (b - tile_start.back() == ATTENTION_TILE || table_of(b) != table_of(b - 1)) tile_start.push_back(b);
        const int64_t tiles = static_cast<int64_t>(tile_start.size());
        tile_start.push_back(batch);
        const int64_t tile_tasks = tiles * num_kv_heads;
#ifdef EMBER_AVX512
        const TransposedScoresFn transposed_scores = transposed_scores_kernel(group, head_dim);
        TransposedKeys keys_t;
        if (transposed_scores && batch >= TRANSPOSED_MIN_ROWS) {
          std::vector<TileTable> tile_tables(tiles);
          for (int64_t t = 0; t < tiles; ++t) {
            tile_tables[t] = {table_of(tile_start[t]), tile_start[t + 1] - tile_start[t], 0};
            for (int64_t b = tile_start[t]; b < tile_start[t + 1]; ++b) tile_tables[t].longest = std::max(tile_tables[t].longest, lens[b]);
          }
          keys_t = transpose_tile_keys(tile_tables, kc, num_kv_heads, head_dim, block_size, span_len);
        }
#endif
        at::parallel_for(0, tile_tasks, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> scores(ATTENTION_TILE * group * span_len), partial;
          std::array<int64_t, MAX_SPAN> span_offsets;
          std::array<int64_t, ATTENTION_TILE + 1> first{};
          for (int64_t dealt = begin; dealt < end; ++dealt) {
            const int64_t task = dealt % 2 == 0 ? dealt / 2 : tile_tasks - 1 - dealt / 2;
            const int64_t tile = task / num_kv_heads, kvh = task % num_kv_heads;
            const int64_t b0 = tile_start[tile], rows = tile_start[tile + 1] - b0;
            // Row b0 + r keeps its n spans' partials at first[r] .. first[r + 1].
            int64_t most = 0, longest = 0;
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t n = (lens[b0 + r] + span_len - 1) / span_len;
              first[r + 1] = first[r] + n;
              most = std::max(most, n);
              longest = std::max(longest, lens[b0 + r]);
            }
            partial.resize(first[rows] * stride);
            for (int64_t i = 0; i < most; ++i) {
              // The tile's rows share one block table: the longest row's offsets
              // hold every shorter row's as a prefix.
              const int64_t span_begin = i * span_len;
              span_rows(table_of(b0), span_begin, std::min(longest, span_begin + span_len), kvh * head_dim, kv_width, block_size,
                        span_offsets.data());
              // Row r's length in this span, its partial and its scores.
              auto len_of = [&](int64_t r) { return std::min(lens[b0 + r], span_begin + span_len) - span_begin; };
              auto part_of = [&](int64_t r) { return partial.data() + (first[r] + i) * stride; };
              auto scores_of = [&](int64_t r) { return scores.data() + r * group * span_len; };
              // Every row's scores against the span's keys, then every row's values:
              // one of K or V in L1 at a time (K and V of a 64-token span are 16 KB
              // each: row by row, alternating, they spilled Zen 3's 32 KB L1). The
              // last row (in a prompt chunk the longest) goes first and asks for the
              // span's rows ahead; the others find them in L1, where asking again
              // only took load slots (1.09x without it).
              // Where this sequence's keys are transposed, span_scores_transposed
              // (the same bits) and exp_span; otherwise score_span.
#ifdef EMBER_AVX512
              const float* kt = keys_t.span(tile, i, kvh);
#endif
              for (int64_t r = rows - 1; r >= 0; --r) {
                if (i >= first[r + 1] - first[r]) continue;
                const float* qr = qp + ((b0 + r) * num_heads + kvh * group) * head_dim;
                float* m = part_of(r) + group * head_dim;
                float* l = m + group;
#ifdef EMBER_AVX512
                if (kt != nullptr) {
                  transposed_scores(qr, kt, len_of(r), sc, scores_of(r), m);
                  exp_span(scores_of(r), len_of(r), group, m, l);
                  continue;
                }
#endif
                score_span(qr, kc, span_offsets.data(), len_of(r), group, head_dim, sc, scores_of(r), m, l, r == rows - 1);
              }
              // The values two rows at a time where the shape has a pair kernel.
              int64_t waiting = -1;  // a row that reaches this span, not yet paired
              for (int64_t r = rows - 1; r >= 0; --r) {
                if (i >= first[r + 1] - first[r]) continue;
                if (waiting < 0) {
                  waiting = r;
                  continue;
                }
                const bool prefetch = waiting == rows - 1;
                if (!value_span_pair(vc, span_offsets.data(), group, head_dim, len_of(waiting), scores_of(waiting), part_of(waiting), len_of(r),
                                     scores_of(r), part_of(r), prefetch)) {
                  value_span(vc, span_offsets.data(), len_of(waiting), group, head_dim, scores_of(waiting), part_of(waiting), prefetch);
                  value_span(vc, span_offsets.data(), len_of(r), group, head_dim, scores_of(r), part_of(r), false);
                }
                waiting = -1;
              }
              if (waiting >= 0)
                value_span(vc, span_offsets.data(), len_of(waiting), group, head_dim, scores_of(waiting), part_of(waiting), waiting == rows - 1);
            }
            for (int64_t r = 0; r < rows; ++r)
              merge_spans(partial.data() + first[r] * stride, first[r + 1] - first[r], group, head_dim,
                          op + ((b0 + r) * num_heads + kvh * group) * head_dim);
          }
        });
        return;
      }
      // Few rows (decode): every span is its own task, so one long sequence still
      // spreads over every thread; then the spans of each (row, kv head) merge.
      std::vector<AttentionSpan> spans;
      std::vector<int64_t> first_span(tasks + 1);
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          first_span[b * num_kv_heads + h] = static_cast<int64_t>(spans.size());
          for (int64_t t = 0; t < lens[b]; t += span_len) spans.push_back({b, h, t, std::min(lens[b], t + span_len)});
        }
      }
      first_span[tasks] = static_cast<int64_t>(spans.size());
      const int64_t n_spans = static_cast<int64_t>(spans.size());
      std::vector<float> partial(n_spans * stride);
      at::parallel_for(0, n_spans, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(group * span_len);
        for (int64_t i = begin; i < end; ++i) {
          const AttentionSpan& span = spans[i];
          float* part = partial.data() + i * stride;
          attend_span(qp + (span.seq * num_heads + span.kv_head * group) * head_dim, kc, vc, table_of(span.seq), span, group, head_dim,
                      kv_width, block_size, sc, scores.data(), part, part + group * head_dim, part + group * (head_dim + 1));
        }
      });
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
        merge_spans(partial.data() + first_span[task] * stride, first_span[task + 1] - first_span[task], group, head_dim,
                    op + (b * num_heads + kvh * group) * head_dim);
      }
    });
  });
}

// out = silu(gate) * up for gate_up (T, 2F) = [gate | up]; out (T, F).
void silu_mul(Tensor out, Tensor gate_up) {
  check_contiguous(gate_up, "gate_up");
  check_contiguous(out, "out");
  const int64_t tokens = gate_up.size(0), f = gate_up.size(1) / 2;
  // Work in pieces of 512 features so a 16-row decode step uses both threads.
  constexpr int64_t PIECE = 512;
  const int64_t pieces = (f + PIECE - 1) / PIECE;
  with_ptr(gate_up, [&](auto* gp) {
    with_ptr(out, [&](auto* op) {
      at::parallel_for(0, tokens * pieces, 4, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t t = task / pieces, i0 = (task % pieces) * PIECE, i1 = std::min(f, i0 + PIECE);
          const auto* g_row = gp + t * 2 * f;
          auto* o_row = op + t * f;
          int64_t i = i0;
#ifdef EMBER_AVX512
          if constexpr (std::is_same_v<std::decay_t<decltype(*gp)>, float> && std::is_same_v<std::decay_t<decltype(*op)>, float>) {
            for (; i + 16 <= i1; i += 16)
              _mm512_storeu_ps(o_row + i, ember_simd::silu_mul_ps(_mm512_loadu_ps(g_row + i), _mm512_loadu_ps(g_row + f + i)));
          }
#elif defined(EMBER_AVX2)
          if constexpr (std::is_same_v<std::decay_t<decltype(*gp)>, float> && std::is_same_v<std::decay_t<decltype(*op)>, float>) {
            const __m256 one = _mm256_set1_ps(1.f);
            for (; i + 8 <= i1; i += 8) {
              const __m256 g = _mm256_loadu_ps(g_row + i), u = _mm256_loadu_ps(g_row + f + i);
              const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(one, exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
              _mm256_storeu_ps(o_row + i, _mm256_mul_ps(sig, u));
            }
          }
#endif
          for (; i < i1; ++i) {
            const float g = load(g_row, i), u = load(g_row, f + i);
            store(o_row, i, g / (1.f + std::exp(-g)) * u);
          }
        }
      });
    });
  });
}


// ---------------------------------------------------------------------------
// Sampling a step's rows at once: temperature, top-p and min-p, then an inverse-CDF
// draw with one uniform per row (drawn by the caller from the row's own
// generator, so a seeded row's token depends only on its logits and its seed).
//
// Per row r, with x = logits[r] * (1 / temperature[r]) (NaN -> -3e38, +-inf -> +-3e38)
// and e_i = exp(x_i - max x), so the largest e is exactly 1:
//  * top-p (< 1): the tokens in descending e order (ties: lower id first) while
//    the mass before them is below top_p * sum(e). Only tokens with e above a
//    cutoff are sorted when they alone hold that mass: they are then a prefix
//    of the full order, so the set is the same as sorting everything.
//  * min-p: of those, the tokens with e >= min_p (min_p times the largest).
//  * the token where the cumulative e of the kept tokens first exceeds u * total.
// ---------------------------------------------------------------------------

namespace {

// Tokens with e above a cutoff are sorted alone when they hold top_p of the mass;
// the first cutoff that does is taken (most rows: 1e-2, a few hundred tokens).
constexpr int SAMPLE_CUTOFFS = 3;
constexpr float SAMPLE_CUTOFF[SAMPLE_CUTOFFS] = {1e-2f, 1e-4f, 1e-6f};

int64_t sample_row(const float* logits, int64_t v, float temperature, float top_p, float min_p, float u, float* e,
                   std::vector<int32_t>& order) {
  const float inv_t = 1.f / temperature;
  float mx = -INFINITY;
  float sum = 0.f;
  // The masses above each cutoff (top-p only): full vectors in lanes, then the
  // tail from mass_tail on, one token at a time.
  float mass[SAMPLE_CUTOFFS] = {};
  int64_t mass_tail = 0;
#ifdef EMBER_AVX512
  {
    // Two passes over the logits: the max of x, then x again with e = exp(x - max),
    // its sum and (top-p) the masses, all in one (the same arithmetic as
    // exp_shifted_sum and one masked add per cutoff, in the same order).
    const __m512 vinv = _mm512_set1_ps(inv_t), lo = _mm512_set1_ps(-3.0e38f), hi = _mm512_set1_ps(3.0e38f);
    // max(x, lo) returns lo for a NaN x (its second operand): NaN -> -3e38, as below.
    auto clean = [&](__m512 raw) { return _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(raw, vinv), lo), hi); };
    const int64_t full = v / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (v - full)) - 1);
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < full; i += 16) vmx = _mm512_max_ps(vmx, clean(_mm512_loadu_ps(logits + i)));
    if (tail) vmx = _mm512_max_ps(vmx, _mm512_mask_blend_ps(tail, _mm512_set1_ps(-INFINITY), clean(_mm512_maskz_loadu_ps(tail, logits + full))));
    mx = _mm512_reduce_max_ps(vmx);
    const __m512 vmx_all = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps(), vmass[SAMPLE_CUTOFFS];
    for (int c = 0; c < SAMPLE_CUTOFFS; ++c) vmass[c] = _mm512_setzero_ps();
    const bool masses = top_p < 1.f;
    for (int64_t i = 0; i < full; i += 16) {
      const __m512 ev = exp_ps(_mm512_sub_ps(clean(_mm512_loadu_ps(logits + i)), vmx_all));
      _mm512_storeu_ps(e + i, ev);
      vsum = _mm512_add_ps(vsum, ev);
      if (masses) {
        for (int c = 0; c < SAMPLE_CUTOFFS; ++c) {
          const __mmask16 above = _mm512_cmp_ps_mask(ev, _mm512_set1_ps(SAMPLE_CUTOFF[c]), _CMP_GT_OQ);
          vmass[c] = _mm512_mask_add_ps(vmass[c], above, vmass[c], ev);
        }
      }
    }
    if (tail) {
      const __m512 ev = exp_ps(_mm512_sub_ps(clean(_mm512_maskz_loadu_ps(tail, logits + full)), vmx_all));
      _mm512_mask_storeu_ps(e + full, tail, ev);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, ev));
    }
    sum = _mm512_reduce_add_ps(vsum);
    for (int c = 0; c < SAMPLE_CUTOFFS; ++c) mass[c] = _mm512_reduce_add_ps(vmass[c]);
    mass_tail = full;
  }
#else
  int64_t i0 = 0;
#ifdef EMBER_AVX2
  {
    const __m256 vinv = _mm256_set1_ps(inv_t), lo = _mm256_set1_ps(-3.0e38f), hi = _mm256_set1_ps(3.0e38f);
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (; i0 + 8 <= v; i0 += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(logits + i0), vinv);
      const __m256 clean = _mm256_min_ps(_mm256_max_ps(x, lo), hi);  // NaN -> -3e38, as in the AVX-512 loop
      _mm256_storeu_ps(e + i0, clean);
      vmx = _mm256_max_ps(vmx, clean);
    }
    mx = hmax8(vmx);
  }
#endif
  for (int64_t i = i0; i < v; ++i) {
    const float x = logits[i] * inv_t;
    const float clean = x != x ? -3.0e38f : std::min(3.0e38f, std::max(-3.0e38f, x));
    e[i] = clean;
    mx = std::max(mx, clean);
  }
  sum = exp_shifted_sum(e, v, mx);
  if (top_p < 1.f) {
#ifdef EMBER_AVX2
    __m256 vmass[SAMPLE_CUTOFFS];
    for (int c = 0; c < SAMPLE_CUTOFFS; ++c) vmass[c] = _mm256_setzero_ps();
    for (; mass_tail + 8 <= v; mass_tail += 8) {
      const __m256 ev = _mm256_loadu_ps(e + mass_tail);
      for (int c = 0; c < SAMPLE_CUTOFFS; ++c) {
        const __m256 above = _mm256_cmp_ps(ev, _mm256_set1_ps(SAMPLE_CUTOFF[c]), _CMP_GT_OQ);
        vmass[c] = _mm256_add_ps(vmass[c], _mm256_and_ps(above, ev));
      }
    }
    for (int c = 0; c < SAMPLE_CUTOFFS; ++c) mass[c] = hsum8(vmass[c]);
#endif
  }
#endif
  int64_t kept = v;
  order.clear();
  if (top_p < 1.f) {
    const float need = top_p * sum;
    // The highest cutoff whose tokens alone hold top_p of the mass.
    for (int64_t i = mass_tail; i < v; ++i) {
      for (int c = 0; c < SAMPLE_CUTOFFS; ++c) mass[c] += e[i] > SAMPLE_CUTOFF[c] ? e[i] : 0.f;
    }
    int c = 0;
    while (c < SAMPLE_CUTOFFS && mass[c] < need) ++c;
    const float cutoff = c < SAMPLE_CUTOFFS ? SAMPLE_CUTOFF[c] : -1.f;  // -1: every token
    int64_t i = 0;
#ifdef EMBER_AVX512
    for (const __m512 vcut = _mm512_set1_ps(cutoff); i + 16 <= v; i += 16) {
      for (__mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(e + i), vcut, _CMP_GT_OQ); above; above &= above - 1) {
        order.push_back(static_cast<int32_t>(i + __builtin_ctz(above)));
      }
    }
#elif defined(EMBER_AVX2)
    for (const __m256 vcut = _mm256_set1_ps(cutoff); i + 8 <= v; i += 8) {
      for (unsigned above = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), vcut, _CMP_GT_OQ))); above;
           above &= above - 1) {
        order.push_back(static_cast<int32_t>(i + __builtin_ctz(above)));
      }
    }
#endif
    for (; i < v; ++i) {
      if (e[i] > cutoff) order.push_back(static_cast<int32_t>(i));
    }
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); });
    float before = 0.f;
    kept = 0;
    for (int32_t id : order) {  // the first token always stays
      if (kept > 0 && before >= need) break;
      before += e[id];
      ++kept;
    }
  }
  auto id_at = [&](int64_t j) -> int64_t { return order.empty() ? j : order[j]; };
  float total = 0.f;
  for (int64_t j = 0; j < kept; ++j) {
    const float w = e[id_at(j)];
    if (w >= min_p) total += w;
  }
  const float target = u * total;
  float cumulative = 0.f;
  int64_t last = id_at(0);  // the largest e is 1 >= any min_p <= 1, so some token qualifies
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t id = id_at(j);
    const float w = e[id];
    if (w < min_p) continue;
    last = id;
    cumulative += w;
    if (cumulative > target) return id;
  }
  return last;  // u * total rounded up to the total
}

}  // namespace

// tokens (N,) int64: one draw per row of logits (N, V) float32; temperature, top_p,
// min_p and uniform (N,) float32. Rows are independent (any thread, any batch).
Tensor sample_rows(Tensor logits, Tensor temperature, Tensor top_p, Tensor min_p, Tensor uniform) {
  check_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sample_rows: logits must be float32 (N, V)");
  const int64_t n = logits.size(0), v = logits.size(1);
  for (const Tensor* t : {&temperature, &top_p, &min_p, &uniform}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n && t->is_contiguous(), "sample_rows: per-row parameters must be float32 (N,)");
  }
  TORCH_CHECK(v > 0 && v < (int64_t{1} << 31), "sample_rows: vocabulary size out of range");
  Tensor tokens = torch::empty({n}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>(), *up = uniform.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> e(v);
    std::vector<int32_t> order;
    for (int64_t r = r0; r < r1; ++r) out[r] = sample_row(lp + r * v, v, tp[r], pp[r], mp[r], up[r], e.data(), order);
  });
  return tokens;
}

namespace {

// torch.argmax of one row, exactly: the first index of the maximum, where a NaN
// counts as the maximum (the first NaN wins). Two passes over the row (the
// maximum, then where it first occurs) instead of torch's compare-and-index per
// element: its reduction took ~1.1 ms of a 16-row decode step (16 x 49,152 logits).
int64_t argmax_row(const float* x, int64_t v) {
  float mx = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#ifdef EMBER_AVX512
  {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= v; i += 16) {
      const __m512 a = _mm512_loadu_ps(x + i);
      unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
      vmx = _mm512_max_ps(vmx, a);
    }
    mx = _mm512_reduce_max_ps(vmx);
    nan = unordered != 0;
  }
#elif defined(EMBER_AVX2)
  {
    __m256 vmx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= v; i += 8) {
      const __m256 a = _mm256_loadu_ps(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      vmx = _mm256_max_ps(vmx, a);
    }
    mx = hmax8(vmx);
    nan = _mm256_movemask_ps(unordered) != 0;
  }
#endif
  for (; i < v; ++i) {
    if (x[i] != x[i]) nan = true;
    else mx = std::max(mx, x[i]);
  }
  if (nan) {  // the vector max is meaningless then; NaN rows are rare
    for (int64_t j = 0; j < v; ++j)
      if (x[j] != x[j]) return j;
  }
  i = 0;
#ifdef EMBER_AVX512
  for (const __m512 target = _mm512_set1_ps(mx); i + 16 <= v; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(EMBER_AVX2)
  for (const __m256 target = _mm256_set1_ps(mx); i + 8 <= v; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < v; ++i)
    if (x[i] == mx) return i;
  return 0;  // v == 0 is refused by the caller
}

}  // namespace

// tokens (N,) int64: torch.argmax(logits, dim=-1) of logits (N, V) float32, the same indices.
Tensor argmax_rows(Tensor logits) {
  check_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0, "argmax_rows: logits must be float32 (N, V), V > 0");
  const int64_t n = logits.size(0), v = logits.size(1);
  Tensor tokens = torch::empty({n}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(lp + r * v, v);
  });
  return tokens;
}

// ---------------------------------------------------------------------------
// int8 weight-only GEMV for the memory-bound decode rows.
//
// torch's int8pack kernel reaches ~11 GB/s of weight bandwidth with two threads
// at one row; this one streams each weight row once per call for all M rows of
// x (a converted 16-weight chunk is reused M times from registers), in float32,
// at ~31 GB/s for one row (the machine reads ~33 GB/s). Layout: w (N, K) int8,
// s (N) float32, W[n,k] = s[n] * w[n,k].
// From 9 rows on (with AVX512-BF16) gemm_bf16_packed takes over: a bfloat16
// copy of the weights packed for vdpbf16ps, faster than oneDNN up to 64 rows.
// ---------------------------------------------------------------------------

namespace {

Tensor as_float_rows(const Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

// Dot products of one int8 weight row with ROWS rows of x (row stride k): each
// 16-weight chunk is loaded and converted once and used ROWS times.
template <int ROWS>
inline void dot_i8_rows(const int8_t* w, const float* x, int64_t k, float scale, float* out, int64_t out_stride) {
#ifdef EMBER_AVX512
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  if constexpr (ROWS == 1) {
    // One row has one accumulator chain: four independent ones keep the FMA
    // latency (4 cycles) off the critical path (measured: decode's GEMVs were
    // latency-bound, not bandwidth-bound). The sum order differs from the
    // multi-row path only in float rounding.
    __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (; i + 64 <= k; i += 64) {
      const __m128i* wp = reinterpret_cast<const __m128i*>(w + i);
      acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(wp))), _mm512_loadu_ps(x + i), acc[0]);
      a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(wp + 1))), _mm512_loadu_ps(x + i + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(wp + 2))), _mm512_loadu_ps(x + i + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(wp + 3))), _mm512_loadu_ps(x + i + 48), a3);
    }
    acc[0] = _mm512_add_ps(_mm512_add_ps(acc[0], a1), _mm512_add_ps(a2, a3));
  }
  for (; i + 16 <= k; i += 16) {
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))));
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * k + i), acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) {
    float sum = _mm512_reduce_add_ps(acc[r]);
    for (int64_t j = i; j < k; ++j) sum += static_cast<float>(w[j]) * x[r * k + j];
    out[r * out_stride] = sum * scale;
  }
#else
  for (int r = 0; r < ROWS; ++r) {
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += static_cast<float>(w[j]) * x[r * k + j];
    out[r * out_stride] = sum * scale;
  }
#endif
}

#if defined(EMBER_AVX512) && defined(__AVX512BF16__)
#define EMBER_BF16_DOT 1
// R rows of x (bfloat16, row stride k) against one block of 16 outputs whose
// weights are packed (k / 2, 16, 2): one vector holds an input pair for all 16
// outputs and each x row's pair is broadcast, so every lane accumulates one
// output and nothing is reduced across lanes (oneDNN's bfloat16 layout).
// vdpbf16ps does 32 multiply-adds per instruction.
template <int R>
inline void block16_bf16_rows(const BF16* wblock, const BF16* xb, int64_t k, float* out, int64_t out_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wblock + p * 32));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + r * k + 2 * p));
      acc[r] = _mm512_dpbf16_ps(acc[r], xv, wv);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride, acc[r]);
}
#endif

// Every weight row n (split over the threads) against the M rows of x in
// blocks of 8, 4 and 1 rows: dot(rows, n, x block, out block) with rows a
// std::integral_constant, so each block size is its own kernel.
template <typename X, typename Dot>
void for_row_blocks(int64_t n, int64_t m, int64_t k, const X* x, float* y, Dot dot) {
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      int64_t i = 0;
      for (; i + 8 <= m; i += 8) dot(std::integral_constant<int, 8>{}, row, x + i * k, y + i * n + row);
      for (; i + 4 <= m; i += 4) dot(std::integral_constant<int, 4>{}, row, x + i * k, y + i * n + row);
      for (; i < m; ++i) dot(std::integral_constant<int, 1>{}, row, x + i * k, y + i * n + row);
    }
  });
}

}  // namespace

// y (M, N) float32 = x (M, K) @ W^T for int8 weights with per-row scales.
Tensor gemv_int8(Tensor x, Tensor w, Tensor s) {
  check_contiguous(w, "w");
  Tensor xf = as_float_rows(x);
  const int64_t m = xf.size(0), k = xf.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && w.scalar_type() == at::kChar, "gemv_int8: w must be int8 (N, K)");
  Tensor y = torch::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_row_blocks(n, m, k, xp, yp, [&](auto rows, int64_t row, const float* x, float* out) {
    dot_i8_rows<decltype(rows)::value>(wp + row * k, x, k, sp[row], out, n);
  });
  return y;
}

// Rows up to which gemm_bf16_packed beats the bfloat16 GEMM of ATen (oneDNN)
// on a row-major copy. Measured, all 30 layers' linears with cold weights:
// 15.8 / 25.1 / 44.4 ms at 16 / 32 / 64 rows against 24.2 / 31.1 / 49.1 ms.
constexpr int64_t PACKED_MAX_ROWS = 64;

// y (M, N) float32 = x (M, K) @ W^T for bfloat16 weights packed (N / 16, K / 2, 16, 2).
Tensor gemm_bf16_packed(Tensor x, Tensor w) {
  check_contiguous(w, "w");
  const int64_t m = x.size(0), k = x.size(1), blocks = w.size(0), n = blocks * 16;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.size(1) * 2 == k && w.size(2) == 16 && w.size(3) == 2,
              "gemm_bf16_packed: w must be (N/16, K/2, 16, 2) bfloat16");
#ifdef EMBER_BF16_DOT
  Tensor y = torch::empty({m, n}, x.options().dtype(at::kFloat));
  Tensor xb = x.to(at::kBFloat16).contiguous();
  const BF16* xp = xb.data_ptr<BF16>();
  const BF16* wp = w.data_ptr<BF16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const BF16* wb = wp + b * k * 16;
      int64_t i = 0;
      for (; i + 16 <= m; i += 16) block16_bf16_rows<16>(wb, xp + i * k, k, yp + i * n + b * 16, n);
      for (; i + 8 <= m; i += 8) block16_bf16_rows<8>(wb, xp + i * k, k, yp + i * n + b * 16, n);
      for (; i + 4 <= m; i += 4) block16_bf16_rows<4>(wb, xp + i * k, k, yp + i * n + b * 16, n);
      for (; i < m; ++i) block16_bf16_rows<1>(wb, xp + i * k, k, yp + i * n + b * 16, n);
    }
  });
  return y;
#else
  TORCH_CHECK(false, "gemm_bf16_packed needs a build with AVX512-BF16 (packed_max_rows is 0 here)");
#endif
}

// ---------------------------------------------------------------------------
// The Python <-> C++ contract for weights (model/quant.py builds these):
// named fields, a kind enum, and one dispatch rule, ``linear``, which the
// Python linear modules call too, so the model layer by layer and the fused
// decode loop below cannot take different paths for the same rows.
// ---------------------------------------------------------------------------

// How a linear layer's weights are stored, and so which kernels may run it.
enum class LinearKind : int64_t {
  // ``weight`` (N, K) in the activation dtype; at::linear.
  Dense = 0,
  // int8 weight-only, fastest path per row count (not batch-invariant):
  // ``weight`` int8 (N, K), ``scale`` (N,); gemv_int8 up to GEMV_MAX_ROWS rows,
  // gemm_bf16_packed on ``packed`` up to PACKED_MAX_ROWS, then at::linear on
  // ``dense`` (bfloat16).
  Int8Rows = 1,
  // 4-bit groups: ``weight`` int4pack, ``scale`` scales and zeros; torch's
  // int4 GEMV up to INT4_DIRECT_MAX_ROWS rows, then ``dense`` (bfloat16).
  Int4 = 2,
  // W8A16, batch-invariant (linear_lanes.cpp): ``weight`` int8 lanes
  // (N/8, K/2, 8, 2), ``scale`` (N,); any number of rows.
  Int8Lanes = 3,
  // float32, batch-invariant (linear_lanes.cpp): ``weight`` float32 lanes (N/8, K, 8).
  DenseLanes = 4,
};

// One linear layer's weights. Tensors a kind does not use are empty.
struct LinearWeights {
  LinearKind kind = LinearKind::Dense;
  Tensor weight, scale, dense, packed, bias;
  bool input_bf16 = false;  // the dtype the layer's producer must emit
};

// One decoder layer's weights (absent biases are empty tensors).
struct LayerWeights {
  Tensor attn_norm;
  LinearWeights qkv;
  Tensor qkv_bias;  // added by rope_store, not by the matmul
  LinearWeights o;
  Tensor ffn_norm;
  LinearWeights gate_up, down;
};

namespace {

// Rows up to which Int8Rows reads the int8 weights directly: gemv_int8 beat
// any bfloat16 GEMM up to 8 rows on the 2-core AVX-512 machine.
constexpr int64_t GEMV_MAX_ROWS = 8;
constexpr int64_t INT4_DIRECT_MAX_ROWS = 4;

}  // namespace

// y = x W^T (+ bias), float32 (bfloat16 for Int4 and beyond-GEMV dense copies).
// The one dispatch rule for every linear layer.
Tensor linear(Tensor x, const LinearWeights& w) {
  const int64_t rows = x.size(0);
  Tensor y;
  switch (w.kind) {
    case LinearKind::Int8Lanes:
      y = linear_w8a16(x, w.weight, w.scale);
      break;
    case LinearKind::DenseLanes:
      y = linear_f32_lanes(x, w.weight);
      break;
    case LinearKind::Int8Rows:
      if (rows <= GEMV_MAX_ROWS) {
        y = gemv_int8(x, w.weight, w.scale);
      } else if (w.packed.defined() && w.packed.numel() && rows <= PACKED_MAX_ROWS) {
        y = gemm_bf16_packed(x, w.packed);
      } else {
        y = at::linear(x.to(w.dense.scalar_type()), w.dense);
      }
      break;
    case LinearKind::Int4:
      y = rows <= INT4_DIRECT_MAX_ROWS ? at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w.weight, 32, w.scale)
                                       : at::linear(x.to(w.dense.scalar_type()), w.dense);
      break;
    case LinearKind::Dense:
      y = at::linear(x.to(w.weight.scalar_type()), w.weight);
      break;
    default:
      TORCH_CHECK(false, "linear: unknown LinearKind ", static_cast<int64_t>(w.kind));
  }
  return w.bias.defined() && w.bias.numel() ? y.add_(w.bias) : y;
}

// act (T, F) = silu(gate) * up of x's gate_up linear (outputs [gate | up], 2F),
// in ``dtype``: the one rule for the MLP's activation. Int8 lanes weights on AMX
// fuse it into the matmul's epilogue (half the output written, no second pass);
// any other weights run linear, then silu_mul. The same bits either way.
Tensor swiglu(Tensor x, const LinearWeights& w, at::ScalarType dtype) {
  const bool biased = w.bias.defined() && w.bias.numel();
  if (w.kind == LinearKind::Int8Lanes && dtype == at::kFloat && !biased) {
    Tensor act = torch::empty({x.size(0), w.scale.numel() / 2}, x.options().dtype(at::kFloat));
    if (swiglu_w8a16(act, x, w.weight, w.scale)) return act;
  }
  Tensor gate_up = linear(x, w);
  Tensor act = torch::empty({x.size(0), gate_up.size(1) / 2}, x.options().dtype(dtype));
  silu_mul(act, gate_up.contiguous());
  return act;
}

// The whole decoder stack for a step, in one call: per layer the same kernels,
// in the same order, as model/llama.py's layer-by-layer path. Decode rows,
// drafts and prompt chunks alike when every token attends in one call:
// table_rows and context_lens as in paged_attention (a draft or a prompt chunk
// has several tokens on its block table row).
Tensor decode_layers(Tensor x, const std::vector<LayerWeights>& layers, std::vector<Tensor> k_caches, std::vector<Tensor> v_caches,
                     Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor block_tables, c10::optional<Tensor> table_rows,
                     Tensor context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double eps) {
  const int64_t n_layers = static_cast<int64_t>(layers.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n_layers && static_cast<int64_t>(v_caches.size()) == n_layers,
              "decode_layers: one K and one V cache per layer");
  const int64_t tokens = x.size(0), hidden = x.size(1), q_size = num_heads * head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  auto dtype_for = [&](const LinearWeights& w) { return x.options().dtype(w.input_bf16 ? at::kBFloat16 : at::kFloat); };
  Tensor delta;
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerWeights& lw = layers[l];
    Tensor h = torch::empty({tokens, hidden}, dtype_for(lw.qkv));
    if (delta.defined()) {
      add_rmsnorm(h, x, delta.contiguous(), lw.attn_norm, eps);
    } else {
      rmsnorm(h, x, lw.attn_norm, eps);
    }
    Tensor qkv = linear(h, lw.qkv);
    c10::optional<Tensor> qkv_bias;
    if (lw.qkv_bias.defined() && lw.qkv_bias.numel()) qkv_bias = lw.qkv_bias;
    Tensor q = rope_store(qkv.contiguous(), cos, sin, positions, slots, k_caches[l], v_caches[l], num_heads, num_kv_heads, head_dim, qkv_bias);
    Tensor attn = torch::empty({tokens, q_size}, dtype_for(lw.o));
    paged_attention(attn, q, k_caches[l], v_caches[l], block_tables, table_rows, context_lens, block_size, scale);
    Tensor o = linear(attn, lw.o);
    Tensor h2 = torch::empty({tokens, hidden}, dtype_for(lw.gate_up));
    add_rmsnorm(h2, x, o.contiguous(), lw.ffn_norm, eps);
    delta = linear(swiglu(h2, lw.gate_up, lw.down.input_bf16 ? at::kBFloat16 : at::kFloat), lw.down);
  }
  if (delta.defined()) x.add_(delta);
  return x;
}

// ---------------------------------------------------------------------------
// Warm-tier int8 packing (engine/warm_storage.py), fused with the gather from
// the pool: one pass instead of torch's gather, abs, amax, divide, round,
// clamp and convert (measured 65 ms for a 1,000-token conversation). Each row
// of head_dim values gets scale = max(amax|x| / 127, 1e-8) in float32 and
// q = round-half-even(x / scale) clamped to +-127; the scale is stored as
// float16. The same bits as the torch path (tested). One thread: it runs
// beside the engine (write-behind) or between two of its steps (demotion).
// kv (L, 2, num_blocks, R) float32 with R = block_size * heads * head_dim.
// Returns data int8 (L, 2, n, R) and scales float16 (L, 2, n, R / head_dim).
// ---------------------------------------------------------------------------

namespace {

inline void pack_row_int8(const float* x, int64_t d, int8_t* out, at::Half* scale_out) {
  int64_t i = 0;
  float amax = 0.f;
#ifdef EMBER_AVX512
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = std::max(amax / 127.0f, 1e-8f);
  i = 0;
#ifdef EMBER_AVX512
  const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= d; i += 16) {
    __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
  }
#endif
  for (; i < d; ++i) out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / scale))));
  *scale_out = at::Half(scale);
}

}  // namespace

std::vector<Tensor> pack_kv_int8(Tensor kv, Tensor block_ids, int64_t head_dim) {
  check_contiguous(kv, "kv");
  TORCH_CHECK(kv.dim() == 4, "pack_kv_int8: kv must be (L, 2, blocks, R)");
  const int64_t planes = kv.size(0) * kv.size(1), num_blocks = kv.size(2), r = kv.size(3);
  TORCH_CHECK(head_dim > 0 && head_dim <= 512 && r % head_dim == 0, "pack_kv_int8: a block row must hold whole heads of at most 512");
  Tensor ids = block_ids.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), rows = r / head_dim;
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < num_blocks, "pack_kv_int8: block id out of range");
  Tensor data = torch::empty({kv.size(0), kv.size(1), n, r}, kv.options().dtype(at::kChar));
  Tensor scales = torch::empty({kv.size(0), kv.size(1), n, rows}, kv.options().dtype(at::kHalf));
  int8_t* dst = data.data_ptr<int8_t>();
  at::Half* sp = scales.data_ptr<at::Half>();
  // A float16 pool's rows are widened to float32 first (exact): the torch path's kv.float().
  with_kv_ptr(kv, [&](const auto* src) {
    float widened[512];
    for (int64_t p = 0; p < planes; ++p) {
      for (int64_t i = 0; i < n; ++i) {
        const auto* block = src + (p * num_blocks + idp[i]) * r;
        const int64_t o = p * n + i;
        for (int64_t row = 0; row < rows; ++row) {
          const float* x = float_row(block + row * head_dim, head_dim, widened);
          pack_row_int8(x, head_dim, dst + o * r + row * head_dim, sp + o * rows + row);
        }
      }
    }
  });
  return {data, scales};
}

// ATen keeps, per shared library and per thread, a flag saying whether the
// thread's torch thread count was initialised; the first at::parallel_for of
// this library on a thread sets that thread's count to the process-wide value
// (the last torch.set_num_threads anywhere). The engine thread calls this once
// after claiming its count, so that a later single-threaded default for other
// threads never reaches it (engine/compute_threads.py). Returns the count.
int64_t claim_threads() {
  at::internal::lazy_init_num_threads();
  return at::get_num_threads();
}

// Every kernel runs without the GIL: the engine thread spends most of a step in
// here, and the server's event loop (same process) must keep accepting,
// refusing and streaming meanwhile. Arguments are converted before the release.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  // Rows up to which gemm_bf16_packed should take a linear: 0 where it was not built.
#ifdef EMBER_BF16_DOT
  m.attr("packed_max_rows") = PACKED_MAX_ROWS;
#else
  m.attr("packed_max_rows") = 0;
#endif
  py::enum_<LinearKind>(m, "LinearKind")
      .value("DENSE", LinearKind::Dense)
      .value("INT8_ROWS", LinearKind::Int8Rows)
      .value("INT4", LinearKind::Int4)
      .value("INT8_LANES", LinearKind::Int8Lanes)
      .value("DENSE_LANES", LinearKind::DenseLanes);
  py::class_<LinearWeights>(m, "LinearWeights")
      .def(py::init([](LinearKind kind, Tensor weight, Tensor scale, Tensor dense, Tensor packed, Tensor bias, bool input_bf16) {
             return LinearWeights{kind, weight, scale, dense, packed, bias, input_bf16};
           }),
           py::kw_only(), py::arg("kind"), py::arg("weight"), py::arg("scale"), py::arg("dense"), py::arg("packed"), py::arg("bias"),
           py::arg("input_bf16"))
      .def_readonly("kind", &LinearWeights::kind);
  py::class_<LayerWeights>(m, "LayerWeights")
      .def(py::init([](Tensor attn_norm, LinearWeights qkv, Tensor qkv_bias, LinearWeights o, Tensor ffn_norm, LinearWeights gate_up,
                       LinearWeights down) { return LayerWeights{attn_norm, qkv, qkv_bias, o, ffn_norm, gate_up, down}; }),
           py::kw_only(), py::arg("attn_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("ffn_norm"), py::arg("gate_up"),
           py::arg("down"));
  m.def("claim_threads", &claim_threads);
  m.def("linear", &linear, no_gil());
  m.def("linear_w8a16", &linear_w8a16, no_gil());
  m.def("linear_f32_lanes", &linear_f32_lanes, no_gil());
  m.def("lanes_rows", &lanes_rows, no_gil());
  m.def("set_w8a16_ceiling", &set_w8a16_ceiling);
  m.def("amx_available", &amx_available);
  m.def("vnni_available", &vnni_available);
  m.def("set_w8a16_prefetch", &set_w8a16_prefetch);
  m.def("set_amx_streaming", &ember_amx::set_streaming);
  m.def("decode_layers", &decode_layers, no_gil());
  m.def("gemv_int8", &gemv_int8, no_gil());
  m.def("gemm_bf16_packed", &gemm_bf16_packed, no_gil());
  m.def("rmsnorm", &rmsnorm, no_gil());
  m.def("add_rmsnorm", &add_rmsnorm, no_gil());
  m.def("rope_store", &rope_store, no_gil());
  m.def("paged_attention", &paged_attention, no_gil());
  m.def("silu_mul", &silu_mul, no_gil());
  m.def("swiglu", &swiglu, no_gil());
  m.def("sample_rows", &sample_rows, no_gil());
  m.def("argmax_rows", &argmax_rows, no_gil());
  m.def("pack_kv_int8", &pack_kv_int8, no_gil());
}
