#include "model.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

#include "data.hpp"
#include "common/output_file.hpp"
// First: the runtime routers come compiled from moe_route::runtime.
#include <moe_route/runtime/instantiate.hpp>

#include <moe_route/adapters/torch.hpp>
#ifdef MOE_LM_WITH_CUDA
#include <torch/cuda.h>
#endif

namespace moe_lm {

// ---------------------------------------------------------------------------
// The routing op.

namespace {

// Waits for the work queued on t's device (wall-clock timing of device work).
void synchronize(const torch::Tensor& t) {
#ifdef MOE_LM_WITH_CUDA
  if (t.is_cuda()) torch::cuda::synchronize(t.device().index());
#else
  (void)t;
#endif
}

// A host vector as a tensor on `device`: on the CPU a view of the vector's
// memory (the vector must outlive it), elsewhere a copy.
template <class T>
torch::Tensor on_device(const std::vector<T>& v, std::vector<std::int64_t> shape, torch::ScalarType dtype,
                        const torch::Device& device) {
  const auto t = torch::from_blob(const_cast<T*>(v.data()), shape, dtype);
  return device.is_cpu() ? t : t.to(device);
}

torch::Tensor on_device(const std::vector<std::int32_t>& v, const torch::Device& device) {
  return on_device(v, {static_cast<std::int64_t>(v.size())}, torch::kInt32, device);
}

// One library call of the routing op: the tokens [begin, end) of the batch.
// With the locality penalty on, a segment is one admission group, routed as
// that expert-parallel rank's micro-batch (the penalty's D_c is per rank);
// otherwise the whole batch is one segment.
struct route_segment {
  std::int64_t begin = 0, end = 0;
  moe_route::adapters::route_tensors inputs;  // the segment's rows of the batch's inputs
  torch::Tensor workspace;                    // uint8: filled by the forward, read by the backward
};

// Everything the backward needs besides the logits: the forward's inputs, its
// selections and the workspaces the forward filled. It rides in the autograd
// context as a capsule.
struct route_state : torch::CustomClassHolder {
  route_call call;
  torch::Tensor logits;  // fp32, contiguous, detached
  std::vector<route_segment> segments;
  torch::Tensor hidden_norms, weight_norms;  // cosine admission only (no gradient flows to them)
  torch::Tensor routed, executed;  // int32 [N x K]
};

// Whether the op routes each admission group as its own rank's micro-batch.
bool per_rank(const route_call& call) {
  return call.router.locality.coefficient != 0.0f && call.mode == moe_route::mode::train;
}

// The segments of a batch of n tokens (see route_segment); group ids of the
// routed tokens must come in contiguous runs, as train's admission groups do.
std::vector<route_segment> segments_of(const route_call& call, std::int64_t n) {
  std::vector<route_segment> segs;
  if (!per_rank(call)) {
    segs.push_back({0, n, {}, {}});
    return segs;
  }
  if (call.group_ids.empty())
    throw std::invalid_argument("route: the locality penalty needs admission groups (the expert-parallel ranks)");
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int32_t g = call.group_ids[static_cast<std::size_t>(t)];
    if (g < 0 || g >= call.num_groups) throw std::invalid_argument("route: a group id is outside [0, num_groups)");
    if (segs.empty() || call.group_ids[static_cast<std::size_t>(segs.back().begin)] != g) {
      for (const auto& s : segs)
        if (call.group_ids[static_cast<std::size_t>(s.begin)] == g)
          throw std::invalid_argument("route: under the locality penalty each group's tokens must be contiguous");
      segs.push_back({t, t, {}, {}});
    }
    segs.back().end = t + 1;
  }
  return segs;
}

// The batch's rows [begin, end) of an optional per-token tensor.
std::optional<torch::Tensor> rows_of(const std::optional<torch::Tensor>& t, std::int64_t begin, std::int64_t end) {
  if (!t) return std::nullopt;
  return t->slice(0, begin, end);
}

class route_function : public torch::autograd::Function<route_function> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor logits,
                                                c10::intrusive_ptr<route_state> st) {
    namespace ad = moe_route::adapters;
    const std::int64_t n = logits.size(0);
    const int e = static_cast<int>(logits.size(1));
    st->logits = logits.detach().to(torch::kFloat32).contiguous();
    const torch::Device device = st->logits.device();
    ad::route_tensors batch;
    batch.logits = st->logits;
    batch.training = st->call.mode == moe_route::mode::train;
    if (rt::selection_uses_bias(st->call.router.selection)) {
      if (!st->call.expert_bias.defined())
        throw std::invalid_argument("route: the router's selection needs an expert bias");
      // A copy: the bias may be updated before the backward runs.
      batch.expert_bias = st->call.expert_bias.detach().to(device, torch::kFloat32).clone();
    }
    if (st->call.prior) {
      const auto& p = *st->call.prior;
      batch.prior_bias = on_device(p.bias, {p.rows, e}, torch::kFloat32, device);
      batch.prior_probs = on_device(p.probs, {p.rows, e}, torch::kFloat32, device);
    }
    if (!st->call.prior_rows.empty()) batch.token_prior_row = on_device(st->call.prior_rows, device);
    st->segments = segments_of(st->call, n);
    if (per_rank(st->call)) {  // expert j lives on rank j * R / E
      std::vector<std::int32_t> ranks(static_cast<std::size_t>(e));
      for (int j = 0; j < e; ++j)
        ranks[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(static_cast<std::int64_t>(j) * st->call.num_groups / e);
      batch.expert_rank = on_device(ranks, device).clone();  // owns its memory: ranks is a local
    }
    std::vector<torch::Tensor> routed, gates;
    auto values = torch::zeros({rt::num_penalties}, torch::TensorOptions().dtype(torch::kFloat64).device(device));
    for (auto& seg : st->segments) {
      seg.inputs = batch;
      seg.inputs.logits = st->logits.slice(0, seg.begin, seg.end);
      seg.inputs.token_prior_row = rows_of(batch.token_prior_row, seg.begin, seg.end);
      if (!st->call.sequence_ids.empty() && seg.end > seg.begin) {
        const std::int32_t first = st->call.sequence_ids[static_cast<std::size_t>(seg.begin)];
        std::vector<std::int32_t> ids;  // renumbered from 0 within the segment
        for (std::int64_t t = seg.begin; t < seg.end; ++t)
          ids.push_back(st->call.sequence_ids[static_cast<std::size_t>(t)] - first);
        seg.inputs.num_sequences = ids.back() + 1;
        seg.inputs.sequence_ids = on_device(ids, device).clone();  // owns its memory: ids is a local
      }
      if (per_rank(st->call)) seg.inputs.rank = st->call.group_ids[static_cast<std::size_t>(seg.begin)];
      const ad::route_result r = ad::route(st->call.router, rt::admission_config{}, seg.inputs, {}, st->call.threads);
      routed.push_back(r.indices);
      gates.push_back(r.gates);
      seg.workspace = r.workspace;
      // The penalties of a per-rank call average over the ranks, as data-parallel gradient averaging does.
      values += r.penalty_values / static_cast<double>(st->segments.size());
    }
    st->routed = torch::cat(routed);
    torch::Tensor routed_gates = torch::cat(gates);

    if (st->call.admit) {
      ad::admission_tensors a;
      if (st->hidden_norms.defined()) a.hidden_norms = st->hidden_norms;
      if (st->weight_norms.defined()) a.weight_norms = st->weight_norms;
      if (!st->call.group_ids.empty()) {
        a.group_ids = on_device(st->call.group_ids, device);
        a.num_groups = st->call.num_groups;
      }
      const ad::admit_result r =
          ad::admit(st->call.router, st->call.admission, st->logits, st->routed, routed_gates, std::nullopt, a,
                    st->call.threads);
      st->executed = r.indices;
      routed_gates = r.gates;
    } else {
      st->executed = st->routed;
    }
    ctx->saved_data["state"] = c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(st));
    return {routed_gates, values.to(torch::kFloat32)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto capsule = ctx->saved_data["state"].toCapsule();
    auto* st = static_cast<route_state*>(capsule.get());
    const std::int64_t n = st->logits.size(0);
    const int k = st->call.router.top_k;
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(st->logits.device());
    const torch::Tensor grad_gates =
        grads[0].defined() ? grads[0].to(torch::kFloat32).contiguous() : torch::zeros({n, k}, f32);
    // Each segment's penalties carry 1 / segments of the value (the forward's average).
    const torch::Tensor grad_penalties =
        grads[1].defined() ? grads[1].to(torch::kFloat32) / static_cast<float>(st->segments.size())
                           : torch::zeros({rt::num_penalties}, f32);
    std::vector<torch::Tensor> grad_logits;
    for (const auto& seg : st->segments) {
      const std::optional<torch::Tensor> admitted =
          st->call.admit ? std::optional<torch::Tensor>(st->executed.slice(0, seg.begin, seg.end)) : std::nullopt;
      grad_logits.push_back(moe_route::adapters::backward(
          st->call.router, seg.inputs, st->routed.slice(0, seg.begin, seg.end),
          grad_gates.slice(0, seg.begin, seg.end), grad_penalties, seg.workspace, admitted,
          st->call.admit && rt::renormalizes(st->call.admission), st->call.threads));
    }
    return {torch::cat(grad_logits), torch::Tensor()};
  }
};

