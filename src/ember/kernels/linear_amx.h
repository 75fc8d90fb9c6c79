// W8A16 on Intel AMX tiles (linear_amx.cpp): what linear_lanes.cpp and
// cpu_kernels.cpp call. The definition of the arithmetic is linear_lanes.cpp's.
#pragma once

#include <cstdint>

namespace ember_amx {

// Activation rows per tile: a call's split codes are padded to a multiple of it.
constexpr int64_t TILE_ROWS = 16;

// Whether this process may use the tiles (Linux hands them out on request).
bool available();

// Lowers the weight streaming of one-row-tile calls (tests and benchmarks only);
// returns the previous setting.
bool set_streaming(bool on);

// Whether linear_w8a16 runs this shape on this CPU: whole 64-input tile steps,
// whole quantization groups, whole 16-output blocks (pairs with swiglu).
bool takes(int64_t k, int64_t group, int64_t n, bool swiglu);

// y (m, n) = the definition's W8A16 for activation codes given split into bytes
// c = 256 * hi + lo (hi, lo: row-major (M, k), M = m rounded up to whole row
// tiles, padding rows zero) and their scales (m, k / group), against the int8
// lanes weights (n/8, k/2, 8, 2) and their scales (n,). With swiglu the n
// outputs are [gate | up] and y (m, n / 2) gets silu(gate) * up. Only for a
// shape takes() accepts.
void linear_w8a16(const int8_t* hi, const uint8_t* lo, const float* scales, int64_t m, int64_t k, int64_t group, const int8_t* lanes,
                  const float* wscale, int64_t n, float* y, bool prefetch, bool swiglu);

}  // namespace ember_amx
