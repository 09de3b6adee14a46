// The single-process reference: the same global batch and the same training
// steps as the MPI driver, with no communication. Where the library's
// semantics allow it, one call covers the whole batch: the selection pass, the
// aux_free router's training forward and backward, admission (one call with
// the simulated ranks as admission groups), the expert-major dispatch that the
// experts run from. Locality is a property of one rank's micro-batch, so the
// balanced router is called once per rank slice, and its load_balance value
// is taken from a separate whole-batch call: the single-batch value the ranks'
// mean must reproduce.
#include "moe_layer.hpp"

#include <stdexcept>

namespace ep {
namespace {

template <class Router, class Policy>
json reference(const options& o, Router r, const Policy& policy) {
  const int ranks = o.simulated_ranks;
  const int per_rank = experts / ranks;
  const std::int64_t n_r = o.tokens_per_rank;
  const std::int64_t n = ranks * n_r;
  const std::vector<float> x = token_rows(o.seed, stream::tokens, 0, n);
  const std::vector<float> c = token_rows(o.seed, stream::targets, 0, n);
  const std::vector<float> x_norms = row_norms(x, n, hidden);
  std::vector<float> w = initial_router(o.seed);
  std::vector<float> expert_w;
  for (int e = 0; e < experts; ++e) {
    const std::vector<float> we = initial_expert(o.seed, e);
    expert_w.insert(expert_w.end(), we.begin(), we.end());
  }
  std::vector<float> bias(experts, 0.0f);
  std::vector<std::int32_t> owner(experts), group(n);
  for (int e = 0; e < experts; ++e) owner[e] = e / per_rank;
  for (std::int64_t t = 0; t < n; ++t) group[t] = static_cast<std::int32_t>(t / n_r);
  const float upstream = 1.0f / static_cast<float>(ranks);  // each rank's share of a per-rank penalty

  json steps = json::array();
  for (int step = 0; step < o.steps; ++step) {
    step_record rec;
    const std::vector<float> z = router_logits(w, x, n);

    // Selection only: the global batch's loads and f.
    mr::route_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = n;
    in.num_experts = experts;
    in.expert_bias = bias.data();
    in.mode = mr::mode::eval;
    std::vector<std::int32_t> selected(n * top_k);
    std::vector<float> gates(n * top_k);
    std::vector<double> values(Router::num_penalties);
    mr::route_outputs out;
    out.indices = selected.data();
    out.gates = gates.data();
    out.penalty_values = values.data();
    mr::cpu::route(r, in, out);
    rec.loads = expert_counts(selected);
    std::vector<float> f(experts);
    mr::penalty::load_fractions(selected.data(), n, top_k, experts, f.data());

    // The training forward.
    in.mode = mr::mode::train;
    in.load_fractions = f.data();
    in.expert_rank = owner.data();
    rec.indices.resize(n * top_k);
    out.indices = rec.indices.data();
    std::vector<std::vector<unsigned char>> workspace;
    if constexpr (has_locality<Router>) {
      for (int q = 0; q < ranks; ++q) {
        mr::route_inputs<float> slice = in;
        slice.logits = z.data() + q * n_r * experts;
        slice.num_tokens = n_r;
        slice.rank = q;
        workspace.emplace_back(mr::penalty::training_workspace_bytes(r, n_r, experts));
        mr::route_outputs so = out;
        so.indices = rec.indices.data() + q * n_r * top_k;
        so.gates = gates.data() + q * n_r * top_k;
        so.workspace = workspace.back().data();
        so.workspace_bytes = workspace.back().size();
        mr::cpu::route(r, slice, so);
        rec.locality += values[mr::penalty_slot<mr::penalty::locality, Router>];
      }
      rec.locality /= ranks;
      const auto lb_only = mr::with_policies(r, mr::get<mr::penalty::load_balance>(r));
      std::vector<unsigned char> lb_workspace(mr::penalty::training_workspace_bytes(lb_only, n, experts));
      std::vector<std::int32_t> lb_indices(n * top_k);
      std::vector<float> lb_gates(n * top_k);
      double lb_value = 0.0;
      mr::route_outputs lo;
      lo.indices = lb_indices.data();
      lo.gates = lb_gates.data();
      lo.penalty_values = &lb_value;
      lo.workspace = lb_workspace.data();
      lo.workspace_bytes = lb_workspace.size();
      mr::cpu::route(lb_only, in, lo);
      rec.load_balance = lb_value;
    } else {
      workspace.emplace_back(mr::penalty::training_workspace_bytes(r, n, experts));
      out.workspace = workspace.back().data();
      out.workspace_bytes = workspace.back().size();
      mr::cpu::route(r, in, out);
      rec.load_balance = values[mr::penalty_slot<mr::penalty::load_balance, Router>];
    }
    if (rec.indices != selected) throw std::logic_error("the training forward selected other experts");

    // Admission: one call, one group per simulated rank.
    const std::vector<float> w_norms = row_norms(w, experts, hidden);
    mr::admission_inputs<float> ain;
    ain.logits = z.data();
    ain.num_tokens = n;
    ain.num_experts = experts;
    ain.routed_indices = rec.indices.data();
    ain.routed_gates = gates.data();
    ain.hidden_norms = x_norms.data();
    ain.weight_norms = w_norms.data();
    ain.group_ids = group.data();
    ain.num_groups = ranks;
    rec.admitted.resize(n * top_k);
    std::vector<float> admitted_gates(n * top_k);
    mr::admission_outputs aout;
    aout.indices = rec.admitted.data();
    aout.gates = admitted_gates.data();
    mr::cpu::admit(r, policy, ain, aout);

    // What each simulated rank would send, then the whole batch expert-major.
    rec.send_counts.resize(ranks * experts);
    rec.rank_counts.resize(ranks * ranks);
    std::vector<std::int64_t> slice_offsets(experts + 1);
    for (int q = 0; q < ranks; ++q) {
      mr::dispatch_outputs d;
      d.counts = rec.send_counts.data() + q * experts;
      d.offsets = slice_offsets.data();
      d.rank_counts = rec.rank_counts.data() + q * ranks;
      mr::cpu::dispatch(mr::dispatch_inputs{rec.admitted.data() + q * n_r * top_k, n_r, top_k, experts, 1, ranks}, d);
    }
    rec.expert_rows.resize(experts);
    std::vector<std::int64_t> offsets(experts + 1), inverse(n * top_k);
    std::vector<std::int64_t> permutation(mr::dispatch_rows_bound(n, top_k, experts, 1));
    const std::int64_t rows = mr::cpu::dispatch(mr::dispatch_inputs{rec.admitted.data(), n, top_k, experts, 1, ranks},
                                                mr::dispatch_outputs{rec.expert_rows.data(), offsets.data(),
                                                                     permutation.data(), inverse.data(), nullptr});

    // Every expert over its rows; combine; the task loss's gate gradient.
    std::vector<float> expert_out(rows * hidden);
    for (int e = 0; e < experts; ++e)
      for (std::int64_t row = offsets[e]; row < offsets[e + 1]; ++row)
        expert_forward(expert_w.data() + e * expert_params, x.data() + permutation[row] / top_k * hidden,
                       expert_out.data() + row * hidden);
    std::vector<float> grad_gates;
    combine(admitted_gates, inverse, expert_out, c, n, rec.outputs, grad_gates);

    // Router backward: admitted gates, then the penalties.
    rec.grad_logits.resize(n * experts);
    mr::backward_args b;
    b.indices = rec.indices.data();
    b.admitted_indices = rec.admitted.data();
    b.renormalize = mr::admission::renormalizes(policy);
    b.grad_gates = grad_gates.data();
    b.grad_logits = rec.grad_logits.data();
    if constexpr (has_locality<Router>) {
      const std::vector<float> per_rank_upstream(Router::num_penalties, upstream);
      for (int q = 0; q < ranks; ++q) {
        mr::route_inputs<float> slice = in;
        slice.logits = z.data() + q * n_r * experts;
        slice.num_tokens = n_r;
        slice.rank = q;
        mr::backward_args sb = b;
        sb.indices += q * n_r * top_k;
        sb.admitted_indices += q * n_r * top_k;
        sb.grad_gates += q * n_r * top_k;
        sb.grad_logits += q * n_r * experts;
        sb.workspace = workspace[q].data();
        sb.workspace_bytes = workspace[q].size();
        sb.penalty_grads = per_rank_upstream.data();
        mr::cpu::backward(r, slice, sb);
      }
    } else {
      b.workspace = workspace[0].data();
      b.workspace_bytes = workspace[0].size();
      mr::cpu::backward(r, in, b);  // the single-batch penalty: upstream 1
    }
    rec.grad_router.assign(experts * hidden, 0.0);
    add_router_grad(rec.grad_logits, x, n, rec.grad_router);

    // Expert backward over the same rows, in the same order.
    rec.grad_experts.assign(static_cast<std::size_t>(experts) * expert_params, 0.0);
    float dout[hidden];
    for (int e = 0; e < experts; ++e)
      for (std::int64_t row = offsets[e]; row < offsets[e + 1]; ++row) {
        const std::int64_t slot = permutation[row], t = slot / top_k;
        output_grad(admitted_gates[slot], c.data() + t * hidden, dout);
        expert_backward(expert_w.data() + e * expert_params, x.data() + t * hidden, dout,
                        rec.grad_experts.data() + e * expert_params);
      }

    rec.loss = task_loss(rec.outputs, c, n) + rec.load_balance + rec.locality;
    sgd(w.data(), rec.grad_router.data(), w.size(), o.learning_rate);
    sgd(expert_w.data(), rec.grad_experts.data(), expert_w.size(), o.learning_rate);
    if constexpr (has_bias<Router>) {
      r.selection.update(bias.data(), rec.loads.data(), experts);
      rec.expert_bias = bias;
    }
    steps.push_back(to_json(rec));
  }
  return {{"layer", layer_json(o, ranks, "reference")},
          {"steps", steps},
          {"final", {{"router", w}, {"experts", expert_w}, {"expert_bias", bias}}}};
}

template <class Router>
json with_admission(const options& o, const Router& r) {
  return std::visit([&](const auto& policy) { return reference(o, r, policy); }, make_admission(o));
}

}  // namespace

json run_reference(const options& o) {
  if (o.router == "balanced") return with_admission(o, make_balanced());
  if (o.router == "aux_free") return with_admission(o, make_aux_free());
  throw std::invalid_argument("--router must be balanced or aux_free");
}

}  // namespace ep
