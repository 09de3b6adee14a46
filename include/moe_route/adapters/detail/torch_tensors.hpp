// moe_route: argument checks and device memory for the LibTorch adapter
// (adapters/torch.hpp). Checks raise c10::TypeError (dtype) or
// c10::ValueError (device, shape, value), which PyTorch's Python bindings turn
// into TypeError and ValueError; each names the argument.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <moe_route/config.hpp>
#include <moe_route/types.hpp>

namespace moe_route::adapters::detail {

[[noreturn]] inline void value_error(const std::string& m) { TORCH_CHECK_VALUE(false, "moe_route: ", m); }
[[noreturn]] inline void type_error(const std::string& m) { TORCH_CHECK_TYPE(false, "moe_route: ", m); }

// f(), with the library's own argument errors (moe_route::error) raised as c10::ValueError.
template <class F>
decltype(auto) translating_errors(F&& f) {
  try {
    return f();
  } catch (const moe_route::error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// An integer argument of an operator schema (int64) as the library's int,
// refused when it does not fit rather than wrapped.
inline int int_of(std::int64_t value, const char* name) {
  if (value < INT32_MIN || value > INT32_MAX)
    value_error(std::string(name) + " (= " + std::to_string(value) + ") is outside the int32 range");
  return static_cast<int>(value);
}

inline std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// torch's Python name of a dtype, for messages.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return c10::toString(t);
  }
}

// Where a call runs: the device of its first tensor argument (`of`). CUDA
// tensors are accepted when the adapter is compiled with
// MOE_ROUTE_TORCH_WITH_CUDA (and linked with moe_route::cuda_runtime).
struct placement {
  c10::Device device;
  std::string of;

