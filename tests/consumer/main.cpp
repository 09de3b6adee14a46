// Routes a small batch through a preset and checks the result is sane.
#include <moe_route/moe_route.hpp>

#include <cstdio>
#include <vector>

int main() {
  namespace mr = moe_route;
  auto router = mr::presets::qwen3();
  const int experts = mr::presets::qwen3_experts, tokens = 3, k = router.top_k;
  std::vector<float> logits(tokens * experts);
  for (int i = 0; i < tokens * experts; ++i) logits[i] = static_cast<float>((i * 37) % 101) / 10.0f;
  std::vector<std::int32_t> indices(tokens * k);
  std::vector<float> gates(tokens * k);
  mr::cpu::route(router, mr::route_inputs<float>{logits.data(), tokens, experts},
                 mr::route_outputs{indices.data(), gates.data()});
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += gates[j];
  std::printf("consumer: token 0 -> expert %d, gate sum %.6f\n", indices[0], sum);
  return (sum > 0.999f && sum < 1.001f) ? 0 : 1;
}