// Assignments per expert of int32 indices (-1: none), on the host.
std::vector<std::int64_t> count_experts(const torch::Tensor& indices, std::int64_t experts) {
  const torch::Tensor idx = indices.reshape({-1});
  const torch::Tensor counts = torch::bincount(idx.masked_select(idx >= 0).to(torch::kInt64), {}, experts).cpu();
  return {counts.data_ptr<std::int64_t>(), counts.data_ptr<std::int64_t>() + experts};
}

}  // namespace

std::vector<torch::Tensor> route(const torch::Tensor& logits, const route_call& call, layer_record& record,
                                 const torch::Tensor& hidden_norms, const torch::Tensor& weight_norms) {
  TORCH_CHECK(logits.dim() == 2, "route: logits must be [N x E]");
  if (call.admit && call.mode == moe_route::mode::train && call.admission.overflow == rt::overflow_kind::reroute &&
      call.router.prior == rt::prior_kind::log_prior_bias && call.router.prior_bias.beta != 0.0f &&
      call.router.prior_bias.bias_gates)
    throw std::invalid_argument(
        "route: reroute admission under the soft prior (log_prior_bias with bias_gates) is not supported: the "
        "rerouted gates would come from the unbiased logits, the routed ones from the biased logits");
  auto st = c10::make_intrusive<route_state>();
  st->call = call;
  if (hidden_norms.defined()) st->hidden_norms = hidden_norms.detach().to(torch::kFloat32).contiguous();
  if (weight_norms.defined()) st->weight_norms = weight_norms.detach().to(torch::kFloat32).contiguous();
  auto out = route_function::apply(logits, st);
  record.routed = st->routed;
  record.executed = st->executed;
  record.values = out[1];
  record.routed_counts = count_experts(st->routed, logits.size(1));
  record.counts = call.admit ? count_experts(st->executed, logits.size(1)) : record.routed_counts;
  return out;
}

