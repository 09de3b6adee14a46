// moe_route_ep: an expert-parallel MoE layer trained for a few steps over MPI,
// its single-process reference, and the comparison of the two
// (docs/expert_parallel.md).
//
//   mpirun -np R moe_route_ep [options] [--out run.json]
//   moe_route_ep --ranks-simulated R [options] [--out reference.json]
//   moe_route_ep --compare reference.json run.json
//
// options: --router balanced|aux_free  --admission capacity_probs|cipher_strict|cipher_reroute|dropless
//          --renormalize  --capacity-factor F  --tau T  --tokens-per-rank N  --steps S  --seed S  --lr L
#include "moe_layer.hpp"

#include <mpi.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>

#include "common/output_file.hpp"

namespace {

// One line per step: what a training engineer watches.
void summarize(const ep::json& result) {
  const ep::json& layer = result.at("layer");
  std::printf("%s, %d ranks x %lld tokens, router %s, admission %s\n", layer.at("mode").get<std::string>().c_str(),
              layer.at("ranks").get<int>(), layer.at("tokens_per_rank").get<long long>(),
              layer.at("router").get<std::string>().c_str(), layer.at("admission").get<std::string>().c_str());
  int step = 0;
  for (const ep::json& s : result.at("steps")) {
    int dropped = 0;
    for (const auto& e : s.at("admitted")) dropped += e.get<int>() < 0;
    std::printf("step %d  loss %.9f  load_balance %.9f  locality %.9f  dropped %d  loads %s\n", step++,
                s.at("loss").get<double>(), s.at("penalties").at("load_balance").get<double>(),
                s.at("penalties").at("locality").get<double>(), dropped, s.at("loads").dump().c_str());
  }
  std::printf("expert bias %s\n", result.at("final").at("expert_bias").dump().c_str());
}

int run(const ep::command& c) {
  if (!c.reference.empty()) return ep::compare_files(c.reference, c.candidate, std::cout) ? 0 : 1;
  ep::json result;
  if (c.run.simulated_ranks > 0) {
    result = ep::run_reference(c.run);
  } else {
    MPI_Init(nullptr, nullptr);
    result = ep::run_mpi(c.run);
    MPI_Finalize();
    if (result.is_null()) return 0;  // not rank 0
  }
  summarize(result);
  if (!c.run.out.empty())
    moe_route_examples::write_replacing(c.run.out, [&](const std::string& tmp) {
      std::ofstream out(tmp);
      out << result.dump() << '\n';
      out.close();  // flushes: a full disk shows here, not as a short file
      if (!out) throw std::runtime_error("write to " + tmp + " failed");
    });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const ep::parsed_command parsed = ep::parse_command_line(argc, argv, std::cout, std::cerr);
  if (!parsed.cmd) return parsed.exit_code;
  try {
    return run(*parsed.cmd);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_route_ep: %s\n", e.what());
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks wait in a collective
    return 1;
  }
}
