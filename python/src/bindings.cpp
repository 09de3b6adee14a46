// moe_route._C: the library's calls registered as PyTorch operators
// (torch.ops.moe_route.*, schemas below), with CPU kernels and, when built
// against a CUDA PyTorch with MOE_ROUTE_TORCH_WITH_CUDA, CUDA kernels. Each
// kernel is a call of the LibTorch adapter (include/moe_route/adapters/torch.hpp),
// which checks the arguments and raises TypeError / ValueError naming the
// one at fault before writing anything. The differentiable operators have
// Autograd kernels here; the Python package registers the fake (meta)
// implementations and router_l2's autograd formula (python/moe_route/_ops.py)
// and builds its API on these operators.
//
// Configurations travel as text, "field=value;..." (adapters/detail/config_text.hpp),
// the form an operator schema can carry; the pybind11 functions at the end
// give Python the few host facts it needs about them (presets, K, the
// workspace size as a function of N for the fake tensors).
#include <torch/extension.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// First: the runtime routers come compiled from moe_route::runtime.
#include <moe_route/runtime/instantiate.hpp>

#include <moe_route/adapters/torch.hpp>
#include <moe_route/backend/cpu/isa.hpp>

namespace ad = moe_route::adapters;
namespace rt = moe_route::runtime;

