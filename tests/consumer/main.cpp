// Routes a small batch through a preset, and through the same router
// configured at run time (moe_route::runtime, compiled by the library), and
// checks that both agree and are sane.
#include <moe_route/moe_route.hpp>
#include <moe_route/runtime/instantiate.hpp>

#include <cstdio>
#include <vector>

int main() {
  namespace mr = moe_route;
  auto router = mr::presets::qwen3();
  const int experts = mr::presets::qwen3_experts, tokens = 3, k = router.top_k;
  std::vector<float> logits(tokens * experts);
  for (int i = 0; i < tokens * experts; ++i) logits[i] = static_cast<float>((i * 37) % 101) / 10.0f;
  std::vector<std::int32_t> indices(tokens * k), runtime_indices(tokens * k);
  std::vector<float> gates(tokens * k), runtime_gates(tokens * k);
  mr::cpu::route(router, mr::route_inputs<float>{logits.data(), tokens, experts},
                 mr::route_outputs{indices.data(), gates.data()});

  mr::runtime::router_config config;  // qwen3: softmax, top-8, normalised
  config.top_k = k;
  config.normalize = router.normalize;
  std::vector<double> penalties(mr::runtime::num_penalties);
  mr::route_outputs out{runtime_indices.data(), runtime_gates.data()};
  out.penalty_values = penalties.data();
  mr::route_inputs<float> in{logits.data(), tokens, experts};
  in.mode = mr::mode::eval;
  mr::runtime::route(config, in, out);

  // Built with the consumer's default flags, the calls above took the best
  // instruction set this CPU runs; the baseline loops give the same bits.
  std::vector<std::int32_t> baseline_indices(tokens * k);
  std::vector<float> baseline_gates(tokens * k);
  mr::cpu::route(router, mr::route_inputs<float>{logits.data(), tokens, experts},
                 mr::route_outputs{baseline_indices.data(), baseline_gates.data()},
                 mr::cpu::execution{1, mr::cpu::instruction_set::baseline});

  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += gates[j];
  const bool same = indices == runtime_indices && gates == runtime_gates;
  const bool same_paths = indices == baseline_indices && gates == baseline_gates;
  std::printf("consumer: token 0 -> expert %d, gate sum %.6f, runtime router %s, %s path, baseline path %s\n",
              indices[0], sum, same ? "agrees" : "DIFFERS", mr::cpu::name(mr::cpu::isa_of()),
              same_paths ? "agrees" : "DIFFERS");
  return (same && same_paths && sum > 0.999f && sum < 1.001f) ? 0 : 1;
}
