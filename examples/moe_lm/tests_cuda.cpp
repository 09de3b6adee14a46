// moe_lm on the library's CUDA backend: the routing and expert-choice ops on
// CUDA tensors against the same ops on the CPU, bit for bit, and a smoke run
// of pretraining and post-training on a GPU. Needs a build with
// MOE_LM_WITH_CUDA (a CUDA LibTorch and -DMOE_ROUTE_BUILD_CUDA_RUNTIME=ON) and a
// visible GPU; otherwise doctest reports every case as skipped. Links
// moe_lm_core only (no igraph), so it builds wherever LibTorch does.
#include <algorithm>
#include <cstdio>
#include <string>

#include <torch/cuda.h>

#include "conditions.hpp"
#include "data.hpp"

#include "test_main.hpp"

using namespace moe_lm;
using moe_lm::testing::mean_loss;
using moe_lm::testing::pretrain_tiny;

namespace {

bool cuda_available() { return cuda_backend_built() && torch::cuda::is_available(); }

const torch::Device gpu(torch::kCUDA);

bool same(const torch::Tensor& on_gpu, const torch::Tensor& on_cpu) {
  return on_gpu.is_cuda() && torch::equal(on_gpu.cpu(), on_cpu);
}

// route() on the CPU and on CUDA with the same inputs: the same selections,
// gates, penalty values and dL/dz, bit for bit.
void check_route(route_call call, std::int64_t n, std::int64_t e, bool cosine) {
  torch::manual_seed(21);
  const auto z = torch::randn({n, e}) * 1.5;
  const auto upstream = torch::randn({n, call.router.top_k});
  const auto upstream_values = torch::tensor({0.7f, 1.3f, 0.9f, 1.1f, 0.5f});
  const auto norms_x = torch::rand({n}) + 0.5, norms_w = torch::rand({e}) + 0.5;
  const auto bias = torch::randn({e}) * 0.1;
  std::vector<torch::Tensor> grads;
  std::vector<layer_record> recs(2);
  std::vector<std::vector<torch::Tensor>> outs;
  for (const torch::Device device : {torch::Device(torch::kCPU), gpu}) {
    auto zd = z.to(device).requires_grad_(true);
    call.expert_bias = bias.to(device);
    const auto out = route(zd, call, recs[outs.size()], cosine ? norms_x.to(device) : torch::Tensor(),
                           cosine ? norms_w.to(device) : torch::Tensor());
    (out[0] * upstream.to(device)).sum().add((out[1] * upstream_values.to(device)).sum()).backward();
    outs.push_back(out);
    grads.push_back(zd.grad());
  }
  CHECK(same(recs[1].routed, recs[0].routed));
  CHECK(same(recs[1].executed, recs[0].executed));
  CHECK(recs[1].counts == recs[0].counts);
  CHECK(same(outs[1][0], outs[0][0]));
  CHECK(same(outs[1][1], outs[0][1]));
  CHECK(same(grads[1], grads[0]));
}

}  // namespace

TEST_CASE("route op on CUDA: every penalty with the prior, per-rank locality, admission, bit-equal to the CPU" *
          doctest::skip(!cuda_available())) {
  const std::int64_t n = 301, e = 16;
  route_call call;
  call.router.top_k = 2;
  call.router.prior = rt::prior_kind::log_prior_bias;
  call.router.load_balance.coefficient = 0.1f;
  call.router.load_balance.over = moe_route::penalty::load_balance::scope::sequence;
  call.router.z_loss.coefficient = 0.01f;
  call.router.kl_to_base.coefficient = 0.2f;
  call.router.logit_l2.coefficient = 0.02f;
  torch::manual_seed(3);
  const auto pi = torch::softmax(torch::randn({5, e}), 1).contiguous();
  call.prior = std::make_shared<const prior_table>(
      prepare_prior({std::vector<float>(pi.data_ptr<float>(), pi.data_ptr<float>() + pi.numel())}, static_cast<int>(e))[0]);
  for (std::int64_t t = 0; t < n; ++t) {
    call.prior_rows.push_back(static_cast<std::int32_t>(t % 6) - 1);
    call.sequence_ids.push_back(static_cast<std::int32_t>(t / 40));
    call.group_ids.push_back(static_cast<std::int32_t>(t * 4 / n));
  }
  call.num_sequences = call.sequence_ids.back() + 1;
  call.num_groups = 4;
  check_route(call, n, e, false);

  call.router.gating = rt::gating_kind::sigmoid;
  call.router.selection = rt::selection_kind::expert_bias;
  call.router.normalize = true;
  call.router.locality.coefficient = 0.05f;  // one library call per rank
  check_route(call, n, e, false);

  route_call admitted;
  admitted.router.top_k = 2;
  admitted.admit = true;
  admitted.admission.dropless = false;
  admitted.admission.affinity = rt::affinity_kind::cosine;
  admitted.admission.threshold = 0.0f;
  admitted.admission.capacity_factor = 1.0;
  admitted.group_ids = call.group_ids;
  admitted.num_groups = 4;
  check_route(admitted, n, e, true);
  admitted.admission.overflow = rt::overflow_kind::reroute;
  check_route(admitted, n, e, true);
}