namespace {

using tensor = at::Tensor;
using optional_tensor = std::optional<at::Tensor>;

int threads_of(std::int64_t threads) { return ad::detail::int_of(threads, "threads"); }

ad::route_tensors route_tensors_of(const tensor& logits, const optional_tensor& expert_bias,
                                   const optional_tensor& prior_bias, const optional_tensor& prior_probs,
                                   const optional_tensor& token_prior_row, const optional_tensor& sequence_ids,
                                   std::int64_t num_sequences, const optional_tensor& load_fractions,
                                   const optional_tensor& expert_rank, std::int64_t rank, bool training,
                                   const optional_tensor& token_mask) {
  ad::route_tensors t;
  t.logits = logits;
  t.expert_bias = expert_bias;
  t.prior_bias = prior_bias;
  t.prior_probs = prior_probs;
  t.token_prior_row = token_prior_row;
  t.sequence_ids = sequence_ids;
  t.num_sequences = ad::detail::int_of(num_sequences, "num_sequences");
  t.load_fractions = load_fractions;
  t.expert_rank = expert_rank;
  t.rank = ad::detail::int_of(rank, "rank");
  t.training = training;
  t.token_mask = token_mask;
  return t;
}

ad::admission_tensors admission_tensors_of(const optional_tensor& hidden_norms, const optional_tensor& weight_norms,
                                           const optional_tensor& group_ids, std::int64_t num_groups,
                                           const optional_tensor& capacity) {
  ad::admission_tensors t;
  t.hidden_norms = hidden_norms;
  t.weight_norms = weight_norms;
  t.group_ids = group_ids;
  t.num_groups = ad::detail::int_of(num_groups, "num_groups");
  t.capacity = capacity;
  return t;
}

template <class F>
auto parsed(F&& f) {
  return ad::detail::translating_errors(f);
}

// The configuration of a text, parsed once per thread while the text stays
// the same (a model calls its router with one configuration, step after step).
template <class Config, Config (*parse)(std::string_view)>
const Config& cached(c10::string_view text) {
  thread_local std::string last_text;
  thread_local Config last{};
  thread_local bool valid = false;
  const std::string_view t(text.data(), text.size());
  if (!valid || t != last_text) {
    last = parsed([&] { return parse(t); });
    last_text.assign(t);
    valid = true;
  }
  return last;
}

const rt::router_config& router_config_of(c10::string_view text) {
  return cached<rt::router_config, ad::detail::router_config_of>(text);
}

const rt::admission_config& admission_config_of(c10::string_view text) {
  return cached<rt::admission_config, ad::detail::admission_config_of>(text);
}

// The float32 penalty values route returns; on the CPU converted here rather
// than by a second dispatched operator (the same rounding as Tensor.to).
tensor float_values(const tensor& values) {
  if (!values.device().is_cpu()) return values.to(at::kFloat);
  tensor f = at::empty(values.sizes(), values.options().dtype(at::kFloat));
  const double* from = values.data_ptr<double>();
  float* to = f.data_ptr<float>();
  for (std::int64_t i = 0; i < values.numel(); ++i) to[i] = static_cast<float>(from[i]);
  return f;
}

std::tuple<tensor, tensor, tensor, tensor, tensor, tensor, tensor, tensor, tensor> route(
    const tensor& logits, c10::string_view config, const optional_tensor& expert_bias,
    const optional_tensor& prior_bias, const optional_tensor& prior_probs, const optional_tensor& token_prior_row,
    const optional_tensor& sequence_ids, std::int64_t num_sequences, const optional_tensor& load_fractions,
    const optional_tensor& expert_rank, std::int64_t rank, bool training, c10::string_view admission,
    const optional_tensor& hidden_norms, const optional_tensor& weight_norms, const optional_tensor& group_ids,
    std::int64_t num_groups, const optional_tensor& capacity, const optional_tensor& token_mask,
    const optional_tensor& replay_indices, std::int64_t threads) {
  const rt::router_config c = router_config_of(config);
  const rt::admission_config a = admission_config_of(admission);
  ad::route_tensors t = route_tensors_of(logits, expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids,
                                         num_sequences, load_fractions, expert_rank, rank, training, token_mask);
  t.replay_indices = replay_indices;
  const ad::route_result r =
      ad::route(c, a, t,
                admission_tensors_of(hidden_norms, weight_norms, group_ids, num_groups, capacity), threads_of(threads));
  return {r.gates, float_values(r.penalty_values), r.indices, r.routed_indices, r.routed_gates, r.status, r.workspace,
          r.nonfinite_rows, r.admission_report};
}

std::tuple<tensor, tensor> select_experts(const tensor& logits, c10::string_view config,
                                         const optional_tensor& expert_bias, const optional_tensor& token_mask,
                                         std::int64_t threads) {
  const ad::selection_result r =
      ad::select_experts(router_config_of(config), logits, expert_bias, token_mask, threads_of(threads));
  return {r.gates, r.indices};
}

tensor route_backward(const tensor& grad_gates, const tensor& grad_penalties, const tensor& logits,
                      c10::string_view config, const optional_tensor& expert_bias, const optional_tensor& prior_bias,
                      const optional_tensor& prior_probs, const optional_tensor& token_prior_row,
                      const optional_tensor& sequence_ids, std::int64_t num_sequences,
                      const optional_tensor& load_fractions, const optional_tensor& expert_rank, std::int64_t rank,
                      bool training, const tensor& routed_indices, const tensor& workspace,
                      const optional_tensor& admitted_indices, bool renormalize, const optional_tensor& token_mask,
                      std::int64_t threads) {
  const rt::router_config c = router_config_of(config);
  return ad::backward(c,
                      route_tensors_of(logits, expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids,
                                       num_sequences, load_fractions, expert_rank, rank, training, token_mask),
                      routed_indices, grad_gates, grad_penalties, workspace, admitted_indices, renormalize,
                      threads_of(threads));
}

std::tuple<tensor, tensor, tensor, tensor> admit(const tensor& logits, c10::string_view config,
                                                 c10::string_view admission, const tensor& routed_indices,
                                                 const tensor& routed_gates, const optional_tensor& hidden_norms,
                                                 const optional_tensor& weight_norms, const optional_tensor& group_ids,
                                                 std::int64_t num_groups, const optional_tensor& capacity,
                                                 const optional_tensor& token_mask, std::int64_t threads) {
  const rt::router_config c = router_config_of(config);
  const rt::admission_config a = admission_config_of(admission);
  const ad::admit_result r = ad::admit(c, a, logits, routed_indices, routed_gates, token_mask,
                                       admission_tensors_of(hidden_norms, weight_norms, group_ids, num_groups, capacity),
                                       threads_of(threads));
  return {r.indices, r.gates, r.status, r.report};
}

std::tuple<tensor, tensor, tensor, tensor, tensor> dispatch(const tensor& indices, std::int64_t num_experts,
                                                            std::int64_t align, std::int64_t num_ranks,
                                                            const optional_tensor& expert_rank, std::int64_t capacity) {
  const ad::dispatch_result r = ad::dispatch(indices, ad::detail::int_of(num_experts, "num_experts"),
                                             ad::detail::int_of(align, "align"),
                                             ad::detail::int_of(num_ranks, "num_ranks"), expert_rank, capacity);
  return {r.counts, r.offsets, r.permutation, r.inverse, r.rank_counts};
}

// The differentiable outputs come first in route and expert_choice.
std::tuple<tensor, tensor, tensor, tensor> expert_choice(const tensor& logits, std::int64_t top_k,
                                                         double capacity_factor, std::int64_t min_capacity,
                                                         const optional_tensor& group_ids, std::int64_t num_groups,
                                                         const optional_tensor& capacity,
                                                         const optional_tensor& token_mask, std::int64_t threads) {
  moe_route::selection::expert_choice p;
  p.top_k = ad::detail::int_of(top_k, "top_k");
  p.capacity_factor = capacity_factor;
  p.min_capacity = min_capacity;
  const ad::expert_choice_result r =
      ad::expert_choice(p, logits, group_ids, ad::detail::int_of(num_groups, "num_groups"), capacity, token_mask,
                        threads_of(threads));
  return {r.gates, r.indices, r.experts_per_token, r.report};
}

tensor expert_choice_backward(const tensor& grad_gates, const tensor& logits, const tensor& indices,
                              const optional_tensor& token_mask, std::int64_t threads) {
  return ad::expert_choice_backward(logits, indices, grad_gates, token_mask, threads_of(threads));
}

std::tuple<tensor, std::vector<tensor>> router_l2(at::TensorList weights, at::TensorList base, double coefficient) {
  ad::router_l2_result r = ad::router_l2(weights.vec(), base.vec(), coefficient);
  return {r.value, r.grads};
}

std::tuple<tensor, tensor> prior_build(const tensor& logits, const tensor& rows, std::int64_t num_rows,
                                       c10::string_view gating, std::int64_t threads) {
  const rt::gating_kind g = parsed([&] { return ad::detail::gating_of(gating); });
  const ad::prior_build_result r = ad::prior_build(g, logits, rows, num_rows, threads_of(threads));
  return {r.pi, r.row_tokens};
}

std::tuple<tensor, tensor, tensor> prior_prepare(const tensor& pi, double epsilon, double cap) {
  const ad::prior_prepare_result r = ad::prior_prepare(pi, epsilon, cap);
  return {r.bias, r.probs, r.report};
}

void expert_bias_update(tensor& bias, const tensor& loads, double rate) { ad::expert_bias_update(bias, loads, rate); }

// ---------------------------------------------------------------------------
// Autograd kernels, in C++ so that a call runs no Python (a formula registered
// with torch.library.register_autograd costs about 6 µs a call). Each records
// its node and redispatches below autograd: to the CPU or CUDA kernel, or to
// the fake while torch.compile traces.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr char route_name[] = "moe_route::route";
constexpr char select_experts_name[] = "moe_route::select_experts";
constexpr char route_backward_name[] = "moe_route::route_backward";
constexpr char expert_choice_name[] = "moe_route::expert_choice";
constexpr char expert_choice_backward_name[] = "moe_route::expert_choice_backward";

// The operator `name`, looked up once.
template <class Signature, const char* name>
const c10::TypedOperatorHandle<Signature>& operator_named() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  return op;
}

