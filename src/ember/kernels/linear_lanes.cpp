// Batch-invariant linear layers: y (M, N) = x (M, K) @ W^T, one numerics for any M.
//
// The invariant (issue "same seed, same answer"): the bits of output row r
// depend only on x[r] and the weights, never on M, on which other rows share
// the call, on the thread count's split of the outputs, or on the row tiling.
// Every row runs the same instruction sequence: its own quantization, then,
// per output lane, a reduction over k in one fixed order. Rows are processed in
// blocks (8, 4, 3 or 1, by kernel) and outputs one or two 8-lane blocks at a time
// only to reuse loaded weight vectors and broadcast activations; a row's
// arithmetic is the same in any of them.
//
// Weights are stored "lanes = outputs": a 256-bit vector holds 8 outputs, so
// every lane accumulates one output and nothing is reduced across lanes.
//
// * int8 (W8A16): w (N/8, K/2, 8, 2) int8 with one float32 scale per output;
//   activations quantized per row in groups of 256 inputs to int16
//   (scale = max|x_g| / 32767). Each group's dot product is exact in int32
//   (|sum| <= 256 * 127 * 32767 < 2^30; a group of 512 would still fit, but
//   one outlier would coarsen more of its neighbours); the float epilogue
//   acc = fma(float(dot_g), scale_g, acc) runs over the groups in order, and
//   the output is acc * w_scale. Reads 1 byte per weight (decode is
//   memory-bound) and does 16 multiply-adds per vpmaddwd (prefill is
//   compute-bound: twice float32's FMA rate on AVX2). Accuracy: int16
//   activations carry ~16 bits per group, better than bfloat16's 8.
// * float32: w (N/8, K, 8) float32, acc = fma(x[k], w[k], acc) over k in order.
//
// Without AVX2 the same arithmetic runs in plain loops (the int part is exact,
// the float epilogue is the same fma sequence), so the bits match the AVX2
// path on a machine that has it. On AVX2, two rows or more run two blocks at a
// time (block_w8a16<2, R>), the same bits. With AVX-512 VNNI, two rows or more run 16
// outputs to a 512-bit register (pair_w8a16_vnni), the same bits. With AMX, seven rows or more run on tiles
// (linear_amx.cpp), again the same bits. Groups of 256 (not 64) because the
// epilogue, not the integer work, bounds the tile kernel: measured 1.3-1.5x
// on AMX for the same teacher-forced agreement with float32 (96.7 %).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <utility>

#include "linear_amx.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EMBER_AVX2 1
#endif

using torch::Tensor;

