// moe_route CPU backend: how a call runs. Deterministic: the same inputs give
// the same bits for any thread count and instruction set, and the same bits as
// the CUDA backend, because every row reduction runs in the canonical 32-lane
// order and every score comes from the shared bit-reproducible math in
// detail/numerics.hpp.
#pragma once

#include <cstdint>

namespace moe_route::cpu {

// The instruction set a call's per-token loops run with. A header-only library
// is compiled with its consumer's flags, and a wheel or a distribution's
// package must run on any x86-64, so in a build for baseline x86-64 (no AVX2)
// with GCC or Clang the loops are compiled a second time for x86-64-v3 (AVX2 +
// FMA) and chosen at run time. Every path gives the same bits.
enum class instruction_set {
  best,       // x86_64_v3 where the CPU has it, else baseline; the environment
              // variable MOE_ROUTE_CPU_ISA=baseline|x86-64-v3 overrides it
  baseline,   // the loops as the consumer's compiler flags build them
  x86_64_v3,  // AVX2 + FMA: the run-time path, or the baseline one of a build
              // whose flags already target x86-64-v3 (an error on a CPU without them)
};

// threads == 1 is the sequential reference path; more threads split the
// tokens into contiguous blocks and give identical results. threads <= 0 uses
// std::thread::hardware_concurrency(). A call takes fewer threads than asked
// where a thread would cost more than it saves: each thread gets at least
// min_tokens_per_thread tokens, or, when that is 0, as many as the pass's own
// estimate (for routing and its backward, 2^16 / (64 + E) tokens; measured in
// docs/performance.md, "Threads").
struct execution {
  int threads = 1;
  instruction_set isa = instruction_set::best;
  std::int64_t min_tokens_per_thread = 0;
};

}  // namespace moe_route::cpu
