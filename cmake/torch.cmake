# PyTorch, one for everything (the Python extension, the moe_lm driver, the
# benchmarks' LibTorch peers): the torch of the first Python that imports it
# among Python3_EXECUTABLE, the project's virtual environment (.venv, made by
# scripts/setup.sh from PyPI) and python3 on PATH. Torch_DIR, when given,
# names a LibTorch directly instead.
set(moe_route_venv_python "${CMAKE_CURRENT_LIST_DIR}/../.venv/bin/python3")
if(NOT DEFINED CACHE{MOE_ROUTE_TORCH_PYTHON})
  find_program(moe_route_path_python3 python3)
  set(moe_route_found_python "")
  set(moe_route_found_prefix "")
  foreach(candidate IN ITEMS "${Python3_EXECUTABLE}" "${moe_route_venv_python}" "${moe_route_path_python3}")
    if(candidate AND EXISTS "${candidate}")
      execute_process(COMMAND "${candidate}" -c "import torch; print(torch.utils.cmake_prefix_path)"
                      OUTPUT_VARIABLE moe_route_found_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
                      RESULT_VARIABLE moe_route_found_ok ERROR_QUIET)
      if(moe_route_found_ok EQUAL 0)
        get_filename_component(moe_route_found_python "${candidate}" ABSOLUTE)
        break()
      endif()
      set(moe_route_found_prefix "")
    endif()
  endforeach()
  set(MOE_ROUTE_TORCH_PYTHON "${moe_route_found_python}" CACHE INTERNAL "The Python whose torch the build uses")
  set(MOE_ROUTE_TORCH_PREFIX "${moe_route_found_prefix}" CACHE INTERNAL "Its torch's CMake prefix")
endif()

# moe_route_find_torch(): find_package(Torch QUIET) in that prefix, without
# its side effects on the caller's CUDA flags. A CUDA LibTorch's Caffe2
# package appends its own nvcc flags (every architecture that LibTorch was
# built for, -DONNX_NAMESPACE, ...) to CMAKE_CUDA_FLAGS of the directory that
# finds it; they would reach this project's CUDA targets in that directory and
# below (nvcc 13 rejects compute_50). Inside a function those variables stay
# local: the caller gets the imported `torch` target and the results below.
function(moe_route_find_torch)
  if(MOE_ROUTE_TORCH_PREFIX)
    list(PREPEND CMAKE_PREFIX_PATH "${MOE_ROUTE_TORCH_PREFIX}")
  endif()
  find_package(Torch QUIET)
  # TorchConfig looks for libtorch in the system directories first: a
  # LibTorch there (Debian's libtorch-dev) would be linked with the headers of
  # the one found here.
  if(Torch_FOUND AND TORCH_LIBRARY)
    file(REAL_PATH "${TORCH_INSTALL_PREFIX}" prefix)
    file(REAL_PATH "${TORCH_LIBRARY}" library)
    string(FIND "${library}" "${prefix}/" at)
  endif()
  if(Torch_FOUND AND TORCH_LIBRARY AND NOT at EQUAL 0)
    message(FATAL_ERROR "moe_route: LibTorch ${TORCH_INSTALL_PREFIX} found, but its library resolves to "
                        "${TORCH_LIBRARY}, another PyTorch's; remove that one (Debian: apt-get remove libtorch-dev)")
  endif()
  # The PyPI wheel's libtorch_cuda finds its NCCL, cuDNN, ... beside it
  # (site-packages/nvidia/*/lib, through its $ORIGIN rpath); the linker would
  # take the CUDA toolkit's older ones first from the rpath TorchConfig adds.
  if(Torch_FOUND)
    file(GLOB wheel_libraries LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
    foreach(directory IN LISTS wheel_libraries)
      set_property(TARGET torch APPEND PROPERTY INTERFACE_LINK_OPTIONS "LINKER:-rpath-link,${directory}")
    endforeach()
  endif()
  foreach(result IN ITEMS Torch_FOUND TORCH_LIBRARIES TORCH_INSTALL_PREFIX TORCH_CXX_FLAGS CAFFE2_USE_CUDA)
    set(${result} "${${result}}" PARENT_SCOPE)
  endforeach()
endfunction()