namespace {

// From this many rows on, W8A16 runs on AMX tiles where the CPU has them
// (linear_amx.cpp: the same bits). Below it the tiles' fixed 16-row shape and
// the per-call weight reshuffle cost more than they save. Measured on the
// model's 120 linears, weights from memory, two runs: AMX / VNNI time 1.06-1.13
// at 5 rows, 1.06-1.11 at 6, 0.91 at 7, 0.90-0.99 at 8, 0.76 at 16.
constexpr int64_t AMX_MIN_ROWS = 7;
// From this many rows on (and for an even number of blocks), the AVX2 kernel runs
// two blocks at a time (block_w8a16<2, R>). A lone decode row keeps one block:
// it is bound by memory, and one weight stream per thread reads fastest.
constexpr int64_t AVX2_PAIRS_MIN_ROWS = 2;

// The W8A16 paths from slowest to fastest; each computes the same bits. A call
// takes the fastest one that the CPU, the build, its shape and the ceiling allow.
enum class W8A16Path { avx2 = 0, avx2_pairs = 1, vnni = 2, amx = 3 };
constexpr const char* W8A16_PATH_NAMES[] = {"avx2", "avx2-pairs", "vnni", "amx"};
// Lowered only by tests and benchmarks, to run a slower path on this CPU.
W8A16Path w8a16_ceiling = W8A16Path::amx;
bool path_allowed(W8A16Path path) { return static_cast<int>(path) <= static_cast<int>(w8a16_ceiling); }

constexpr int64_t LANES = 8;         // outputs per weight vector
constexpr int64_t QUANT_GROUP = 256;  // inputs per activation scale
constexpr float INT16_MAX_F = 32767.f;
// Rows of x kept hot in the cache while a thread walks its outputs.
constexpr int64_t ROW_TILE = 64;
constexpr int64_t CACHE_LINE = 64;
// Whether W8A16 calls prefetch their weights (for_lane_blocks: the next unit, or
// their own stream ahead; the AMX path: its stream ahead); lowered only by tests and benchmarks, to measure the
// previous default in the same run.
bool w8a16_prefetch = true;

// What one kernel call asks the memory for (see for_lane_blocks). Empty:
// nothing. Either `lines` cache lines of the next weight unit from `from`,
// spread evenly over the call's pass (it works on weights already in cache), or
// `ahead`: it streams its own weights from memory, so it asks for them
// STREAM_AHEAD bytes before it reads them.
struct Prefetch {
  const char* from = nullptr;
  int64_t lines = 0;
  bool ahead = false;
};
// How far ahead a call that streams its weights asks for them. The hardware
// prefetcher stops at 4 KB pages; a lone decode row (one call per unit, every
// unit from DRAM) measured 1.06-1.09x with 4-16 KB (engine decode steps, the
// variants flipped every step), 1.03x with 1 KB.
constexpr int64_t STREAM_AHEAD = 4096;
// Units with more calls than this (in a row tile) prefetch nothing: 6 calls is
// 16 rows in blocks of 3 (see for_lane_blocks).
constexpr int64_t MAX_PREFETCHING_CALLS = 6;

// Issues a Prefetch's requests, one every `every` steps of a pass of `steps`
// steps, so that they trickle out between the arithmetic instead of flooding
// the load queue at once (a burst at the start of a block measured 0.9x). Into
// L2, not L1: the next unit and the current one together can outgrow L1 (two
// blocks of a 1,536-input layer are 24 KB). A prefetch never faults and never
// changes a value: the bits are the same with or without.
class PrefetchTrickle {
 public:
  PrefetchTrickle(const Prefetch& p, int64_t steps)
      : from_(p.from), left_(p.lines), every_(p.lines > 0 ? std::max<int64_t>(1, steps / p.lines) : 0), countdown_(every_) {}
  inline void step() {
    if (left_ == 0 || --countdown_ > 0) return;
    __builtin_prefetch(from_, 0, 2);
    from_ += CACHE_LINE;
    --left_;
    countdown_ = every_;
  }

 private:
  const char* from_;
  int64_t left_, every_, countdown_;
};

// One input's code: nearbyint(x * inv) clamped to +-32767 (NaN -> -32767, as
// std::max/min order their operands). The vector loops below compute exactly this.
inline int16_t quantize_one(float x, float inv) {
  const float q = std::nearbyint(x * inv);
  return static_cast<int16_t>(std::min(INT16_MAX_F, std::max(-INT16_MAX_F, q)));
}

// Where quantize_row puts a row's codes: as int16 (the vector kernels) ...
struct Int16Codes {
  int16_t* codes;
  void put(int64_t i, int16_t c) const { codes[i] = c; }
#if defined(__AVX512F__)
  void put16(int64_t i, __m512i c) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm512_cvtepi32_epi16(c)); }
#elif defined(EMBER_AVX2)
  void put8(int64_t i, __m128i c) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), c); }
#endif
};

// ... or split exactly into the bytes AMX multiplies (linear_amx.cpp):
// c = 256 * hi + lo, hi = c >> 8 (signed), lo = c & 255.
struct SplitCodes {
  int8_t* hi;
  uint8_t* lo;
  void put(int64_t i, int16_t c) const {
    hi[i] = static_cast<int8_t>(c >> 8);
    lo[i] = static_cast<uint8_t>(c & 255);
  }
#if defined(__AVX512F__)
  void put16(int64_t i, __m512i c) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtepi32_epi8(_mm512_srai_epi32(c, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), _mm512_cvtepi32_epi8(_mm512_and_si512(c, _mm512_set1_epi32(255))));
  }
#elif defined(EMBER_AVX2)
  void put8(int64_t i, __m128i c) const {  // AMX comes with AVX-512: never a hot path
    alignas(16) int16_t codes[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(codes), c);
    for (int j = 0; j < 8; ++j) put(i + j, codes[j]);
  }
#endif
};

