// W8A16 on Intel AMX tiles: the same bits as linear_lanes.cpp's definition, several times faster for many rows.
//
// The definition (linear_lanes.cpp): per row, int16 activation codes in groups
// of `group` inputs (256, a multiple of 64); per (row, output, group) an exact
// int32 dot product with the int8 weights; acc = fma(float(dot_g), scale_g, acc)
// over the groups in order; output acc * w_scale. AMX multiplies bytes, not
// int16, so each code is split exactly as c = 256 * hi + lo (hi = c >> 8 signed,
// lo = c & 255 unsigned):
//
//   dot_g = 256 * (hi . w) + (lo . w)       TDPBSSD for hi, TDPBUSD for lo
//
// One int8 tile row is 64 bytes wide, so a group's products accumulate over its
// 256 / 64 = 4 tile steps in the C tiles before the epilogue. Both partial dots
// are exact in int32 (|hi . w| <= 256 * 128 * 127, |lo . w| <= 256 * 255 * 127),
// and so is their sum (|dot_g| <= 256 * 127 * 32767 < 2^31): the integer dot is
// the definition's, whatever the hardware's order inside a tile. The float
// epilogue is the definition's fma sequence, lane for lane.
//
// Weights are read from the lanes layout (N/8, K/2, 8, 2) that the AVX2 kernel
// uses; each 16-output x 64-input B tile is reshuffled into AMX's (16 x 4)-byte
// rows on the fly (1 KB, reused by every row tile), so no second copy is kept.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "linear_amx.h"
#include "simd_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define EMBER_AMX 1
#endif

namespace ember_amx {

constexpr int64_t GROUP = 64;   // inputs per tile step = bytes per AMX tile row (a quantization group holds several)
constexpr int64_t OUTS = 16;    // outputs per B tile (16 int32 columns of C)
// How far ahead gather_b_quads asks for the weights it streams (as linear_lanes.cpp's calls that stream).
constexpr int64_t STREAM_AHEAD = 4096;
// Whether a call with one row tile (m <= 16: a decode step) streams its weights
// pair by pair (linear_w8a16), and the weight tiles are gathered with vpermt2w
// (gather_b_quads); lowered only by tests and benchmarks, to measure the
// arrangement before both. The same bits either way.
bool streaming = true;

#ifdef EMBER_AMX

namespace {

// Linux hands out AMX's 8 KB of tile state only to a process that asks for it.
bool request_tile_permission() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
  constexpr int XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers (the intrinsics take literal numbers): the activation bytes of
// 16 rows x 64 inputs, two weight tiles (32 outputs) and their four accumulators.
#define A_HI 0
#define A_LO 1
#define B_0 2
#define B_1 3
#define C_HI_0 4
#define C_LO_0 5
#define C_HI_1 6
#define C_LO_1 7

void load_tile_config() {
  TileConfig config;
  for (int t = 0; t <= C_LO_1; ++t) {
    config.rows[t] = TILE_ROWS;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// The same tile rows, 32 bytes at a time with 128-bit unpacks: the gather before
// vpermt2w, kept for the previous arrangement (``streaming`` off) that the engine
// bench measures next to the default.
void gather_b_quads_unpacked(const int8_t* lanes, int64_t k, int64_t b, int8_t* tiles, int64_t q0, int64_t q1, bool prefetch) {
  const int64_t block_bytes = k * 8;
  for (int half = 0; half < 2; ++half) {
    const int8_t* block = lanes + (2 * b + half) * block_bytes;
    for (int64_t quad = q0; quad < q1; ++quad) {
      if (prefetch && quad % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(block + 2 * quad * 16) + STREAM_AHEAD, _MM_HINT_T0);
      const __m128i p0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (2 * quad) * 16));
      const __m128i p1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (2 * quad + 1) * 16));
      int8_t* row = tiles + quad * 64 + half * 32;  // tile quad / 16, row quad % 16
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row), _mm_unpacklo_epi16(p0, p1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16), _mm_unpackhi_epi16(p0, p1));
    }
  }
}

