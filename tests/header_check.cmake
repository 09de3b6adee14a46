# Every public header compiles on its own with the host compiler and no CUDA
# (docs/development.md): one generated translation unit per header, built with
# the project's warnings whenever the tests are. A header that needs another
# it does not include, or a CUDA header, fails the build. The analysis headers
# are checked when igraph is there (moe_route::analysis). Included from the
# top-level CMakeLists.txt after cmake/analysis.cmake.
file(GLOB_RECURSE moe_route_public_headers RELATIVE ${PROJECT_SOURCE_DIR}/include CONFIGURE_DEPENDS
     ${PROJECT_SOURCE_DIR}/include/moe_route/*.hpp)
set(moe_route_header_check_sources "")
foreach(header IN LISTS moe_route_public_headers)
  if(header MATCHES "^moe_route/analysis/" AND NOT TARGET moe_route::analysis)
    continue()
  endif()
  string(MAKE_C_IDENTIFIER "${header}" name)
  set(source ${CMAKE_BINARY_DIR}/header_check/${name}.cpp)
  file(CONFIGURE OUTPUT ${source} CONTENT "#include <${header}>\n")
  list(APPEND moe_route_header_check_sources ${source})
endforeach()
add_library(moe_route_header_check OBJECT ${moe_route_header_check_sources})
target_link_libraries(moe_route_header_check PRIVATE moe_route::moe_route moe_route_project_flags)
if(TARGET moe_route::analysis)
  target_link_libraries(moe_route_header_check PRIVATE moe_route::analysis)
endif()
