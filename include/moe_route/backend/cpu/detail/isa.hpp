// moe_route CPU backend: which instruction set a call's per-token loops use
// (cpu::instruction_set), and the x86-64-v3 copy of those loops in a build for
// baseline x86-64.
//
// The copy is a function with GCC/Clang's target("avx2,fma,...") and flatten
// attributes that calls the loop body: flatten inlines the body and
// everything it calls into it, so they are compiled again with AVX2 and FMA
// (std::fma becomes one instruction instead of a libm call, and the loops
// vectorise eight floats wide); the rows on that path also call the
// hand-written AVX2 kernels of detail/simd.hpp. Only that function, its
// inlined code and those kernels (their own names, called only on the path)
// carry the new instructions: the out-of-line functions it still calls are
// the baseline ones every caller shares, so no symbol compiled for x86-64-v3
// can be picked by the linker for a baseline caller. The bits are the same
// because the library's float math has no contraction left to the compiler
// and no reassociated reduction (detail/numerics.hpp, tests/contraction/), and
// each AVX2 kernel adds in the portable form's order.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#include <moe_route/backend/cpu/execution.hpp>
#include <moe_route/types.hpp>

// 1 where the x86-64-v3 copy is compiled: GCC or Clang on x86-64, flags below
// x86-64-v3. nvcc's host passes never run the CPU loops for speed.
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__CUDACC__) && !(defined(__AVX2__) && defined(__FMA__))
#define MOE_ROUTE_CPU_RUNTIME_X86_64_V3 1
#else
#define MOE_ROUTE_CPU_RUNTIME_X86_64_V3 0
#endif
// The instructions of that copy: x86-64-v3's vector and bit-manipulation sets.
#define MOE_ROUTE_CPU_X86_64_V3_TARGET __attribute__((target("avx2,fma,bmi,bmi2,popcnt")))

namespace moe_route::cpu::detail {

// Whether this CPU (and its operating system) runs AVX2, FMA, BMI1/2 and POPCNT.
inline bool cpu_has_x86_64_v3() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
           __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
  }();
  return has;
#else
  return false;
#endif
}

// MOE_ROUTE_CPU_ISA, read once: best when unset or empty.
inline instruction_set isa_from_environment() {
  static const instruction_set from_env = [] {
    const char* v = std::getenv("MOE_ROUTE_CPU_ISA");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "best") == 0) return instruction_set::best;
    if (std::strcmp(v, "baseline") == 0) return instruction_set::baseline;
    if (std::strcmp(v, "x86-64-v3") == 0) return instruction_set::x86_64_v3;
    moe_route::detail::fail(std::string("the environment variable MOE_ROUTE_CPU_ISA is '") + v +
                            "'; expected baseline, x86-64-v3 or best");
  }();
  return from_env;
}

// The path a call with `ex` takes: baseline or x86_64_v3, never best. Throws
// moe_route::error naming execution.isa (or MOE_ROUTE_CPU_ISA) when it asks
// for AVX2 + FMA on a CPU without them. Every CPU entry point calls it before
// writing anything.
inline instruction_set resolve_isa(const execution& ex) {
  const bool from_env = ex.isa == instruction_set::best;
  const instruction_set asked = from_env ? isa_from_environment() : ex.isa;
  if (asked == instruction_set::best) return cpu_has_x86_64_v3() ? instruction_set::x86_64_v3 : instruction_set::baseline;
  if (asked == instruction_set::x86_64_v3 && !cpu_has_x86_64_v3())
    moe_route::detail::fail(std::string(from_env ? "MOE_ROUTE_CPU_ISA" : "execution.isa") +
                            " asks for x86-64-v3, but this CPU does not run AVX2 and FMA");
  return asked;
}

#if MOE_ROUTE_CPU_RUNTIME_X86_64_V3
template <class Body, class... Args>
MOE_ROUTE_CPU_X86_64_V3_TARGET __attribute__((flatten)) void run_x86_64_v3(Body& body, Args... args) {
  body(args...);
}
#endif

// body(args...) on the path `isa` (resolve_isa's).
template <class Body, class... Args>
void run_with_isa(instruction_set isa, Body& body, Args... args) {
#if MOE_ROUTE_CPU_RUNTIME_X86_64_V3
  if (isa == instruction_set::x86_64_v3) return run_x86_64_v3(body, args...);
#endif
  (void)isa;
  body(args...);
}

}  // namespace moe_route::cpu::detail