// x row (K floats) -> int16 codes (into ``out``) and one scale per group of
// QUANT_GROUP inputs. A group of zeros gets scale 0 (and codes 0). The group's
// max ignores NaN (std::max(amax, NaN) keeps amax; _mm*_max_ps(NaN, amax)
// returns amax too).
template <typename Codes>
void quantize_row(const float* x, int64_t k, const Codes& out, float* scales) {
  for (int64_t g0 = 0, g = 0; g0 < k; g0 += QUANT_GROUP, ++g) {
    const int64_t g1 = std::min(k, g0 + QUANT_GROUP);
    int64_t i = g0;
    float amax = 0.f;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; i + 16 <= g1; i += 16) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vmax);
    amax = _mm512_reduce_max_ps(vmax);
#elif defined(EMBER_AVX2)
    __m256 vmax = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; i + 8 <= g1; i += 8) vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), vmax);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float v : lanes) amax = std::max(amax, v);
#endif
    for (; i < g1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / INT16_MAX_F;
    const float inv = amax > 0.f ? INT16_MAX_F / amax : 0.f;
    scales[g] = scale;
    i = g0;
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(INT16_MAX_F), lo = _mm512_set1_ps(-INT16_MAX_F);
    for (; i + 16 <= g1; i += 16) {
      const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 clamped = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
      out.put16(i, _mm512_cvtps_epi32(clamped));
    }
#elif defined(EMBER_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(INT16_MAX_F), lo = _mm256_set1_ps(-INT16_MAX_F);
    for (; i + 8 <= g1; i += 8) {
      const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i ints = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi));
      out.put8(i, _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1)));
    }
#endif
    for (; i < g1; ++i) out.put(i, quantize_one(x[i], inv));
  }
}

// R rows (codes with row stride k, scales with row stride groups) against BLOCKS
// neighbouring blocks of 8 outputs (block b's K/2 pairs of 8 x 2 int8 at
// wb + b * k * 8). Writes R x (8 * BLOCKS) floats.
//
// With two blocks each broadcast activation pair feeds two vpmaddwd, and a
// weight vector feeds R of them: on AMD Zen 3 two blocks of 3 rows measured
// ~1.4x one block of 4 (fewer loads per multiply-add, and 6 dot chains + 2
// weights + 3 broadcasts fit the 16 registers: 2 x 4 rows made GCC 12 spill a
// dot chain to the stack, 0.7x). Unrolling the pair loop twice gives the
// scheduler room between the broadcasts and the multiplies (+15-35 % there).
// A lane's arithmetic is the same whatever BLOCKS and R: the same bits.
//
// Each kind of Prefetch runs its own copy of the loop (ASKS): the next unit's
// share (NEXT_UNIT), the call's own stream ahead (AHEAD) or nothing (NOTHING:
// a unit's first call when the calls before it asked for its weights, later
// row tiles). A check per pair that a call does not need cost the arithmetic-
// bound calls up to 7 % (63 rows).
enum class Asks { NOTHING, NEXT_UNIT, AHEAD };
template <int BLOCKS, int R, Asks ASKS = Asks::NOTHING>
void block_w8a16(const int8_t* wb, const int16_t* codes, const float* scales, int64_t k, int64_t groups,
                 const float* wscale, float* out, int64_t out_stride, const Prefetch& prefetch = {}) {
#ifdef EMBER_AVX2
  if constexpr (ASKS == Asks::NOTHING) {
    if (prefetch.lines > 0)
      return block_w8a16<BLOCKS, R, Asks::NEXT_UNIT>(wb, codes, scales, k, groups, wscale, out, out_stride, prefetch);
    if (prefetch.ahead) return block_w8a16<BLOCKS, R, Asks::AHEAD>(wb, codes, scales, k, groups, wscale, out, out_stride, prefetch);
  }
  PrefetchTrickle trickle(prefetch, k / 2);
  __m256 acc[BLOCKS][R];
  for (int b = 0; b < BLOCKS; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p0 = g * QUANT_GROUP / 2, p1 = std::min(k, (g + 1) * QUANT_GROUP) / 2;
    __m256i dot[BLOCKS][R];
    for (int b = 0; b < BLOCKS; ++b)
      for (int r = 0; r < R; ++r) dot[b][r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int64_t p = p0; p < p1; ++p) {
      if constexpr (ASKS == Asks::NEXT_UNIT) trickle.step();
      if constexpr (ASKS == Asks::AHEAD)
        if ((p & 3) == 0)  // a cache line per stream every 4 pairs
          for (int b = 0; b < BLOCKS; ++b) __builtin_prefetch(wb + b * k * LANES + p * 16 + STREAM_AHEAD, 0, 3);
      __m256i w[BLOCKS];
      for (int b = 0; b < BLOCKS; ++b)
        w[b] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + b * k * LANES + p * 16)));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(codes + r * k + 2 * p));
        for (int b = 0; b < BLOCKS; ++b) dot[b][r] = _mm256_add_epi32(dot[b][r], _mm256_madd_epi16(w[b], xv));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 group_scale = _mm256_set1_ps(scales[r * groups + g]);
      for (int b = 0; b < BLOCKS; ++b) acc[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[b][r]), group_scale, acc[b][r]);
    }
  }
  for (int b = 0; b < BLOCKS; ++b) {
    const __m256 ws = _mm256_loadu_ps(wscale + b * LANES);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride + b * LANES, _mm256_mul_ps(acc[b][r], ws));
  }
