#include "train.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

// First: the runtime routers come compiled from moe_route::runtime.
#include <moe_route/runtime/instantiate.hpp>

#include <moe_route/adapters/torch.hpp>
#include <moe_route/prior/build.hpp>
#include <moe_route/prior/prepare.hpp>

namespace moe_lm {

namespace {

std::vector<std::int64_t> encode(const example& e) {
  std::vector<std::int64_t> t;
  t.reserve(static_cast<std::size_t>(encoded_length(e)));
  t.push_back(vocab::bos);
  for (char c : e.prompt) t.push_back(vocab::of(c));
  t.push_back(vocab::sep);
  for (char c : e.answer) t.push_back(vocab::of(c));
  t.push_back(vocab::eos);
  return t;
}

// The routing context of a batch (train or eval).
routing_context context_of(const batch& b, moe_route::mode mode, bool prior_rows) {
  routing_context ctx;
  ctx.mode = mode;
  if (prior_rows) ctx.prior_rows = &b.prior_rows;
  ctx.sequence_ids = &b.sequence_ids;
  ctx.num_sequences = b.sequences;
  return ctx;
}

// The batch's tensors on the model's device (the per-token vectors stay on the host).
batch on_device(const batch& b, const torch::Device& device) {
  if (device.is_cpu()) return b;
  batch d = b;
  d.tokens = b.tokens.to(device);
  d.targets = b.targets.to(device);
  d.answer_positions = b.answer_positions.to(device);
  d.target_positions = b.target_positions.to(device);
  return d;
}

// Router-L2 over the layers' router weights, its gradient added to theirs
// (the LibTorch adapter: the library's CPU or CUDA call by the weights' device).
double router_l2(const model& m, const std::vector<torch::Tensor>& base, float lambda) {
  const auto weights = m.router_weights();
  std::vector<torch::Tensor> grads;
  for (const auto& w : weights) grads.push_back(w.mutable_grad());
  return moe_route::adapters::router_l2_into(weights, base, lambda, grads).item<double>();
}

torch::Tensor task_loss(model& m, const batch& b, const torch::Tensor& hidden, const torch::Tensor& positions) {
  const std::int64_t d = hidden.size(-1);
  const auto h = hidden.reshape({-1, d}).index_select(0, positions);
  const auto y = b.targets.reshape({-1}).index_select(0, positions);
  return torch::nn::functional::cross_entropy(m.logits(h), y);
}

std::vector<std::size_t> range(std::size_t begin, std::size_t end) {
  std::vector<std::size_t> v;
  for (std::size_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

// One step of one layer: its routed cosines, and its signal retention when asked.
void record_signal(const layer_record& rec, const std::vector<std::int32_t>& groups, const train_options& o,
                   std::vector<float>& affinities, moe_route::analysis::signal_retention_stats& stats) {
  const torch::Tensor a = rec.routed_affinity.cpu().contiguous();
  if (o.routed_affinities) affinities.insert(affinities.end(), a.data_ptr<float>(), a.data_ptr<float>() + a.numel());
  if (!o.signal_retention) return;
  const torch::Tensor routed = rec.routed.cpu().contiguous(), executed = rec.executed.cpu().contiguous();
  moe_route::analysis::signal_retention_inputs in;
  in.routed_indices = routed.data_ptr<std::int32_t>();
  in.executed_indices = executed.data_ptr<std::int32_t>();
  in.affinities = a.data_ptr<float>();
  in.num_tokens = routed.size(0);
  in.top_k = static_cast<int>(routed.size(1));
  in.num_experts = static_cast<int>(rec.routed_counts.size());
  if (!groups.empty()) {
    in.group_ids = groups.data();
    in.num_groups = o.admission_groups;
  }
  stats += moe_route::analysis::signal_retention(in, *o.signal_retention);
}

}  // namespace

batch make_batch(const std::vector<example>& data, const std::vector<std::size_t>& which, std::int64_t max_len) {
  batch b;
  std::vector<std::vector<std::int64_t>> seqs;
  std::int64_t width = 1;
  for (std::size_t i : which) {
    seqs.push_back(encode(data.at(i)));
    const auto len = static_cast<std::int64_t>(seqs.back().size()) - 1;  // inputs drop the final EOS
    if (len > max_len)
      throw std::invalid_argument("example " + std::to_string(i) + " (\"" + data[i].prompt + "\") needs " +
                                  std::to_string(len) + " positions, more than max_len " + std::to_string(max_len));
    width = std::max(width, len);
  }
  const auto rows = static_cast<std::int64_t>(which.size());
  b.tokens = torch::full({rows, width}, vocab::pad, torch::kInt64);
  b.targets = torch::full({rows, width}, vocab::pad, torch::kInt64);
  auto tok = b.tokens.accessor<std::int64_t, 2>();
  auto tgt = b.targets.accessor<std::int64_t, 2>();
  std::vector<std::int64_t> answer, any;
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto& s = seqs[static_cast<std::size_t>(r)];
    const auto prompt_end = static_cast<std::int64_t>(data[which[static_cast<std::size_t>(r)]].prompt.size());  // index of the last prompt byte
    const auto len = static_cast<std::int64_t>(s.size()) - 1;
    for (std::int64_t i = 0; i < len; ++i) {
      tok[r][i] = s[static_cast<std::size_t>(i)];
      tgt[r][i] = s[static_cast<std::size_t>(i) + 1];
      const int span = i <= prompt_end ? 0 : 1;
      if (span == 1) answer.push_back(r * width + i);
      any.push_back(r * width + i);
      b.prior_rows.push_back(static_cast<std::int32_t>(2 * which[static_cast<std::size_t>(r)] + span));
      b.sequence_ids.push_back(static_cast<std::int32_t>(r));
      b.domains.push_back(static_cast<std::int32_t>(data[which[static_cast<std::size_t>(r)]].dom));
    }
  }
  b.answer_positions = torch::tensor(answer, torch::kInt64);
  b.target_positions = torch::tensor(any, torch::kInt64);
  b.sequences = static_cast<std::int32_t>(rows);
  return b;
}

std::vector<std::int32_t> admission_groups(const batch& b, int groups) {
  std::vector<std::int32_t> g(b.sequence_ids.size());
  for (std::size_t t = 0; t < g.size(); ++t)
    g[t] = static_cast<std::int32_t>(static_cast<std::int64_t>(b.sequence_ids[t]) * groups / std::max(b.sequences, 1));
  return g;
}

train_result train(model& m, const std::vector<example>& data, const train_options& o) {
  if (data.empty()) throw std::invalid_argument("train: no examples");
  if (o.router_l2 != 0.0f && o.base_router.size() != m.moe_layers().size())
    throw std::invalid_argument("train: router_l2 needs the base router weights of every layer");
  torch::manual_seed(o.seed);
  torch::set_num_threads(o.threads);
  m.train();
  // Decay the weight matrices, not the norm gains (the Megatron and Hugging Face convention).
  std::vector<torch::Tensor> matrices, gains;
  for (const auto& p : m.parameters()) (p.dim() >= 2 ? matrices : gains).push_back(p);
  const auto options = [&](double decay) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(o.lr).betas({0.9, o.beta2}).weight_decay(decay));
  };
  torch::optim::AdamW opt({torch::optim::OptimizerParamGroup(matrices, options(o.weight_decay)),
                           torch::optim::OptimizerParamGroup(gains, options(0.0))},
                          torch::optim::AdamWOptions(o.lr).betas({0.9, o.beta2}).weight_decay(o.weight_decay));
  const int warmup = o.warmup >= 0 ? o.warmup : std::min(100, o.steps / 10);
  const auto lr_at = [&](int step) {
    if (step <= warmup) return o.lr * step / (warmup + 1);
    const double progress = static_cast<double>(step - warmup) / std::max(1, o.steps - warmup);
    return o.lr * (o.final_lr_ratio + (1.0 - o.final_lr_ratio) * 0.5 * (1.0 + std::cos(3.141592653589793 * progress)));
  };
  double window = 0.0;
  int window_steps = 0;
  rng r(o.seed ^ 0x5eedull);
  std::vector<std::size_t> order = range(0, data.size());
  std::size_t cursor = order.size();
  train_result result;
  const auto e = static_cast<std::size_t>(m.config().experts);
  result.routed_loads.assign(m.moe_layers().size(), std::vector<std::int64_t>(e, 0));
  result.executed_loads = result.routed_loads;
  result.routed_affinities.resize(m.moe_layers().size());
  result.signal_retention.resize(m.moe_layers().size());
  m.set_affinity_record(o.routed_affinities || o.signal_retention.has_value());
  for (int step = 1; step <= o.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::size_t> which;
    while (static_cast<int>(which.size()) < o.batch_size) {
      if (cursor == order.size()) {  // a new epoch in a new order
        for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[r.below(i)]);
        cursor = 0;
      }
      which.push_back(order[cursor++]);
    }
    const batch b = on_device(make_batch(data, which, m.config().max_len), m.device());
    routing_context ctx = context_of(b, moe_route::mode::train, o.prior_rows);
    std::vector<std::int32_t> groups;
    if (o.admission_groups > 1) {
      groups = admission_groups(b, o.admission_groups);
      ctx.group_ids = &groups;
      ctx.num_groups = o.admission_groups;
    }
    opt.zero_grad();
    const auto hidden = m.forward(b.tokens, ctx);
    const auto task = task_loss(m, b, hidden, o.prompt_loss ? b.target_positions : b.answer_positions);
    const auto aux = m.aux_loss();
    (task + aux).backward();
    step_log log;
    log.step = step;
    log.task_loss = task.item<double>();
    log.aux_loss = aux.item<double>();
    if (o.router_l2 != 0.0f) log.router_l2 = router_l2(m, o.base_router, o.router_l2);
    if (o.clip > 0.0) torch::nn::utils::clip_grad_norm_(m.parameters(), o.clip);
    log.lr = lr_at(step);
    for (auto& group : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(log.lr);
    opt.step();
    if (o.update_expert_bias)
      for (const auto& layer : m.moe_layers())
        if (rt::selection_uses_bias(layer->router.selection)) {
          // In place on the bias's device (the adapter; the host update's bits on either).
          const auto loads = torch::tensor(layer->last.routed_counts, torch::kInt64);
          moe_route::adapters::expert_bias_update(layer->expert_bias, loads.to(layer->expert_bias.device()),
                                                  layer->router.bias_update_rate);
        }
    log.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    for (std::size_t l = 0; l < m.moe_layers().size(); ++l) {
      const auto& rec = m.moe_layers()[l]->last;
      log.expert_ms += rec.expert_ms;
      log.expert_rows += rec.expert_rows;
      for (std::size_t j = 0; j < e; ++j) {
        result.routed_loads[l][j] += rec.routed_counts[j];
        result.executed_loads[l][j] += rec.counts[j];
      }
      if (rec.routed_affinity.defined()) record_signal(rec, groups, o, result.routed_affinities[l], result.signal_retention[l]);
    }
    result.slots += m.moe_layers().front()->last.offered;
    result.log.push_back(log);
    window += log.task_loss;
    ++window_steps;
    if (o.on_log && o.log_every > 0 && (step % o.log_every == 0 || step == o.steps)) {
      log.window_loss = window / window_steps;
      window = 0.0;
      window_steps = 0;
      o.on_log(log);
    }
  }
  return result;
}

