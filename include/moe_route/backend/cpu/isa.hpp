// moe_route CPU backend: the instruction set a call runs its loops with
// (cpu::instruction_set, backend/cpu/execution.hpp).
//
//   instruction_set cpu::isa_of(execution)   baseline or x86_64_v3
//   const char* cpu::name(instruction_set)   "best", "baseline" or "x86-64-v3"
#pragma once

#include <moe_route/backend/cpu/detail/isa.hpp>
#include <moe_route/backend/cpu/execution.hpp>

namespace moe_route::cpu {

// The path a call with `ex` takes (execution.isa, else MOE_ROUTE_CPU_ISA, else
// the best this CPU runs). Throws moe_route::error where the request names an
// instruction set this CPU lacks, as the call itself would.
inline instruction_set isa_of(const execution& ex = {}) { return detail::resolve_isa(ex); }

inline const char* name(instruction_set isa) {
  switch (isa) {
    case instruction_set::baseline: return "baseline";
    case instruction_set::x86_64_v3: return "x86-64-v3";
    case instruction_set::best: break;
  }
  return "best";
}

}  // namespace moe_route::cpu