#else
  for (int b = 0; b < BLOCKS; ++b) {
    const int8_t* wblock = wb + b * k * LANES;
    for (int r = 0; r < R; ++r) {
      for (int lane = 0; lane < LANES; ++lane) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t p0 = g * QUANT_GROUP / 2, p1 = std::min(k, (g + 1) * QUANT_GROUP) / 2;
          int32_t dot = 0;
          for (int64_t p = p0; p < p1; ++p) {
            dot += int32_t(wblock[p * 16 + lane * 2]) * codes[r * k + 2 * p] + int32_t(wblock[p * 16 + lane * 2 + 1]) * codes[r * k + 2 * p + 1];
          }
          acc = std::fma(static_cast<float>(dot), scales[r * groups + g], acc);
        }
        out[r * out_stride + b * LANES + lane] = acc * wscale[b * LANES + lane];
      }
    }
  }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EMBER_VNNI512 1
// From this many rows on (and for an even number of blocks), W8A16 takes the
// 512-bit VNNI kernel below. A lone decode row stays on block_w8a16: it is bound
// by memory, and one weight stream per thread reads faster than the VNNI
// kernel's two (5.96 against 6.67 ms for a pass over SmolLM2-135M's linears from
// DRAM, measured on AMD Zen 5).
constexpr int64_t VNNI_MIN_ROWS = 2;
// How far ahead a few-row call asks for its two weight streams (2 and 4 rows
// read from DRAM 10-40 % faster with it; 8 rows and more are bound by arithmetic).
constexpr int64_t PREFETCH_BYTES = 1024;

// R rows against two neighbouring blocks (16 outputs: wb0's 8, then the 8 of
// wb0 + k * 8) in one 512-bit register: vpdpwssd does 32 multiply-adds into 16
// int32 lanes, the activation pair broadcast to every lane. The integer dot of a
// group is exact (the sum of the same products in any order), and the float
// epilogue is block_w8a16's, lane for lane: the same bits. Rows of 4 or fewer
// keep two dot chains (even and odd pairs, added at the group's end: still
// exact) so that few rows do not wait on vpdpwssd's latency.
//
// Tried and not kept (same bits, measured slower here): the codes split into
// bytes for vpdpbusd (twice vpdpwssd's rate on Zen 5, but a vpermb per weight
// vector and two broadcasts per row: 0.85x), 12 rows or 32 outputs per call
// (no faster), and the accumulators tied to registers by inline asm (0.5x).
template <int R>
void pair_w8a16_vnni(const int8_t* wb0, const int16_t* codes, const float* scales, int64_t k, int64_t groups,
                     const float* wscale, float* out, int64_t out_stride) {
  constexpr int CHAINS = R <= 4 ? 2 : 1;
  const int8_t* wb1 = wb0 + k * LANES;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p0 = g * QUANT_GROUP / 2, p1 = std::min(k, (g + 1) * QUANT_GROUP) / 2;
    __m512i dot[CHAINS][R];
    for (int c = 0; c < CHAINS; ++c)
      for (int r = 0; r < R; ++r) dot[c][r] = _mm512_setzero_si512();
    int64_t p = p0;
    auto step = [&](int c, int64_t pair) {
      const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb0 + pair * 16))),
                                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb1 + pair * 16)), 1);
      const __m512i w = _mm512_cvtepi8_epi16(bytes);
      for (int r = 0; r < R; ++r)
        dot[c][r] = _mm512_dpwssd_epi32(dot[c][r], w, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(codes + r * k + 2 * pair)));
    };
    for (; p + CHAINS <= p1; p += CHAINS) {
      if (R <= 4 && (p & 3) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(wb0 + p * 16 + PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wb1 + p * 16 + PREFETCH_BYTES), _MM_HINT_T0);
      }
      for (int c = 0; c < CHAINS; ++c) step(c, p + c);
    }
    for (; p < p1; ++p) step(0, p);
    for (int r = 0; r < R; ++r) {
      __m512i sum = dot[0][r];
      for (int c = 1; c < CHAINS; ++c) sum = _mm512_add_epi32(sum, dot[c][r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(scales[r * groups + g]), acc[r]);
    }
  }
  const __m512 ws = _mm512_loadu_ps(wscale);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride, _mm512_mul_ps(acc[r], ws));
}