TEST_CASE("expert-choice op on CUDA: bit-equal to the CPU" * doctest::skip(!cuda_available())) {
  torch::manual_seed(22);
  const std::int64_t n = 200, e = 8;
  const auto z = torch::randn({n, e});
  const auto upstream = torch::randn({n, e});
  std::vector<std::int32_t> groups;
  for (std::int64_t t = 0; t < n; ++t) groups.push_back(static_cast<std::int32_t>(t * 2 / n));
  std::vector<torch::Tensor> gates, grads;
  std::vector<layer_record> recs(2);
  for (const torch::Device device : {torch::Device(torch::kCPU), gpu}) {
    auto zd = z.to(device).requires_grad_(true);
    gates.push_back(route_expert_choice(zd, moe_route::selection::expert_choice{2, 1.0, 0}, 1, recs[gates.size()],
                                        &groups, 2));
    (gates.back() * upstream.to(device)).sum().backward();
    grads.push_back(zd.grad());
  }
  CHECK(same(recs[1].routed, recs[0].routed));
  CHECK(same(gates[1], gates[0]));
  CHECK(same(grads[1], grads[0]));
}

TEST_CASE("training on CUDA: pretraining, then post-training with the prior, penalties, admission and expert choice" *
          doctest::skip(!cuda_available())) {
  const split data = default_data(1, 100, 80, 12, 12);
  const auto post_set = of_domain(data.post, domain::arithmetic);
  const auto probe_set = of_domain(data.probe, domain::arithmetic);
  for (const gating_preset preset : {gating_preset::softmax, gating_preset::sigmoid_bias}) {
    CAPTURE(preset_name(preset));
    auto base = pretrain_tiny(preset, data.train, gpu);
    const std::string ckpt = std::string("/tmp/moe_lm_cuda_test_") + preset_name(preset) + ".pt";
    save_model(base, ckpt);
    CHECK(base->device().is_cuda());  // saving goes through the CPU and back

    struct run {
      condition c;
      bool admit = false;
      int groups = 1;
      float locality = 0.0f;
      bool expert_choice = false;
    };
    for (const run& u : {run{condition::rpb}, run{condition::router_l2}, run{condition::kl_to_base},
                         run{condition::sft, true, 2}, run{condition::sft, false, 4, 0.01f},
                         run{condition::sft, false, 2, 0.0f, true}}) {
      CAPTURE(condition_name(u.c));
      CAPTURE(u.groups);
      auto m = load_model(ckpt);
      m->to(gpu);
      condition_params cp;
      cp.router_l2 = 10.0f;
      const condition_setup cs = setup(u.c, m->router(), cp);
      train_options o;
      o.steps = 20;
      o.batch_size = 16;
      o.lr = 3e-3;
      o.seed = 5;
      o.prior_rows = cs.prior != prior_source::none;
      o.router_l2 = cs.router_l2;
      o.update_expert_bias = cs.update_expert_bias && !u.expert_choice;
      o.admission_groups = u.groups;
      if (cs.router_l2 != 0.0f)
        for (const auto& w : m->router_weights()) o.base_router.push_back(w.detach().clone());
      if (cs.prior != prior_source::none) m->set_prior(prepare_prior(build_prior(*m, post_set).pi, 4));
      rt::router_config router = cs.router;
      router.locality.coefficient = u.locality;
      m->set_router(router);
      if (u.expert_choice) m->set_expert_choice(moe_route::selection::expert_choice{2, 1.0, 0});
      if (u.admit) {
        rt::admission_config a;
        a.dropless = false;
        a.affinity = rt::affinity_kind::cosine;
        a.threshold = 0.0f;
        a.capacity_factor = 1.0;
        m->set_admission(a);
      }
      const train_result tr = train(*m, post_set, o);
      CHECK(mean_loss(tr, 15, 20) < mean_loss(tr, 0, 5));
      if (u.c == condition::kl_to_base || u.locality != 0.0f) CHECK(tr.log.back().aux_loss > 0.0);
      if (u.c == condition::router_l2) CHECK(tr.log.back().router_l2 > 0.0);
      if (u.expert_choice) {  // every expert took its capacity of every group in every step
        m->set_expert_choice(std::nullopt);
        const auto& loads = tr.executed_loads[0];
        CHECK(std::all_of(loads.begin(), loads.end(), [&](std::int64_t v) { return v == loads[0] && v > 0; }));
      }
      if (cs.prior != prior_source::none) {  // the prior is off in evaluation: the probe routing ignores it
        const routing_trace with_prior = probe(*m, probe_set);
        m->set_prior({});
        CHECK(with_prior.indices == probe(*m, probe_set).indices);
      }
      CHECK(evaluate(*m, data.eval).size() == 3);
    }
    if (preset == gating_preset::sigmoid_bias)  // the aux-loss-free bias moved on the device
      CHECK(base->moe_layers()[0]->expert_bias.abs().max().item<double>() > 0.0);
    std::remove(ckpt.c_str());
  }
}
