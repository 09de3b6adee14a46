// moe_route._C: the library's calls on torch tensors. The Python package
// (python/moe_route) wraps them in autograd functions and modules; everything
// here checks its arguments and raises TypeError (dtype) or ValueError
// (device, shape, values) naming the argument before any output is written.
// The library's own errors (moe_route::error) arrive as ValueError.
//
// A call runs where its first tensor argument lives. CPU tensors take the CPU
// backend. CUDA tensors take runtime::cuda (runtime/cuda.hpp) on torch's
// current stream of that device, with every output and workspace from torch's
// caching allocator; that branch is compiled when MOE_ROUTE_PYTHON_WITH_CUDA is
// defined (a build against a CUDA PyTorch, docs/python.md). Reading a count
// back to the host (the dispatch rows, the admission and expert-choice
// reports, the non-finite rows) synchronises with that stream.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <moe_route/moe_route.hpp>
#include <moe_route/prior/build.hpp>

#include <moe_route/runtime/instantiate.hpp>
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <moe_route/runtime/cuda.hpp>
#endif

namespace py = pybind11;
namespace mr = moe_route;
namespace rt = moe_route::runtime;

namespace {

[[noreturn]] void value_error(const std::string& m) { throw py::value_error("moe_route: " + m); }
[[noreturn]] void type_error(const std::string& m) { throw py::type_error("moe_route: " + m); }

std::string shape_of(const torch::Tensor& t) {
  std::string s = "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// torch's Python name of a dtype, for messages.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "torch.float32";
    case torch::kFloat64: return "torch.float64";
    case torch::kFloat16: return "torch.float16";
    case torch::kBFloat16: return "torch.bfloat16";
    case torch::kInt8: return "torch.int8";
    case torch::kUInt8: return "torch.uint8";
    case torch::kInt32: return "torch.int32";
    case torch::kInt64: return "torch.int64";
    case torch::kBool: return "torch.bool";
    default: return c10::toString(t);
  }
}

// Where a call runs: the device of its first tensor argument (`of`).
struct placement {
  c10::Device device;
  std::string of;
  bool cuda() const { return device.is_cuda(); }
  torch::TensorOptions options(at::ScalarType dtype) const {
    return torch::TensorOptions().dtype(dtype).device(device);
  }
};

// The placement of a call whose first tensor argument is `t`.
placement placement_of(const torch::Tensor& t, const std::string& name) {
  if (!t.defined()) value_error(name + " is undefined");
  const c10::Device d = t.device();
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (!d.is_cpu() && !d.is_cuda())
    value_error(name + " is on " + d.str() + "; moe_route runs on CPU and CUDA tensors");
#else
  if (!d.is_cpu())
    value_error(name + " is on " + d.str() +
                ", but this moe_route was built for the CPU only (build it against a CUDA PyTorch for GPU tensors)");
#endif
  return {d, name};
}

// A tensor of `dtype` and the given shape (-1: any extent) on the call's
// device, made contiguous (a copy only if it was not). Integer index tensors
// may be given as int64; they are range-checked and converted to int32.
torch::Tensor checked(const torch::Tensor& t, const std::string& name, at::ScalarType dtype,
                      std::vector<std::int64_t> shape, const placement& at) {
  if (!t.defined()) value_error(name + " is undefined");
  if (t.device() != at.device)
    value_error(name + " is on " + t.device().str() + ", but " + at.of + " is on " + at.device.str());
  torch::Tensor u = t;
  if (dtype == torch::kInt32 && t.scalar_type() == torch::kInt64) {
    if (t.numel() > 0 && (t.min().item<std::int64_t>() < INT32_MIN || t.max().item<std::int64_t>() > INT32_MAX))
      value_error(name + " has values outside the int32 range");
    u = t.to(torch::kInt32);
  } else if (t.scalar_type() != dtype) {
    type_error(name + " must be " + dtype_name(dtype) + (dtype == torch::kInt32 ? " or torch.int64" : "") + ", got " +
               dtype_name(t.scalar_type()));
  }
  bool ok = u.dim() == static_cast<std::int64_t>(shape.size());
  for (std::size_t d = 0; ok && d < shape.size(); ++d) ok = shape[d] < 0 || u.size(d) == shape[d];
  if (!ok) {
    std::string want = "[";
    for (std::size_t d = 0; d < shape.size(); ++d)
      want += (d ? ", " : "") + (shape[d] < 0 ? std::string("*") : std::to_string(shape[d]));
    value_error(name + " must have shape " + want + "], got " + shape_of(u));
  }
  return u.contiguous();
}

std::optional<torch::Tensor> checked(const std::optional<torch::Tensor>& t, const std::string& name,
                                     at::ScalarType dtype, std::vector<std::int64_t> shape, const placement& at) {
  if (!t || !t->defined()) return std::nullopt;
  return checked(*t, name, dtype, std::move(shape), at);
}

