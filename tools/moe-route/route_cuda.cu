// moe-route route --backend cuda: the same routing as the CPU path of
// route.cpp (gating x selection, the prior policies, admission) on the GPU with
// device buffers: moe_route::cuda::route, cuda::admit with its workspace, or
// cuda::expert_choice. The results are downloaded; route.cpp computes the
// dispatch metadata and statistics on the host, as for the CPU backend.
#include "route_cuda.hpp"

#include <moe_route/moe_route.cuh>

#include <cuda_runtime.h>

#include <limits>
#include <stdexcept>
#include <utility>

namespace moe_route_cli {

namespace mr = moe_route;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("--backend cuda: ") + what + ": " + cudaGetErrorString(e));
}

// An owned device array of n elements (at least one, so that no pointer is null).
template <class T>
class device_array {
 public:
  device_array() = default;
  explicit device_array(std::size_t n) : n_(n) {
    check(cudaMalloc(reinterpret_cast<void**>(&p_), (n > 0 ? n : 1) * sizeof(T)), "cudaMalloc");
  }
  device_array(const T* host, std::size_t n) : device_array(n) {
    if (n > 0) check(cudaMemcpy(p_, host, n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy to the device");
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  device_array(device_array&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
  device_array& operator=(device_array&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~device_array() {
    if (p_ != nullptr) cudaFree(p_);
  }
  T* get() const { return p_; }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_ > 0) check(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
    return h;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

template <class T>
device_array<T> upload(const T* host, std::size_t n) {
  return host == nullptr ? device_array<T>() : device_array<T>(host, n);
}

struct device_data {
  device_array<float> logits, admission_logits, expert_bias, hidden_norms, weight_norms, prior_bias;
  device_array<std::int32_t> prior_rows;
  const float* z_admission() const { return admission_logits.get() != nullptr ? admission_logits.get() : logits.get(); }
};

// The routing call: the router alone or with its prior policy (mode::train).
template <class Router>
void route_device(const Router& r, const cuda_route_args& a, const device_data& d, const mr::route_outputs& out) {
  mr::route_inputs<float> ri{d.logits.get(), a.n, a.e, d.expert_bias.get()};
  if (a.prior_mode == cuda_route_args::prior::none) return mr::cuda::route(r, ri, out);
  ri.mode = mr::mode::train;
  ri.prior_bias = d.prior_bias.get();
  ri.prior_rows = a.prior_rows;
  ri.token_prior_row = d.prior_rows.get();
  if (a.prior_mode == cuda_route_args::prior::soft)
    return mr::cuda::route(mr::with_policies(r, mr::prior::log_prior_bias{a.beta, true}), ri, out);
  mr::cuda::route(mr::with_policies(r, mr::prior::prior_override{}), ri, out);
}

template <class Router>
cuda_route_result run_router(Router r, const cuda_route_args& a, const device_data& d) {
  cuda_route_result res;
  r.top_k = a.k;
  if (a.normalize_set) r.normalize = a.normalize;
  r.scaling_factor = a.scaling;
  res.slots = a.k;
  const std::size_t slots = static_cast<std::size_t>(a.n) * a.k;
  device_array<std::int32_t> idx(slots);
  device_array<float> gates(slots);
  device_array<std::int64_t> nonfinite(1);
  check(cudaMemset(nonfinite.get(), 0, sizeof(std::int64_t)), "cudaMemset");
  route_device(r, a, d, mr::route_outputs{idx.get(), gates.get(), nonfinite.get()});

  // Admission with a plain top-k router of the same gating (as route.cpp).
  mr::router<typename Router::gating_type, mr::selection::top_k, mr::default_max_k> proxy;
  proxy.top_k = r.top_k;
  proxy.normalize = r.normalize;
  proxy.scaling_factor = r.scaling_factor;
  mr::admission_inputs<float> ain{d.z_admission(), a.n, a.e, idx.get(), gates.get()};
  ain.hidden_norms = d.hidden_norms.get();
  ain.weight_norms = d.weight_norms.get();
  device_array<std::int32_t> aidx(slots);
  device_array<float> agates(slots);
  device_array<mr::admission_report> report(1);
  const mr::admission_outputs aout{aidx.get(), agates.get(), nullptr, report.get()};
  auto admit = [&](const auto& policy) {
    const std::size_t bytes = mr::cuda::admit_workspace_bytes(proxy, policy, a.n, a.e);
    device_array<unsigned char> ws(bytes);
    mr::cuda::admit(proxy, policy, ain, aout, ws.get(), bytes);
    check(cudaDeviceSynchronize(), "admission");
  };
  const double cf = a.capacity_factor.value_or(1.0);
  const float tau = a.tau.value_or(-std::numeric_limits<float>::infinity());
  if (a.admission == "dropless") admit(mr::admission::dropless());
  else if (a.admission == "cipher_strict") admit(mr::admission::cipher_strict(tau, a.capacity_factor.value_or(8.0)));
  else if (a.admission == "cipher_reroute")
    admit(mr::admission::cipher_reroute(tau, a.capacity_factor.value_or(8.0), a.fill_factor));
  else if (a.admission == "locmoe") admit(mr::admission::locmoe(cf, a.tau.value_or(0.01f)));
  else if (a.admission == "capacity_position") admit(mr::admission::capacity_position(cf, a.min_capacity));
  else if (a.admission == "capacity_probs") admit(mr::admission::capacity_probs(cf, a.min_capacity));
  else throw std::runtime_error("--backend cuda: unknown admission " + a.admission);
  res.indices = aidx.download();
  res.gates = agates.download();
  res.admission = report.download()[0];
  res.nonfinite_rows = nonfinite.download()[0];
  return res;
}

template <class Gating>
cuda_route_result with_selection(const cuda_route_args& a, const device_data& d) {
  constexpr int K = mr::default_max_k;  // the runtime routers' MaxK, which the CPU path uses
  const bool biased = a.expert_bias != nullptr;
  if (a.groups > 0) {
    auto set = [&](auto r) {
      r.selection.groups = a.groups;
      r.selection.top_groups = a.top_groups;
      r.selection.per_group_k = a.per_group_k;
      return run_router(r, a, d);
    };
    if constexpr (Gating::shape != mr::gating::kind::selected_softmax)
      if (biased) return set(mr::router<Gating, mr::selection::group_limited<mr::selection::expert_bias>, K>{});
    return set(mr::router<Gating, mr::selection::group_limited<mr::selection::top_k>, K>{});
  }
  if constexpr (Gating::shape != mr::gating::kind::selected_softmax)
    if (biased) return run_router(mr::router<Gating, mr::selection::expert_bias, K>{}, a, d);
  return run_router(mr::router<Gating, mr::selection::top_k, K>{}, a, d);
}

cuda_route_result expert_choice(const cuda_route_args& a, const device_data& d) {
  cuda_route_result res;
  res.expert_choice = true;
  mr::selection::expert_choice p;
  p.top_k = a.k;
  p.capacity_factor = a.capacity_factor.value_or(1.0);
  p.min_capacity = a.min_capacity;
  res.slots = a.e;
  const std::size_t slots = static_cast<std::size_t>(a.n) * a.e;
  device_array<std::int32_t> idx(slots);
  device_array<float> gates(slots);
  check(cudaMemset(idx.get(), 0xff, slots * sizeof(std::int32_t)), "cudaMemset");  // -1, as the CPU path
  check(cudaMemset(gates.get(), 0, slots * sizeof(float)), "cudaMemset");
  device_array<mr::expert_choice_report> report(1);
  const std::size_t bytes = mr::cuda::expert_choice_workspace_bytes(p, a.n, a.e);
  device_array<unsigned char> ws(bytes);
  mr::cuda::expert_choice(p, mr::expert_choice_inputs<float>{d.z_admission(), a.n, a.e},
                          mr::expert_choice_outputs{idx.get(), gates.get(), nullptr, report.get()}, ws.get(), bytes);
  check(cudaDeviceSynchronize(), "expert_choice");
  res.indices = idx.download();
  res.gates = gates.download();
  res.expert_choice_report = report.download()[0];
  return res;
}

}  // namespace

std::string cuda_device_problem() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    return std::string("--backend cuda: no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) +
           "); route on the CPU with --backend cpu";
  if (count < 1) return "--backend cuda: no CUDA device found (cudaGetDeviceCount = 0); route on the CPU with --backend cpu";
  return {};
}

cuda_route_result route_cuda(const cuda_route_args& a) {
  const std::size_t ne = static_cast<std::size_t>(a.n) * a.e, n = static_cast<std::size_t>(a.n),
                    e = static_cast<std::size_t>(a.e);
  device_data d;
  d.logits = upload(a.logits, ne);
  if (a.admission_logits != nullptr && a.admission_logits != a.logits) d.admission_logits = upload(a.admission_logits, ne);
  d.expert_bias = upload(a.expert_bias, e);
  d.hidden_norms = upload(a.hidden_norms, n);
  d.weight_norms = upload(a.weight_norms, e);
  if (a.prior_mode != cuda_route_args::prior::none) {
    d.prior_bias = upload(a.prior_bias, static_cast<std::size_t>(a.prior_rows) * e);
    d.prior_rows = upload(a.token_prior_row, n);
  }
  cuda_route_result res;
  if (a.admission == "expert_choice") res = expert_choice(a, d);
  else if (a.gating == "softmax") res = with_selection<mr::gating::softmax>(a, d);
  else if (a.gating == "sigmoid") res = with_selection<mr::gating::sigmoid>(a, d);
  else if (a.gating == "sqrt_softplus") res = with_selection<mr::gating::sqrt_softplus>(a, d);
  else res = with_selection<mr::gating::softmax_after_topk>(a, d);
  check(cudaDeviceSynchronize(), "routing");
  return res;
}

}  // namespace moe_route_cli
