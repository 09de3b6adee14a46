// moe_route on LibTorch tensors: the calls of runtime/ (routers configured at
// run time) with tensor arguments, for any LibTorch host (the PyTorch
// operators of python/, the moe_lm driver, a C++ engine).
//
// Every call checks its tensors before it writes anything (dtype, device,
// shape; errors name the argument: c10::TypeError for a dtype, c10::ValueError
// otherwise, the library's own moe_route::error included) and allocates its
// outputs and scratch with torch's allocator on the device of its first tensor.
// CPU tensors take the CPU backend with `threads` threads. CUDA tensors take
// runtime::cuda on torch's current stream of their device when this header is
// compiled with MOE_ROUTE_TORCH_WITH_CUDA and linked with
// moe_route::cuda_runtime; nothing in the routing, backward or dispatch calls
// waits for the device: input values the CPU rejects are handled on the
// device as docs/gpu.md says (admission and expert choice count them in their
// reports' "invalid" counter).
//
// Configurations come as runtime::router_config / admission_config, or in
// text form (detail/config_text.hpp: router_config_of, admission_config_of).
// The runtime routers are compiled once in moe_route::runtime: include
// runtime/instantiate.hpp in the translation unit and link that library (or
// instantiate them yourself, runtime/instantiate.hpp says how).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <moe_route/adapters/detail/config_text.hpp>
#include <moe_route/adapters/detail/torch_tensors.hpp>
#include <moe_route/backend/cpu/dispatch.hpp>
#include <moe_route/backend/cpu/expert_choice.hpp>
#include <moe_route/penalty/router_l2.hpp>
#include <moe_route/prior/build.hpp>
#include <moe_route/prior/prepare.hpp>
#include <moe_route/runtime/cpu.hpp>
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
#include <moe_route/runtime/cuda.hpp>
#endif

namespace moe_route::adapters {

// The tensors of a routing call besides the configuration (route_inputs).
struct route_tensors {
  at::Tensor logits;                                         // [N, E] float32
  std::optional<at::Tensor> expert_bias;                     // [E] float32 (expert_bias selections)
  std::optional<at::Tensor> prior_bias, prior_probs;         // [S, E] float32 (prior/prepare)
  std::optional<at::Tensor> token_prior_row, sequence_ids;   // [N] int32 (or int64)
  std::optional<at::Tensor> load_fractions;                  // [E] float32 (global-batch load balance)
  std::optional<at::Tensor> expert_rank;                     // [E] int32 (locality, rank counts)
  std::optional<at::Tensor> token_mask;                      // [N] bool: false = padding (routed nowhere)
  std::optional<at::Tensor> replay_indices;                  // [N, K] int32: route() to these experts
  std::int32_t num_sequences = 0;
  std::int32_t rank = 0;
  bool training = true;
};

// The tensors of admission (admission_inputs) besides the routing result.
struct admission_tensors {
  std::optional<at::Tensor> hidden_norms;  // [N] float32 (cosine affinity)
  std::optional<at::Tensor> weight_norms;  // [E] float32 (cosine affinity)
  std::optional<at::Tensor> group_ids;     // [N] int32: admission groups
  std::optional<at::Tensor> capacity;      // [E] int64: per-expert capacity instead of the factor
  int num_groups = 1;
};

struct route_result {
  at::Tensor indices, gates;                // [N, K] int32, float32: after admission
  // Under capacity admission [N, K]: the routing before admission and each slot's outcome (0 kept,
  // 1 dropped, 2 rerouted); under dropless admission [0, K] (indices and gates are the routed ones).
  at::Tensor routed_indices, routed_gates;  // int32, float32
  at::Tensor status;                        // int8
  at::Tensor penalty_values;                // [num_penalties] float64, runtime::penalty_names order
  at::Tensor workspace;                     // uint8 [workspace_bytes]: read by backward()
  at::Tensor nonfinite_rows;                // int64 []: rows with a non-finite logit
  at::Tensor admission_report;              // int64 [8]: the admission_report counters in order
};

namespace detail {

// The checked tensors of a routing call, kept alive beside route_inputs.
struct checked_route {
  placement where;
  at::Tensor logits;
  std::optional<at::Tensor> expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids, load_fractions,
      expert_rank, token_mask;
  route_inputs<float> in;