template <class T>
const T* ptr(const std::optional<torch::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

// ---------------------------------------------------------------------------
// Configurations: Python passes plain dicts (the dataclasses' fields).

template <class Enum>
Enum parse_enum(const py::handle& v, const char* field, std::initializer_list<std::pair<const char*, Enum>> names) {
  const std::string s = py::str(v);
  std::string all;
  for (const auto& [n, e] : names) {
    if (s == n) return e;
    all += (all.empty() ? "" : ", ") + std::string(n);
  }
  value_error(std::string(field) + " = '" + s + "' is not one of: " + all);
}

rt::gating_kind parse_gating(const py::handle& v) {
  return parse_enum<rt::gating_kind>(v, "gating",
                                     {{"softmax", rt::gating_kind::softmax},
                                      {"sigmoid", rt::gating_kind::sigmoid},
                                      {"sqrt_softplus", rt::gating_kind::sqrt_softplus},
                                      {"softmax_after_topk", rt::gating_kind::softmax_after_topk}});
}

rt::router_config parse_router(const py::dict& d) {
  rt::router_config c;
  for (const auto& item : d) {
    const std::string key = py::str(item.first);
    const py::handle v = item.second;
    if (key == "gating")
      c.gating = parse_gating(v);
    else if (key == "selection")
      c.selection = parse_enum<rt::selection_kind>(v, "selection",
                                                   {{"top_k", rt::selection_kind::top_k},
                                                    {"expert_bias", rt::selection_kind::expert_bias},
                                                    {"group_limited", rt::selection_kind::group_limited},
                                                    {"group_limited_bias", rt::selection_kind::group_limited_bias},
                                                    {"fixed", rt::selection_kind::fixed}});
    else if (key == "prior")
      c.prior = parse_enum<rt::prior_kind>(v, "prior",
                                           {{"none", rt::prior_kind::none},
                                            {"log_prior_bias", rt::prior_kind::log_prior_bias},
                                            {"prior_override", rt::prior_kind::prior_override}});
    else if (key == "load_balance_scope")
      c.load_balance.over = parse_enum<mr::penalty::load_balance::scope>(
          v, "load_balance_scope",
          {{"batch", mr::penalty::load_balance::scope::batch},
           {"sequence", mr::penalty::load_balance::scope::sequence},
           {"global_batch", mr::penalty::load_balance::scope::global_batch}});
    else if (key == "top_k") c.top_k = v.cast<int>();
    else if (key == "normalize") c.normalize = v.cast<bool>();
    else if (key == "scaling_factor") c.scaling_factor = v.cast<float>();
    else if (key == "groups") c.groups = v.cast<int>();
    else if (key == "top_groups") c.top_groups = v.cast<int>();
    else if (key == "per_group_k") c.per_group_k = v.cast<int>();
    else if (key == "bias_update_rate") c.bias_update_rate = v.cast<float>();
    else if (key == "prior_beta") c.prior_bias.beta = v.cast<float>();
    else if (key == "bias_gates") c.prior_bias.bias_gates = v.cast<bool>();
    else if (key == "load_balance") c.load_balance.coefficient = v.cast<float>();
    else if (key == "z_loss") c.z_loss.coefficient = v.cast<float>();
    else if (key == "kl_to_base") c.kl_to_base.coefficient = v.cast<float>();
    else if (key == "logit_l2") c.logit_l2.coefficient = v.cast<float>();
    else if (key == "locality") c.locality.coefficient = v.cast<float>();
    else if (key == "locality_epsilon") c.locality.epsilon = v.cast<float>();
    else value_error("RouterConfig has no field '" + key + "'");
  }
  rt::validate(c);
  return c;
}

rt::admission_config parse_admission(const py::dict& d) {
  rt::admission_config a;
  for (const auto& item : d) {
    const std::string key = py::str(item.first);
    const py::handle v = item.second;
    if (key == "kind") {
      a.dropless = parse_enum<bool>(v, "kind", {{"dropless", true}, {"capacity", false}});
    } else if (key == "affinity") {
      a.affinity = parse_enum<rt::affinity_kind>(v, "affinity",
                                                 {{"position", rt::affinity_kind::position},
                                                  {"probability", rt::affinity_kind::probability},
                                                  {"logit", rt::affinity_kind::logit},
                                                  {"cosine", rt::affinity_kind::cosine}});
    } else if (key == "overflow") {
      a.overflow = parse_enum<rt::overflow_kind>(v, "overflow",
                                                 {{"drop", rt::overflow_kind::drop}, {"reroute", rt::overflow_kind::reroute}});
    } else if (key == "threshold") {
      a.threshold = v.cast<float>();
    } else if (key == "capacity_factor") {
      a.capacity_factor = v.cast<double>();
    } else if (key == "min_capacity") {
      a.min_capacity = v.cast<std::int64_t>();
    } else if (key == "renormalize") {
      a.renormalize = v.cast<bool>();
    } else if (key == "fill_factor") {
      a.fill_factor = v.cast<double>();
    } else if (key == "max_rounds") {
      a.max_rounds = v.cast<int>();
    } else {
      value_error("Admission has no field '" + key + "'");
    }
  }
  rt::validate(a);
  return a;
}

// ---------------------------------------------------------------------------
// Routing.

torch::Tensor logits_of(const torch::Tensor& logits, const placement& at) {
  torch::Tensor z = checked(logits, "logits", torch::kFloat32, {-1, -1}, at);
  if (z.size(1) < 1) value_error("logits must have at least one expert column, got shape " + shape_of(z));
  return z;
}

#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
// torch's current stream on the call's device (the device is made current by
// the caller's DeviceGuard).
rt::cuda::stream_t stream_of(const placement& at) {
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(at.device.type());
  return static_cast<rt::cuda::stream_t>(impl->getStreamNativeHandle(impl->getStream(at.device)));
}

// A device buffer of `bytes` bytes from torch's caching allocator (none for 0).
torch::Tensor device_bytes(std::size_t bytes, const placement& at) {
  return torch::empty({static_cast<std::int64_t>(bytes)}, at.options(torch::kUInt8));
}

// A device struct of int64 counters read back to the host (synchronises).
template <class Report>
Report read_back(const torch::Tensor& device_report) {
  static_assert(sizeof(Report) % sizeof(std::int64_t) == 0, "reports are int64 counters");
  const torch::Tensor host = device_report.cpu();
  Report r;
  std::memcpy(&r, host.data_ptr(), sizeof(Report));
  return r;
}

torch::Tensor device_report(std::size_t bytes, const placement& at) {
  return torch::zeros({static_cast<std::int64_t>(bytes / sizeof(std::int64_t))}, at.options(torch::kInt64));
}
#endif

// route_inputs over the tensors of a call, which it keeps alive.
struct call_inputs {
  placement at;
  torch::Tensor logits;
  std::optional<torch::Tensor> expert_bias, prior_bias, prior_probs, token_prior_row, sequence_ids, load_fractions,
      expert_rank;
  mr::route_inputs<float> in;

  call_inputs(const torch::Tensor& z, const py::dict& d, bool training)
      : at(placement_of(z, "logits")), logits(logits_of(z, at)) {
    const std::int64_t n = logits.size(0), e = logits.size(1);
    auto get = [&](const char* key) -> std::optional<torch::Tensor> {
      if (!d.contains(key) || d[key].is_none()) return std::nullopt;
      return d[key].cast<torch::Tensor>();
    };
    expert_bias = checked(get("expert_bias"), "expert_bias", torch::kFloat32, {e}, at);
    prior_bias = checked(get("prior_bias"), "prior_bias", torch::kFloat32, {-1, e}, at);
    prior_probs = checked(get("prior_probs"), "prior_probs", torch::kFloat32, {-1, e}, at);
    if (prior_bias && prior_probs && prior_bias->size(0) != prior_probs->size(0))
      value_error("prior_bias and prior_probs must have the same number of rows, got " + shape_of(*prior_bias) +
                  " and " + shape_of(*prior_probs));
    token_prior_row = checked(get("token_prior_row"), "token_prior_row", torch::kInt32, {n}, at);
    sequence_ids = checked(get("sequence_ids"), "sequence_ids", torch::kInt32, {n}, at);
    load_fractions = checked(get("load_fractions"), "load_fractions", torch::kFloat32, {e}, at);
    expert_rank = checked(get("expert_rank"), "expert_rank", torch::kInt32, {e}, at);
    in.logits = logits.data_ptr<float>();
    in.num_tokens = n;
    in.num_experts = static_cast<int>(e);
    in.expert_bias = ptr<float>(expert_bias);
    in.mode = training ? mr::mode::train : mr::mode::eval;
    in.prior_bias = ptr<float>(prior_bias);
    in.prior_probs = ptr<float>(prior_probs);
    in.prior_rows = prior_bias ? prior_bias->size(0) : (prior_probs ? prior_probs->size(0) : 0);
    in.token_prior_row = ptr<std::int32_t>(token_prior_row);
    in.sequence_ids = ptr<std::int32_t>(sequence_ids);
    in.num_sequences = d.contains("num_sequences") && !d["num_sequences"].is_none()
                           ? d["num_sequences"].cast<std::int32_t>()
                           : 0;
    if (sequence_ids && in.num_sequences < 1) value_error("num_sequences must be >= 1 when sequence_ids is given");
    in.load_fractions = ptr<float>(load_fractions);
    in.expert_rank = ptr<std::int32_t>(expert_rank);
    in.rank = d.contains("rank") && !d["rank"].is_none() ? d["rank"].cast<std::int32_t>() : 0;
  }
};

// Forward: (indices [N, K] int32, gates [N, K] fp32, penalty values [5] fp64,
// workspace uint8, rows with non-finite logits: an int, or on CUDA a device
// int64 [1] that Python reads when asked).
py::tuple route_forward(const torch::Tensor& logits, const py::dict& config, const py::dict& inputs, bool training,
                        int threads) {
  const rt::router_config c = parse_router(config);
  call_inputs call(logits, inputs, training);
  const placement& at = call.at;
  const std::int64_t n = call.in.num_tokens;
  if (c.top_k > call.in.num_experts)
    value_error("top_k (= " + std::to_string(c.top_k) + ") exceeds the number of experts (= " +
                std::to_string(call.in.num_experts) + ")");
  auto indices = torch::empty({n, c.top_k}, at.options(torch::kInt32));
  auto gates = torch::empty({n, c.top_k}, at.options(torch::kFloat32));
  auto values = torch::zeros({rt::num_penalties}, at.options(torch::kFloat64));
  auto workspace = torch::empty(
      {static_cast<std::int64_t>(rt::workspace_bytes(c, n, call.in.num_experts, call.in.num_sequences))},
      at.options(torch::kUInt8));
  mr::route_outputs out;
  out.indices = indices.data_ptr<std::int32_t>();
  out.gates = gates.data_ptr<float>();
  out.penalty_values = values.data_ptr<double>();
  out.workspace = workspace.data_ptr<std::uint8_t>();
  out.workspace_bytes = static_cast<std::size_t>(workspace.numel());
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (at.cuda()) {
    const c10::DeviceGuard guard(at.device);
    auto nonfinite = torch::zeros({1}, at.options(torch::kInt64));
    out.nonfinite_rows = nonfinite.data_ptr<std::int64_t>();
    const std::size_t scratch_bytes = rt::cuda::neutral_bytes(c, call.in);
    auto scratch = device_bytes(scratch_bytes, at);
    rt::cuda::route(c, call.in, out, scratch.data_ptr(), scratch_bytes, stream_of(at));
    return py::make_tuple(indices, gates, values, workspace, nonfinite);
  }
#endif
  mr::route_report rep;
  {
    py::gil_scoped_release release;
    rep = rt::route(c, call.in, out, mr::cpu::execution{threads});
  }
  return py::make_tuple(indices, gates, values, workspace, rep.nonfinite_rows);
}

torch::Tensor route_backward(const torch::Tensor& logits, const py::dict& config, const py::dict& inputs,
                             bool training, int threads, const torch::Tensor& indices, const torch::Tensor& grad_gates,
                             const torch::Tensor& penalty_grads, const torch::Tensor& workspace,
                             const std::optional<torch::Tensor>& admitted_indices, bool renormalize) {
  const rt::router_config c = parse_router(config);
  call_inputs call(logits, inputs, training);
  const placement& at = call.at;
  const std::int64_t n = call.in.num_tokens;
  const auto idx = checked(indices, "indices", torch::kInt32, {n, c.top_k}, at);
  const auto dw = checked(grad_gates, "grad_gates", torch::kFloat32, {n, c.top_k}, at);
  // The penalty gradients are read on the host by both backends.
  const auto dp = checked(penalty_grads.cpu(), "penalty_grads", torch::kFloat32, {rt::num_penalties},
                          placement{c10::Device(c10::kCPU), "the host"});
  const auto ws = checked(workspace, "workspace", torch::kUInt8, {-1}, at);
  const auto admitted = checked(admitted_indices, "admitted_indices", torch::kInt32, {n, c.top_k}, at);
  auto grad = torch::empty({n, call.in.num_experts}, at.options(torch::kFloat32));
  mr::backward_args b;
  b.indices = idx.data_ptr<std::int32_t>();
  b.grad_gates = dw.data_ptr<float>();
  b.grad_logits = grad.data_ptr<float>();
  b.admitted_indices = ptr<std::int32_t>(admitted);
  b.renormalize = renormalize;
  b.workspace = ws.data_ptr<std::uint8_t>();
  b.workspace_bytes = static_cast<std::size_t>(ws.numel());
  b.penalty_grads = dp.data_ptr<float>();
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (at.cuda()) {
    const c10::DeviceGuard guard(at.device);
    const std::size_t scratch_bytes = rt::cuda::neutral_bytes(c, call.in);
    auto scratch = device_bytes(scratch_bytes, at);
    rt::cuda::backward(c, call.in, b, scratch.data_ptr(), scratch_bytes, stream_of(at));
    return grad;
  }
#endif
  {
    py::gil_scoped_release release;
    rt::backward(c, call.in, b, mr::cpu::execution{threads});
  }
  return grad;
}

py::dict report_dict(const mr::admission_report& r) {
  py::dict d;
  d["offered"] = r.offered;
  d["kept"] = r.kept;
  d["rerouted"] = r.rerouted;
  d["dropped"] = r.dropped;
  d["below_threshold"] = r.below_threshold;
  d["over_capacity"] = r.over_capacity;
  d["tokens_without_experts"] = r.tokens_without_experts;
  return d;
}

// Admission: (indices [N, K] int32, gates [N, K] fp32, status [N, K] int8, report).
py::tuple admit(const torch::Tensor& logits, const py::dict& config, const py::dict& admission,
                const torch::Tensor& routed_indices, const torch::Tensor& routed_gates,
                const std::optional<torch::Tensor>& hidden_norms, const std::optional<torch::Tensor>& weight_norms,
                const std::optional<torch::Tensor>& group_ids, int num_groups,
                const std::optional<torch::Tensor>& capacity, int threads) {
  const rt::router_config c = parse_router(config);
  const rt::admission_config a = parse_admission(admission);
  const placement at = placement_of(logits, "logits");
  const auto z = logits_of(logits, at);
  const std::int64_t n = z.size(0), e = z.size(1);
  const auto routed = checked(routed_indices, "routed_indices", torch::kInt32, {n, c.top_k}, at);
  const auto gates_in = checked(routed_gates, "routed_gates", torch::kFloat32, {n, c.top_k}, at);
  const auto xn = checked(hidden_norms, "hidden_norms", torch::kFloat32, {n}, at);
  const auto wn = checked(weight_norms, "weight_norms", torch::kFloat32, {e}, at);
  const auto groups = checked(group_ids, "group_ids", torch::kInt32, {n}, at);
  const auto cap = checked(capacity, "capacity", torch::kInt64, {e}, at);
  mr::admission_inputs<float> in;
  in.logits = z.data_ptr<float>();
  in.num_tokens = n;
  in.num_experts = static_cast<int>(e);
  in.routed_indices = routed.data_ptr<std::int32_t>();
  in.routed_gates = gates_in.data_ptr<float>();
  in.hidden_norms = ptr<float>(xn);
  in.weight_norms = ptr<float>(wn);
  in.group_ids = ptr<std::int32_t>(groups);
  in.num_groups = num_groups;
  in.capacity = ptr<std::int64_t>(cap);
  auto indices = torch::empty({n, c.top_k}, at.options(torch::kInt32));
  auto gates = torch::empty({n, c.top_k}, at.options(torch::kFloat32));
  auto status = torch::empty({n, c.top_k}, at.options(torch::kInt8));
  mr::admission_outputs out;
  out.indices = indices.data_ptr<std::int32_t>();
  out.gates = gates.data_ptr<float>();
  out.status = status.data_ptr<std::int8_t>();
  mr::admission_report rep;
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (at.cuda()) {
    const c10::DeviceGuard guard(at.device);
    const std::size_t bytes = rt::cuda::admit_workspace_bytes(c, a, n, in.num_experts, num_groups);
    auto workspace = device_bytes(bytes, at);
    auto report = device_report(sizeof(mr::admission_report), at);
    out.report = reinterpret_cast<mr::admission_report*>(report.data_ptr<std::int64_t>());
    rt::cuda::admit(c, a, in, out, workspace.data_ptr(), bytes, stream_of(at));
    rep = read_back<mr::admission_report>(report);
    // The CPU backend rejects these inputs before admitting; the device drops their slots and counts them.
    if (rep.invalid > 0)
      value_error("admit: " + std::to_string(rep.invalid) +
                  " slots had a routed index outside [0, E), a group id outside [0, num_groups) or (cosine) a "
                  "norm that is not finite and > 0");
    return py::make_tuple(indices, gates, status, report_dict(rep));
  }
#endif
  {
    py::gil_scoped_release release;
    rep = rt::admit(c, a, in, out, mr::cpu::execution{threads});
  }
  return py::make_tuple(indices, gates, status, report_dict(rep));
}

// Dispatch metadata: (counts [E], offsets [E + 1], permutation [rows bound],
// inverse [N * S], rank_counts [R]), all int64; the permutation is cut to the
// rows used (offsets[E], read back from the device on CUDA).
py::tuple dispatch(const torch::Tensor& indices, int num_experts, int align, int num_ranks,
                   const std::optional<torch::Tensor>& expert_rank) {
  const placement at = placement_of(indices, "indices");
  const auto idx = checked(indices, "indices", torch::kInt32, {-1, -1}, at);
  const auto ranks = checked(expert_rank, "expert_rank", torch::kInt32, {num_experts}, at);
  if (num_experts < 1) value_error("num_experts must be >= 1");
  if (align < 1) value_error("align must be >= 1");
  if (num_ranks < 1) value_error("num_ranks must be >= 1");
  if (idx.size(1) < 1) value_error("indices must have at least one slot per token");
  mr::dispatch_inputs in;
  in.indices = idx.data_ptr<std::int32_t>();
  in.num_tokens = idx.size(0);
  in.slots_per_token = static_cast<int>(idx.size(1));
  in.num_experts = num_experts;
  in.align = align;
  in.num_ranks = num_ranks;
  in.expert_rank = ptr<std::int32_t>(ranks);
  const auto i64 = at.options(torch::kInt64);
  auto counts = torch::empty({num_experts}, i64);
  auto offsets = torch::empty({num_experts + 1}, i64);
  auto permutation =
      torch::empty({mr::dispatch_rows_bound(in.num_tokens, in.slots_per_token, num_experts, align)}, i64);
  auto inverse = torch::empty({in.num_tokens * in.slots_per_token}, i64);
  auto rank_counts = torch::empty({num_ranks}, i64);
  mr::dispatch_outputs out;
  out.counts = counts.data_ptr<std::int64_t>();
  out.offsets = offsets.data_ptr<std::int64_t>();
  out.permutation = permutation.data_ptr<std::int64_t>();
  out.inverse = inverse.data_ptr<std::int64_t>();
  out.rank_counts = rank_counts.data_ptr<std::int64_t>();
  std::int64_t rows = 0;
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (at.cuda()) {
    const c10::DeviceGuard guard(at.device);
    const std::size_t bytes = rt::cuda::dispatch_workspace_bytes(in.num_tokens, in.slots_per_token, num_experts);
    auto workspace = device_bytes(bytes, at);
    rt::cuda::dispatch(in, out, workspace.data_ptr(), bytes, stream_of(at));
    rows = offsets[num_experts].item<std::int64_t>();
  } else
#endif
  {
    rows = mr::cpu::dispatch(in, out);
  }
  return py::make_tuple(counts, offsets, permutation.narrow(0, 0, rows), inverse, rank_counts);
}

// ---------------------------------------------------------------------------
// Expert choice, Router-L2, prior tools, the expert-bias update, presets.

mr::expert_choice_inputs<float> expert_choice_inputs_of(const torch::Tensor& z, const std::optional<torch::Tensor>& groups,
                                                        int num_groups, const std::optional<torch::Tensor>& cap) {
  mr::expert_choice_inputs<float> in;
  in.logits = z.data_ptr<float>();
  in.num_tokens = z.size(0);
  in.num_experts = static_cast<int>(z.size(1));
  in.group_ids = ptr<std::int32_t>(groups);
  in.num_groups = num_groups;
  in.capacity = ptr<std::int64_t>(cap);
  return in;
}

py::tuple expert_choice(const torch::Tensor& logits, int top_k, double capacity_factor, std::int64_t min_capacity,
                        const std::optional<torch::Tensor>& group_ids, int num_groups,
                        const std::optional<torch::Tensor>& capacity, int threads) {
  const placement at = placement_of(logits, "logits");
  const auto z = logits_of(logits, at);
  const std::int64_t n = z.size(0), e = z.size(1);
  const auto groups = checked(group_ids, "group_ids", torch::kInt32, {n}, at);
  const auto cap = checked(capacity, "capacity", torch::kInt64, {e}, at);
  mr::selection::expert_choice p;
  p.top_k = top_k;
  p.capacity_factor = capacity_factor;
  p.min_capacity = min_capacity;
  auto indices = torch::empty({n, e}, at.options(torch::kInt32));
  auto gates = torch::empty({n, e}, at.options(torch::kFloat32));
  auto per_token = torch::empty({n}, at.options(torch::kInt32));
  mr::expert_choice_report rep;
  mr::expert_choice_outputs out;
  out.indices = indices.data_ptr<std::int32_t>();
  out.gates = gates.data_ptr<float>();
  out.experts_per_token = per_token.data_ptr<std::int32_t>();
  const auto in = expert_choice_inputs_of(z, groups, num_groups, cap);
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (at.cuda()) {
    const c10::DeviceGuard guard(at.device);
    const std::size_t bytes = rt::cuda::expert_choice_workspace_bytes(p, n, in.num_experts, num_groups);
    auto workspace = device_bytes(bytes, at);
    auto report = device_report(sizeof(mr::expert_choice_report), at);
    out.report = reinterpret_cast<mr::expert_choice_report*>(report.data_ptr<std::int64_t>());
    rt::cuda::expert_choice(p, in, out, workspace.data_ptr(), bytes, stream_of(at));
    rep = read_back<mr::expert_choice_report>(report);
    // The CPU backend rejects these group ids before choosing; the device leaves their tokens out and counts them.
    if (rep.invalid > 0)
      value_error("expert_choice: " + std::to_string(rep.invalid) + " tokens had a group id outside [0, num_groups)");
  } else
#endif
  {
    py::gil_scoped_release release;
    rep = mr::cpu::expert_choice(p, in, out, mr::cpu::execution{threads});
  }
  py::dict r;
  r["assignments"] = rep.assignments;
  r["tokens_without_experts"] = rep.tokens_without_experts;
  r["max_experts_per_token"] = rep.max_experts_per_token;
  return py::make_tuple(indices, gates, per_token, r);
}

torch::Tensor expert_choice_backward(const torch::Tensor& logits, const torch::Tensor& indices,
                                     const torch::Tensor& grad_gates, int threads) {
  const placement at = placement_of(logits, "logits");
  const auto z = logits_of(logits, at);
  const std::int64_t n = z.size(0), e = z.size(1);
  const auto idx = checked(indices, "indices", torch::kInt32, {n, e}, at);
  const auto dw = checked(grad_gates, "grad_gates", torch::kFloat32, {n, e}, at);
  auto grad = torch::empty({n, e}, at.options(torch::kFloat32));
  const auto in = expert_choice_inputs_of(z, std::nullopt, 1, std::nullopt);
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (at.cuda()) {
    const c10::DeviceGuard guard(at.device);
    rt::cuda::expert_choice_backward(in, idx.data_ptr<std::int32_t>(), dw.data_ptr<float>(), grad.data_ptr<float>(),
                                     stream_of(at));
    return grad;
  }
#endif
  py::gil_scoped_release release;
  mr::cpu::expert_choice_backward(in, idx.data_ptr<std::int32_t>(), dw.data_ptr<float>(), grad.data_ptr<float>(),
                                  mr::cpu::execution{threads});
  return grad;
}

// Router-L2 over layers: (value, [dL/dW_l]); the value is a float on the CPU
// and a 0-d float64 tensor on CUDA.
py::tuple router_l2(const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& base,
                    float coefficient) {
  if (weights.size() != base.size())
    value_error("router_l2: weights and base must list the same number of layers, got " +
                std::to_string(weights.size()) + " and " + std::to_string(base.size()));
  if (weights.empty()) value_error("router_l2: weights must list at least one layer");
  const placement at = placement_of(weights[0], "router_l2: layer 0 weights");
  std::vector<torch::Tensor> w, w0, grads;
  std::vector<mr::penalty::router_weights> layers;
  for (std::size_t l = 0; l < weights.size(); ++l) {
    const std::string name = "router_l2: layer " + std::to_string(l) + " ";
    w.push_back(
        checked(weights[l], name + "weights", torch::kFloat32, std::vector<std::int64_t>(weights[l].dim(), -1), at));
    w0.push_back(
        checked(base[l], name + "base", torch::kFloat32, std::vector<std::int64_t>(weights[l].sizes().vec()), at));
    grads.push_back(torch::zeros_like(w.back()));
    layers.push_back({w.back().data_ptr<float>(), w0.back().data_ptr<float>(), w.back().numel(),
                      grads.back().data_ptr<float>()});
  }
  const mr::penalty::router_l2 policy{coefficient};
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (at.cuda()) {
    const c10::DeviceGuard guard(at.device);
    const int num_layers = static_cast<int>(layers.size());
    const std::size_t bytes = rt::cuda::router_l2_workspace_bytes(layers.data(), num_layers);
    auto workspace = device_bytes(bytes, at);
    auto value = torch::empty({}, at.options(torch::kFloat64));
    rt::cuda::router_l2(policy, layers.data(), num_layers, value.data_ptr<double>(), workspace.data_ptr(), bytes,
                        stream_of(at));
    return py::make_tuple(value, grads);
  }
#endif
  const double value = policy.apply(layers.data(), static_cast<int>(layers.size()));
  return py::make_tuple(value, grads);
}

// A host tool: on CUDA the prior is prepared on a host copy and the results
// are moved back (S x E floats, once per base model).
py::tuple prior_prepare(const torch::Tensor& pi, float epsilon, float cap) {
  const placement at = placement_of(pi, "pi");
  const auto p = checked(pi, "pi", torch::kFloat32, {-1, -1}, at).cpu();
  auto bias = torch::empty_like(p), probs = torch::empty_like(p);
  mr::prior::clamp_bounds bounds;
  bounds.epsilon = epsilon;
  bounds.cap = cap;
  const auto rep = mr::prior::prepare(p.data_ptr<float>(), p.size(0), static_cast<int>(p.size(1)),
                                      bias.data_ptr<float>(), probs.data_ptr<float>(), bounds);
  py::dict r;
  r["upper_clamped"] = rep.upper_clamped;
  r["lower_clamped"] = rep.lower_clamped;
  return py::make_tuple(bias.to(at.device), probs.to(at.device), r);
}

// (pi [S, E], the empty rows as a list).
py::tuple prior_build(const torch::Tensor& logits, const torch::Tensor& rows, std::int64_t num_rows,
                      const std::string& gating) {
  const placement at = placement_of(logits, "logits");
  const auto z = logits_of(logits, at);
  const auto r = checked(rows, "rows", torch::kInt32, {z.size(0)}, at);
  if (num_rows < 1) value_error("num_rows must be >= 1");
  const rt::gating_kind g = parse_gating(py::str(gating));
  auto pi = torch::empty({num_rows, z.size(1)}, at.options(torch::kFloat32));
  mr::route_inputs<float> in;
  in.logits = z.data_ptr<float>();
  in.num_tokens = z.size(0);
  in.num_experts = static_cast<int>(z.size(1));
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  if (at.cuda()) {
    const c10::DeviceGuard guard(at.device);
    // The host builder rejects row ids outside [-1, S); the device one leaves those tokens out.
    if (r.numel() > 0 && (r.min().item<std::int32_t>() < -1 || r.max().item<std::int32_t>() >= num_rows))
      value_error("rows must be -1 or in [0, num_rows = " + std::to_string(num_rows) + ")");
    const std::size_t bytes = rt::cuda::prior_build_workspace_bytes(num_rows, in.num_experts);
    auto workspace = device_bytes(bytes, at);
    auto row_tokens = torch::empty({num_rows}, at.options(torch::kInt64));
    rt::cuda::prior_build(g, in, r.data_ptr<std::int32_t>(), num_rows, pi.data_ptr<float>(),
                          row_tokens.data_ptr<std::int64_t>(), workspace.data_ptr(), bytes, stream_of(at));
    const torch::Tensor empty = torch::nonzero(row_tokens == 0).flatten().cpu();
    return py::make_tuple(pi, std::vector<std::int64_t>(empty.data_ptr<std::int64_t>(),
                                                        empty.data_ptr<std::int64_t>() + empty.numel()));
  }
#endif
  const mr::prior::build_report rep = rt::detail::by_gating(g, [&](auto gating) {
    return mr::prior::build<decltype(gating)>(in, r.data_ptr<std::int32_t>(), num_rows, pi.data_ptr<float>());
  });
  return py::make_tuple(pi, rep.empty_rows);
}

// In place. A CUDA bias is updated through a host copy (E floats): the update
// is the host policy's, bit for bit.
void expert_bias_update(torch::Tensor& bias, const torch::Tensor& loads, float rate) {
  if (!bias.defined() || bias.scalar_type() != torch::kFloat32 || !bias.is_contiguous() || bias.dim() != 1)
    value_error("expert_bias must be a contiguous 1-D float32 tensor, updated in place");
  const placement at = placement_of(bias, "expert_bias");
  const auto l = checked(loads.to(torch::kFloat64), "loads", torch::kFloat64, {bias.size(0)}, at).cpu();
  torch::Tensor host = bias.cpu();
  mr::selection::expert_bias policy;
  policy.update_rate = rate;
  policy.update(host.data_ptr<float>(), l.data_ptr<double>(), static_cast<int>(bias.size(0)));
  if (at.cuda()) bias.copy_(host);
}

// The published models' routers (presets.hpp) as RouterConfig fields.
py::dict preset(const std::string& name) {
  py::dict d;
  auto common = [&](const auto& r, const char* gating, const char* selection, int experts) {
    d["gating"] = gating;
    d["selection"] = selection;
    d["top_k"] = r.top_k;
    d["normalize"] = r.normalize;
    d["scaling_factor"] = r.scaling_factor;
    d["num_experts"] = experts;
  };
  namespace p = mr::presets;
  if (name == "deepseek_v2_lite") {
    common(p::deepseek_v2_lite(), "softmax", "top_k", p::deepseek_v2_lite_experts);
  } else if (name == "moonlight") {
    common(p::moonlight(), "sigmoid", "expert_bias", p::moonlight_experts);
    d["bias_update_rate"] = p::moonlight().selection.update_rate;
  } else if (name == "deepseek_v3") {
    const auto r = p::deepseek_v3();
    common(r, "sigmoid", "group_limited_bias", p::deepseek_v3_experts);
    d["groups"] = r.selection.groups;
    d["top_groups"] = r.selection.top_groups;
    d["per_group_k"] = r.selection.per_group_k;
    d["bias_update_rate"] = r.selection.inner.update_rate;
  } else if (name == "qwen3") {
    common(p::qwen3(), "softmax", "top_k", p::qwen3_experts);
  } else if (name == "mixtral") {
    common(p::mixtral(), "softmax_after_topk", "top_k", p::mixtral_experts);
  } else if (name == "deepseek_v4") {
    common(p::deepseek_v4(), "sqrt_softplus", "expert_bias", p::deepseek_v4_experts);
    d["bias_update_rate"] = p::deepseek_v4().selection.update_rate;
  } else {
    value_error("no preset named '" + name +
                "' (deepseek_v2_lite, moonlight, deepseek_v3, qwen3, mixtral, deepseek_v4)");
  }
  return d;
}

bool normalizes_by_default(const std::string& gating) {
  return rt::detail::by_gating(parse_gating(py::str(gating)), [](auto g) { return decltype(g)::normalize_by_default; });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_route: MoE router policies (CPU backend, and CUDA when built against a CUDA PyTorch)";
  m.attr("penalty_names") = std::vector<std::string>(rt::penalty_names, rt::penalty_names + rt::num_penalties);
  m.attr("router_max_k") = rt::router_max_k;
#ifdef MOE_ROUTE_PYTHON_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("route_forward", &route_forward);
  m.def("route_backward", &route_backward);
  m.def("admit", &admit);
  m.def("dispatch", &dispatch);
  m.def("expert_choice", &expert_choice);
  m.def("expert_choice_backward", &expert_choice_backward);
  m.def("router_l2", &router_l2);
  m.def("prior_prepare", &prior_prepare);
  m.def("prior_build", &prior_build);
  m.def("expert_bias_update", &expert_bias_update);
  m.def("preset", &preset);
  m.def("normalizes_by_default", &normalizes_by_default);
}
