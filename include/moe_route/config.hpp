// moe_route: configuration macros shared by host and device code.
#pragma once

#define MOE_ROUTE_VERSION_MAJOR 0
#define MOE_ROUTE_VERSION_MINOR 1
#define MOE_ROUTE_VERSION_PATCH 0

// One function body serves both backends: under nvcc the per-token math is
// compiled for host and device, under a plain host compiler it is ordinary C++.
#if defined(__CUDACC__)
#define MOE_ROUTE_HD __host__ __device__ __forceinline__
#define MOE_ROUTE_DEVICE_COMPILE 1
#else
#define MOE_ROUTE_HD inline
#define MOE_ROUTE_DEVICE_COMPILE 0
#endif

// A host function whose callees are all inlined into it, however large it
// grows. The penalties' per-token rows call exp, log and the gatings' scores
// per expert; left to its heuristics g++ keeps those out of line there, and
// the loops around them stop vectorising (2x on a training step with load
// balance, docs/performance.md).
#if !defined(__CUDACC__) && defined(__GNUC__)
#define MOE_ROUTE_FLATTEN __attribute__((flatten))
#else
#define MOE_ROUTE_FLATTEN
#endif

// A host function always inlined into its caller. For the penalties' row
// constructor, which g++ otherwise keeps out of line even inside a flattened
// caller: the run-time x86-64-v3 path (backend/cpu/detail/isa.hpp) then
// called its baseline copy, with every fma a libm call (6x on a sigmoid
// z_loss forward).
#if !defined(__CUDACC__) && defined(__GNUC__)
#define MOE_ROUTE_ALWAYS_INLINE __attribute__((always_inline))
#else
#define MOE_ROUTE_ALWAYS_INLINE
#endif

// Kernels get internal linkage: two shared objects built for different GPU
// architectures must never resolve each other's kernels.
#if defined(__CUDACC__)
#define MOE_ROUTE_KERNEL static __global__
#endif

namespace moe_route {

// Compile-time bounds of the generated code.
inline constexpr int max_top_k = 32;            // largest K any router may be built with (its MaxK)
inline constexpr int default_max_k = 16;        // a router's MaxK when none is given, and every runtime router's
inline constexpr int max_experts = 4096;        // largest E of the general path
inline constexpr int max_fast_path_experts = 512;  // largest register-resident bucket

// A dependent false for readable static_asserts in unsupported specialisations.
template <class...>
inline constexpr bool dependent_false = false;

}  // namespace moe_route
