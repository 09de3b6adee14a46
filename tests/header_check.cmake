# Every public header compiles on its own (docs/development.md): each .hpp with
# the host compiler and no CUDA, each .cuh with nvcc, one generated translation
# unit per header, built with the project's warnings whenever the tests are. A
# header that needs another it does not include, or a .hpp that needs CUDA,
# fails the build. The analysis headers are checked when igraph is there
# (moe_route::analysis); the LibTorch adapter's where LibTorch is
# (python/CMakeLists.txt). Included from tests/CMakeLists.txt.
function(moe_route_header_check target pattern extension)
  file(GLOB_RECURSE headers RELATIVE ${PROJECT_SOURCE_DIR}/include CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/include/moe_route/${pattern})
  set(sources "")
  foreach(header IN LISTS headers)
    if(header MATCHES "^moe_route/analysis/" AND NOT TARGET moe_route::analysis)
      continue()
    endif()
    if(header MATCHES "^moe_route/adapters/(detail/)?torch")  # need LibTorch: python/CMakeLists.txt checks them
      continue()
    endif()
    string(MAKE_C_IDENTIFIER "${header}" name)
    set(source ${CMAKE_BINARY_DIR}/header_check/${name}.${extension})
    file(CONFIGURE OUTPUT ${source} CONTENT "#include <${header}>\n")
    list(APPEND sources ${source})
  endforeach()
  add_library(${target} OBJECT ${sources})
  target_link_libraries(${target} PRIVATE moe_route::moe_route moe_route_project_flags)
  if(TARGET moe_route::analysis)
    target_link_libraries(${target} PRIVATE moe_route::analysis)
  endif()
endfunction()

moe_route_header_check(moe_route_header_check "*.hpp" cpp)
if(MOE_ROUTE_HAS_CUDA)
  # One architecture is enough to find a missing include (about 5 s of nvcc a header).
  moe_route_header_check(moe_route_cuda_header_check "*.cuh" cu)
  list(GET CMAKE_CUDA_ARCHITECTURES 0 moe_route_header_check_arch)
  target_link_libraries(moe_route_cuda_header_check PRIVATE moe_route::cuda)
  set_target_properties(moe_route_cuda_header_check PROPERTIES CUDA_ARCHITECTURES ${moe_route_header_check_arch})
endif()