// The B tiles of outputs [16 b, 16 b + 16), one per 64 inputs, 1 KB each: row i of
// tile t holds, for each of the 16 outputs, its weights for inputs 64 t + 4 i ..
// + 3. The lanes layout gives a pair (2 inputs) of 8 outputs per 16 bytes;
// interleaving the 16-bit units of two consecutive pairs yields 4 inputs for 4
// outputs per 16 bytes. Inputs [4 q0, 4 q1) only (``quad`` = 4 inputs).
//
// This is where a call with few row tiles (a 16-row decode step) reads every
// weight from memory: with ``prefetch`` it asks for each cache line STREAM_AHEAD
// bytes ahead, past the 4 KB pages where the hardware prefetcher stops.
void gather_b_quads(const int8_t* lanes, int64_t k, int64_t b, int8_t* tiles, int64_t q0, int64_t q1, bool prefetch) {
  if (!streaming) return gather_b_quads_unpacked(lanes, k, b, tiles, q0, q1, prefetch);
  // Two quads of both halves per iteration: 64 bytes (4 pairs) of each half's
  // lanes block in, two whole tile rows out, the 16-bit units of both put in
  // place by one vpermt2w each (q0 and q1 are even: a tile step is 16 quads).
  const int64_t block_bytes = k * 8;  // one lanes block: K/2 pairs x 8 outputs x 2
  const int8_t* half0 = lanes + (2 * b) * block_bytes;
  const int8_t* half1 = half0 + block_bytes;
  // Row q: output o < 8 takes units (pair 2q, unit o), (pair 2q + 1, unit o) of half 0;
  // o >= 8 the same of half 1 (units 32.. of the two-source index). Row q + 1: pairs 2q + 2, 2q + 3.
  alignas(64) static const uint16_t first[32] = {0,  8,  1,  9,  2,  10, 3,  11, 4,  12, 5,  13, 6,  14, 7,  15,
                                                 32, 40, 33, 41, 34, 42, 35, 43, 36, 44, 37, 45, 38, 46, 39, 47};
  alignas(64) static const uint16_t second[32] = {16, 24, 17, 25, 18, 26, 19, 27, 20, 28, 21, 29, 22, 30, 23, 31,
                                                  48, 56, 49, 57, 50, 58, 51, 59, 52, 60, 53, 61, 54, 62, 55, 63};
  const __m512i row_a = _mm512_load_si512(first), row_b = _mm512_load_si512(second);
  for (int64_t quad = q0; quad < q1; quad += 2) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(half0 + quad * 32) + STREAM_AHEAD, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(half1 + quad * 32) + STREAM_AHEAD, _MM_HINT_T0);
    }
    const __m512i a = _mm512_loadu_si512(half0 + quad * 32);
    const __m512i c = _mm512_loadu_si512(half1 + quad * 32);
    _mm512_storeu_si512(tiles + quad * 64, _mm512_permutex2var_epi16(a, row_a, c));
    _mm512_storeu_si512(tiles + quad * 64 + 64, _mm512_permutex2var_epi16(a, row_b, c));
  }
}

// acc (16 rows x 16 outputs, row stride `stride`) = fma(float(256 * c_hi + c_lo), scale of the row, acc):
// the definition's epilogue for one group, lane for lane.
inline void fold_group(const int32_t* c_hi, const int32_t* c_lo, const float* scales, int64_t groups, int64_t rows, float* acc, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c_hi + r * OUTS), 8), _mm512_load_si512(c_lo + r * OUTS));
    float* a = acc + r * stride;
    _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scales[r * groups]), _mm512_loadu_ps(a)));
  }
}