#endif

// R rows of x (row stride k) against one block of 8 float32 outputs (wb: K x 8).
template <int R>
void block_f32(const float* wb, const float* x, int64_t k, float* out, int64_t out_stride) {
#ifdef EMBER_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w = _mm256_loadu_ps(wb + i * LANES);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * k + i]), w, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride, acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    for (int lane = 0; lane < LANES; ++lane) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc = std::fma(x[r * k + i], wb[i * LANES + lane], acc);
      out[r * out_stride + lane] = acc;
    }
  }
#endif
}

// How many calls for_lane_blocks makes for `rows` rows of one tile: WIDE at a
// time, then 4 (when WIDE is more), then 2 (when WIDE is more), then one.
template <int WIDE>
int64_t row_calls(int64_t rows) {
  int64_t calls = rows / WIDE;
  rows %= WIDE;
  if constexpr (WIDE > 4) calls += rows / 4, rows %= 4;
  if constexpr (WIDE > 2) calls += rows / 2, rows %= 2;
  return calls + rows;
}

// What call `call` (from 0) of a unit's `calls` in a row tile asks for:
// `streamed` says the unit comes from memory (the first tile, weights given),
// `next_unit` is where the thread's next unit starts (nullptr: it has none).
// A lone call streams ahead; otherwise, with at most MAX_PREFETCHING_CALLS
// calls, every call after the first asks for its share of the next unit.
Prefetch plan_prefetch(bool streamed, const char* next_unit, int64_t unit_lines, int64_t calls, int64_t call) {
  if (!streamed) return {};
  if (calls == 1) return {nullptr, 0, true};
  if (next_unit == nullptr || calls > MAX_PREFETCHING_CALLS || call == 0) return {};
  const int64_t share = (unit_lines + calls - 2) / (calls - 1), first = (call - 1) * share;
  if (first >= unit_lines) return {};
  return {next_unit + first * CACHE_LINE, std::min(share, unit_lines - first)};
}

// Splits the output blocks over the threads, BLOCKS neighbouring 8-output blocks
// (a "unit", unit_bytes at weights + u * unit_bytes) per call; each thread walks
// the rows in tiles of about ROW_TILE (kept in cache across its blocks; a
// multiple of WIDE, so that only the last tile ends in narrower blocks), WIDE
// rows at a time, then 4, 2 and 1 as row_calls says: a weight vector feeds as
// many rows as it can. ``block(rows, row, b, out, prefetch)`` computes rows x
// (8 * BLOCKS) outputs from block b on. n must be a multiple of 8 * BLOCKS.
//
// Prefetch (when `weights` is given): in the first tile only a unit's first call
// reads its weights from memory, and the calls after it find them in cache and
// are bound by arithmetic, so the memory sat idle while they ran and the next
// unit's first call stalled on it. Now each of those later calls asks for an
// equal share of the thread's next unit. A pass over the model's linears, the
// variants flipped every round in one process (AMD Zen 3): 4 rows 1.07-1.15x,
// 8 rows 1.15-1.18x, 16 rows 1.07-1.12x; 1 to 3 rows make one call per unit and
// gain nothing from that. They stream every unit from memory instead, so each
// of their calls asks for its own weights ahead (Prefetch::ahead). Later tiles
// find their units in L2 (prefetching there too measured 0.99x at 1,000 rows),
// so they ask for nothing, and so do units with more than MAX_PREFETCHING_CALLS
// calls: their arithmetic hides the first call's stall, and the prefetching
// loop's per-pair check cost more than it saved (0.97x at 32 rows, 0.93x at
// 63). plan_prefetch states the rule. The VNNI and float32 lanes paths pass no
// weights: this has not been measured on a CPU with VNNI.
template <int BLOCKS, int WIDE, typename Block>
void for_lane_blocks(int64_t m, int64_t n, float* y, const void* weights, int64_t unit_bytes, Block block) {
  const int64_t units = n / (LANES * BLOCKS);
  const int64_t unit_lines = unit_bytes / CACHE_LINE;
  const char* base = static_cast<const char*>(weights);
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    constexpr int64_t tile = ROW_TILE / WIDE * WIDE;
    for (int64_t t0 = 0; t0 < m; t0 += tile) {
      const int64_t t1 = std::min(m, t0 + tile);
      const int64_t calls = row_calls<WIDE>(t1 - t0);
      const bool streamed = base != nullptr && t0 == 0;
      for (int64_t u = u0; u < u1; ++u) {
        const char* next_unit = streamed && u + 1 < u1 ? base + (u + 1) * unit_bytes : nullptr;
        int64_t call = 0;
        auto prefetch = [&] { return plan_prefetch(streamed, next_unit, unit_lines, calls, call++); };
        const int64_t b = u * BLOCKS;
        int64_t r = t0;
        for (; r + WIDE <= t1; r += WIDE) block(std::integral_constant<int, WIDE>{}, r, b, y + r * n + b * LANES, prefetch());
        if constexpr (WIDE > 4)
          for (; r + 4 <= t1; r += 4) block(std::integral_constant<int, 4>{}, r, b, y + r * n + b * LANES, prefetch());
        if constexpr (WIDE > 2)
          for (; r + 2 <= t1; r += 2) block(std::integral_constant<int, 2>{}, r, b, y + r * n + b * LANES, prefetch());
        for (; r < t1; ++r) block(std::integral_constant<int, 1>{}, r, b, y + r * n + b * LANES, prefetch());
      }
    }
  });
}

