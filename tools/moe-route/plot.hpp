// moe-route: gnuplot figures of an analysis (analyze --plot DIR).
#pragma once

#include <moe_route/analysis/routing_retention.hpp>

#include <cstdint>
#include <string>

#include "common.hpp"

namespace moe_route_cli {

// Writes, staged in `out` (renamed into place on commit):
//   DIR/coactivation_layer<l>_base.png, DIR/coactivation_layer<l>_post.png:
//     W of the layer as a heat map, experts ordered by the base communities,
//     with the base community boundaries drawn as boxes;
//   DIR/utilisation_layer<l>.png: per-expert utilisation, base vs post.
// gnuplot (Debian gnuplot-nox) with the pngcairo terminal, or png when
// pngcairo is missing; a data_error if gnuplot is not installed or fails.
void write_plots(const std::string& dir, const moe_route::analysis::retention_result& r, const std::int32_t* base,
                 const std::int32_t* post, staged_outputs& out);

}  // namespace moe_route_cli
