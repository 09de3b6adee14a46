// The expert-parallel driver: R MPI ranks, rank r owns tokens [r N_r, (r+1) N_r)
// of the global batch and hosts experts [r E/R, (r+1) E/R). One training step:
//
//   route (selection only) -> all-reduce the per-expert counts -> f
//   route (training: load_balance over the global batch, locality of this rank)
//   admit (this rank's tokens are one admission group) -> dispatch
//   all-to-all of per-expert counts, all-to-all-v of token rows (expert-major)
//   experts on the received rows -> all-to-all-v back -> combine with the gates
//   backward: dL/dgates -> cpu::backward -> dL/dz -> all-reduced dL/dW_router;
//             dL/do rows along the same all-to-all-v -> expert weight gradients
//   SGD on the router and the experts; the expert bias from the all-reduced counts
//
// Rank 0 gathers everything into the same record the reference writes.
#include "moe_layer.hpp"

#include <mpi.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ep {
namespace {

// Alltoallv counts and displacements in floats for rows of width `hidden`.
struct row_exchange {
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;

  row_exchange(const std::vector<std::int64_t>& send_rows, const std::vector<std::int64_t>& send_first,
               const std::vector<std::int64_t>& recv_rows) {
    const std::size_t ranks = send_rows.size();
    std::int64_t recv_first = 0;
    for (std::size_t q = 0; q < ranks; ++q) {
      send_counts.push_back(static_cast<int>(send_rows[q] * hidden));
      send_displs.push_back(static_cast<int>(send_first[q] * hidden));
      recv_counts.push_back(static_cast<int>(recv_rows[q] * hidden));
      recv_displs.push_back(static_cast<int>(recv_first * hidden));
      recv_first += recv_rows[q];
    }
  }

  std::size_t recv_floats() const { return recv_counts.empty() ? 0 : recv_displs.back() + recv_counts.back(); }
  std::size_t send_floats() const { return send_counts.empty() ? 0 : send_displs.back() + send_counts.back(); }

  // Token-side rows to the expert owners.
  std::vector<float> forward(const std::vector<float>& rows, MPI_Comm comm) const {
    std::vector<float> recv(recv_floats());
    MPI_Alltoallv(rows.data(), send_counts.data(), send_displs.data(), MPI_FLOAT, recv.data(), recv_counts.data(),
                  recv_displs.data(), MPI_FLOAT, comm);
    return recv;
  }
  // Expert-side rows back to the tokens' ranks, into the dispatch layout.
  std::vector<float> back(const std::vector<float>& rows, MPI_Comm comm) const {
    std::vector<float> recv(send_floats());
    MPI_Alltoallv(rows.data(), recv_counts.data(), recv_displs.data(), MPI_FLOAT, recv.data(), send_counts.data(),
                  send_displs.data(), MPI_FLOAT, comm);
    return recv;
  }
};

template <class T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else return MPI_INT64_T;
}

// Rank 0 gets every rank's equally sized block, in rank order.
template <class T>
std::vector<T> gather(const std::vector<T>& local, int rank, int ranks, MPI_Comm comm) {
  std::vector<T> all(rank == 0 ? local.size() * ranks : 0);
  MPI_Gather(local.data(), static_cast<int>(local.size()), mpi_type<T>(), all.data(), static_cast<int>(local.size()),
             mpi_type<T>(), 0, comm);
  return all;
}