Tensor float_rows(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a (M, K) CPU tensor");
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

}  // namespace

namespace {

// Rows per task of the activation quantization: 8, so that a 16-row decode step
// splits over two threads (at 16 it ran on the calling thread while the other
// waited at the barrier, 120 times a step).
constexpr int64_t QUANTIZE_GRAIN = 8;

// x (M, K) float32 rows as the definition's int16 codes (M, K) and per-group scales (M, K / QUANT_GROUP).
std::pair<Tensor, Tensor> quantize_rows(const Tensor& xf) {
  const int64_t m = xf.size(0), k = xf.size(1), groups = (k + QUANT_GROUP - 1) / QUANT_GROUP;
  Tensor codes = torch::empty({m, k}, xf.options().dtype(at::kShort));
  Tensor scales = torch::empty({m, groups}, xf.options());
  const float* xp = xf.data_ptr<float>();
  int16_t* cp = codes.data_ptr<int16_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, m, QUANTIZE_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(xp + r * k, k, Int16Codes{cp + r * k}, sp + r * groups);
  });
  return {codes, scales};
}

// The same codes split into bytes for ember_amx::linear_w8a16: hi (int8) and lo
// (uint8), (M, K) with M = the rows rounded up to whole AMX row tiles (padding
// rows zero), and the scales (rows, K / QUANT_GROUP).
struct SplitRows {
  Tensor hi, lo, scales;
};

SplitRows quantize_rows_split(const Tensor& xf) {
  const int64_t m = xf.size(0), k = xf.size(1), groups = (k + QUANT_GROUP - 1) / QUANT_GROUP;
  const int64_t padded = (m + ember_amx::TILE_ROWS - 1) / ember_amx::TILE_ROWS * ember_amx::TILE_ROWS;
  SplitRows split{torch::empty({padded, k}, xf.options().dtype(at::kChar)), torch::empty({padded, k}, xf.options().dtype(at::kByte)),
                  torch::empty({m, groups}, xf.options())};
  int8_t* hi = split.hi.data_ptr<int8_t>();
  uint8_t* lo = split.lo.data_ptr<uint8_t>();
  std::memset(hi + m * k, 0, (padded - m) * k);
  std::memset(lo + m * k, 0, (padded - m) * k);
  const float* xp = xf.data_ptr<float>();
  float* sp = split.scales.data_ptr<float>();
  at::parallel_for(0, m, QUANTIZE_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(xp + r * k, k, SplitCodes{hi + r * k, lo + r * k}, sp + r * groups);
  });
  return split;
}

// Whether a W8A16 call of m rows runs on AMX tiles (ember_amx::takes for the shape).
bool runs_on_amx(int64_t m, int64_t k, int64_t n, bool swiglu) {
  return path_allowed(W8A16Path::amx) && m >= AMX_MIN_ROWS && ember_amx::takes(k, QUANT_GROUP, n, swiglu);
}