template <class Signature, const char* name, class... Args>
auto below_autograd(Args&&... args) {
  const at::AutoDispatchBelowADInplaceOrView guard;
  return operator_named<Signature, name>().call(std::forward<Args>(args)...);
}

template <class Signature>
struct arity;
template <class R, class... Args>
struct arity<R(Args...)> : std::integral_constant<std::size_t, sizeof...(Args)> {};

// Whether autograd records a call whose only differentiable input is `t`; when
// it does not, the kernels below skip building a node (a few µs a call).
bool recorded(const tensor& t) { return at::GradMode::is_enabled() && t.requires_grad(); }

// Saved tensors hold an absent optional as an undefined tensor.
tensor or_undefined(const optional_tensor& t) { return t.value_or(tensor()); }
optional_tensor optional_of(const tensor& t) { return t.defined() ? optional_tensor(t) : std::nullopt; }

// select_experts' gates are not differentiable, so a call that autograd would
// record is refused rather than given gates that silently get no gradient.
std::tuple<tensor, tensor> select_experts_autograd(const tensor& logits, c10::string_view config,
                                                  const optional_tensor& expert_bias,
                                                  const optional_tensor& token_mask, std::int64_t threads) {
  if (recorded(logits))
    ad::detail::value_error(
        "select_experts is inference routing and its gates have no gradient, but logits requires grad: call it under "
        "torch.no_grad() / torch.inference_mode(), or use route() for training");
  return below_autograd<decltype(select_experts), select_experts_name>(logits, config, expert_bias, token_mask,
                                                                      threads);
}