std::vector<domain_metrics> evaluate(model& m, const std::vector<example>& data, int batch_size) {
  torch::NoGradGuard no_grad;
  m.eval();
  std::vector<double> loss(num_domains, 0.0), tokens(num_domains, 0.0), correct(num_domains, 0.0),
      count(num_domains, 0.0);
  for (std::size_t begin = 0; begin < data.size(); begin += static_cast<std::size_t>(batch_size)) {
    const auto which = range(begin, std::min(data.size(), begin + static_cast<std::size_t>(batch_size)));
    const batch b = make_batch(data, which, m.config().max_len);
    const batch db = on_device(b, m.device());
    const auto hidden = m.forward(db.tokens, context_of(db, moe_route::mode::eval, false));
    const auto h = hidden.reshape({-1, hidden.size(-1)}).index_select(0, db.answer_positions);
    const auto y = db.targets.reshape({-1}).index_select(0, db.answer_positions);
    const auto logits = m.logits(h);
    const auto per_token = torch::nn::functional::cross_entropy(
        logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone)).cpu();
    const auto hit = (logits.argmax(-1) == y).cpu();
    // Greedy decoding reproduces the answer exactly when, at every answer
    // position and at EOS, the argmax given the true prefix is the true next
    // token: the greedy prefix is then the true prefix. Causal attention and
    // per-token routing in mode::eval make these teacher-forced logits the
    // greedy decoder's, so one forward decides exact match.
    const auto width = b.tokens.size(1);
    const auto pos = b.answer_positions.accessor<std::int64_t, 1>();
    const auto lt = per_token.accessor<float, 1>();
    const auto ht = hit.accessor<bool, 1>();
    std::vector<bool> exact(which.size(), true);
    for (std::int64_t i = 0; i < pos.size(0); ++i) {
      const auto row = static_cast<std::size_t>(pos[i] / width);
      const auto dom = static_cast<std::size_t>(data[which[row]].dom);
      loss[dom] += lt[i];
      tokens[dom] += 1.0;
      if (!ht[i]) exact[row] = false;
    }
    for (std::size_t r = 0; r < which.size(); ++r) {
      const auto dom = static_cast<std::size_t>(data[which[r]].dom);
      count[dom] += 1.0;
      if (exact[r]) correct[dom] += 1.0;
    }
  }
  std::vector<domain_metrics> result;
  for (int dom = 0; dom < num_domains; ++dom) {
    const auto u = static_cast<std::size_t>(dom);
    if (count[u] == 0.0) continue;
    domain_metrics dm;
    dm.domain = domain_name(static_cast<domain>(dom));
    dm.examples = static_cast<std::int64_t>(count[u]);
    dm.accuracy = correct[u] / count[u];
    dm.answer_loss = tokens[u] > 0.0 ? loss[u] / tokens[u] : 0.0;
    result.push_back(dm);
  }
  return result;
}