// ember_amx::linear_w8a16 on x's rows (runs_on_amx must hold).
void amx_w8a16(const Tensor& xf, const Tensor& w, const Tensor& scale, float* y, bool swiglu) {
  const SplitRows split = quantize_rows_split(xf);
  ember_amx::linear_w8a16(split.hi.data_ptr<int8_t>(), split.lo.data_ptr<uint8_t>(), split.scales.data_ptr<float>(), xf.size(0), xf.size(1),
                          QUANT_GROUP, w.data_ptr<int8_t>(), scale.data_ptr<float>(), w.size(0) * LANES, y, w8a16_prefetch, swiglu);
}

void check_w8a16(const Tensor& xf, const Tensor& w, const Tensor& scale) {
  const int64_t k = xf.size(1);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 4 && w.is_contiguous() && w.size(1) * 2 == k && w.size(2) == LANES && w.size(3) == 2,
              "linear_w8a16: w must be int8 (N/8, K/2, 8, 2) for K = ", k);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0) * LANES && scale.is_contiguous(),
              "linear_w8a16: scale must be float32 (N,)");
}

}  // namespace

// act (M, N/2) float32 = silu(gate) * up for y = x W^T whose N outputs are
// [gate | up] (W as in linear_w8a16): on AMX tiles, fused into the matmul's
// epilogue, so half the output is written and no second pass reads it back.
// The same bits as linear_w8a16 followed by silu_mul. Returns false, act
// untouched, where this call would not run on AMX; the caller runs those two.
bool swiglu_w8a16(Tensor act, Tensor x, Tensor w, Tensor scale) {
  const Tensor xf = float_rows(x);
  check_w8a16(xf, w, scale);
  const int64_t m = xf.size(0), k = xf.size(1), n = w.size(0) * LANES;
  TORCH_CHECK(act.scalar_type() == at::kFloat && act.is_contiguous() && act.dim() == 2 && act.size(0) == m && act.size(1) * 2 == n,
              "swiglu_w8a16: act must be float32 (M, N/2)");
  if (!runs_on_amx(m, k, n, true)) return false;
  amx_w8a16(xf, w, scale, act.data_ptr<float>(), true);
  return true;
}

// y (M, N) float32 = x (M, K) @ W^T, W given as int8 lanes (N/8, K/2, 8, 2) and scales (N,).
Tensor linear_w8a16(Tensor x, Tensor w, Tensor scale) {
  const Tensor xf = float_rows(x);
  check_w8a16(xf, w, scale);
  const int64_t m = xf.size(0), k = xf.size(1);
  const int64_t n = w.size(0) * LANES, groups = (k + QUANT_GROUP - 1) / QUANT_GROUP;
  Tensor y = torch::empty({m, n}, xf.options());
  if (m == 0) return y;
  if (runs_on_amx(m, k, n, false)) {
    amx_w8a16(xf, w, scale, y.data_ptr<float>(), false);
    return y;
  }
  const auto [codes, scales] = quantize_rows(xf);
  const int16_t* cp = codes.data_ptr<int16_t>();
  const float* sp = scales.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* ws = scale.data_ptr<float>();
#ifdef EMBER_VNNI512
  if (path_allowed(W8A16Path::vnni) && m >= VNNI_MIN_ROWS && n % (2 * LANES) == 0) {
    for_lane_blocks<2, 8>(m, n, y.data_ptr<float>(), nullptr, 0, [&](auto rows, int64_t r, int64_t b, float* out, const Prefetch&) {
      pair_w8a16_vnni<decltype(rows)::value>(wp + b * k * LANES, cp + r * k, sp + r * groups, k, groups, ws + b * LANES, out, n);
    });
    return y;
  }
#endif
  if (path_allowed(W8A16Path::avx2_pairs) && m >= AVX2_PAIRS_MIN_ROWS && n % (2 * LANES) == 0) {
    for_lane_blocks<2, 3>(m, n, y.data_ptr<float>(), w8a16_prefetch ? wp : nullptr, 2 * k * LANES, [&](auto rows, int64_t r, int64_t b, float* out, const Prefetch& prefetch) {
      block_w8a16<2, decltype(rows)::value>(wp + b * k * LANES, cp + r * k, sp + r * groups, k, groups, ws + b * LANES, out, n, prefetch);
    });
    return y;
  }
  for_lane_blocks<1, 4>(m, n, y.data_ptr<float>(), w8a16_prefetch ? wp : nullptr, k * LANES, [&](auto rows, int64_t r, int64_t b, float* out, const Prefetch& prefetch) {
    block_w8a16<1, decltype(rows)::value>(wp + b * k * LANES, cp + r * k, sp + r * groups, k, groups, ws + b * LANES, out, n, prefetch);
  });
  return y;
}