// route: gates and penalty values are differentiable in the logits; the
// backward reruns nothing but reads the forward's workspace.
class route_function : public torch::autograd::Function<route_function> {
 public:
  static variable_list forward(AutogradContext* ctx, const tensor& logits, c10::string_view config,
                               const optional_tensor& expert_bias, const optional_tensor& prior_bias,
                               const optional_tensor& prior_probs, const optional_tensor& token_prior_row,
                               const optional_tensor& sequence_ids, std::int64_t num_sequences,
                               const optional_tensor& load_fractions, const optional_tensor& expert_rank,
                               std::int64_t rank, bool training, c10::string_view admission,
                               const optional_tensor& hidden_norms, const optional_tensor& weight_norms,
                               const optional_tensor& group_ids, std::int64_t num_groups,
                               const optional_tensor& capacity, const optional_tensor& token_mask,
                               const optional_tensor& replay_indices, std::int64_t threads) {
    auto [gates, values, indices, routed_indices, routed_gates, status, workspace, nonfinite_rows, report] =
        below_autograd<decltype(route), route_name>(logits, config, expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids,
                       num_sequences, load_fractions, expert_rank, rank, training, admission, hidden_norms,
                       weight_norms, group_ids, num_groups, capacity, token_mask, replay_indices, threads);
    // Under admission the backward takes the routed experts and the admitted ones.
    const rt::admission_config& a = admission_config_of(admission);
    const bool admitting = !a.dropless;
    ctx->save_for_backward({logits, or_undefined(expert_bias), or_undefined(prior_bias), or_undefined(prior_probs),
                            or_undefined(token_prior_row), or_undefined(sequence_ids), or_undefined(load_fractions),
                            or_undefined(expert_rank), admitting ? routed_indices : indices, workspace,
                            admitting ? indices : tensor(), or_undefined(token_mask)});
    ctx->saved_data["config"] = std::string(config);
    ctx->saved_data["num_sequences"] = num_sequences;
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["training"] = training;
    ctx->saved_data["renormalize"] = admitting && rt::renormalizes(a);
    ctx->saved_data["threads"] = threads;
    ctx->mark_non_differentiable({indices, routed_indices, routed_gates, status, workspace, nonfinite_rows, report});
    ctx->set_materialize_grads(false);
    return {gates, values, indices, routed_indices, routed_gates, status, workspace, nonfinite_rows, report};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    const variable_list s = ctx->get_saved_variables();
    const tensor& logits = s[0];
    const tensor& routed_indices = s[8];
    const auto f32 = logits.options().dtype(at::kFloat);
    const tensor grad_gates = grads[0].defined() ? grads[0].contiguous() : at::zeros(routed_indices.sizes(), f32);
    const tensor grad_values = grads[1].defined() ? grads[1].contiguous() : at::zeros({rt::num_penalties}, f32);
    const auto& d = ctx->saved_data;
    // Through the dispatcher with autograd: a double backward reaches route_backward's refusal.
    variable_list grad_inputs(arity<decltype(route)>::value);
    grad_inputs[0] = operator_named<decltype(route_backward), route_backward_name>().call(grad_gates, grad_values, logits, d.at("config").toStringRef(), optional_of(s[1]),
                             optional_of(s[2]), optional_of(s[3]), optional_of(s[4]), optional_of(s[5]),
                             d.at("num_sequences").toInt(), optional_of(s[6]), optional_of(s[7]), d.at("rank").toInt(),
                             d.at("training").toBool(), routed_indices, s[9], optional_of(s[10]),
                             d.at("renormalize").toBool(), optional_of(s[11]), d.at("threads").toInt());
    return grad_inputs;
  }
};

