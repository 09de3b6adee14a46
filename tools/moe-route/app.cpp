// moe-route: the command line parsed and run (main.cpp calls it; so does the
// CLI's fuzz target, tests/fuzz/cli.cpp).
#include "common.hpp"

#include <moe_route/types.hpp>

#include <cstdio>
#include <string>

namespace moe_route_cli {

int run(int argc, char** argv) {
  CLI::App app{"moe-route: run MoE router policies on .npy logits, analyse routing traces, build priors, "
               "compute capacity bounds"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::to_string(MOE_ROUTE_VERSION_MAJOR) + "." +
                                        std::to_string(MOE_ROUTE_VERSION_MINOR) + "." +
                                        std::to_string(MOE_ROUTE_VERSION_PATCH));
  add_route(app);
  add_analyze(app);
  add_prior(app);
  add_capacity(app);
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
  } catch (const usage_error& e) {
    std::fprintf(stderr, "moe-route: usage error: %s\n", e.what());
    return 2;
  } catch (const data_error& e) {
    std::fprintf(stderr, "moe-route: error: %s\n", e.what());
    return 1;
  } catch (const moe_route::error& e) {
    std::fprintf(stderr, "moe-route: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace moe_route_cli
