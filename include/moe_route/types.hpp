// moe_route: value types, argument structs and the error type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>

namespace moe_route {

// Thrown by host-side validation; the message names the offending argument.
// Device code never throws.
class error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
// Throws moe_route::error; every argument check reports through it.
[[noreturn]] inline void fail(const std::string& what) { throw error("moe_route: " + what); }
}  // namespace detail

// 16-bit storage types for host code. Their layout equals CUDA's __nv_bfloat16
// and __half, so device buffers of either type can be passed as these.
struct bfloat16 {
  std::uint16_t bits;
  // Round to nearest even; NaN stays NaN.
  static bfloat16 from_float(float f) {
    std::uint32_t u = detail::float_to_bits(f);
    if (detail::is_nan(f)) return {static_cast<std::uint16_t>((u >> 16) | 0x40u)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return {static_cast<std::uint16_t>(u >> 16)};
  }
};

struct float16 {
  std::uint16_t bits;
  // Round to nearest even, overflow to infinity, NaN stays NaN.
  static float16 from_float(float f) {
    const std::uint32_t u = detail::float_to_bits(f);
    const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return {static_cast<std::uint16_t>(sign | 0x7e00u)};
    if (a >= 0x477ff000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds past 65504
    if (a < 0x38800000u) {  // below the smallest normal half: subnormal or zero
      const float scaled = detail::bits_to_float(a) * 16777216.0f;  // in units of 2^-24, exact
      const float r = std::nearbyint(scaled);                       // ties to even
      return {static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(r))};
    }
    std::uint32_t m = a + 0xfffu + ((a >> 13) & 1u);
    return {static_cast<std::uint16_t>(sign | ((m - 0x38000000u) >> 13))};
  }
};

namespace detail {

MOE_ROUTE_HD float to_float(float x) { return x; }

// Whether token t is padding under a token mask (null: no token is).
MOE_ROUTE_HD bool token_masked(const std::uint8_t* token_mask, std::int64_t t) {
  return token_mask != nullptr && token_mask[t] == 0;
}
MOE_ROUTE_HD float to_float(bfloat16 x) { return bits_to_float(static_cast<std::uint32_t>(x.bits) << 16); }
MOE_ROUTE_HD float to_float(float16 x) {
  const std::uint32_t sign = static_cast<std::uint32_t>(x.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

template <class T>
inline constexpr bool is_logit_type = false;
template <>
inline constexpr bool is_logit_type<float> = true;
template <>
inline constexpr bool is_logit_type<bfloat16> = true;
template <>
inline constexpr bool is_logit_type<float16> = true;

}  // namespace detail

// Whether the call is a training step. Later policies (the prior bias) act in
// training only; evaluation and probing see the plain router.
enum class mode { train, eval };

// Inputs of one routing call. All pointers are caller-owned and live in the
// memory space of the backend that is called (host for cpu::, device for cuda::).
template <class T>
struct route_inputs {
  static_assert(detail::is_logit_type<T>, "logits must be float, moe_route::bfloat16 or moe_route::float16");
  const T* logits = nullptr;            // [num_tokens x num_experts], row-major, dense
  std::int64_t num_tokens = 0;          // N >= 0
  int num_experts = 0;                  // E in [1, max_experts]
  const float* expert_bias = nullptr;   // [E], selection::expert_bias only
  // Valid-token mask (docs/policies.md, "Token mask"): 0 marks a padding token,
  // routed nowhere (indices -1, gates 0), in no penalty, count or gradient, its
  // row never read; null: every token is valid.
  const std::uint8_t* token_mask = nullptr;  // [N]
  // Routing replay (docs/policies.md §2.9): the experts of each token, given by
  // the caller, instead of the selection's; K distinct experts per valid token.
  const std::int32_t* replay_indices = nullptr;  // [N x K]

  // Training policies (router<..., Policies...>). mode::eval turns every prior
  // policy and penalty off, so the same inputs can be probed bias-free.
  moe_route::mode mode = moe_route::mode::train;
  // The prepared prior table (prior::prepare) and each token's row in it.
  const float* prior_bias = nullptr;             // [prior_rows x E] centred log prior b
  const float* prior_probs = nullptr;            // [prior_rows x E] clamped prior pi (kl_to_base)
  std::int64_t prior_rows = 0;                   // S
  const std::int32_t* token_prior_row = nullptr; // [N] r(t) in [0, S), or -1: no prior
  // load_balance: scope::sequence needs each token's sequence; scope::global_batch
  // needs the caller's f (penalty::load_fractions).
  const std::int32_t* sequence_ids = nullptr;    // [N] in [0, num_sequences)
  std::int32_t num_sequences = 0;
  const float* load_fractions = nullptr;         // [E] f_e, summing to 1
  // locality: the expert-parallel rank that hosts each expert, and this call's rank.
  const std::int32_t* expert_rank = nullptr;     // [E]
  std::int32_t rank = 0;
};

// Outputs of the forward pass, written for every token.
struct route_outputs {
  std::int32_t* indices = nullptr;      // [N x K] selected experts, in descending key order
  float* gates = nullptr;               // [N x K] gate weights (fp32)
  // Optional: number of rows that contained NaN or +-inf logits. On the CUDA
  // backend a device counter that the call adds to (zero it first).
  std::int64_t* nonfinite_rows = nullptr;

  // Routers with penalties: their values, in the order of the router's policy
  // list (penalty_slot<P, Router>), and the training workspace the forward
  // fills and the backward reads (training_workspace_bytes; same memory space
  // as the other pointers). Both are required when the router has penalties.
  double* penalty_values = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// What the CPU backend returns about a call.
struct route_report {
  std::int64_t nonfinite_rows = 0;
};

// Inputs of the fused backward: the forward's inputs and selected indices,
// the upstream gradient of the gates, and where dL/dz goes.
struct backward_args {
  const std::int32_t* indices = nullptr;  // [N x K], as written by the forward
  const float* grad_gates = nullptr;      // [N x K] dL/dgates
  float* grad_logits = nullptr;           // [N x E] dL/dz, overwritten

  // Admitted gates (cpu::admit / cuda::admit): `indices` are then the routed
  // indices and these the admitted ones (-1 = dropped, another expert =
  // rerouted); the gradient follows admission/gates.hpp. renormalize is the
  // admission policy's (drop with renormalisation).
  const std::int32_t* admitted_indices = nullptr;  // [N x K] or null: gates as routed
  bool renormalize = false;

  // Routers with penalties: the workspace the forward filled, and the upstream
  // gradient of each penalty value (router's penalty order; null means 1 for
  // every penalty), in the backend's memory like the other arrays: device
  // memory for cuda::backward, so that a backward never waits for the host.
  // The backward also writes its shared dL/dp into the workspace.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  const float* penalty_grads = nullptr;
};

}  // namespace moe_route