std::tuple<tensor, tensor, tensor, tensor, tensor, tensor, tensor, tensor, tensor> route_autograd(
    const tensor& logits, c10::string_view config, const optional_tensor& expert_bias,
    const optional_tensor& prior_bias, const optional_tensor& prior_probs, const optional_tensor& token_prior_row,
    const optional_tensor& sequence_ids, std::int64_t num_sequences, const optional_tensor& load_fractions,
    const optional_tensor& expert_rank, std::int64_t rank, bool training, c10::string_view admission,
    const optional_tensor& hidden_norms, const optional_tensor& weight_norms, const optional_tensor& group_ids,
    std::int64_t num_groups, const optional_tensor& capacity, const optional_tensor& token_mask,
    const optional_tensor& replay_indices, std::int64_t threads) {
  if (!recorded(logits))
    return below_autograd<decltype(route), route_name>(logits, config, expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids,
                          num_sequences, load_fractions, expert_rank, rank, training, admission, hidden_norms,
                          weight_norms, group_ids, num_groups, capacity, token_mask, replay_indices, threads);
  const variable_list r =
      route_function::apply(logits, config, expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids,
                            num_sequences, load_fractions, expert_rank, rank, training, admission, hidden_norms,
                            weight_norms, group_ids, num_groups, capacity, token_mask, replay_indices, threads);
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]};
}

// expert_choice: the gates are differentiable in the logits.
class expert_choice_function : public torch::autograd::Function<expert_choice_function> {
 public:
  static variable_list forward(AutogradContext* ctx, const tensor& logits, std::int64_t top_k, double capacity_factor,
                               std::int64_t min_capacity, const optional_tensor& group_ids, std::int64_t num_groups,
                               const optional_tensor& capacity, const optional_tensor& token_mask,
                               std::int64_t threads) {
    auto [gates, indices, experts_per_token, report] = below_autograd<decltype(expert_choice), expert_choice_name>(
        logits, top_k, capacity_factor, min_capacity, group_ids, num_groups, capacity, token_mask, threads);
    ctx->save_for_backward({logits, indices, or_undefined(token_mask)});
    ctx->saved_data["threads"] = threads;
    ctx->mark_non_differentiable({indices, experts_per_token, report});
    ctx->set_materialize_grads(false);
    return {gates, indices, experts_per_token, report};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    const variable_list s = ctx->get_saved_variables();
    const tensor& logits = s[0];
    const tensor grad_gates =
        grads[0].defined() ? grads[0].contiguous() : at::zeros(logits.sizes(), logits.options().dtype(at::kFloat));
    variable_list grad_inputs(arity<decltype(expert_choice)>::value);
    grad_inputs[0] = operator_named<decltype(expert_choice_backward), expert_choice_backward_name>().call(grad_gates, logits, s[1], optional_of(s[2]), ctx->saved_data.at("threads").toInt());
    return grad_inputs;
  }
};