template <class Router, class Policy>
json driver(const options& o, Router r, const Policy& policy, MPI_Comm comm) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  if (experts % ranks != 0)
    throw std::invalid_argument("the number of MPI ranks must divide E = " + std::to_string(experts));
  const int per_rank = experts / ranks;
  const int first_expert = rank * per_rank;
  const std::int64_t n = o.tokens_per_rank;
  const std::vector<float> x = token_rows(o.seed, stream::tokens, rank * n, n);
  const std::vector<float> c = token_rows(o.seed, stream::targets, rank * n, n);
  const std::vector<float> x_norms = row_norms(x, n, hidden);
  std::vector<float> w = initial_router(o.seed);
  std::vector<float> expert_w;  // this rank's experts only
  for (int e = first_expert; e < first_expert + per_rank; ++e) {
    const std::vector<float> we = initial_expert(o.seed, e);
    expert_w.insert(expert_w.end(), we.begin(), we.end());
  }
  std::vector<float> bias(experts, 0.0f);
  std::vector<std::int32_t> owner(experts);
  for (int e = 0; e < experts; ++e) owner[e] = e / per_rank;
  const std::vector<float> upstream(Router::num_penalties, 1.0f / static_cast<float>(ranks));

  json steps = json::array();
  for (int step = 0; step < o.steps; ++step) {
    step_record rec;
    const std::vector<float> z = router_logits(w, x, n);

    // Selection only, then the global batch's counts (exact int64 sum) and f.
    mr::route_inputs<float> in;
    in.logits = z.data();
    in.num_tokens = n;
    in.num_experts = experts;
    in.expert_bias = bias.data();
    in.mode = mr::mode::eval;
    std::vector<std::int32_t> selected(n * top_k), indices(n * top_k);
    std::vector<float> gates(n * top_k);
    std::vector<double> values(Router::num_penalties);
    mr::route_outputs out;
    out.indices = selected.data();
    out.gates = gates.data();
    out.penalty_values = values.data();
    mr::cpu::route(r, in, out);
    rec.loads = expert_counts(selected);
    MPI_Allreduce(MPI_IN_PLACE, rec.loads.data(), experts, MPI_INT64_T, MPI_SUM, comm);
    std::vector<float> f(experts);
    mr::penalty::load_fractions(rec.loads.data(), experts, f.data());

    // The training forward of this rank's micro-batch.
    in.mode = mr::mode::train;
    in.load_fractions = f.data();
    in.expert_rank = owner.data();
    in.rank = rank;
    std::vector<unsigned char> workspace(mr::penalty::training_workspace_bytes(r, n, experts));
    out.indices = indices.data();
    out.workspace = workspace.data();
    out.workspace_bytes = workspace.size();
    mr::cpu::route(r, in, out);
    if (indices != selected) throw std::logic_error("the training forward selected other experts");

    // Admission: this rank's tokens are one group.
    const std::vector<float> w_norms = row_norms(w, experts, hidden);
    mr::admission_inputs<float> ain;
    ain.logits = z.data();
    ain.num_tokens = n;
    ain.num_experts = experts;
    ain.routed_indices = indices.data();
    ain.routed_gates = gates.data();
    ain.hidden_norms = x_norms.data();
    ain.weight_norms = w_norms.data();
    std::vector<std::int32_t> admitted(n * top_k);
    std::vector<float> admitted_gates(n * top_k);
    mr::admission_outputs aout;
    aout.indices = admitted.data();
    aout.gates = admitted_gates.data();
    mr::cpu::admit(r, policy, ain, aout);

    // Dispatch metadata: expert-major rows, and how many go to each rank.
    std::vector<std::int64_t> counts(experts), offsets(experts + 1), inverse(n * top_k), rank_counts(ranks);
    std::vector<std::int64_t> permutation(mr::dispatch_rows_bound(n, top_k, experts, 1));
    const std::int64_t rows = mr::cpu::dispatch(
        mr::dispatch_inputs{admitted.data(), n, top_k, experts, 1, ranks},
        mr::dispatch_outputs{counts.data(), offsets.data(), permutation.data(), inverse.data(), rank_counts.data()});

    // Each owner learns, per source rank, how many rows of each of its experts arrive.
    std::vector<std::int64_t> arriving(ranks * per_rank);
    MPI_Alltoall(counts.data(), per_rank, MPI_INT64_T, arriving.data(), per_rank, MPI_INT64_T, comm);
    std::vector<std::int64_t> send_first(ranks), recv_rows(ranks, 0), local_rows(per_rank, 0);
    for (int q = 0; q < ranks; ++q) {
      send_first[q] = offsets[q * per_rank];  // the experts of rank q are contiguous rows
      for (int e = 0; e < per_rank; ++e) {
        recv_rows[q] += arriving[q * per_rank + e];
        local_rows[e] += arriving[q * per_rank + e];
      }
    }
    const row_exchange plan(rank_counts, send_first, recv_rows);

    // Token rows out in permutation order; the owners run their experts.
    std::vector<float> send(rows * hidden);
    for (std::int64_t row = 0; row < rows; ++row) {
      const float* xt = x.data() + permutation[row] / top_k * hidden;
      std::copy(xt, xt + hidden, send.begin() + row * hidden);
    }
    const std::vector<float> x_in = plan.forward(send, comm);
    std::vector<float> o_in(x_in.size());
    // Rows from source q are grouped by local expert, each group in token order.
    const auto for_each_arrived = [&](auto body) {
      std::int64_t row = 0;
      for (int q = 0; q < ranks; ++q)
        for (int e = 0; e < per_rank; ++e)
          for (std::int64_t i = 0; i < arriving[q * per_rank + e]; ++i, ++row) body(e, row);
    };
    for_each_arrived([&](int e, std::int64_t row) {
      expert_forward(expert_w.data() + e * expert_params, x_in.data() + row * hidden, o_in.data() + row * hidden);
    });
    const std::vector<float> o_back = plan.back(o_in, comm);
    std::vector<float> y, grad_gates;
    combine(admitted_gates, inverse, o_back, c, n, y, grad_gates);

    // Router backward; this rank's penalty values each carry 1/R of the layer's loss.
    std::vector<float> dz(n * experts);
    mr::backward_args b;
    b.indices = indices.data();
    b.admitted_indices = admitted.data();
    b.renormalize = mr::admission::renormalizes(policy);
    b.grad_gates = grad_gates.data();
    b.grad_logits = dz.data();
    b.workspace = workspace.data();
    b.workspace_bytes = workspace.size();
    b.penalty_grads = upstream.data();
    mr::cpu::backward(r, in, b);
    rec.grad_router.assign(experts * hidden, 0.0);
    add_router_grad(dz, x, n, rec.grad_router);
    MPI_Allreduce(MPI_IN_PLACE, rec.grad_router.data(), experts * hidden, MPI_DOUBLE, MPI_SUM, comm);

    // dL/do = g c_t rows along the same route; the owners accumulate dW_e.
    std::vector<float> dout(rows * hidden);
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t slot = permutation[row];
      output_grad(admitted_gates[slot], c.data() + slot / top_k * hidden, dout.data() + row * hidden);
    }
    const std::vector<float> dout_in = plan.forward(dout, comm);
    std::vector<double> grad_experts(static_cast<std::size_t>(per_rank) * expert_params, 0.0);
    for_each_arrived([&](int e, std::int64_t row) {
      expert_backward(expert_w.data() + e * expert_params, x_in.data() + row * hidden, dout_in.data() + row * hidden,
                      grad_experts.data() + e * expert_params);
    });

    // The layer's loss: the ranks' task terms, the mean of their penalty values.
    double totals[3] = {task_loss(y, c, n), values[mr::penalty_slot<mr::penalty::load_balance, Router>], 0.0};
    if constexpr (has_locality<Router>) totals[2] = values[mr::penalty_slot<mr::penalty::locality, Router>];
    MPI_Allreduce(MPI_IN_PLACE, totals, 3, MPI_DOUBLE, MPI_SUM, comm);
    rec.load_balance = totals[1] / ranks;
    rec.locality = totals[2] / ranks;
    rec.loss = totals[0] + rec.load_balance + rec.locality;

    sgd(w.data(), rec.grad_router.data(), w.size(), o.learning_rate);
    sgd(expert_w.data(), grad_experts.data(), expert_w.size(), o.learning_rate);
    if constexpr (has_bias<Router>) {
      r.selection.update(bias.data(), rec.loads.data(), experts);  // the same counts on every rank
      rec.expert_bias = bias;
    }

    rec.indices = gather(indices, rank, ranks, comm);
    rec.admitted = gather(admitted, rank, ranks, comm);
    rec.send_counts = gather(counts, rank, ranks, comm);
    rec.rank_counts = gather(rank_counts, rank, ranks, comm);
    rec.expert_rows = gather(local_rows, rank, ranks, comm);
    rec.outputs = gather(y, rank, ranks, comm);
    rec.grad_logits = gather(dz, rank, ranks, comm);
    rec.grad_experts = gather(grad_experts, rank, ranks, comm);
    if (rank == 0) steps.push_back(to_json(rec));
  }
  const std::vector<float> all_experts = gather(expert_w, rank, ranks, comm);
  if (rank != 0) return nullptr;
  return {{"layer", layer_json(o, ranks, "mpi")},
          {"steps", steps},
          {"final", {{"router", w}, {"experts", all_experts}, {"expert_bias", bias}}}};
}

template <class Router>
json with_admission(const options& o, const Router& r) {
  return std::visit([&](const auto& policy) { return driver(o, r, policy, MPI_COMM_WORLD); }, make_admission(o));
}

}  // namespace

json run_mpi(const options& o) {
  if (o.router == "balanced") return with_admission(o, make_balanced());
  if (o.router == "aux_free") return with_admission(o, make_aux_free());
  throw std::invalid_argument("--router must be balanced or aux_free");
}

}  // namespace ep
