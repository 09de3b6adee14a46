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
#include <stdexcept>
#include <string>

namespace {

struct command {
  ep::options run;
  std::string reference, candidate;  // --compare
};

command parse(int argc, char** argv) {
  command c;
  ep::options& o = c.run;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--router") o.router = value();
    else if (a == "--admission") o.admission = value();
    else if (a == "--renormalize") o.renormalize = true;
    else if (a == "--capacity-factor") o.capacity_factor = std::stod(value());
    else if (a == "--tau") o.tau = std::stof(value());
    else if (a == "--tokens-per-rank") o.tokens_per_rank = std::stoll(value());
    else if (a == "--steps") o.steps = std::stoi(value());
    else if (a == "--seed") o.seed = std::stoull(value());
    else if (a == "--lr") o.learning_rate = std::stof(value());
    else if (a == "--ranks-simulated") o.simulated_ranks = std::stoi(value());
    else if (a == "--out") o.out = value();
    else if (a == "--compare") {
      c.reference = value();
      c.candidate = value();
    } else {
      throw std::invalid_argument("unknown argument " + a);
    }
  }
  if (o.tokens_per_rank < 1) throw std::invalid_argument("--tokens-per-rank must be >= 1");
  if (o.steps < 1) throw std::invalid_argument("--steps must be >= 1");
  if (o.simulated_ranks < 0 || (o.simulated_ranks > 0 && ep::experts % o.simulated_ranks != 0))
    throw std::invalid_argument("--ranks-simulated must divide E = " + std::to_string(ep::experts));
  return c;
}

ep::json read(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  return ep::json::parse(in);
}

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

int run(const command& c) {
  if (!c.reference.empty()) return ep::compare(read(c.reference), read(c.candidate)) ? 0 : 1;
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
  if (!c.run.out.empty()) {
    std::ofstream out(c.run.out);
    out << result.dump() << '\n';
    if (!out) throw std::runtime_error("cannot write " + c.run.out);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_route_ep: %s\n", e.what());
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks wait in a collective
    return 1;
  }
}