std::tuple<tensor, tensor, tensor, tensor> expert_choice_autograd(const tensor& logits, std::int64_t top_k,
                                                                  double capacity_factor, std::int64_t min_capacity,
                                                                  const optional_tensor& group_ids,
                                                                  std::int64_t num_groups,
                                                                  const optional_tensor& capacity,
                                                                  const optional_tensor& token_mask,
                                                                  std::int64_t threads) {
  if (!recorded(logits))
    return below_autograd<decltype(expert_choice), expert_choice_name>(logits, top_k, capacity_factor, min_capacity,
                                                                        group_ids, num_groups, capacity, token_mask,
                                                                        threads);
  const variable_list r = expert_choice_function::apply(logits, top_k, capacity_factor, min_capacity, group_ids,
                                                        num_groups, capacity, token_mask, threads);
  return {r[0], r[1], r[2], r[3]};
}

// The backward operators: their result has no derivative here, so a double
// backward through it raises (when it runs, not when create_graph records it).
template <class Signature, const char* name>
class once_differentiable;
template <class... Args, const char* name>
class once_differentiable<tensor(Args...), name>
    : public torch::autograd::Function<once_differentiable<tensor(Args...), name>> {
 public:
  static variable_list forward(AutogradContext*, Args... args) {
    return {below_autograd<tensor(Args...), name>(args...)};
  }
  static variable_list backward(AutogradContext*, const variable_list&) {
    throw std::runtime_error("moe_route: the router's backward is not differentiable (no double backward)");
  }

  // The Autograd kernel: a node only when create_graph asks autograd to record the backward.
  static tensor kernel(Args... args) {
    if (!at::GradMode::is_enabled()) return below_autograd<tensor(Args...), name>(args...);
    return once_differentiable::apply(args...)[0];
  }
};

// Host facts about a configuration text, for the Python layer.
py::dict preset(const std::string& name) {
  const ad::detail::preset_fields f = parsed([&] { return ad::detail::preset_of(name); });
  py::dict d;
  d["config"] = f.text;
  d["num_experts"] = f.num_experts;
  return d;
}

// Whether the router of a configuration text normalises its gates (the field, or the gating's default).
bool normalizes(const std::string& config) {
  return router_config_of(config).normalize;
}

// (top_k, workspace fixed bytes, bytes per value, chunk): route's output shapes
// as functions of N (runtime::workspace_shape).
py::tuple route_shape(const std::string& config, std::int64_t num_experts, std::int64_t num_sequences) {
  const rt::router_config c = router_config_of(config);
  const rt::workspace_shape w =
      rt::workspace_shape_of(c, static_cast<int>(num_experts), static_cast<std::int32_t>(num_sequences));
  return py::make_tuple(c.top_k, w.fixed, w.per_value, w.chunk);
}

// The text of an admission preset (adapters/detail/config_text.hpp: admission_preset_of).
std::string admission_preset(const std::string& name, double capacity_factor, double fill_factor,
                             std::optional<float> threshold) {
  return parsed([&] {
    return ad::detail::text_of(ad::detail::admission_preset_of(name, capacity_factor, fill_factor, threshold));
  });
}

// (admits, renormalizes) of an admission text: whether it is capacity
// admission, and whether route_backward renormalises (runtime::renormalizes).
py::tuple admission_flags(const std::string& admission) {
  const rt::admission_config a = admission_config_of(admission);
  return py::make_tuple(!a.dropless, rt::renormalizes(a));
}

