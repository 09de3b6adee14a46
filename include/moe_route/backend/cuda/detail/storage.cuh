// moe_route CUDA backend: the logit types a kernel reads. CUDA's __nv_bfloat16
// and __half have the layout of moe_route::bfloat16 and float16, so inputs of
// either kind are read as the library's storage types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include <moe_route/admission/admission.hpp>
#include <moe_route/selection/expert_choice.hpp>
#include <moe_route/types.hpp>

namespace moe_route::detail {
// CUDA's 16-bit types are accepted as logits wherever the CUDA backend is included.
template <>
inline constexpr bool is_logit_type<__nv_bfloat16> = true;
template <>
inline constexpr bool is_logit_type<__half> = true;
}  // namespace moe_route::detail

namespace moe_route::cuda {

namespace detail {

template <class T>
struct storage {
  using type = T;
};
template <>
struct storage<__nv_bfloat16> {
  using type = bfloat16;
};
template <>
struct storage<__half> {
  using type = float16;
};
template <class T>
using storage_t = typename storage<T>::type;

static_assert(sizeof(__nv_bfloat16) == sizeof(bfloat16) && alignof(__nv_bfloat16) >= alignof(bfloat16),
              "__nv_bfloat16 and moe_route::bfloat16 must share a layout");
static_assert(sizeof(__half) == sizeof(float16) && alignof(__half) >= alignof(float16),
              "__half and moe_route::float16 must share a layout");

template <class T>
const storage_t<T>* storage_pointer(const T* p) {
  return reinterpret_cast<const storage_t<T>*>(p);
}

// The same inputs with the logits read as the library's storage type.
template <class T>
admission_inputs<storage_t<T>> storage_inputs(const admission_inputs<T>& in) {
  return {storage_pointer(in.logits), in.num_tokens,   in.num_experts, in.routed_indices, in.routed_gates,
          in.hidden_norms,            in.weight_norms, in.group_ids,   in.num_groups,     in.capacity,
          in.token_mask};
}
template <class T>
expert_choice_inputs<storage_t<T>> storage_inputs(const expert_choice_inputs<T>& in) {
  return {storage_pointer(in.logits), in.num_tokens, in.num_experts, in.group_ids,
          in.num_groups,              in.capacity,   in.token_mask};
}

}  // namespace detail

}  // namespace moe_route::cuda
