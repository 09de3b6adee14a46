// moe_route: the neutral values a runtime router's policy inputs get when a
// call leaves them null, for both backends: which inputs are missing
// (find_missing), where their values go in one buffer (layout_of), and the
// inputs pointing at them (fill_neutral, over a backend's memory writes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <moe_route/runtime/config.hpp>
#include <moe_route/types.hpp>

namespace moe_route::runtime::detail {

// The policy inputs a call leaves null, which a runtime router (it carries
// every penalty) needs as neutral values: no prior row for any token, a zero
// prior bias and uniform prior probabilities over prior_rows rows, one
// sequence, uniform load fractions, every expert on rank 0. Both backends fill
// the same set (host memory in runtime/cpu.hpp, device scratch in runtime/detail/cuda.cuh).
struct missing_inputs {
  bool token_prior_row = false, prior_bias = false, prior_probs = false, sequence_ids = false,
       load_fractions = false, expert_rank = false;
  std::int64_t prior_rows = 0;  // rows of the neutral prior tables: the caller's, or 1 when it gives neither
};

// Which inputs `in` leaves null. A policy that is on still needs its real
// input: a missing one is named in the error.
inline missing_inputs find_missing(const router_config& c, const route_inputs<float>& in) {
  auto fail = [](const std::string& m) { throw error("moe_route: " + m); };
  missing_inputs m;
  if (in.num_experts < 1) return m;  // the backend names the bad E
  const bool prior_on = c.prior != prior_kind::none && !(c.prior == prior_kind::log_prior_bias && c.prior_bias.beta == 0.0f);
  // With no tokens nothing is read, so nothing is required (as for a typed router).
  const bool train = in.mode == mode::train && in.num_tokens > 0;
  if (in.token_prior_row == nullptr) {
    if (train && (prior_on || c.kl_to_base.coefficient != 0.0f || c.logit_l2.coefficient != 0.0f))
      fail("token_prior_row is null, but the router's prior policy or a prior-space penalty (kl_to_base, "
           "logit_l2) is on");
    m.token_prior_row = true;
  }
  if (in.prior_bias == nullptr || in.prior_probs == nullptr) {
    if (train && in.prior_bias == nullptr && (prior_on || c.logit_l2.coefficient != 0.0f))
      fail("prior_bias is null, but the prior policy or logit_l2 is on (prior::prepare)");
    if (train && in.prior_probs == nullptr && c.kl_to_base.coefficient != 0.0f)
      fail("prior_probs is null, but kl_to_base is on (prior::prepare's probs)");
    m.prior_bias = in.prior_bias == nullptr;
    m.prior_probs = in.prior_probs == nullptr;
  }
  m.prior_rows = m.prior_bias && m.prior_probs ? 1 : in.prior_rows;
  if (in.sequence_ids == nullptr) {
    if (train && c.load_balance.coefficient != 0.0f && c.load_balance.over == penalty::load_balance::scope::sequence)
      fail("sequence_ids is null, but load_balance has scope::sequence");
    m.sequence_ids = true;
  }
  if (in.load_fractions == nullptr) {
    if (train && c.load_balance.coefficient != 0.0f && c.load_balance.over == penalty::load_balance::scope::global_batch)
      fail("load_fractions is null, but load_balance has scope::global_batch");
    m.load_fractions = true;
  }
  m.expert_rank = in.expert_rank == nullptr;
  return m;
}

// The neutral inputs' places in one buffer (the caller's device scratch on the GPU): each region
// 256-byte aligned, present only when find_missing asks for it (an offset of
// -1 otherwise).
struct neutral_layout {
  std::ptrdiff_t token_prior_row = -1, sequence_ids = -1, prior_bias = -1, prior_probs = -1, load_fractions = -1,
                 expert_rank = -1;
  std::size_t bytes = 0;
};

inline neutral_layout layout_of(const missing_inputs& m, std::int64_t num_tokens, int num_experts) {
  neutral_layout l;
  const auto n = static_cast<std::size_t>(num_tokens > 0 ? num_tokens : 0);
  const auto e = static_cast<std::size_t>(num_experts > 0 ? num_experts : 0);
  const auto rows = static_cast<std::size_t>(m.prior_rows > 0 ? m.prior_rows : 0);
  auto take = [&](bool wanted, std::size_t size) -> std::ptrdiff_t {
    if (!wanted) return -1;
    const auto at = static_cast<std::ptrdiff_t>(l.bytes);
    l.bytes += (size + 255) / 256 * 256;
    return at;
  };
  l.token_prior_row = take(m.token_prior_row, n * sizeof(std::int32_t));
  l.sequence_ids = take(m.sequence_ids, n * sizeof(std::int32_t));
  l.prior_bias = take(m.prior_bias, rows * e * sizeof(float));
  l.prior_probs = take(m.prior_probs, rows * e * sizeof(float));
  l.load_fractions = take(m.load_fractions, e * sizeof(float));
  l.expert_rank = take(m.expert_rank, e * sizeof(std::int32_t));
  return l;
}


// `in` with its missing inputs pointing at neutral values written into the
// l.bytes bytes at `base` by `fill`, which provides
//   fill.bytes(p, value, count, what): count bytes of `value` at p;
//   fill.floats(p, value, count): count floats of `value` at p.
// A -1 row id is the byte 0xff four times, 0 and 0.0f are zero bytes.
template <class Fill>
route_inputs<float> fill_neutral(const missing_inputs& m, const neutral_layout& l, route_inputs<float> in,
                                 unsigned char* base, const Fill& fill) {
  if (l.bytes == 0) return in;
  const auto n = static_cast<std::size_t>(in.num_tokens > 0 ? in.num_tokens : 0);
  const auto e = static_cast<std::size_t>(in.num_experts);
  const float one_over_e = 1.0f / static_cast<float>(in.num_experts);
  if (l.token_prior_row >= 0) {
    fill.bytes(base + l.token_prior_row, 0xff, n * sizeof(std::int32_t), "neutral token_prior_row");
    in.token_prior_row = reinterpret_cast<const std::int32_t*>(base + l.token_prior_row);
  }
  if (l.sequence_ids >= 0) {
    fill.bytes(base + l.sequence_ids, 0, n * sizeof(std::int32_t), "neutral sequence_ids");
    in.sequence_ids = reinterpret_cast<const std::int32_t*>(base + l.sequence_ids);
    in.num_sequences = 1;
  }
  if (m.prior_bias || m.prior_probs) in.prior_rows = m.prior_rows;
  const std::size_t table = static_cast<std::size_t>(m.prior_rows) * e;
  if (l.prior_bias >= 0) {
    fill.bytes(base + l.prior_bias, 0, table * sizeof(float), "neutral prior_bias");
    in.prior_bias = reinterpret_cast<const float*>(base + l.prior_bias);
  }
  if (l.prior_probs >= 0) {
    auto* p = reinterpret_cast<float*>(base + l.prior_probs);
    fill.floats(p, one_over_e, table);
    in.prior_probs = p;
  }
  if (l.load_fractions >= 0) {
    auto* p = reinterpret_cast<float*>(base + l.load_fractions);
    fill.floats(p, one_over_e, e);
    in.load_fractions = p;
  }
  if (l.expert_rank >= 0) {
    fill.bytes(base + l.expert_rank, 0, e * sizeof(std::int32_t), "neutral expert_rank");
    in.expert_rank = reinterpret_cast<const std::int32_t*>(base + l.expert_rank);
    in.rank = 0;
  }
  return in;
}

}  // namespace moe_route::runtime::detail
