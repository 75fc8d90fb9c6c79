// The instruction-mix ceilings of this core for the linear layers' inner loops
// (``python -m benchmarks linears`` builds and runs it; x86-64 with AVX2 only).
//
// Each probe times a block of independent register-only instructions in a loop
// (no memory traffic, no dependency chains longer than the block), so the
// result is the issue rate of that mix on this core. The clock is measured the
// same way, from a chain of dependent scalar adds (one cycle each).
//
// Prints one line per probe: "<name> <cycles per block> <multiply-adds per block>",
// after "clock_ghz <value>".

#include <chrono>
#include <cstdio>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

#define TWELVE(op) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11) op(12) op(13) op(14) op(15)
#define CLOBBERS "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

// int16 activation pairs x int16 weight pairs -> int32 lanes, then accumulated:
// the W8A16 kernel's multiply-accumulate (16 multiply-adds per vpmaddwd).
#define MADD_ADD(i) "vpmaddwd %%ymm0, %%ymm1, %%ymm2\n vpaddd %%ymm2, %%ymm" #i ", %%ymm" #i "\n"
// The same, plus the weights' int8 -> int16 sign extension, one per three rows
// (the kernel's two 8-output blocks x three rows per weight load).
#define EXTEND(i) "vpmovsxbw %%xmm0, %%ymm3\n"
// uint8 x int8 quads -> int16 pairs -> int32 lanes (vpmaddubsw, then vpmaddwd by
// ones), accumulated: the int8-activation path without VNNI (32 multiply-adds).
#define UBS_ADD(i) "vpmaddubsw %%ymm0, %%ymm1, %%ymm2\n vpmaddwd %%ymm3, %%ymm2, %%ymm2\n vpaddd %%ymm2, %%ymm" #i ", %%ymm" #i "\n"
// float32 fused multiply-add (attention): 8 per instruction. Its block first
// zeroes its inputs (zero idioms, which take no execution port): printf passes
// doubles in xmm0, and a denormal float there costs every fma a microcode
// assist on Intel cores (the probe read 0.0 multiply-adds a cycle on a Xeon).
#define FMA(i) "vfmadd231ps %%ymm0, %%ymm1, %%ymm" #i "\n"
#define FMA_INPUTS "vxorps %%ymm0, %%ymm0, %%ymm0\n vxorps %%ymm1, %%ymm1, %%ymm1\n"

template <typename Body>
double cycles_per_block(double hz, long blocks, Body body) {
  const auto start = Clock::now();
  for (long i = 0; i < blocks; ++i) body();
  return seconds_since(start) * hz / blocks;
}

}  // namespace

int main() {
  const long adds = 200000000;
  long x = 0;
  const auto start = Clock::now();
  // A register operand, not an immediate: newer Intel cores (seen on a 2-core
  // Xeon with AMX) fold chains of immediate adds at rename, several a cycle,
  // which read as an 11 GHz clock here.
  const long one = 1;
  for (long i = 0; i < adds; ++i) asm volatile("add %1, %0\n add %1, %0\n add %1, %0\n add %1, %0" : "+r"(x) : "r"(one));
  const double hz = 4.0 * adds / seconds_since(start);
  std::printf("clock_ghz %.3f\n", hz / 1e9);
  asm volatile("vpxor %%ymm0, %%ymm0, %%ymm0\n vpxor %%ymm1, %%ymm1, %%ymm1\n vpcmpeqw %%ymm3, %%ymm3, %%ymm3" ::: "xmm0", "xmm1", "xmm3");
  const long blocks = 50000000;
  std::printf("int16_madd %.3f %d\n", cycles_per_block(hz, blocks, [] { asm volatile(TWELVE(MADD_ADD) ::: CLOBBERS); }), 12 * 16);
  std::printf("int16_madd_with_extend %.3f %d\n",
              cycles_per_block(hz, blocks, [] { asm volatile(TWELVE(MADD_ADD) EXTEND(0) EXTEND(1) EXTEND(2) EXTEND(3) ::: CLOBBERS); }),
              12 * 16);
  std::printf("int8_maddubs %.3f %d\n", cycles_per_block(hz, blocks, [] { asm volatile(TWELVE(UBS_ADD) ::: CLOBBERS); }), 12 * 32);
  // The accumulators start at zero too (whatever they held may be a denormal), and stay zero.
#define ZERO(i) "vxorps %%ymm" #i ", %%ymm" #i ", %%ymm" #i "\n"
  asm volatile(TWELVE(ZERO) ::: CLOBBERS);
  std::printf("float32_fma %.3f %d\n", cycles_per_block(hz, blocks, [] { asm volatile(FMA_INPUTS TWELVE(FMA) ::: "xmm0", "xmm1", CLOBBERS); }), 12 * 8);
  return x == 0;
}
