// Compiles the CUDA backend inside a downstream project (not run here).
#include <moe_route/moe_route.cuh>

void consumer_route(const float* logits, std::int64_t tokens, std::int32_t* indices, float* gates,
                    cudaStream_t stream) {
  namespace mr = moe_route;
  mr::cuda::route(mr::presets::deepseek_v2_lite(),
                  mr::route_inputs<float>{logits, tokens, mr::presets::deepseek_v2_lite_experts},
                  mr::route_outputs{indices, gates}, stream);
}