// Rows [r0, r0 + rows) against NB (1 or 2) blocks of 16 outputs starting at block b.
template <int NB, typename Step>
void row_tile(const int8_t* hi, const uint8_t* lo, const float* scales, int64_t r0, int64_t rows, int64_t k, int64_t group,
              const int8_t* b_tiles, int64_t b_stride, float* acc, int32_t* c_buf, const Step& step) {
  const int64_t groups = (k + group - 1) / group;
  constexpr int64_t stride = NB * OUTS;
  std::fill(acc, acc + TILE_ROWS * stride, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(C_HI_0);
    _tile_zero(C_LO_0);
    if constexpr (NB == 2) {
      _tile_zero(C_HI_1);
      _tile_zero(C_LO_1);
    }
    for (int64_t k0 = g * group; k0 < std::min(k, (g + 1) * group); k0 += GROUP) {
      _tile_loadd(A_HI, hi + r0 * k + k0, k);
      _tile_loadd(A_LO, lo + r0 * k + k0, k);
      _tile_loadd(B_0, b_tiles + k0 * OUTS, 64);
      _tile_dpbssd(C_HI_0, A_HI, B_0);
      _tile_dpbusd(C_LO_0, A_LO, B_0);
      if constexpr (NB == 2) {
        _tile_loadd(B_1, b_tiles + b_stride + k0 * OUTS, 64);
        _tile_dpbssd(C_HI_1, A_HI, B_1);
        _tile_dpbusd(C_LO_1, A_LO, B_1);
      }
      step(k0);
    }
    int32_t* c_hi = c_buf;
    int32_t* c_lo = c_buf + TILE_ROWS * OUTS;
    _tile_stored(C_HI_0, c_hi, OUTS * 4);
    _tile_stored(C_LO_0, c_lo, OUTS * 4);
    fold_group(c_hi, c_lo, scales + r0 * groups + g, groups, rows, acc, stride);
    if constexpr (NB == 2) {
      _tile_stored(C_HI_1, c_hi, OUTS * 4);
      _tile_stored(C_LO_1, c_lo, OUTS * 4);
      fold_group(c_hi, c_lo, scales + r0 * groups + g, groups, rows, acc + OUTS, stride);
    }
  }
}

}  // namespace

bool set_streaming(bool on) {
  const bool was = streaming;
  streaming = on;
  return was;
}

bool available() {
  static const bool ok = request_tile_permission();
  return ok;
}

bool takes(int64_t k, int64_t group, int64_t n, bool swiglu) {
  return k % GROUP == 0 && group % GROUP == 0 && n % (swiglu ? 2 * OUTS : OUTS) == 0 && available();
}