  bool cuda() const { return device.is_cuda(); }
  at::TensorOptions options(at::ScalarType dtype) const { return at::TensorOptions().dtype(dtype).device(device); }
};

inline placement placement_of(const at::Tensor& t, const std::string& name) {
  if (!t.defined()) value_error(name + " is undefined");
  const c10::Device d = t.device();
#ifdef MOE_ROUTE_TORCH_WITH_CUDA
  if (!d.is_cpu() && !d.is_cuda()) value_error(name + " is on " + d.str() + "; moe_route runs on CPU and CUDA tensors");
#else
  if (!d.is_cpu())
    value_error(name + " is on " + d.str() +
                ", but this moe_route was built for the CPU only (build it against a CUDA PyTorch for GPU tensors)");
#endif
  return {d, name};
}

// `t` as a contiguous tensor of `dtype` and `shape` (-1: any extent) on the
// call's device; a copy only if it was not contiguous. Integer index tensors
// may be int64: they are range-checked and narrowed to int32.
inline at::Tensor checked(const at::Tensor& t, const std::string& name, at::ScalarType dtype,
                          const std::vector<std::int64_t>& shape, const placement& where) {
  if (!t.defined()) value_error(name + " is undefined");
  if (t.device() != where.device)
    value_error(name + " is on " + t.device().str() + ", but " + where.of + " is on " + where.device.str());
  at::Tensor u = t;
  if (dtype == at::kInt && t.scalar_type() == at::kLong) {
    if (t.numel() > 0 && (t.min().item<std::int64_t>() < INT32_MIN || t.max().item<std::int64_t>() > INT32_MAX))
      value_error(name + " has values outside the int32 range");
    u = t.to(at::kInt);
  } else if (t.scalar_type() != dtype) {
    type_error(name + " must be " + dtype_name(dtype) + (dtype == at::kInt ? " or torch.int64" : "") + ", got " +
               dtype_name(t.scalar_type()));
  }
  bool ok = u.dim() == static_cast<std::int64_t>(shape.size());
  for (std::size_t d = 0; ok && d < shape.size(); ++d) ok = shape[d] < 0 || u.size(d) == shape[d];
  if (!ok) {
    std::string want = "[";
    for (std::size_t d = 0; d < shape.size(); ++d)
      want += (d ? ", " : "") + (shape[d] < 0 ? std::string("*") : std::to_string(shape[d]));
    value_error(name + " must have shape " + want + "], got " + shape_of(u));
  }
  return u.contiguous();
}

inline std::optional<at::Tensor> checked(const std::optional<at::Tensor>& t, const std::string& name,
                                         at::ScalarType dtype, const std::vector<std::int64_t>& shape,
                                         const placement& where) {
  if (!t || !t->defined()) return std::nullopt;
  return checked(*t, name, dtype, shape, where);
}

// Logits [N, E] float32 with 1 <= E <= max_experts.
inline at::Tensor logits_of(const at::Tensor& logits, const placement& where) {
  at::Tensor z = checked(logits, "logits", at::kFloat, {-1, -1}, where);
  if (z.size(1) < 1) value_error("logits must have at least one expert column, got shape " + shape_of(z));
  if (z.size(1) > max_experts)
    value_error("logits: num_experts (= " + std::to_string(z.size(1)) + ") must be in [1, " +
                std::to_string(max_experts) + "]");
  return z;
}

template <class T>
const T* data_of(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

// A valid-token mask [n] (torch.bool, true = valid) as the bytes the library
// reads, or null; checked like every other tensor argument.
inline std::optional<at::Tensor> token_mask_of(const std::optional<at::Tensor>& mask, std::int64_t n,
                                               const placement& where) {
  return checked(mask, "token_mask", at::kBool, {n}, where);
}

inline const std::uint8_t* mask_data(const std::optional<at::Tensor>& mask) {
  return mask ? static_cast<const std::uint8_t*>(mask->data_ptr()) : nullptr;
}

// Bytes from torch's allocator on the call's device (the caching allocator on CUDA).
inline at::Tensor bytes_on(std::size_t bytes, const placement& where) {
  return at::empty({static_cast<std::int64_t>(bytes)}, where.options(at::kByte));
}

// A zero tensor on the call's device. On the CPU the bytes are cleared here
// rather than by a second dispatched operator (fill_), which is most of the
// cost of a small tensor.
inline at::Tensor zeros_on(at::IntArrayRef sizes, at::ScalarType dtype, const placement& where) {
  if (where.cuda()) return at::zeros(sizes, where.options(dtype));
  at::Tensor t = at::empty(sizes, where.options(dtype));
  std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

// A zeroed byte buffer whose size the caller's arguments set: a size the
// allocator refuses is reported naming those arguments (sized_by(), called
// only then), not as the allocator's own error.
template <class SizedBy>
at::Tensor zeroed_bytes(std::size_t bytes, const placement& where, SizedBy sized_by) {
  const auto refused = [&] { return sized_by() + " need a workspace of " + std::to_string(bytes) + " bytes, which "; };
  if (bytes > static_cast<std::size_t>(INT64_MAX)) value_error(refused() + "no tensor can hold");
  try {
    return zeros_on({static_cast<std::int64_t>(bytes)}, at::kByte, where);
  } catch (const c10::Error&) {
    value_error(refused() + "cannot be allocated on " + where.device.str());
  }
}

// A report struct of int64 counters as an int64 tensor (zeros), and back.
template <class Report>
at::Tensor report_tensor(const placement& where) {
  static_assert(sizeof(Report) % sizeof(std::int64_t) == 0, "reports are int64 counters");
  return zeros_on({static_cast<std::int64_t>(sizeof(Report) / sizeof(std::int64_t))}, at::kLong, where);
}

template <class Report>
Report* report_data(const at::Tensor& t) {
  return reinterpret_cast<Report*>(t.data_ptr<std::int64_t>());
}

// torch's current stream on the call's device, as a cudaStream_t (the device
// is made current by the caller's DeviceGuard).
inline void* current_stream(const placement& where) {
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(where.device.type());
  return impl->getStreamNativeHandle(impl->getStream(where.device));
}

}  // namespace moe_route::adapters::detail