std::string generate(model& m, const std::string& prompt, int max_bytes, bool* eos) {
  torch::NoGradGuard no_grad;
  m.eval();
  std::vector<std::int64_t> s{vocab::bos};
  for (char c : prompt) s.push_back(vocab::of(c));
  s.push_back(vocab::sep);
  std::string out;
  if (eos) *eos = false;
  while (static_cast<int>(out.size()) < max_bytes && static_cast<std::int64_t>(s.size()) <= m.config().max_len) {
    routing_context ctx;
    ctx.mode = moe_route::mode::eval;
    const auto tokens = torch::tensor(s, torch::kInt64).unsqueeze(0).to(m.device());
    const auto h = m.forward(tokens, ctx).select(1, static_cast<std::int64_t>(s.size()) - 1);
    const auto next = m.logits(h).argmax(-1).item<std::int64_t>();
    if (next < vocab::first_byte) {
      if (eos) *eos = next == vocab::eos;
      break;
    }
    out.push_back(static_cast<char>(next - vocab::first_byte));
    s.push_back(next);
  }
  return out;
}

routing_trace probe(model& m, const std::vector<example>& data, int batch_size) {
  torch::NoGradGuard no_grad;
  m.eval();
  const auto& layers = m.moe_layers();
  routing_trace tr;
  tr.layers = static_cast<std::int64_t>(layers.size());
  tr.k = m.config().top_k;
  tr.experts = static_cast<int>(m.config().experts);
  std::vector<std::vector<std::int32_t>> per_layer(layers.size());
  for (std::size_t begin = 0; begin < data.size(); begin += static_cast<std::size_t>(batch_size)) {
    const batch b = make_batch(data, range(begin, std::min(data.size(), begin + static_cast<std::size_t>(batch_size))),
                               m.config().max_len);
    m.forward(b.tokens.to(m.device()), context_of(b, moe_route::mode::eval, false));
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const auto idx = layers[l]->last.routed.cpu();
      per_layer[l].insert(per_layer[l].end(), idx.data_ptr<std::int32_t>(), idx.data_ptr<std::int32_t>() + idx.numel());
    }
    tr.domains.insert(tr.domains.end(), b.domains.begin(), b.domains.end());
    for (std::int32_t r : b.prior_rows) tr.spans.push_back(r % 2);
  }
  tr.tokens = static_cast<std::int64_t>(tr.domains.size());
  for (const auto& v : per_layer) tr.indices.insert(tr.indices.end(), v.begin(), v.end());
  return tr;
}


