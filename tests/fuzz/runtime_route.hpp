// A runtime router call as the fuzz targets make it: every output a runtime
// router may write (it carries all penalties) allocated, and poisoned so that
// an output left unwritten shows.
#pragma once

#include <moe_route/runtime/instantiate.hpp>

#include <cstdint>
#include <vector>

namespace fuzz {

struct routed {
  std::vector<std::int32_t> indices;
  std::vector<float> gates;
  std::int64_t nonfinite = -1;
  std::vector<double> penalties;
  std::vector<unsigned char> workspace;  // filled by route, read by backward
};

inline routed route(const moe_route::runtime::router_config& c, const std::vector<float>& logits, std::int64_t N,
                    int E, const float* bias, int threads, moe_route::mode mode = moe_route::mode::train) {
  namespace rt = moe_route::runtime;
  routed o;
  o.indices.assign(static_cast<std::size_t>(N) * c.top_k, -7);
  o.gates.assign(o.indices.size(), -7.0f);
  o.penalties.assign(rt::num_penalties, -7.0);
  o.workspace.assign(rt::workspace_bytes(c, N, E), 0);
  moe_route::route_inputs<float> in;
  in.logits = logits.data();
  in.num_tokens = N;
  in.num_experts = E;
  in.expert_bias = bias;
  in.mode = mode;
  moe_route::route_outputs out;
  out.indices = o.indices.data();
  out.gates = o.gates.data();
  out.penalty_values = o.penalties.data();
  out.workspace = o.workspace.data();
  out.workspace_bytes = o.workspace.size();
  o.nonfinite = rt::route(c, in, out, moe_route::cpu::execution{threads, moe_route::cpu::instruction_set::best, 1}).nonfinite_rows;
  return o;
}

}  // namespace fuzz
