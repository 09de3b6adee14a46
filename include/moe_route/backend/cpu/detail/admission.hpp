// moe_route CPU backend: the machinery of cpu::admit (backend/cpu/admit.hpp)
// and cpu::expert_choice: row buffers, the (group, expert) segments of a slot
// list, the top-C cut, and the passes of admission.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <moe_route/admission/admission.hpp>
#include <moe_route/admission/gates.hpp>
#include <moe_route/admission/scores.hpp>
#include <moe_route/backend/cpu/detail/rows.hpp>
#include <moe_route/backend/cpu/detail/threads.hpp>
#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/config.hpp>
#include <moe_route/detail/numerics.hpp>
#include <moe_route/router.hpp>
#include <moe_route/types.hpp>

namespace moe_route::cpu::admission_detail {

namespace num = moe_route::detail;
using namespace moe_route::admission;
using moe_route::admission::detail::state_below_threshold;
using moe_route::admission::detail::state_dropped;
using moe_route::admission::detail::state_invalid;
using moe_route::admission::detail::state_kept;
using moe_route::admission::detail::state_masked;
using moe_route::admission::detail::state_over_capacity;
using moe_route::admission::detail::state_pending;
using moe_route::admission::detail::state_rerouted;
using moe_route::admission::detail::state_status_mask;

using cpu::detail::parallel_blocks;
using cpu::detail::block_plan;
using cpu::detail::plan_blocks;
using cpu::detail::plan_token_blocks;

template <class T>
void sanitized_row(const T* z, int n, float* v) {
  for (int e = 0; e < n; ++e) v[e] = num::sanitize(num::to_float(z[e]));
}

// Per-worker scratch of one token row.
struct row_buffers {
  std::vector<float> v, t, aff;
  std::vector<std::uint64_t> keys;
  std::vector<unsigned char> mark;
  explicit row_buffers(int e) : v(e), t(e), aff(e), keys(e), mark(e, 0) {}
};

// The (group, expert) segments of a list of slots: a stable counting sort of
// `slots` by segment id seg_of(slot) in [0, segments); returns the segment
// starts [segments + 1] and writes the sorted slots to `order`.
template <class SegOf>
std::vector<std::int64_t> bucket(const std::vector<std::int32_t>& slots, std::int64_t segments, SegOf seg_of,
                                 std::vector<std::int32_t>& order) {
  std::vector<std::int64_t> start(static_cast<std::size_t>(segments) + 1, 0);
  for (std::int32_t s : slots) ++start[static_cast<std::size_t>(seg_of(s)) + 1];
  for (std::int64_t b = 0; b < segments; ++b) start[b + 1] += start[b];
  std::vector<std::int64_t> cursor(start.begin(), start.end() - 1);
  order.assign(slots.size(), 0);
  for (std::int32_t s : slots) order[static_cast<std::size_t>(cursor[seg_of(s)]++)] = s;
  return start;
}

// Moves the `keep` largest keys of order[begin, end) to the front (their
// order among themselves is unspecified; the set is unique as keys are distinct).
inline void select_top(std::vector<std::int32_t>& order, std::int64_t begin, std::int64_t end, std::int64_t keep,
                       const std::vector<std::uint64_t>& key) {
  if (keep <= 0 || keep >= end - begin) return;
  std::nth_element(order.begin() + begin, order.begin() + begin + keep, order.begin() + end,
                   [&key](std::int32_t a, std::int32_t b) { return key[a] > key[b]; });
}


// cpu::admit after its argument checks: (1) the affinity of every routed
// slot against the threshold, (2) the strict pass, (3) the reroute rounds,
// (4) the admitted indices and gates, (5) the report.
template <class Router, class Policy, class T>
admission_report admit(const Router& r, const Policy& p, const admission_inputs<T>& in, const admission_outputs& out,
                       execution ex) {
  using namespace moe_route::admission::detail;

  const std::int64_t n_tokens = in.num_tokens;
  const int k = r.top_k;
  const int e_count = in.num_experts;
  const std::int64_t slots = n_tokens * k;
  auto masked = [&](std::int64_t t) { return num::token_masked(in.token_mask, t); };
  admission_report rep;

  if constexpr (Policy::is_dropless) {
    for (std::int64_t t = 0; t < n_tokens; ++t) {
      const bool pad = masked(t);
      for (std::int64_t s = t * k; s < (t + 1) * k; ++s) {
        out.indices[s] = pad ? -1 : in.routed_indices[s];
        out.gates[s] = pad ? 0.0f : in.routed_gates[s];
        if (out.status != nullptr)
          out.status[s] = static_cast<std::int8_t>(pad ? slot_status::dropped : slot_status::kept);
      }
      rep.kept += pad ? 0 : k;
    }
    rep.offered = rep.kept;
    if (out.report != nullptr) *out.report = rep;
    return rep;
  } else {
    using A = typename Policy::affinity_type;
    using G = typename Router::gating_type;
    constexpr bool aff_row = A::kind == affinity_kind::probability && probability_needs_row<G>;
    const float tau = p.threshold;
    const int groups = in.num_groups;
    const std::int64_t segments = static_cast<std::int64_t>(groups) * e_count;
    auto group_of = [&](std::int64_t t) { return in.group_ids != nullptr ? in.group_ids[t] : 0; };

    std::vector<std::int64_t> group_tokens(groups, 0);
    for (std::int64_t t = 0; t < n_tokens; ++t)
      if (!masked(t)) ++group_tokens[group_of(t)];
    std::vector<std::int64_t> factor_capacity(groups);
    for (int g = 0; g < groups; ++g)
      factor_capacity[g] = capacity_from_factor(p.capacity_factor, p.min_capacity, group_tokens[g], k, e_count);
    auto capacity = [&](int g, int e) { return in.capacity != nullptr ? in.capacity[e] : factor_capacity[g]; };

    const block_plan plan = plan_token_blocks(ex, n_tokens, 512);
    std::vector<std::uint8_t> state(static_cast<std::size_t>(slots));
    std::vector<std::uint64_t> key(static_cast<std::size_t>(slots), 0);
    std::vector<std::int32_t> target(in.routed_indices, in.routed_indices + slots);  // the expert a slot holds
    const std::uint8_t rejected = Policy::reroutes ? state_pending : state_dropped;

    // 1. Affinity of every routed slot; tau.
    parallel_blocks(n_tokens, plan, [&](std::int64_t begin, std::int64_t end, int) {
      row_buffers buf(e_count);
      for (std::int64_t t = begin; t < end; ++t) {
        if (masked(t)) {
          std::fill_n(state.begin() + t * k, k, static_cast<std::uint8_t>(state_dropped | state_masked));
          continue;
        }
        const T* z = in.logits + t * e_count;
        row_stats st;
        if constexpr (aff_row) {
          sanitized_row(z, e_count, buf.v.data());
          st = softmax_row_stats(buf.v.data(), e_count, buf.t.data());
        }
        const float xn = A::needs_norms ? in.hidden_norms[t] : 1.0f;
        for (int j = 0; j < k; ++j) {
          const std::int64_t s = t * k + j;
          const int e = in.routed_indices[s];
          const float v = num::sanitize(num::to_float(z[e]));
          const float a = slot_affinity<A, G>(v, st, xn, A::needs_norms ? in.weight_norms[e] : 1.0f,
                                              in.routed_gates[s]);
          if (a < tau) {
            state[s] = static_cast<std::uint8_t>(rejected | state_below_threshold);
          } else {
            state[s] = state_kept;
            key[s] = rank_key(a, t);
          }
        }
      }
    });

    // 2. Strict pass: per (group, expert), keep the top C_e of the candidates.
    std::vector<std::int64_t> load(static_cast<std::size_t>(segments), 0);
    {
      std::vector<std::int32_t> candidates, order;
      candidates.reserve(static_cast<std::size_t>(slots));
      for (std::int64_t s = 0; s < slots; ++s)
        if (state[s] == state_kept) candidates.push_back(static_cast<std::int32_t>(s));
      auto seg_of = [&](std::int32_t s) {
        return static_cast<std::int64_t>(group_of(s / k)) * e_count + in.routed_indices[s];
      };
      const std::vector<std::int64_t> start = bucket(candidates, segments, seg_of, order);
      for (std::int64_t b = 0; b < segments; ++b) {
        const std::int64_t size = start[b + 1] - start[b];
        if (size == 0) continue;
        const std::int64_t cap = capacity(static_cast<int>(b / e_count), static_cast<int>(b % e_count));
        select_top(order, start[b], start[b + 1], cap, key);
        for (std::int64_t i = start[b] + std::min(cap, size); i < start[b + 1]; ++i)
          state[order[i]] = static_cast<std::uint8_t>(rejected | state_over_capacity);
        load[b] = std::min(cap, size);
      }
    }

    // 3. Reroute rounds.
    if constexpr (Policy::reroutes) {
      const int rounds = p.overflow.max_rounds < 0 ? k : p.overflow.max_rounds;
      std::vector<std::int64_t> fill(groups);
      for (int g = 0; g < groups; ++g)
        fill[g] = capacity_from_factor(p.overflow.fill_factor, 0, group_tokens[g], k, e_count);
      std::vector<std::int64_t> limit_of(static_cast<std::size_t>(segments));
      for (std::int64_t seg = 0; seg < segments; ++seg)
        limit_of[seg] = std::min(fill[seg / e_count], capacity(static_cast<int>(seg / e_count), static_cast<int>(seg % e_count)));
      auto limit = [&](std::int64_t seg) { return limit_of[seg]; };
      std::vector<unsigned char> open(static_cast<std::size_t>(segments));  // load < limit at the start of the round
      std::vector<std::int64_t> pending_tokens;
      for (std::int64_t t = 0; t < n_tokens; ++t)
        for (int j = 0; j < k; ++j)
          if ((state[t * k + j] & state_status_mask) == state_pending) {
            pending_tokens.push_back(t);
            break;
          }
      std::vector<std::int32_t> proposal(static_cast<std::size_t>(slots), -1);
      for (int round = 0; round < rounds && !pending_tokens.empty(); ++round) {
        std::vector<std::int64_t> open_in_group(groups, 0);
        for (std::int64_t seg = 0; seg < segments; ++seg) {
          open[seg] = load[seg] < limit_of[seg];
          open_in_group[seg / e_count] += open[seg];
        }
        // 3a. Proposals, per token, against the loads at the start of the round.
        const block_plan pending_plan = plan_token_blocks(ex, static_cast<std::int64_t>(pending_tokens.size()), 64);
        parallel_blocks(static_cast<std::int64_t>(pending_tokens.size()), pending_plan,
                            [&](std::int64_t begin, std::int64_t end, int) {
          row_buffers buf(e_count);
          for (std::int64_t i = begin; i < end; ++i) {
            const std::int64_t t = pending_tokens[i];
            const int g = group_of(t);
            if (open_in_group[g] == 0) {  // every expert of the group is at its limit: no proposal
              for (int j = 0; j < k; ++j) proposal[t * k + j] = -1;
              continue;
            }
            const T* z = in.logits + t * e_count;
            sanitized_row(z, e_count, buf.v.data());
            row_stats st;
            if constexpr (aff_row) st = softmax_row_stats(buf.v.data(), e_count, buf.t.data());
            const float xn = A::needs_norms ? in.hidden_norms[t] : 1.0f;
            // Candidate keys (affinity desc, expert asc) of the experts with room
            // and a >= tau; 0 = not a candidate.
            const unsigned char* open_g = open.data() + static_cast<std::int64_t>(g) * e_count;
            for (int e = 0; e < e_count; ++e) {
              buf.aff[e] = affinity_value<A, G>(buf.v[e], st, xn, A::needs_norms ? in.weight_norms[e] : 1.0f);
              buf.keys[e] = open_g[e] && !(buf.aff[e] < tau) ? num::pack_key(buf.aff[e], e) : 0;
            }
            for (int j = 0; j < k; ++j) {
              const std::uint8_t s = state[t * k + j] & state_status_mask;
              if (s == state_kept || s == state_rerouted) buf.mark[target[t * k + j]] = 1;
            }
            for (int j = 0; j < k; ++j) {
              const std::int64_t s = t * k + j;
              proposal[s] = -1;
              if ((state[s] & state_status_mask) != state_pending) continue;
              std::uint64_t best = 0;
              for (int e = 0; e < e_count; ++e) {
                const std::uint64_t candidate = buf.mark[e] ? 0 : buf.keys[e];
                best = candidate > best ? candidate : best;
              }
              if (best == 0) continue;
              const int e = num::packed_expert(best);
              proposal[s] = e;
              key[s] = rank_key(buf.aff[e], t);
              buf.mark[e] = 1;
            }
            for (int j = 0; j < k; ++j) {
              const std::int64_t s = t * k + j;
              const std::uint8_t st2 = state[s] & state_status_mask;
              if (st2 == state_kept || st2 == state_rerouted) buf.mark[target[s]] = 0;
              if (proposal[s] >= 0) buf.mark[proposal[s]] = 0;
            }
          }
        });
        // 3b. Acceptance per (group, expert), in key order, up to the room left.
        std::vector<std::int32_t> proposing, order;
        for (std::int64_t t : pending_tokens)
          for (int j = 0; j < k; ++j)
            if (proposal[t * k + j] >= 0) proposing.push_back(static_cast<std::int32_t>(t * k + j));
        if (proposing.empty()) break;  // nothing can change in later rounds
        auto seg_of = [&](std::int32_t s) { return static_cast<std::int64_t>(group_of(s / k)) * e_count + proposal[s]; };
        const std::vector<std::int64_t> start = bucket(proposing, segments, seg_of, order);
        for (std::int64_t b = 0; b < segments; ++b) {
          const std::int64_t size = start[b + 1] - start[b];
          if (size == 0) continue;
          const std::int64_t room = std::max<std::int64_t>(0, limit(b) - load[b]);
          select_top(order, start[b], start[b + 1], room, key);
          const std::int64_t accepted = std::min(room, size);
          for (std::int64_t i = start[b]; i < start[b] + accepted; ++i) {
            const std::int32_t s = order[i];
            state[s] = static_cast<std::uint8_t>((state[s] & ~state_status_mask) | state_rerouted);
            target[s] = proposal[s];
          }
          load[b] += accepted;
        }
        for (std::int32_t s : proposing) proposal[s] = -1;
        std::vector<std::int64_t> still;
        for (std::int64_t t : pending_tokens)
          for (int j = 0; j < k; ++j)
            if ((state[t * k + j] & state_status_mask) == state_pending) {
              still.push_back(t);
              break;
            }
        pending_tokens.swap(still);
      }
      for (std::int64_t s = 0; s < slots; ++s)
        if ((state[s] & state_status_mask) == state_pending)
          state[s] = static_cast<std::uint8_t>((state[s] & ~state_status_mask) | state_dropped);
    }

    // 4. Admitted indices and gates, per token.
    const bool renorm = renormalizes(p);
    parallel_blocks(n_tokens, plan, [&](std::int64_t begin, std::int64_t end, int) {
      row_buffers buf(e_count);
      for (std::int64_t t = begin; t < end; ++t) {
        std::int32_t* admitted = out.indices + t * k;
        if (masked(t)) {
          std::fill_n(admitted, k, -1);
          std::fill_n(out.gates + t * k, k, 0.0f);
          if (out.status != nullptr) std::fill_n(out.status + t * k, k, static_cast<std::int8_t>(slot_status::dropped));
          continue;
        }
        const std::int32_t* routed = in.routed_indices + t * k;
        bool any_rerouted = false;
        for (int j = 0; j < k; ++j) {
          const std::uint8_t s = state[t * k + j] & state_status_mask;
          admitted[j] = s == state_dropped ? -1 : target[t * k + j];
          any_rerouted |= s == state_rerouted;
          if (out.status != nullptr)
            out.status[t * k + j] = static_cast<std::int8_t>(s == state_kept       ? slot_status::kept
                                                             : s == state_rerouted ? slot_status::rerouted
                                                                                   : slot_status::dropped);
        }
        float sigma[max_top_k], phi[max_top_k];
        if (any_rerouted) {
          const T* z = in.logits + t * e_count;
          row_stats st;
          if constexpr (gate_input_needs_row<G>) {
            sanitized_row(z, e_count, buf.v.data());
            st = softmax_row_stats(buf.v.data(), e_count, buf.t.data());
          }
          for (int j = 0; j < k; ++j) {
            sigma[j] = gate_input<G>(num::sanitize(num::to_float(z[routed[j]])), st);
            phi[j] = admitted[j] >= 0 ? gate_input<G>(num::sanitize(num::to_float(z[admitted[j]])), st) : 0.0f;
          }
        }
        admitted_gate_weights(r, in.routed_gates + t * k, sigma, phi, routed, admitted, renorm, out.gates + t * k, k);
      }
    });

    // 5. Report.
    for (std::int64_t t = 0; t < n_tokens; ++t) {
      if (masked(t)) continue;
      rep.offered += k;
      int survivors = 0;
      for (int j = 0; j < k; ++j) {
        const std::uint8_t s = state[t * k + j];
        const std::uint8_t status = s & state_status_mask;
        rep.kept += status == state_kept;
        rep.rerouted += status == state_rerouted;
        rep.dropped += status == state_dropped;
        rep.below_threshold += (s & state_below_threshold) != 0;
        rep.over_capacity += (s & state_over_capacity) != 0;
        survivors += status != state_dropped;
      }
      rep.tokens_without_experts += survivors == 0;
    }
    if (out.report != nullptr) *out.report = rep;
    return rep;
  }
}

}  // namespace moe_route::cpu::admission_detail
