# moe_route::analysis (routing statistics with igraph), included once from the
# top-level CMakeLists.txt. Optional: without igraph (Debian libigraph-dev)
# there is no analysis target, hence no moe-route CLI (tools/) and no analysis
# tests; the rest of the library never needs it.

# igraph through pkg-config (igraph.pc; links the shared libigraph only).
# Preferred over Debian 12's igraph-config.cmake, whose imported target names
# libarpack.so, libglpk.so and libplfit.so that only further -dev packages
# provide. Fallback: the CMake package, for igraph installs without a .pc file.
set(moe_route_igraph_target "")
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(MOE_ROUTE_IGRAPH QUIET IMPORTED_TARGET GLOBAL igraph>=0.10)
  if(MOE_ROUTE_IGRAPH_FOUND)
    set(moe_route_igraph_target PkgConfig::MOE_ROUTE_IGRAPH)
  endif()
endif()
if(NOT moe_route_igraph_target)
  find_package(igraph 0.10 CONFIG QUIET)
  if(TARGET igraph::igraph)
    set(moe_route_igraph_target igraph::igraph)
  endif()
endif()

if(NOT moe_route_igraph_target)
  message(STATUS "moe_route: igraph not found (Debian: libigraph-dev); no moe_route::analysis, no moe-route")
  return()
endif()
message(STATUS "moe_route: analysis with ${moe_route_igraph_target}")

add_library(moe_route_analysis INTERFACE)
add_library(moe_route::analysis ALIAS moe_route_analysis)
set_target_properties(moe_route_analysis PROPERTIES EXPORT_NAME analysis)
target_link_libraries(moe_route_analysis INTERFACE moe_route::moe_route ${moe_route_igraph_target})

if(NOT MOE_ROUTE_INSTALL)
  return()
endif()
# A package of its own, so that the core package never asks for igraph:
# find_package(moe_route_analysis CONFIG) gives moe_route::analysis.
install(TARGETS moe_route_analysis EXPORT moe_route_analysis_targets)
install(EXPORT moe_route_analysis_targets NAMESPACE moe_route:: FILE moe_route_analysis-targets.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/moe_route_analysis)
if(moe_route_igraph_target STREQUAL "igraph::igraph")
  set(moe_route_igraph_lookup "find_dependency(igraph 0.10 CONFIG)")
else()
  set(moe_route_igraph_lookup "find_dependency(PkgConfig)
pkg_check_modules(MOE_ROUTE_IGRAPH REQUIRED QUIET IMPORTED_TARGET GLOBAL igraph>=0.10)")
endif()
file(WRITE ${PROJECT_BINARY_DIR}/moe_route_analysis-config.cmake
"include(CMakeFindDependencyMacro)
find_dependency(moe_route CONFIG)
${moe_route_igraph_lookup}
include(\${CMAKE_CURRENT_LIST_DIR}/moe_route_analysis-targets.cmake)
")
install(FILES ${PROJECT_BINARY_DIR}/moe_route_analysis-config.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/moe_route_analysis)