// y (M, N) float32 = x (M, K) @ W^T, W given as float32 lanes (N/8, K, 8).
Tensor linear_f32_lanes(Tensor x, Tensor w) {
  const Tensor xf = float_rows(x);
  const int64_t m = xf.size(0), k = xf.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 3 && w.is_contiguous() && w.size(1) == k && w.size(2) == LANES,
              "linear_f32_lanes: w must be float32 (N/8, K, 8) for K = ", k);
  const int64_t n = w.size(0) * LANES;
  Tensor y = torch::empty({m, n}, xf.options());
  if (m == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  for_lane_blocks<1, 4>(m, n, y.data_ptr<float>(), nullptr, 0, [&](auto rows, int64_t r, int64_t b, float* out, const Prefetch&) {
    block_f32<decltype(rows)::value>(wp + b * k * LANES, xp + r * k, k, out, n);
  });
  return y;
}

// Rows ``ids`` (outputs) of an int8 lanes weight W (N/8, K/2, 8, 2), dequantized:
// out (len(ids), K) float32 = W[id] * scale[id]. A tied embedding table is the
// LM head's weight, so this is the token embedding; one call instead of the
// seven torch ops of the index arithmetic and gather (~0.3 ms of a 16-row
// decode step). The same bits: one float32 multiply per value.
Tensor lanes_rows(Tensor w, Tensor scale, Tensor ids) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 4 && w.is_contiguous() && w.size(2) == LANES && w.size(3) == 2,
              "lanes_rows: w must be int8 (N/8, K/2, 8, 2)");
  const int64_t n = w.size(0) * LANES, pairs = w.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n, "lanes_rows: scale must be float32 (N,)");
  const Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t count = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "lanes_rows: id ", ip[i], " out of range [0, ", n, ")");
  Tensor out = torch::empty({count, 2 * pairs}, scale.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t id = ip[i];
      const int8_t* src = wp + (id / LANES) * pairs * LANES * 2 + (id % LANES) * 2;  // pair j at src + j * LANES * 2
      const float s = sp[id];
      float* row = op + i * 2 * pairs;
      for (int64_t j = 0; j < pairs; ++j) {
        row[2 * j] = static_cast<float>(src[j * LANES * 2]) * s;
        row[2 * j + 1] = static_cast<float>(src[j * LANES * 2 + 1]) * s;
      }
    }
  });
  return out;
}

// The fastest W8A16 path allowed: "amx" (the default: every path the CPU has),
// "vnni", "avx2-pairs" (two 8-output blocks at a time) or "avx2" (one block, the
// oldest). Tests lower it to check each path's bits on this CPU; the engine bench
// lowers it to measure the previous default in the same run. Returns the
// previous ceiling.
std::string set_w8a16_ceiling(const std::string& path) {
  const std::string previous = W8A16_PATH_NAMES[static_cast<int>(w8a16_ceiling)];
  for (int i = 0; i < static_cast<int>(std::size(W8A16_PATH_NAMES)); ++i)
    if (path == W8A16_PATH_NAMES[i]) {
      w8a16_ceiling = static_cast<W8A16Path>(i);
      return previous;
    }
  TORCH_CHECK(false, "set_w8a16_ceiling: unknown path '", path, "' (amx, vnni, avx2-pairs or avx2)");
}

// Turns the W8A16 kernels' weight prefetch (next unit and stream ahead, AMX included) on or off (the
// same bits either way); returns whether it was on. For tests and benchmarks.
bool set_w8a16_prefetch(bool on) {
  const bool previous = w8a16_prefetch;
  w8a16_prefetch = on;
  return previous;
}

// Whether this CPU, kernel and build run W8A16 on AMX tiles.
bool amx_available() { return ember_amx::available(); }

// Whether this build (-march=native on this CPU) has the AVX-512 VNNI kernel.
bool vnni_available() {
#ifdef EMBER_VNNI512
  return true;
#else
  return false;
#endif
}
