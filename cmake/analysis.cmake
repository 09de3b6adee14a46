# moe_route::analysis (routing statistics with igraph), the moe-route CLI and
# their tests. Included once from the top-level CMakeLists.txt. Everything
# here is optional: without igraph (Debian libigraph-dev) there is no analysis
# target, and without CLI11, nlohmann-json and xtensor (libcli11-dev,
# nlohmann-json3-dev, libxtensor-dev) no CLI; the rest of the library never
# needs any of them.

option(MOE_ROUTE_BUILD_TOOLS "Build the moe-route command-line tool" ${PROJECT_IS_TOP_LEVEL})

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

# ---------------------------------------------------------------------------
# The moe-route CLI.
set(moe_route_cli_target "")
if(MOE_ROUTE_BUILD_TOOLS)
  find_package(CLI11 CONFIG QUIET)
  find_package(nlohmann_json CONFIG QUIET)
  find_package(xtensor CONFIG QUIET)
  if(TARGET CLI11::CLI11 AND TARGET nlohmann_json::nlohmann_json AND TARGET xtensor)
    add_executable(moe_route_cli
      tools/moe-route/main.cpp
      tools/moe-route/npy.cpp
      tools/moe-route/route.cpp
      tools/moe-route/analyze.cpp
      tools/moe-route/plot.cpp
      tools/moe-route/prior.cpp
      tools/moe-route/capacity.cpp)
    set_target_properties(moe_route_cli PROPERTIES OUTPUT_NAME moe-route)
    target_link_libraries(moe_route_cli PRIVATE moe_route::analysis moe_route_project_flags CLI11::CLI11
                          nlohmann_json::nlohmann_json xtensor)
    # --backend cuda: one CUDA translation unit (route_cuda.cu) when the project
    # has the CUDA backend, built for the project's CMAKE_CUDA_ARCHITECTURES.
    if(MOE_ROUTE_HAS_CUDA)
      target_sources(moe_route_cli PRIVATE tools/moe-route/route_cuda.cu)
      target_link_libraries(moe_route_cli PRIVATE moe_route::cuda CUDA::cudart)
      target_compile_definitions(moe_route_cli PRIVATE MOE_ROUTE_CLI_CUDA=1)
      target_compile_options(moe_route_cli PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--threads=0>)
      set_target_properties(moe_route_cli PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
    endif()
    install(TARGETS moe_route_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
    set(moe_route_cli_target moe_route_cli)
  else()
    message(STATUS "moe_route: CLI11, nlohmann_json or xtensor not found (libcli11-dev, nlohmann-json3-dev, "
                   "libxtensor-dev); no moe-route")
  endif()
endif()

# ---------------------------------------------------------------------------
# Tests.
if(MOE_ROUTE_BUILD_TESTS)
  find_package(doctest REQUIRED)
  set(moe_route_analysis_tests_dir ${PROJECT_SOURCE_DIR}/tests/analysis)
  file(GLOB moe_route_analysis_test_sources CONFIGURE_DEPENDS ${moe_route_analysis_tests_dir}/*_test.cpp)
  add_executable(moe_route_analysis_tests ${moe_route_analysis_tests_dir}/test_main.cpp
                 ${moe_route_analysis_test_sources})
  target_link_libraries(moe_route_analysis_tests PRIVATE moe_route::analysis moe_route_project_flags doctest::doctest)
  add_test(NAME analysis_tests COMMAND moe_route_analysis_tests)

  # GPU parity of the co-activation kernel: one CUDA TU, skipped without a device.
  if(MOE_ROUTE_HAS_CUDA)
    add_executable(moe_route_coactivation_gpu_test ${PROJECT_SOURCE_DIR}/tests/cuda/coactivation_parity.cu)
    target_link_libraries(moe_route_coactivation_gpu_test PRIVATE moe_route::cuda moe_route_project_flags
                          doctest::doctest CUDA::cudart)
    target_compile_options(moe_route_coactivation_gpu_test PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--threads=0>)
    add_test(NAME coactivation_gpu_test COMMAND moe_route_coactivation_gpu_test)
  endif()

  if(moe_route_cli_target)
    # Fixtures (.npy files written by an independent minimal writer), then the
    # CLI round trips and error paths, each checking its exit code.
    add_executable(moe_route_cli_fixtures ${moe_route_analysis_tests_dir}/cli/make_fixtures.cpp)
    target_link_libraries(moe_route_cli_fixtures PRIVATE moe_route_project_flags)
    set(moe_route_cli_dir ${CMAKE_CURRENT_BINARY_DIR}/cli_tests)
    add_test(NAME cli_fixtures COMMAND moe_route_cli_fixtures ${moe_route_cli_dir})
    set_tests_properties(cli_fixtures PROPERTIES FIXTURES_SETUP moe_route_cli)
    include(${moe_route_analysis_tests_dir}/cli/cli_tests.cmake)
  endif()
endif()
