// moe-route: the command-line tool of moe_route (docs/analysis.md).
//
//   moe-route route | analyze | prior build|shuffle|validate | capacity
//
// Exit codes: 0 success, 2 usage error (flags), 1 data error (files, dtypes,
// shapes, values). Output files appear only complete (temporary name, then rename).
#include "common.hpp"

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  try {
    return moe_route_cli::run(argc, argv);
  } catch (const std::exception& e) {  // not one of the errors run() names: still a message, not an abort
    std::fprintf(stderr, "moe-route: error: %s\n", e.what());
    return 1;
  }
}