namespace {

struct expert_choice_state : torch::CustomClassHolder {
  moe_route::selection::expert_choice policy;
  int threads = 1;
  std::vector<std::int32_t> group_ids;  // empty: one group
  int num_groups = 1;
  torch::Tensor logits;   // fp32, contiguous, detached
  torch::Tensor indices;  // int32 [N x E]
};

class expert_choice_function : public torch::autograd::Function<expert_choice_function> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor logits,
                                                c10::intrusive_ptr<expert_choice_state> st) {
    st->logits = logits.detach().to(torch::kFloat32).contiguous();
    std::optional<torch::Tensor> groups;
    if (!st->group_ids.empty()) groups = on_device(st->group_ids, st->logits.device());
    const auto r = moe_route::adapters::expert_choice(st->policy, st->logits, groups, st->num_groups, std::nullopt,
                                                      std::nullopt, st->threads);
    st->indices = r.indices;
    ctx->saved_data["state"] = c10::IValue::make_capsule(c10::intrusive_ptr<torch::CustomClassHolder>(st));
    return {r.gates};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto capsule = ctx->saved_data["state"].toCapsule();
    auto* st = static_cast<expert_choice_state*>(capsule.get());
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(st->logits.device());
    const torch::Tensor grad_gates =
        grads[0].defined() ? grads[0].to(torch::kFloat32).contiguous() : torch::zeros(st->logits.sizes(), f32);
    return {moe_route::adapters::expert_choice_backward(st->logits, st->indices, grad_gates, std::nullopt, st->threads),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor route_expert_choice(const torch::Tensor& logits, const moe_route::selection::expert_choice& policy,
                                  int threads, layer_record& record, const std::vector<std::int32_t>* group_ids,
                                  int num_groups) {
  TORCH_CHECK(logits.dim() == 2, "route_expert_choice: logits must be [N x E]");
  auto st = c10::make_intrusive<expert_choice_state>();
  st->policy = policy;
  st->threads = threads;
  if (group_ids != nullptr) {
    st->group_ids = *group_ids;
    st->num_groups = num_groups;
  }
  auto gates = expert_choice_function::apply(logits, st)[0];
  record.routed = record.executed = st->indices;
  record.values = torch::zeros({rt::num_penalties}, logits.options().dtype(torch::kFloat32));
  record.routed_counts = record.counts = count_experts(st->indices, logits.size(1));
  return gates;
}

// ---------------------------------------------------------------------------
// Modules.

rms_norm::rms_norm(std::int64_t d) { weight_ = register_parameter("weight", torch::ones({d})); }

torch::Tensor rms_norm::forward(const torch::Tensor& x) {
  return x * torch::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * weight_;
}

moe_ffn::moe_ffn(const model_config& c) {
  const std::int64_t d = c.d_model, e = c.experts, h = c.expert_hidden, hs = c.shared_hidden;
  // Output projections are scaled down with depth so the residual stream starts near the identity.
  const double out_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(c.layers));
  router_weight = register_parameter("router", torch::randn({e, d}) * 0.02);
  expert_bias = register_buffer("expert_bias", torch::zeros({e}));
  w1_ = register_parameter("w1", torch::randn({e, d, h}) / std::sqrt(static_cast<double>(d)));
  w2_ = register_parameter("w2", torch::randn({e, h, d}) * (out_scale / std::sqrt(static_cast<double>(h))));
  shared_w1_ = register_parameter("shared_w1", torch::randn({d, hs}) / std::sqrt(static_cast<double>(d)));
  shared_w2_ = register_parameter("shared_w2", torch::randn({hs, d}) * (out_scale / std::sqrt(static_cast<double>(hs))));
  router = preset_router(c);
}

torch::Tensor moe_ffn::forward(const torch::Tensor& x, const routing_context& ctx) {
  const std::int64_t n = x.size(0), d = x.size(1), e = router_weight.size(0);
  const torch::Tensor logits = torch::matmul(x, router_weight.t());
  torch::Tensor gates;  // [N x slots]: K slots per token, or E under expert choice
  last.routed_affinity = torch::Tensor();
  if (expert_choice && ctx.mode == moe_route::mode::train) {
    gates = route_expert_choice(logits, *expert_choice, threads, last, ctx.group_ids, ctx.num_groups);
  } else {
    route_call call;
    call.router = router;
    call.mode = ctx.mode;
    call.admission = admission;
    call.admit = !admission.dropless && (ctx.mode == moe_route::mode::train || admit_at_eval);
    call.expert_bias = expert_bias;
    call.prior = prior;
    call.threads = threads;
    if (ctx.prior_rows) call.prior_rows = *ctx.prior_rows;
    if (ctx.sequence_ids) {
      call.sequence_ids = *ctx.sequence_ids;
      call.num_sequences = ctx.num_sequences;
    }
    if (ctx.group_ids) {
      call.group_ids = *ctx.group_ids;
      call.num_groups = ctx.num_groups;
    }
    torch::Tensor hidden_norms, weight_norms;
    const bool record = record_affinity && ctx.mode == moe_route::mode::train;
    const bool cosine = call.admit && admission.affinity == rt::affinity_kind::cosine;
    if (record || cosine) {
      hidden_norms = x.detach().norm(2, 1);
      weight_norms = router_weight.detach().norm(2, 1);
    }
    gates = route(logits, call, last, cosine ? hidden_norms : torch::Tensor(), cosine ? weight_norms : torch::Tensor())[0];
    if (record) {  // one rounded product of the norms, one rounded division: admission's cosine
      const torch::Tensor slots = last.routed.clamp_min(0).to(torch::kInt64);
      last.routed_affinity = logits.detach().to(torch::kFloat32).gather(1, slots) /
                             (hidden_norms.unsqueeze(1) * weight_norms.index_select(0, slots.reshape({-1})).view_as(slots));
    }
  }
  last.offered = n * router.top_k;
  if (ctx.keep_logits) last.logits = logits.detach().clone();
  const int k = static_cast<int>(gates.size(1));

  // Expert-major rows from the library's dispatch metadata (on the device; the
  // counts and offsets come to the host, which slices the rows per expert).
  const auto meta = moe_route::adapters::dispatch(last.executed, static_cast<int>(e), 1, 1, std::nullopt);
  const torch::Tensor& counts_t = meta.counts;
  const torch::Tensor& offsets_t = meta.offsets;
  const torch::Tensor& permutation = meta.permutation;
  const torch::Tensor& inverse = meta.inverse;
  const torch::Tensor counts_host = counts_t.cpu(), offsets_host = offsets_t.cpu();
  const std::vector<std::int64_t> counts(counts_host.data_ptr<std::int64_t>(), counts_host.data_ptr<std::int64_t>() + e);
  const std::vector<std::int64_t> offsets(offsets_host.data_ptr<std::int64_t>(),
                                          offsets_host.data_ptr<std::int64_t>() + e + 1);
  const std::int64_t rows = offsets.back();

  const torch::Tensor source = permutation.slice(0, 0, rows).div(k, "floor");
  const torch::Tensor xe = x.index_select(0, source);
  const std::int64_t peak = *std::max_element(counts.begin(), counts.end());
  std::vector<torch::Tensor> ys;
  synchronize(x);
  const auto start = std::chrono::steady_clock::now();
  if (pad_experts) {
    // Capacity-padded buffers, as expert-parallel ranks hold them: every expert
    // gets `peak` rows (its own, then zeros), and one batched matmul runs them all.
    std::vector<std::int64_t> slot(static_cast<std::size_t>(rows));
    for (std::int64_t j = 0; j < e; ++j)
      for (std::int64_t r = offsets[static_cast<std::size_t>(j)]; r < offsets[static_cast<std::size_t>(j) + 1]; ++r)
        slot[static_cast<std::size_t>(r)] = j * peak + r - offsets[static_cast<std::size_t>(j)];
    const torch::Tensor where = torch::tensor(slot, torch::kInt64).to(x.device());
    const torch::Tensor buffers = torch::zeros({e * peak, d}, x.options()).index_copy(0, where, xe).view({e, peak, d});
    ys.push_back(torch::bmm(torch::silu(torch::bmm(buffers, w1_)), w2_).view({e * peak, d}).index_select(0, where));
    last.expert_rows = e * peak;
  } else {
    for (std::int64_t j = 0; j < e; ++j) {
      const std::int64_t r0 = offsets[static_cast<std::size_t>(j)], r1 = offsets[static_cast<std::size_t>(j) + 1];
      if (r1 == r0) continue;
      ys.push_back(torch::matmul(torch::silu(torch::matmul(xe.slice(0, r0, r1), w1_[j])), w2_[j]));
    }
    last.expert_rows = rows;
  }
  synchronize(x);
  last.expert_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ys.push_back(torch::zeros({1, d}, x.options()));  // the row a dropped slot gathers
  const torch::Tensor y = torch::cat(ys, 0);
  const torch::Tensor slot_rows = torch::where(inverse < 0, torch::full_like(inverse, rows), inverse);
  const torch::Tensor combined = (y.index_select(0, slot_rows).view({n, k, d}) * gates.unsqueeze(-1)).sum(1);
  const torch::Tensor shared = torch::matmul(torch::silu(torch::matmul(x, shared_w1_)), shared_w2_);
  return combined + shared;
}

block::block(const model_config& c) : cfg_(c) {
  if (c.rms_norm) {
    rms1_ = register_module("norm1", std::make_shared<rms_norm>(c.d_model));
    rms2_ = register_module("norm2", std::make_shared<rms_norm>(c.d_model));
  } else {
    ln1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    ln2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  }
  qkv_ = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, 3 * c.d_model).bias(false)));
  proj_ = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.d_model).bias(false)));
  torch::NoGradGuard guard;
  proj_->weight.mul_(1.0 / std::sqrt(2.0 * static_cast<double>(c.layers)));
  moe = register_module("moe", std::make_shared<moe_ffn>(c));
}

