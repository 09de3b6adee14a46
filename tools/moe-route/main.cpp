// moe-route: the command-line tool of moe_route (docs/analysis.md).
//
//   moe-route route | analyze | prior build|shuffle|validate | capacity
//
// Exit codes: 0 success, 2 usage error (flags), 1 data error (files, dtypes,
// shapes, values). Output files appear only complete (temporary name, then rename).
#include "common.hpp"

#include <moe_route/types.hpp>

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  CLI::App app{"moe-route: run MoE router policies on .npy logits, analyse routing traces, build priors, "
               "compute capacity bounds"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::to_string(MOE_ROUTE_VERSION_MAJOR) + "." +
                                        std::to_string(MOE_ROUTE_VERSION_MINOR) + "." +
                                        std::to_string(MOE_ROUTE_VERSION_PATCH));
  moe_route_cli::add_route(app);
  moe_route_cli::add_analyze(app);
  moe_route_cli::add_prior(app);
  moe_route_cli::add_capacity(app);
  try {
    app.parse(argc, argv);  // runs the chosen subcommand's callback
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the message
    return 2;
  } catch (const moe_route_cli::usage_error& e) {
    std::fprintf(stderr, "moe-route: usage error: %s\n", e.what());
    return 2;
  } catch (const moe_route_cli::data_error& e) {
    std::fprintf(stderr, "moe-route: error: %s\n", e.what());
    return 1;
  } catch (const moe_route::error& e) {
    std::fprintf(stderr, "moe-route: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe-route: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
