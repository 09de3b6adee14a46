// moe_route CPU backend: how a call runs. Deterministic: the same inputs give
// the same bits for any thread count, and the same bits as the CUDA backend,
// because every row reduction runs in the canonical 32-lane order and every
// score comes from the shared bit-reproducible math in detail/numerics.hpp.
#pragma once

namespace moe_route::cpu {

// threads == 1 is the sequential reference path; more threads split the
// tokens into contiguous blocks and give identical results. threads <= 0 uses
// std::thread::hardware_concurrency().
struct execution {
  int threads = 1;
};

}  // namespace moe_route::cpu