torch::Tensor block::norm(int which, const torch::Tensor& x) {
  if (cfg_.rms_norm) return which == 1 ? rms1_->forward(x) : rms2_->forward(x);
  return which == 1 ? ln1_->forward(x) : ln2_->forward(x);
}

torch::Tensor block::forward(const torch::Tensor& x, const torch::Tensor& valid, const routing_context& ctx) {
  const std::int64_t b = x.size(0), t = x.size(1), d = x.size(2), h = cfg_.heads, dh = d / h;
  const auto qkv = qkv_->forward(norm(1, x)).view({b, t, 3, h, dh}).permute({2, 0, 3, 1, 4});
  const auto scores = torch::matmul(qkv[0], qkv[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
  const auto causal = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
  const auto attn = torch::softmax(scores.masked_fill(causal, -std::numeric_limits<float>::infinity()), -1);
  const auto mixed = torch::matmul(attn, qkv[2]).transpose(1, 2).reshape({b, t, d});
  const auto x1 = x + proj_->forward(mixed);
  // Only the real tokens are routed: padding takes no expert capacity and no load.
  const auto flat = norm(2, x1).reshape({b * t, d});
  const auto routed = moe->forward(flat.index_select(0, valid), ctx);
  const auto ffn = torch::zeros_like(flat).index_copy(0, valid, routed);
  return x1 + ffn.view({b, t, d});
}

model::model(const model_config& c) : cfg_(c) {
  check(c, naming::fields);
  embed_ = register_module("embed", torch::nn::Embedding(vocab::size, c.d_model));
  {
    torch::NoGradGuard guard;
    embed_->weight.normal_(0.0, 0.02);
  }
  pos_ = register_parameter("pos", torch::randn({c.max_len, c.d_model}) * 0.02);
  for (std::int64_t l = 0; l < c.layers; ++l) {
    blocks_.push_back(register_module("block" + std::to_string(l), std::make_shared<block>(c)));
    moes_.push_back(blocks_.back()->moe);
  }
  if (c.rms_norm)
    rms_f_ = register_module("norm_f", std::make_shared<rms_norm>(c.d_model));
  else
    ln_f_ = register_module("norm_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  if (!c.tie_embeddings)
    head_ = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, vocab::size).bias(false)));
}