// C of a capacity admission text for tokens x top_k assignments over
// num_experts (admission::capacity_from_factor), the size of a fixed dispatch
// layout (dispatch(..., capacity)).
std::int64_t admission_capacity(const std::string& admission, std::int64_t tokens, std::int64_t top_k,
                                std::int64_t num_experts) {
  return parsed([&] {
    const rt::admission_config a = admission_config_of(admission);
    if (a.dropless) ad::detail::value_error("dropless admission has no capacity");
    if (tokens < 0) ad::detail::value_error("num_tokens must be >= 0, got " + std::to_string(tokens));
    const int k = ad::detail::int_of(top_k, "top_k");
    const int e = ad::detail::int_of(num_experts, "num_experts");
    if (k < 1 || e < 1) ad::detail::value_error("top_k and num_experts must be >= 1");
    return moe_route::admission::capacity_from_factor(a.capacity_factor, a.min_capacity, tokens, k, e);
  });
}

// The benchmark's peer (python/bench/bench_overhead.py): seconds per call of
// runtime::route on these CPU logits with outputs allocated once, the direct
// C++ call the operator path is measured against.
double direct_route_seconds(const std::string& config, const tensor& logits, std::int64_t calls, std::int64_t threads) {
  const rt::router_config c = router_config_of(config);
  const ad::detail::placement where = ad::detail::placement_of(logits, "logits");
  const tensor z = ad::detail::logits_of(logits, where);
  if (!z.device().is_cpu()) ad::detail::value_error("direct_route_seconds times the CPU backend: logits must be on the CPU");
  moe_route::route_inputs<float> in;
  in.logits = z.data_ptr<float>();
  in.num_tokens = z.size(0);
  in.num_experts = static_cast<int>(z.size(1));
  in.mode = moe_route::mode::train;  // as the operator path's training=True
  std::vector<std::int32_t> indices(static_cast<std::size_t>(in.num_tokens * c.top_k));
  std::vector<float> gates(indices.size());
  std::vector<double> values(rt::num_penalties);
  std::vector<std::uint8_t> workspace(rt::workspace_bytes(c, in.num_tokens, in.num_experts));
  moe_route::route_outputs out{indices.data(), gates.data()};
  out.penalty_values = values.data();
  out.workspace = workspace.data();
  out.workspace_bytes = workspace.size();
  const py::gil_scoped_release unlocked;
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < calls; ++i) rt::route(c, in, out, moe_route::cpu::execution{static_cast<int>(threads)});
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / static_cast<double>(calls);
}

// The instruction set the CPU operators run their loops with: MOE_ROUTE_CPU_ISA
// (baseline, x86-64-v3), else the best this CPU has.
std::string cpu_isa() { return moe_route::cpu::name(moe_route::cpu::isa_of()); }

}  // namespace

