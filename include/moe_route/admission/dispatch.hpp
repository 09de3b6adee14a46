// moe_route: dispatch metadata of a routing result (docs/policies.md section 4).
//
// Input: indices [N x S] (S slots per token: K after route/admit, E after
// expert_choice), -1 = not executed. Slot id of (t, j) is t * S + j.
// Output (cpu::dispatch, cuda::dispatch; identical on both):
//
//   counts[e]        admitted assignments of expert e                       [E]
//   offsets[e]       exclusive scan of the rows of each expert: rows(e) =
//                    ceil(counts[e] / align) * align, or with a fixed
//                    capacity C > 0 ceil(C / align) * align for every expert
//                    (an E x C layout of static shape); offsets[E] = rows   [E + 1]
//   permutation[r]   the slot id held by row r of the expert-major buffer:
//                    expert e owns rows [offsets[e], offsets[e+1]); its
//                    first counts[e] rows hold its slots sorted by (token,
//                    slot), the rest (padding) and every row >= offsets[E]
//                    hold -1                                   [dispatch_rows_bound]
//   inverse[s]       the row of slot s, or -1 if the slot is not executed
//                    (the combine step gathers row inverse[s])            [N x S]
//   rank_counts[r]   assignments sent to rank r (unpadded counts summed over
//                    the experts the rank hosts), optional                  [R]
//
// With a fixed capacity no expert may hold more than C slots: cpu::dispatch
// rejects such indices; cuda::dispatch, which cannot check device data
// before it runs, keeps an expert's first C slots in (token, slot) order and
// leaves the rest not executed (inverse -1, not in counts).
//
// All offsets and ids are 64-bit. The order is the result of a counting sort
// (CPU) or a stable radix sort (CUDA) of the slots by expert: never of atomic
// slot counters.
#pragma once

#include <cstdint>

#include <moe_route/config.hpp>

namespace moe_route {

struct dispatch_inputs {
  const std::int32_t* indices = nullptr;    // [N x S], -1 = not executed
  std::int64_t num_tokens = 0;              // N >= 0
  int slots_per_token = 0;                  // S >= 1 (K, or E for expert_choice)
  int num_experts = 0;                      // E in [1, max_experts]
  int align = 1;                            // pad every count to a multiple of align (>= 1)
  int num_ranks = 1;                        // R >= 1 expert-parallel ranks
  const std::int32_t* expert_rank = nullptr;  // [E] rank of each expert in [0, R); null: expert e on rank e / (E / R)
  std::int64_t capacity = 0;                // > 0: every expert owns expert_rows(capacity) rows, a fixed
                                            // layout (Megatron's moe_pad_expert_input_to_capacity); 0: off
};

struct dispatch_outputs {
  std::int64_t* counts = nullptr;       // [E]
  std::int64_t* offsets = nullptr;      // [E + 1]
  std::int64_t* permutation = nullptr;  // [dispatch_rows_bound(...)], optional
  std::int64_t* inverse = nullptr;      // [N x S], optional
  std::int64_t* rank_counts = nullptr;  // [R], optional
};

// The rows expert e owns: its count, or the fixed capacity when there is one,
// rounded up to a multiple of align.
MOE_ROUTE_HD constexpr std::int64_t expert_rows(std::int64_t count, int align, std::int64_t capacity) {
  const std::int64_t rows = capacity > 0 ? capacity : count;
  return (rows + align - 1) / align * align;
}

// The largest number of rows any result can need: N * S + E * (align - 1),
// or exactly E * expert_rows(capacity) with a fixed capacity. permutation
// must hold this many entries.
constexpr std::int64_t dispatch_rows_bound(std::int64_t num_tokens, int slots_per_token, int num_experts, int align,
                                           std::int64_t capacity = 0) {
  return capacity > 0 ? num_experts * expert_rows(0, align, capacity)
                      : num_tokens * slots_per_token + static_cast<std::int64_t>(num_experts) * (align - 1);
}

// The rank hosting expert e with the default contiguous map (E divisible by R).
MOE_ROUTE_HD int contiguous_rank(int expert, int num_experts, int num_ranks) {
  return expert / (num_experts / num_ranks);
}

}  // namespace moe_route
