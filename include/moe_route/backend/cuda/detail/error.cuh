// moe_route CUDA backend: the error thrown when the CUDA runtime reports a
// failure (a launch that did not start, a bad stream). Argument errors are
// moe_route::error, thrown by host validation before anything is launched.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moe_route::cuda {

class cuda_error : public std::runtime_error {
 public:
  cuda_error(const char* call, cudaError_t code)
      : std::runtime_error(std::string("moe_route: ") + call + " failed: " + cudaGetErrorName(code) + " (" +
                           cudaGetErrorString(code) + ")"),
        code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace detail {

// After a launch: throws cuda_error naming `call` if the launch failed.
inline void check_launch(const char* call) {
  const cudaError_t code = cudaGetLastError();
  if (code != cudaSuccess) throw cuda_error(call, code);
}

// After a runtime call: throws cuda_error naming `call` if it failed.
inline void check_launch(cudaError_t code, const char* call) {
  if (code != cudaSuccess) throw cuda_error(call, code);
}

}  // namespace detail
}  // namespace moe_route::cuda