torch::Tensor model::forward(const torch::Tensor& tokens, const routing_context& ctx) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= cfg_.max_len, "model: tokens must be [B x T], T <= max_len");
  const std::int64_t t = tokens.size(1);
  const torch::Tensor valid = (tokens.reshape({-1}) != vocab::pad).nonzero().reshape({-1});
  torch::Tensor x = embed_->forward(tokens) + pos_.slice(0, 0, t).unsqueeze(0);
  for (auto& b : blocks_) x = b->forward(x, valid, ctx);
  return cfg_.rms_norm ? rms_f_->forward(x) : ln_f_->forward(x);
}

torch::Tensor model::logits(const torch::Tensor& hidden) {
  return cfg_.tie_embeddings ? torch::matmul(hidden, embed_->weight.t()) : head_->forward(hidden);
}

torch::Tensor model::aux_loss() const {
  torch::Tensor sum = torch::zeros({}, pos_.options());
  for (const auto& m : moes_)
    if (m->last.values.defined()) sum = sum + m->last.values.sum();
  return sum;
}

void model::set_router(const rt::router_config& r) {
  rt::validate(r);
  if (r.top_k != cfg_.top_k) throw std::invalid_argument("set_router: top_k must stay the model's");
  for (auto& m : moes_) m->router = r;
}