row_spread spread(const std::vector<float>& table, int experts) {
  row_spread out;
  const std::size_t rows = table.size() / static_cast<std::size_t>(experts);
  if (rows == 0) return out;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = table.data() + r * static_cast<std::size_t>(experts);
    double mean = 0.0;
    for (int e = 0; e < experts; ++e) mean += row[e];
    mean /= experts;
    double squares = 0.0;
    for (int e = 0; e < experts; ++e) squares += (row[e] - mean) * (row[e] - mean);
    out.sd += std::sqrt(squares / experts);
    out.range += *std::max_element(row, row + experts) - *std::min_element(row, row + experts);
  }
  out.sd /= static_cast<double>(rows);
  out.range /= static_cast<double>(rows);
  return out;
}

base_prior build_prior(model& m, const std::vector<example>& data, prior_form form, int batch_size) {
  torch::NoGradGuard no_grad;
  m.eval();
  const auto& layers = m.moe_layers();
  const auto e = static_cast<int>(m.config().experts);
  std::vector<std::vector<float>> logits(layers.size());
  std::vector<std::int32_t> rows;
  for (std::size_t begin = 0; begin < data.size(); begin += static_cast<std::size_t>(batch_size)) {
    const batch b = make_batch(data, range(begin, std::min(data.size(), begin + static_cast<std::size_t>(batch_size))),
                               m.config().max_len);
    routing_context ctx = context_of(b, moe_route::mode::eval, false);
    ctx.keep_logits = true;
    m.forward(b.tokens.to(m.device()), ctx);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const auto z = layers[l]->last.logits.cpu().contiguous();
      logits[l].insert(logits[l].end(), z.data_ptr<float>(), z.data_ptr<float>() + z.numel());
    }
    rows.insert(rows.end(), b.prior_rows.begin(), b.prior_rows.end());
  }
  const auto s = static_cast<std::int64_t>(2 * data.size());
  base_prior out;
  out.pi.assign(layers.size(), std::vector<float>(static_cast<std::size_t>(s) * e));
  for (std::size_t l = 0; l < layers.size(); ++l) {
    out.logits.push_back(spread(logits[l], e));
    moe_route::route_inputs<float> in;
    in.logits = logits[l].data();
    in.num_tokens = static_cast<std::int64_t>(rows.size());
    in.num_experts = e;
    float* pi = out.pi[l].data();
    const rt::gating_kind gating = form == prior_form::softmax ? rt::gating_kind::softmax : layers[l]->router.gating;
    switch (gating) {
      case rt::gating_kind::softmax: moe_route::prior::build<moe_route::gating::softmax>(in, rows.data(), s, pi); break;
      case rt::gating_kind::sigmoid: moe_route::prior::build<moe_route::gating::sigmoid>(in, rows.data(), s, pi); break;
      case rt::gating_kind::sqrt_softplus:
        moe_route::prior::build<moe_route::gating::sqrt_softplus>(in, rows.data(), s, pi);
        break;
      case rt::gating_kind::softmax_after_topk:
        moe_route::prior::build<moe_route::gating::softmax_after_topk>(in, rows.data(), s, pi);
        break;
    }
  }
  return out;
}

std::vector<prior_table> prepare_prior(const std::vector<std::vector<float>>& pi, int experts) {
  std::vector<prior_table> tables;
  for (const auto& layer : pi) {
    prior_table t;
    t.rows = static_cast<std::int64_t>(layer.size()) / experts;
    t.bias.resize(layer.size());
    t.probs.resize(layer.size());
    moe_route::prior::prepare(layer.data(), t.rows, experts, t.bias.data(), t.probs.data());
    tables.push_back(std::move(t));
  }
  return tables;
}

}  // namespace moe_lm
