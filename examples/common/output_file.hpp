// Every file the example drivers write (moe_lm's checkpoints and --json,
// moe_route_ep's --out) goes through write_replacing: a run killed or failing
// mid-write leaves the previous file (or none) under the final name, never a
// truncated one.
#pragma once

#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <system_error>

#include <unistd.h>

namespace moe_route_examples {

// Calls write(tmp) with a temporary name beside `path` (same directory, so
// the rename cannot cross file systems), then renames it to `path`. On any
// failure the temporary is removed and the error names `path`. The temporary
// ends in ".tmp.<pid>", not in the final name, so a leftover from a killed
// run is never taken for an output.
inline void write_replacing(const std::string& path, const std::function<void(const std::string& tmp)>& write) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  try {
    write(tmp);
    std::filesystem::rename(tmp, path);
  } catch (const std::exception& e) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw std::runtime_error(path + ": cannot write (" + e.what() + ")");
  }
}

}  // namespace moe_route_examples