TORCH_LIBRARY(moe_route, m) {
  m.def(
      "route(Tensor logits, str config, Tensor? expert_bias, Tensor? prior_bias, Tensor? prior_probs, "
      "Tensor? token_prior_row, Tensor? sequence_ids, int num_sequences, Tensor? load_fractions, "
      "Tensor? expert_rank, int rank, bool training, str admission, Tensor? hidden_norms, Tensor? weight_norms, "
      "Tensor? group_ids, int num_groups, Tensor? capacity, Tensor? token_mask, Tensor? replay_indices, int threads) "
      "-> (Tensor gates, "
      "Tensor penalty_values, "
      "Tensor indices, Tensor routed_indices, Tensor routed_gates, Tensor status, Tensor workspace, "
      "Tensor nonfinite_rows, Tensor admission_report)");
  m.def(
      "select_experts(Tensor logits, str config, Tensor? expert_bias, Tensor? token_mask, int threads) -> "
      "(Tensor gates, Tensor indices)");
  m.def(
      "route_backward(Tensor grad_gates, Tensor grad_penalties, Tensor logits, str config, Tensor? expert_bias, "
      "Tensor? prior_bias, Tensor? prior_probs, Tensor? token_prior_row, Tensor? sequence_ids, int num_sequences, "
      "Tensor? load_fractions, Tensor? expert_rank, int rank, bool training, Tensor routed_indices, "
      "Tensor workspace, Tensor? admitted_indices, bool renormalize, Tensor? token_mask, int threads) -> Tensor");
  m.def(
      "admit(Tensor logits, str config, str admission, Tensor routed_indices, Tensor routed_gates, "
      "Tensor? hidden_norms, Tensor? weight_norms, Tensor? group_ids, int num_groups, Tensor? capacity, "
      "Tensor? token_mask, int threads) -> (Tensor indices, Tensor gates, Tensor status, Tensor report)");
  m.def(
      "dispatch(Tensor indices, int num_experts, int align, int num_ranks, Tensor? expert_rank, int capacity=0) -> "
      "(Tensor counts, Tensor offsets, Tensor permutation, Tensor inverse, Tensor rank_counts)");
  m.def(
      "expert_choice(Tensor logits, int top_k, float capacity_factor, int min_capacity, Tensor? group_ids, "
      "int num_groups, Tensor? capacity, Tensor? token_mask, int threads) -> (Tensor gates, Tensor indices, "
      "Tensor experts_per_token, Tensor report)");
  m.def(
      "expert_choice_backward(Tensor grad_gates, Tensor logits, Tensor indices, Tensor? token_mask, int threads) -> "
      "Tensor");
  m.def("router_l2(Tensor[] weights, Tensor[] base, float coefficient) -> (Tensor value, Tensor[] grads)");
  m.def("prior_build(Tensor logits, Tensor rows, int num_rows, str gating, int threads) -> (Tensor pi, Tensor row_tokens)");
  m.def("prior_prepare(Tensor pi, float epsilon, float cap) -> (Tensor bias, Tensor probs, Tensor report)");
  m.def("expert_bias_update(Tensor(a!) expert_bias, Tensor loads, float rate) -> ()");
}

TORCH_LIBRARY_IMPL(moe_route, Autograd, m) {
  m.impl("route", &route_autograd);
  m.impl("select_experts", &select_experts_autograd);
  m.impl("route_backward", &once_differentiable<decltype(route_backward), route_backward_name>::kernel);
  m.impl("expert_choice", &expert_choice_autograd);
  m.impl("expert_choice_backward",
         &once_differentiable<decltype(expert_choice_backward), expert_choice_backward_name>::kernel);
}

// One set of kernels serves both devices: the adapter picks the backend from
// the tensors' device.
static void kernels(torch::Library& m) {
  m.impl("route", &route);
  m.impl("select_experts", &select_experts);
  m.impl("route_backward", &route_backward);
  m.impl("admit", &admit);
  m.impl("dispatch", &dispatch);
  m.impl("expert_choice", &expert_choice);
  m.impl("expert_choice_backward", &expert_choice_backward);
  m.impl("router_l2", &router_l2);
  m.impl("prior_build", &prior_build);
  m.impl("prior_prepare", &prior_prepare);
  m.impl("expert_bias_update", &expert_bias_update);
}

TORCH_LIBRARY_IMPL(moe_route, CPU, m) { kernels(m); }
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
TORCH_LIBRARY_IMPL(moe_route, CUDA, m) { kernels(m); }
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_route: MoE router policies as torch.ops.moe_route operators (CPU, and CUDA when built for it)";
  m.attr("penalty_names") = std::vector<std::string>(rt::penalty_names, rt::penalty_names + rt::num_penalties);
  m.attr("router_max_k") = rt::router_max_k;
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("preset", &preset);
  m.def("normalizes", &normalizes);
  m.def("route_shape", &route_shape);
  m.def("admission_flags", &admission_flags);
  m.def("admission_preset", &admission_preset);
  m.def("admission_capacity", &admission_capacity);
  m.def("direct_route_seconds", &direct_route_seconds);
  m.def("cpu_isa", &cpu_isa);
}