  explicit checked_route(const route_tensors& t) : where(placement_of(t.logits, "logits")), logits(logits_of(t.logits, where)) {
    const std::int64_t n = logits.size(0), e = logits.size(1);
    expert_bias = checked(t.expert_bias, "expert_bias", at::kFloat, {e}, where);
    prior_bias = checked(t.prior_bias, "prior_bias", at::kFloat, {-1, e}, where);
    prior_probs = checked(t.prior_probs, "prior_probs", at::kFloat, {-1, e}, where);
    if (prior_bias && prior_probs && prior_bias->size(0) != prior_probs->size(0))
      value_error("prior_bias and prior_probs must have the same number of rows, got " + shape_of(*prior_bias) +
                  " and " + shape_of(*prior_probs));
    token_prior_row = checked(t.token_prior_row, "token_prior_row", at::kInt, {n}, where);
    sequence_ids = checked(t.sequence_ids, "sequence_ids", at::kInt, {n}, where);
    if (sequence_ids && t.num_sequences < 1) value_error("num_sequences must be >= 1 when sequence_ids is given");
    load_fractions = checked(t.load_fractions, "load_fractions", at::kFloat, {e}, where);
    expert_rank = checked(t.expert_rank, "expert_rank", at::kInt, {e}, where);
    token_mask = token_mask_of(t.token_mask, n, where);
    in.logits = logits.data_ptr<float>();
    in.num_tokens = n;
    in.num_experts = static_cast<int>(e);
    in.expert_bias = data_of<float>(expert_bias);
    in.token_mask = mask_data(token_mask);
    in.mode = t.training ? mode::train : mode::eval;
    in.prior_bias = data_of<float>(prior_bias);
    in.prior_probs = data_of<float>(prior_probs);
    in.prior_rows = prior_bias ? prior_bias->size(0) : (prior_probs ? prior_probs->size(0) : 0);
    in.token_prior_row = data_of<std::int32_t>(token_prior_row);
    in.sequence_ids = data_of<std::int32_t>(sequence_ids);
    in.num_sequences = t.num_sequences;
    in.load_fractions = data_of<float>(load_fractions);
    in.expert_rank = data_of<std::int32_t>(expert_rank);
    in.rank = t.rank;
  }
};

// The checked admission tensors for `n` tokens of `e` experts.
struct checked_admission {
  std::optional<at::Tensor> hidden_norms, weight_norms, group_ids, capacity;

