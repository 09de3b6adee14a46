#include "options.hpp"

#include <ostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/cli_checks.hpp"

namespace ep {

using moe_route_examples::cosine;
using moe_route_examples::file_name;
using moe_route_examples::positive;

parsed_command parse_command_line(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"moe_route_ep: an expert-parallel MoE layer over MPI, its single-process reference, and their "
               "comparison (docs/expert_parallel.md)"};
  command c;
  options& o = c.run;
  std::vector<CLI::Option*> run_options = {
      app.add_option("--router", o.router, "balanced or aux_free")
          ->check(CLI::IsMember({"balanced", "aux_free"})),
      app.add_option("--admission", o.admission, "capacity_probs, cipher_strict, cipher_reroute or dropless")
          ->check(CLI::IsMember({"capacity_probs", "cipher_strict", "cipher_reroute", "dropless"})),
      app.add_flag("--renormalize", o.renormalize, "drop policies: rescale the survivors of a token that lost a slot"),
      app.add_option("--capacity-factor", o.capacity_factor, "admission capacity factor")
          ->check(positive<double>()),
      app.add_option("--tau", o.tau, "cosine threshold of the cipher policies")
          ->check(cosine<float>()),
      app.add_option("--tokens-per-rank", o.tokens_per_rank, "tokens each rank owns")
          ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20)),
      app.add_option("--steps", o.steps, "training steps")->check(CLI::Range(1, 1 << 16)),
      app.add_option("--seed", o.seed, "data and weight seed"),
      app.add_option("--lr", o.learning_rate, "SGD learning rate")
          ->check(positive<float>()),
      app.add_option("--ranks-simulated", o.simulated_ranks,
                     "run the single-process reference with this many ranks (a divisor of E = " +
                         std::to_string(experts) + ") instead of MPI")
          ->check(CLI::Range(1, experts)),
      app.add_option("--out", o.out, "write the JSON record here")->check(file_name())};
  std::vector<std::string> files;
  auto* compare_opt = app.add_option("--compare", files, "compare two records: REFERENCE RUN")
                          ->expected(2)
                          ->check(CLI::ExistingFile);
  parsed_command result;
  try {
    app.parse(argc, argv);
    if (o.simulated_ranks > 0 && experts % o.simulated_ranks != 0)
      throw CLI::ValidationError("--ranks-simulated", "must divide E = " + std::to_string(experts) + ", got " +
                                                          std::to_string(o.simulated_ranks));
    if (compare_opt->count() > 0) {
      for (const CLI::Option* opt : run_options)
        if (opt->count() > 0)
          throw CLI::ValidationError("--compare", "takes no other option (got " + opt->get_name() + ")");
      c.reference = files[0];
      c.candidate = files[1];
    }
    result.cmd = std::move(c);
  } catch (const CLI::ParseError& error) {
    result.exit_code = app.exit(error, out, err);
  }
  return result;
}

}  // namespace ep
