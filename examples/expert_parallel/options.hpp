// moe_route_ep's sizes and command line (CLI11), without MPI or the library:
// every value is checked where it is read, so a bad one is refused naming its
// option before MPI starts or a file is touched.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>

namespace ep {

inline constexpr int hidden = 16;                    // d
inline constexpr int ffn = 32;                       // expert hidden width
inline constexpr int experts = 8;                    // E
inline constexpr int top_k = 2;                      // K
inline constexpr int expert_params = 2 * ffn * hidden;  // W1 [ffn x d], then W2 [d x ffn]

struct options {
  std::string router = "balanced";  // balanced | aux_free
  std::string admission = "capacity_probs";  // capacity_probs | cipher_strict | cipher_reroute | dropless
  bool renormalize = false;         // drop policies: rescale the survivors of a token that lost a slot
  double capacity_factor = 1.0;
  float tau = 0.0f;                 // cosine threshold of the cipher policies
  std::int64_t tokens_per_rank = 8;
  int steps = 3;
  std::uint64_t seed = 1;
  float learning_rate = 0.05f;
  int simulated_ranks = 0;          // > 0: the single-process reference with this many ranks
  std::string out;                  // where to write the JSON record; empty: none
};

// What the process does: a run (MPI, or the reference with simulated ranks),
// or the comparison of two records (--compare REFERENCE RUN).
struct command {
  options run;
  std::string reference, candidate;  // --compare; empty otherwise
};

// A command to run, or none and the exit code (0 after --help; CLI11's code
// for a refused command line, after its message, naming the option, went to
// `err`).
struct parsed_command {
  std::optional<command> cmd;
  int exit_code = 0;
};

// Reads argv[1..argc) as moe_route_ep does. Throws nothing but std::bad_alloc.
parsed_command parse_command_line(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace ep