void linear_w8a16(const int8_t* hi, const uint8_t* lo, const float* scales, int64_t m, int64_t k, int64_t group, const int8_t* lanes,
                  const float* wscale, int64_t n, float* y, bool prefetch, bool swiglu) {
  // A pair is the two 16-output blocks one row tile meets together: blocks 2p and
  // 2p + 1 (the second absent at an odd count); with swiglu, gate block p and up
  // block p, so that both halves of an output are in the pair's epilogue.
  const int64_t blocks = n / OUTS, pairs = swiglu ? blocks / 2 : (blocks + 1) / 2;
  const int64_t y_stride = swiglu ? n / 2 : n;
  auto first_block = [&](int64_t p) { return swiglu ? p : 2 * p; };
  auto second_block = [&](int64_t p) { return swiglu ? p + pairs : 2 * p + 1; };
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    load_tile_config();
    const int64_t pair_bytes = 2 * k * OUTS;
    alignas(64) float acc[TILE_ROWS * 2 * OUTS];
    alignas(64) int32_t c_buf[2 * TILE_ROWS * OUTS];
    auto pair_product = [&](int64_t p, int64_t r0, const int8_t* tiles, const auto& step) {
      const int64_t rows = std::min(TILE_ROWS, m - r0);
      const int64_t b0 = first_block(p), b1 = second_block(p);
      const bool two = b1 < blocks;
      if (two) {
        row_tile<2>(hi, lo, scales, r0, rows, k, group, tiles, k * OUTS, acc, c_buf, step);
      } else {
        row_tile<1>(hi, lo, scales, r0, rows, k, group, tiles, k * OUTS, acc, c_buf, step);
      }
      const int64_t width = two ? 2 * OUTS : OUTS;
      const __m512 ws0 = _mm512_loadu_ps(wscale + b0 * OUTS);
      const __m512 ws1 = two ? _mm512_loadu_ps(wscale + b1 * OUTS) : ws0;
      for (int64_t r = 0; r < rows; ++r) {
        // The definition's output acc * w_scale, then (swiglu) silu_mul's arithmetic on it.
        const __m512 out0 = _mm512_mul_ps(_mm512_loadu_ps(acc + r * width), ws0);
        float* y_row = y + (r0 + r) * y_stride;
        if (swiglu) {
          _mm512_storeu_ps(y_row + p * OUTS, ember_simd::silu_mul_ps(out0, _mm512_mul_ps(_mm512_loadu_ps(acc + r * width + OUTS), ws1)));
          continue;
        }
        _mm512_storeu_ps(y_row + b0 * OUTS, out0);
        if (two) _mm512_storeu_ps(y_row + b1 * OUTS, _mm512_mul_ps(_mm512_loadu_ps(acc + r * width + OUTS), ws1));
      }
    };
    auto nothing = [](int64_t) {};
    // Pair p's B tiles for inputs [4 q0, 4 q1), into dst.
    auto gather_pair = [&](int64_t p, int8_t* dst, int64_t q0, int64_t q1) {
      gather_b_quads(lanes, k, first_block(p), dst, q0, q1, prefetch);
      if (second_block(p) < blocks) gather_b_quads(lanes, k, second_block(p), dst + k * OUTS, q0, q1, prefetch);
    };
    if (m <= TILE_ROWS && streaming) {
      // One row tile (a decode step): each pair's tiles meet one row tile and are
      // done, so nothing is worth keeping in L2. The pair's tiles are gathered
      // into one of two 1-pair buffers (in L1/L2) while the tile products of the
      // pair before run, a 64-input slice per tile step: the weights' stream from
      // memory, the call's bottleneck, no longer stops for the tile products.
      // (Gathering every pair first, then multiplying, measured 0.90x at 16 rows.)
      std::unique_ptr<int8_t[]> buf(new int8_t[2 * pair_bytes]);
      gather_pair(p0, buf.get(), 0, k / 4);
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* tiles = buf.get() + ((p - p0) % 2) * pair_bytes;
        int8_t* next = buf.get() + ((p - p0 + 1) % 2) * pair_bytes;
        if (p + 1 < p1) {
          pair_product(p, 0, tiles, [&](int64_t k0) { gather_pair(p + 1, next, k0 / 4, (k0 + GROUP) / 4); });
        } else {
          pair_product(p, 0, tiles, nothing);
        }
      }
      _tile_release();
      return;
    }
    // This thread's weights, as B tiles, once (at most half the model's largest
    // linear: it stays in L2); then each row tile's activations (in L1) meet
    // every pair in turn. The other order streamed all of A from L2 or beyond per pair.
    std::unique_ptr<int8_t[]> b_tiles(new int8_t[(p1 - p0) * pair_bytes]);
    for (int64_t p = p0; p < p1; ++p) gather_pair(p, b_tiles.get() + (p - p0) * pair_bytes, 0, k / 4);
    for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
      for (int64_t p = p0; p < p1; ++p) pair_product(p, r0, b_tiles.get() + (p - p0) * pair_bytes, nothing);
    }
    _tile_release();
  });
}

#else

bool set_streaming(bool) { return false; }
bool available() { return false; }

bool takes(int64_t, int64_t, int64_t, bool) { return false; }
void linear_w8a16(const int8_t*, const uint8_t*, const float*, int64_t, int64_t, int64_t, const int8_t*, const float*, int64_t, float*, bool,
                  bool) {}

#endif

}  // namespace ember_amx
