// moe-route: shared declarations of the command-line tool (errors, .npy I/O,
// staged output files, the subcommands).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace moe_route_cli {

// Exit code 2: the command line is wrong (missing or inconsistent flags).
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Exit code 1: the data is wrong (missing file, wrong dtype or shape, values out of range).
struct data_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class T>
struct array {
  std::vector<T> data;
  std::vector<std::size_t> shape;
  std::size_t dim(std::size_t i) const { return shape[i]; }
};

// .npy reading (its own strict header parser; C or Fortran order, returned in
// C order). The dtype must be the one asked for
// (float32: '<f4'; int32: '<i4', int64 '<i8' accepted and range-checked), and
// the file must hold exactly the data its header declares (checked before any
// allocation); anything else is a data_error naming the flag and the file.
array<float> load_f32(const std::string& path, const std::string& what);
array<std::int32_t> load_i32(const std::string& path, const std::string& what);

// Output files are written under temporary names next to their destination and
// renamed into place by commit(); a failure before commit() removes them, so no
// partial output file is ever left behind.
class staged_outputs {
 public:
  staged_outputs() = default;
  staged_outputs(const staged_outputs&) = delete;
  staged_outputs& operator=(const staged_outputs&) = delete;
  ~staged_outputs();
  // A temporary path for `final_path`; the caller writes it.
  std::string stage(const std::string& final_path);
  void save_f32(const std::string& final_path, const float* data, const std::vector<std::size_t>& shape);
  void save_i32(const std::string& final_path, const std::int32_t* data, const std::vector<std::size_t>& shape);
  void save_i64(const std::string& final_path, const std::int64_t* data, const std::vector<std::size_t>& shape);
  void save_text(const std::string& final_path, const std::string& text);
  void commit();

 private:
  std::vector<std::pair<std::string, std::string>> files_;  // (temporary, final)
  bool committed_ = false;
};

std::string shape_string(const std::vector<std::size_t>& shape);
void ensure_directory(const std::string& dir);  // creates it (and parents); data_error on failure

// Parses the command line and runs its subcommand: the exit code (0, 1 data
// error, 2 usage error; help and version 0). Exceptions other than the named
// errors propagate (main reports them; the fuzz target counts them as findings).
int run(int argc, char** argv);

// Subcommands: each registers its options and a callback on the app.
void add_route(CLI::App& app);
void add_analyze(CLI::App& app);
void add_prior(CLI::App& app);
void add_capacity(CLI::App& app);

}  // namespace moe_route_cli