  checked_admission(const admission_tensors& t, std::int64_t n, std::int64_t e, const placement& where)
      : hidden_norms(checked(t.hidden_norms, "hidden_norms", at::kFloat, {n}, where)),
        weight_norms(checked(t.weight_norms, "weight_norms", at::kFloat, {e}, where)),
        group_ids(checked(t.group_ids, "group_ids", at::kInt, {n}, where)),
        capacity(checked(t.capacity, "capacity", at::kLong, {e}, where)) {
    if (t.num_groups < 1) value_error("num_groups must be >= 1, got " + std::to_string(t.num_groups));
  }
};

// Admits routed [N, K] into (indices, gates, status, report). The CPU
// rejects a routed index outside [0, E), a group id outside [0, num_groups)
// and (cosine) a norm that is not finite and > 0 before admitting; the device,
// which would have to wait to raise, drops those slots and counts them in
// report[7] ("invalid").
inline void admit_into(const runtime::router_config& c, const runtime::admission_config& a, const placement& where,
                       const at::Tensor& logits, const at::Tensor& routed, const at::Tensor& routed_gates,
                       const std::uint8_t* token_mask, const admission_tensors& t, int threads, at::Tensor& indices,
                       at::Tensor& gates, at::Tensor& status, at::Tensor& report) {
  const std::int64_t n = logits.size(0), e = logits.size(1);
  const checked_admission checked_in(t, n, e, where);
  admission_inputs<float> in;
  in.logits = logits.data_ptr<float>();
  in.num_tokens = n;
  in.num_experts = static_cast<int>(e);
  in.routed_indices = routed.data_ptr<std::int32_t>();
  in.routed_gates = routed_gates.data_ptr<float>();
  in.hidden_norms = data_of<float>(checked_in.hidden_norms);
  in.weight_norms = data_of<float>(checked_in.weight_norms);
  in.group_ids = data_of<std::int32_t>(checked_in.group_ids);
  in.num_groups = t.num_groups;
  in.capacity = data_of<std::int64_t>(checked_in.capacity);
  in.token_mask = token_mask;
  indices = at::empty({n, c.top_k}, where.options(at::kInt));
  gates = at::empty({n, c.top_k}, where.options(at::kFloat));
  status = at::empty({n, c.top_k}, where.options(at::kChar));
  report = report_tensor<admission_report>(where);
  admission_outputs out;
  out.indices = indices.data_ptr<std::int32_t>();
  out.gates = gates.data_ptr<float>();
  out.status = status.data_ptr<std::int8_t>();
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
  if (where.cuda()) {
    const c10::DeviceGuard guard(where.device);
    const std::size_t bytes = runtime::cuda::admit_workspace_bytes(c, a, n, in.num_experts, t.num_groups);
    const at::Tensor workspace = bytes_on(bytes, where);
    out.report = report_data<admission_report>(report);
    runtime::cuda::admit(c, a, in, out, workspace.data_ptr(), bytes,
                         static_cast<runtime::cuda::stream_t>(current_stream(where)));
    return;
  }
#endif
  *report_data<admission_report>(report) = runtime::admit(c, a, in, out, cpu::execution{threads});
}

}  // namespace detail

struct selection_result {
  at::Tensor gates, indices;  // [N, K] float32, int32
};

namespace detail {
inline void check_top_k(const runtime::router_config& c, int num_experts) {
  if (c.top_k > num_experts)
    value_error("top_k (= " + std::to_string(c.top_k) + ") exceeds the number of experts (= " +
                std::to_string(num_experts) + ")");
}
}  // namespace detail

// Inference routing, the decode path of an engine: route() in evaluation mode
// (no prior, no penalties; docs/policies.md section 4), the same gates and
// indices, and nothing else computed or allocated. 16-bit logits are widened
// exactly here (route() takes float32; mr.route widens them in Python).
inline selection_result select_experts(const runtime::router_config& c, const at::Tensor& logits,
                                       const std::optional<at::Tensor>& expert_bias,
                                       const std::optional<at::Tensor>& token_mask, int threads) {
  return detail::translating_errors([&] {
    const detail::placement where = detail::placement_of(logits, "logits");
    const bool half = logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kHalf;
    const at::Tensor z = detail::logits_of(half ? logits.to(at::kFloat) : logits, where);
    const auto bias = detail::checked(expert_bias, "expert_bias", at::kFloat, {z.size(1)}, where);
    const auto mask = detail::token_mask_of(token_mask, z.size(0), where);
    route_inputs<float> in;
    in.logits = z.data_ptr<float>();
    in.num_tokens = z.size(0);
    in.num_experts = static_cast<int>(z.size(1));
    in.expert_bias = detail::data_of<float>(bias);
    in.token_mask = detail::mask_data(mask);
    in.mode = mode::eval;
    detail::check_top_k(c, in.num_experts);
    selection_result r{at::empty({in.num_tokens, c.top_k}, where.options(at::kFloat)),
                       at::empty({in.num_tokens, c.top_k}, where.options(at::kInt))};
    route_outputs out{r.indices.data_ptr<std::int32_t>(), r.gates.data_ptr<float>()};
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      // One scratch block: the neutral inputs (from the allocator's aligned start), then the penalty values
      // route zeroes in evaluation mode.
      const std::size_t neutral_bytes = runtime::cuda::neutral_bytes(c, in);
      const std::size_t values_at = (neutral_bytes + alignof(double) - 1) / alignof(double) * alignof(double);
      const at::Tensor scratch = detail::bytes_on(values_at + sizeof(double) * runtime::num_penalties, where);
      out.penalty_values = reinterpret_cast<double*>(scratch.data_ptr<std::uint8_t>() + values_at);
      runtime::cuda::route(c, in, out, scratch.data_ptr(), neutral_bytes,
                           static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
      return r;
    }
#endif
    double values[runtime::num_penalties];
    out.penalty_values = values;
    runtime::route(c, in, out, cpu::execution{threads});
    return r;
  });
}

// Routes, then admits unless `a` is dropless (then the report is zero).
inline route_result route(const runtime::router_config& c, const runtime::admission_config& a, const route_tensors& t,
                          const admission_tensors& admission, int threads) {
  return detail::translating_errors([&] {
    detail::checked_route call(t);
    const detail::placement& where = call.where;
    const std::int64_t n = call.in.num_tokens;
    detail::check_top_k(c, call.in.num_experts);
    const auto replay = detail::checked(t.replay_indices, "replay_indices", at::kInt, {n, c.top_k}, where);
    call.in.replay_indices = detail::data_of<std::int32_t>(replay);
    route_result r;
    r.indices = at::empty({n, c.top_k}, where.options(at::kInt));
    r.gates = at::empty({n, c.top_k}, where.options(at::kFloat));
    r.penalty_values = detail::zeros_on({runtime::num_penalties}, at::kDouble, where);
    // Zeroed: the bytes route leaves unwritten (alignment padding) are then fixed too, so equal inputs give
    // equal outputs, workspace included (torch.compile's checks compare every output).
    r.workspace = detail::zeroed_bytes(
        runtime::workspace_bytes(c, n, call.in.num_experts, call.in.num_sequences), where, [&] {
          return "num_tokens (= " + std::to_string(n) + "), num_experts (= " + std::to_string(call.in.num_experts) +
                 ") and num_sequences (= " + std::to_string(call.in.num_sequences) + ")";
        });
    r.nonfinite_rows = detail::zeros_on({}, at::kLong, where);
    route_outputs out;
    out.indices = r.indices.data_ptr<std::int32_t>();
    out.gates = r.gates.data_ptr<float>();
    out.penalty_values = r.penalty_values.data_ptr<double>();
    out.workspace = r.workspace.data_ptr<std::uint8_t>();
    out.workspace_bytes = static_cast<std::size_t>(r.workspace.numel());
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      out.nonfinite_rows = r.nonfinite_rows.data_ptr<std::int64_t>();
      const std::size_t scratch_bytes = runtime::cuda::neutral_bytes(c, call.in);
      const at::Tensor scratch = detail::bytes_on(scratch_bytes, where);
      runtime::cuda::route(c, call.in, out, scratch.data_ptr(), scratch_bytes,
                           static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
    } else
#endif
    {
      *r.nonfinite_rows.data_ptr<std::int64_t>() = runtime::route(c, call.in, out, cpu::execution{threads}).nonfinite_rows;
    }
    if (a.dropless) {
      r.routed_indices = at::empty({0, c.top_k}, where.options(at::kInt));
      r.routed_gates = at::empty({0, c.top_k}, where.options(at::kFloat));
      r.status = at::empty({0, c.top_k}, where.options(at::kChar));
      r.admission_report = detail::report_tensor<admission_report>(where);
    } else {
      r.routed_indices = std::move(r.indices);
      r.routed_gates = std::move(r.gates);
      detail::admit_into(c, a, where, call.logits, r.routed_indices, r.routed_gates, call.in.token_mask, admission,
                         threads, r.indices, r.gates, r.status, r.admission_report);
    }
    return r;
  });
}

// dL/dlogits [N, E] float32 for the inputs of route(): `routed_indices` and
// `workspace` from its result, grad_gates [N, K] of its gates (of the admitted
// gates when admitted_indices is given), grad_penalties [num_penalties] of its
// penalty values.
inline at::Tensor backward(const runtime::router_config& c, const route_tensors& t, const at::Tensor& routed_indices,
                           const at::Tensor& grad_gates, const at::Tensor& grad_penalties, const at::Tensor& workspace,
                           const std::optional<at::Tensor>& admitted_indices, bool renormalize, int threads) {
  return detail::translating_errors([&] {
    const detail::checked_route call(t);
    const detail::placement& where = call.where;
    const std::int64_t n = call.in.num_tokens;
    const at::Tensor idx = detail::checked(routed_indices, "routed_indices", at::kInt, {n, c.top_k}, where);
    const at::Tensor dw = detail::checked(grad_gates, "grad_gates", at::kFloat, {n, c.top_k}, where);
    const at::Tensor dp = detail::checked(grad_penalties, "grad_penalties", at::kFloat, {runtime::num_penalties}, where);
    // A copy: the backward writes its own scratch into the workspace, and the caller's stays as route left
    // it (an operator does not mutate its inputs; a second backward reads the same bytes).
    const at::Tensor ws = detail::checked(workspace, "workspace", at::kByte, {-1}, where).clone();
    const auto admitted = detail::checked(admitted_indices, "admitted_indices", at::kInt, {n, c.top_k}, where);
    at::Tensor grad = at::empty({n, call.in.num_experts}, where.options(at::kFloat));
    backward_args b;
    b.indices = idx.data_ptr<std::int32_t>();
    b.grad_gates = dw.data_ptr<float>();
    b.grad_logits = grad.data_ptr<float>();
    b.admitted_indices = detail::data_of<std::int32_t>(admitted);
    b.renormalize = renormalize;
    b.workspace = ws.data_ptr<std::uint8_t>();
    b.workspace_bytes = static_cast<std::size_t>(ws.numel());
    b.penalty_grads = dp.data_ptr<float>();
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      const std::size_t scratch_bytes = runtime::cuda::neutral_bytes(c, call.in);
      const at::Tensor scratch = detail::bytes_on(scratch_bytes, where);
      runtime::cuda::backward(c, call.in, b, scratch.data_ptr(), scratch_bytes,
                              static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
      return grad;
    }
#endif
    runtime::backward(c, call.in, b, cpu::execution{threads});
    return grad;
  });
}

struct admit_result {
  at::Tensor indices, gates, status;  // [N, K] int32, float32, int8
  at::Tensor report;                  // int64 [8]: admission_report
};

// Admission of a routing result routed_indices / routed_gates [N, K] of `logits`.
inline admit_result admit(const runtime::router_config& c, const runtime::admission_config& a, const at::Tensor& logits,
                          const at::Tensor& routed_indices, const at::Tensor& routed_gates,
                          const std::optional<at::Tensor>& token_mask, const admission_tensors& t, int threads) {
  return detail::translating_errors([&] {
    const detail::placement where = detail::placement_of(logits, "logits");
    const at::Tensor z = detail::logits_of(logits, where);
    const std::int64_t n = z.size(0);
    const at::Tensor routed = detail::checked(routed_indices, "routed_indices", at::kInt, {n, c.top_k}, where);
    const at::Tensor gates_in = detail::checked(routed_gates, "routed_gates", at::kFloat, {n, c.top_k}, where);
    const auto mask = detail::token_mask_of(token_mask, n, where);
    admit_result r;
    detail::admit_into(c, a, where, z, routed, gates_in, detail::mask_data(mask), t, threads, r.indices, r.gates,
                       r.status, r.report);
    return r;
  });
}

struct dispatch_result {
  at::Tensor counts;       // [E] int64
  at::Tensor offsets;      // [E + 1] int64; offsets[E] = rows used
  at::Tensor permutation;  // [dispatch_rows_bound] int64, -1 past the rows used
  at::Tensor inverse;      // [N * S] int64
  at::Tensor rank_counts;  // [num_ranks] int64
};

// Dispatch metadata (admission/dispatch.hpp) of indices [N, S], in the fixed
// E x capacity layout when capacity > 0; every shape is fixed by the
// arguments, so nothing is read back.
inline dispatch_result dispatch(const at::Tensor& indices, int num_experts, int align, int num_ranks,
                                const std::optional<at::Tensor>& expert_rank, std::int64_t capacity = 0) {
  return detail::translating_errors([&] {
    const detail::placement where = detail::placement_of(indices, "indices");
    if (num_experts < 1 || num_experts > max_experts)
      detail::value_error("num_experts (= " + std::to_string(num_experts) + ") must be in [1, " +
                          std::to_string(max_experts) + "]");
    if (align < 1) detail::value_error("align must be >= 1, got " + std::to_string(align));
    if (num_ranks < 1) detail::value_error("num_ranks must be >= 1, got " + std::to_string(num_ranks));
    if (capacity < 0) detail::value_error("capacity must be >= 0, got " + std::to_string(capacity));
    const at::Tensor idx = detail::checked(indices, "indices", at::kInt, {-1, -1}, where);
    const auto ranks = detail::checked(expert_rank, "expert_rank", at::kInt, {num_experts}, where);
    if (idx.size(1) < 1) detail::value_error("indices must have at least one slot per token");
    dispatch_inputs in;
    in.indices = idx.data_ptr<std::int32_t>();
    in.num_tokens = idx.size(0);
    in.slots_per_token = static_cast<int>(idx.size(1));
    in.num_experts = num_experts;
    in.align = align;
    in.num_ranks = num_ranks;
    in.expert_rank = detail::data_of<std::int32_t>(ranks);
    in.capacity = capacity;
    admission::detail::validate_dispatch_shape(in);  // before the outputs are sized from it
    const auto i64 = where.options(at::kLong);
    dispatch_result r;
    r.counts = at::empty({num_experts}, i64);
    r.offsets = at::empty({num_experts + 1}, i64);
    r.permutation =
        at::empty({dispatch_rows_bound(in.num_tokens, in.slots_per_token, num_experts, align, capacity)}, i64);
    r.inverse = at::empty({in.num_tokens * in.slots_per_token}, i64);
    r.rank_counts = at::empty({num_ranks}, i64);
    dispatch_outputs out;
    out.counts = r.counts.data_ptr<std::int64_t>();
    out.offsets = r.offsets.data_ptr<std::int64_t>();
    out.permutation = r.permutation.data_ptr<std::int64_t>();
    out.inverse = r.inverse.data_ptr<std::int64_t>();
    out.rank_counts = r.rank_counts.data_ptr<std::int64_t>();
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      const std::size_t bytes = runtime::cuda::dispatch_workspace_bytes(in.num_tokens, in.slots_per_token, num_experts);
      const at::Tensor workspace = detail::bytes_on(bytes, where);
      runtime::cuda::dispatch(in, out, workspace.data_ptr(), bytes,
                              static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
      return r;
    }
#endif
    cpu::dispatch(in, out);
    return r;
  });
}

struct expert_choice_result {
  at::Tensor indices, gates;       // [N, E] int32, float32
  at::Tensor experts_per_token;    // [N] int32
  at::Tensor report;               // int64 [4]: expert_choice_report
};

namespace detail {
inline expert_choice_inputs<float> expert_choice_inputs_of(const at::Tensor& z, const std::optional<at::Tensor>& groups,
                                                           int num_groups, const std::optional<at::Tensor>& capacity,
                                                           const std::optional<at::Tensor>& token_mask) {
  expert_choice_inputs<float> in;
  in.logits = z.data_ptr<float>();
  in.num_tokens = z.size(0);
  in.num_experts = static_cast<int>(z.size(1));
  in.group_ids = data_of<std::int32_t>(groups);
  in.num_groups = num_groups;
  in.capacity = data_of<std::int64_t>(capacity);
  in.token_mask = mask_data(token_mask);
  return in;
}
}  // namespace detail

// Expert choice (selection/expert_choice.hpp). The CPU rejects a group id
// outside [0, num_groups); the device leaves those tokens out and counts them
// in report[3] ("invalid") rather than wait to raise.
inline expert_choice_result expert_choice(const selection::expert_choice& p, const at::Tensor& logits,
                                          const std::optional<at::Tensor>& group_ids, int num_groups,
                                          const std::optional<at::Tensor>& capacity,
                                          const std::optional<at::Tensor>& token_mask, int threads) {
  return detail::translating_errors([&] {
    const detail::placement where = detail::placement_of(logits, "logits");
    const at::Tensor z = detail::logits_of(logits, where);
    const std::int64_t n = z.size(0), e = z.size(1);
    const auto groups = detail::checked(group_ids, "group_ids", at::kInt, {n}, where);
    const auto cap = detail::checked(capacity, "capacity", at::kLong, {e}, where);
    const auto mask = detail::token_mask_of(token_mask, n, where);
    expert_choice_result r;
    r.indices = at::empty({n, e}, where.options(at::kInt));
    r.gates = at::empty({n, e}, where.options(at::kFloat));
    r.experts_per_token = at::empty({n}, where.options(at::kInt));
    r.report = detail::report_tensor<expert_choice_report>(where);
    expert_choice_outputs out;
    out.indices = r.indices.data_ptr<std::int32_t>();
    out.gates = r.gates.data_ptr<float>();
    out.experts_per_token = r.experts_per_token.data_ptr<std::int32_t>();
    const auto in = detail::expert_choice_inputs_of(z, groups, num_groups, cap, mask);
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      const std::size_t bytes = runtime::cuda::expert_choice_workspace_bytes(p, n, in.num_experts, num_groups);
      const at::Tensor workspace = detail::bytes_on(bytes, where);
      out.report = detail::report_data<expert_choice_report>(r.report);
      runtime::cuda::expert_choice(p, in, out, workspace.data_ptr(), bytes,
                                   static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
      return r;
    }
#endif
    *detail::report_data<expert_choice_report>(r.report) = cpu::expert_choice(p, in, out, cpu::execution{threads});
    return r;
  });
}

// dL/dlogits [N, E] of expert_choice's gates.
inline at::Tensor expert_choice_backward(const at::Tensor& logits, const at::Tensor& indices,
                                         const at::Tensor& grad_gates, const std::optional<at::Tensor>& token_mask,
                                         int threads) {
  return detail::translating_errors([&] {
    const detail::placement where = detail::placement_of(logits, "logits");
    const at::Tensor z = detail::logits_of(logits, where);
    const std::int64_t n = z.size(0), e = z.size(1);
    const at::Tensor idx = detail::checked(indices, "indices", at::kInt, {n, e}, where);
    const at::Tensor dw = detail::checked(grad_gates, "grad_gates", at::kFloat, {n, e}, where);
    const auto mask = detail::token_mask_of(token_mask, n, where);
    at::Tensor grad = at::empty({n, e}, where.options(at::kFloat));
    const auto in = detail::expert_choice_inputs_of(z, std::nullopt, 1, std::nullopt, mask);
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      runtime::cuda::expert_choice_backward(in, idx.data_ptr<std::int32_t>(), dw.data_ptr<float>(),
                                            grad.data_ptr<float>(),
                                            static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
      return grad;
    }
#endif
    cpu::expert_choice_backward(in, idx.data_ptr<std::int32_t>(), dw.data_ptr<float>(), grad.data_ptr<float>(),
                                cpu::execution{threads});
    return grad;
  });
}

struct router_l2_result {
  at::Tensor value;               // float64 []
  std::vector<at::Tensor> grads;  // dvalue/dW_l, float32, shaped as the weights
};

// Router-L2 over layers (penalty/router_l2.hpp): its value (float64 [] on the
// weights' device), its gradient added to grads[l] (float32, contiguous, shaped
// as weights[l]; a training loop passes the weights' .grad), as the library's
// policy accumulates.
inline at::Tensor router_l2_into(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& base,
                                 double coefficient, const std::vector<at::Tensor>& grads) {
  return detail::translating_errors([&] {
    if (weights.size() != base.size() || weights.size() != grads.size())
      detail::value_error("router_l2: weights, base and grads must list the same number of layers, got " +
                          std::to_string(weights.size()) + ", " + std::to_string(base.size()) + " and " +
                          std::to_string(grads.size()));
    if (weights.empty()) detail::value_error("router_l2: weights must list at least one layer");
    const detail::placement where = detail::placement_of(weights[0], "router_l2: layer 0 weights");
    std::vector<at::Tensor> w, w0;
    std::vector<penalty::router_weights> layers;
    for (std::size_t l = 0; l < weights.size(); ++l) {
      const std::string name = "router_l2: layer " + std::to_string(l) + " ";
      w.push_back(detail::checked(weights[l], name + "weights", at::kFloat,
                                  std::vector<std::int64_t>(static_cast<std::size_t>(weights[l].dim()), -1), where));
      w0.push_back(detail::checked(base[l], name + "base", at::kFloat, weights[l].sizes().vec(), where));
      // Written in place, so no copy: it must already be what the policy writes.
      const at::Tensor g = detail::checked(grads[l], name + "grads", at::kFloat, weights[l].sizes().vec(), where);
      if (!g.is_same(grads[l])) detail::value_error(name + "grads must be contiguous: the gradient is added in place");
      layers.push_back({w.back().data_ptr<float>(), w0.back().data_ptr<float>(), w.back().numel(),
                        g.data_ptr<float>()});
    }
    const penalty::router_l2 policy{static_cast<float>(coefficient)};
    at::Tensor value = at::empty({}, where.options(at::kDouble));
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      const int num_layers = static_cast<int>(layers.size());
      const std::size_t bytes = runtime::cuda::router_l2_workspace_bytes(layers.data(), num_layers);
      const at::Tensor workspace = detail::bytes_on(bytes, where);
      runtime::cuda::router_l2(policy, layers.data(), num_layers, value.data_ptr<double>(), workspace.data_ptr(),
                               bytes, static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
      return value;
    }
#endif
    value.fill_(policy.apply(layers.data(), static_cast<int>(layers.size())));
    return value;
  });
}

// Router-L2 over layers, with its gradient in fresh tensors.
inline router_l2_result router_l2(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& base,
                                  double coefficient) {
  return detail::translating_errors([&] {
    if (weights.size() != base.size())
      detail::value_error("router_l2: weights and base must list the same number of layers, got " +
                          std::to_string(weights.size()) + " and " + std::to_string(base.size()));
    router_l2_result r;
    for (std::size_t l = 0; l < weights.size(); ++l) {
      if (!weights[l].defined()) detail::value_error("router_l2: layer " + std::to_string(l) + " weights is undefined");
      r.grads.push_back(at::zeros(weights[l].sizes(), weights[l].options().dtype(at::kFloat)));
    }
    r.value = router_l2_into(weights, base, coefficient, r.grads);
    return r;
  });
}

struct prior_build_result {
  at::Tensor pi;          // [S, E] float32
  at::Tensor row_tokens;  // [S] int64: tokens of each row (0: an empty row, pi uniform)
};

// The prior (prior/build.hpp) of a base router's logits [N, E], rows [N] in [-1, S).
inline prior_build_result prior_build(runtime::gating_kind gating, const at::Tensor& logits, const at::Tensor& rows,
                                      std::int64_t num_rows, int threads = 1) {
  return detail::translating_errors([&] {
    const detail::placement where = detail::placement_of(logits, "logits");
    const at::Tensor z = detail::logits_of(logits, where);
    const at::Tensor r = detail::checked(rows, "rows", at::kInt, {z.size(0)}, where);
    if (num_rows < 1) detail::value_error("num_rows must be >= 1, got " + std::to_string(num_rows));
    prior_build_result out;
    out.pi = at::empty({num_rows, z.size(1)}, where.options(at::kFloat));
    route_inputs<float> in;
    in.logits = z.data_ptr<float>();
    in.num_tokens = z.size(0);
    in.num_experts = static_cast<int>(z.size(1));
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      // The host builder rejects row ids outside [-1, S); the device one leaves those tokens out.
      if (r.numel() > 0 && (r.min().item<std::int32_t>() < -1 || r.max().item<std::int32_t>() >= num_rows))
        detail::value_error("rows must be -1 or in [0, num_rows = " + std::to_string(num_rows) + ")");
      const std::size_t bytes = runtime::cuda::prior_build_workspace_bytes(num_rows, in.num_experts);
      const at::Tensor workspace = detail::bytes_on(bytes, where);
      out.row_tokens = at::empty({num_rows}, where.options(at::kLong));
      runtime::cuda::prior_build(gating, in, r.data_ptr<std::int32_t>(), num_rows, out.pi.data_ptr<float>(),
                                 out.row_tokens.data_ptr<std::int64_t>(), workspace.data_ptr(), bytes,
                                 static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
      return out;
    }
#endif
    const prior::build_report report = runtime::detail::by_gating(gating, [&](auto g) {
      return prior::build<decltype(g)>(in, r.data_ptr<std::int32_t>(), num_rows, out.pi.data_ptr<float>(),
                                       cpu::execution{threads});
    });
    out.row_tokens = at::empty({num_rows}, where.options(at::kLong));
    std::copy(report.row_tokens.begin(), report.row_tokens.end(), out.row_tokens.data_ptr<std::int64_t>());
    return out;
  });
}

struct prior_prepare_result {
  at::Tensor bias, probs;  // [S, E] float32: centred log prior, clamped prior
  at::Tensor report;       // int64 [2]: entries clamped from above, from below
};

// A host tool (once per base model): on CUDA the prior is prepared on a host
// copy and the results are moved back.
inline prior_prepare_result prior_prepare(const at::Tensor& pi, double epsilon, double cap) {
  return detail::translating_errors([&] {
    const detail::placement where = detail::placement_of(pi, "pi");
    const at::Tensor p = detail::checked(pi, "pi", at::kFloat, {-1, -1}, where).cpu();
    at::Tensor bias = at::empty_like(p), probs = at::empty_like(p);
    prior::clamp_bounds bounds;
    bounds.epsilon = static_cast<float>(epsilon);
    bounds.cap = static_cast<float>(cap);
    const auto rep = prior::prepare(p.data_ptr<float>(), p.size(0), static_cast<int>(p.size(1)),
                                    bias.data_ptr<float>(), probs.data_ptr<float>(), bounds);
    const at::Tensor report = at::tensor(std::vector<std::int64_t>{rep.upper_clamped, rep.lower_clamped}, at::kLong);
    return prior_prepare_result{bias.to(where.device), probs.to(where.device), report.to(where.device)};
  });
}

// The aux-loss-free step b_e += rate * sign(mean load - load_e), in place on
// bias [E] float32, on the bias's device (the host update's bits either way).
inline void expert_bias_update(at::Tensor& bias, const at::Tensor& loads, double rate) {
  detail::translating_errors([&] {
    if (!bias.defined() || bias.scalar_type() != at::kFloat || !bias.is_contiguous() || bias.dim() != 1)
      detail::value_error("expert_bias must be a contiguous 1-D float32 tensor, updated in place");
    const detail::placement where = detail::placement_of(bias, "expert_bias");
    const at::Tensor l = detail::checked(loads.to(at::kDouble), "loads", at::kDouble, {bias.size(0)}, where);
    selection::expert_bias policy;
    policy.update_rate = static_cast<float>(rate);
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
    if (where.cuda()) {
      const c10::DeviceGuard guard(where.device);
      runtime::cuda::update_expert_bias(policy, bias.data_ptr<float>(), l.data_ptr<double>(),
                                        static_cast<int>(bias.size(0)),
                                        static_cast<runtime::cuda::stream_t>(detail::current_stream(where)));
      return;
    }
#endif
    policy.update(bias.data_ptr<float>(), l.data_ptr<double>(), static_cast<int>(bias.size(0)));
  });
}

}  // namespace moe_route::adapters