void model::set_admission(const rt::admission_config& a, bool at_eval) {
  rt::validate(a);
  for (auto& m : moes_) {
    m->admission = a;
    m->admit_at_eval = at_eval;
  }
}

void model::set_expert_choice(const std::optional<moe_route::selection::expert_choice>& p) {
  if (p && (p->top_k < 1 || !(p->capacity_factor > 0.0)))
    throw std::invalid_argument("set_expert_choice: top_k must be >= 1 and capacity_factor > 0");
  for (auto& m : moes_) m->expert_choice = p;
}

void model::set_prior(const std::vector<prior_table>& tables) {
  if (!tables.empty() && tables.size() != moes_.size())
    throw std::invalid_argument("set_prior: one table per MoE layer");
  for (std::size_t l = 0; l < moes_.size(); ++l)
    moes_[l]->prior = tables.empty() ? nullptr : std::make_shared<const prior_table>(tables[l]);
}

void model::set_expert_padding(bool pad) {
  for (auto& m : moes_) m->pad_experts = pad;
}

void model::set_affinity_record(bool record) {
  for (auto& m : moes_) m->record_affinity = record;
}

void model::set_router_threads(int threads) {
  for (auto& m : moes_) m->threads = threads;
}

std::vector<torch::Tensor> model::router_weights() const {
  std::vector<torch::Tensor> w;
  for (const auto& m : moes_) w.push_back(m->router_weight);
  return w;
}

bool cuda_backend_built() {
#ifdef MOE_LM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void save_model(const std::shared_ptr<model>& m, const std::string& path) {
  const torch::Device device = m->device();
  if (!device.is_cpu()) m->to(torch::kCPU);
  torch::serialize::OutputArchive archive;
  m->save(archive);
  archive.write("moe_lm_config", c10::IValue(to_json(m->config())));
  moe_route_examples::write_replacing(path, [&](const std::string& tmp) {
    try {
      archive.save_to(tmp);
    } catch (const c10::Error& e) {
      throw std::runtime_error(e.what_without_backtrace());  // the reason, without LibTorch's stack frames
    }
  });
  if (!device.is_cpu()) m->to(device);
}

std::shared_ptr<model> load_model(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  c10::IValue config;
  if (!archive.try_read("moe_lm_config", config))
    throw std::runtime_error(path + ": not a moe_lm checkpoint (no moe_lm_config)");
  auto m = std::make_shared<model>(model_config_from_json(config.toStringRef()));
  m->load(archive);
  return m;
}

}  // namespace moe_lm
