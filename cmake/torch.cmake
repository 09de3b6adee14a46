# moe_route_find_torch(): find_package(Torch QUIET) without its side effects on
# the caller's CUDA flags. A CUDA LibTorch's Caffe2 package appends its own nvcc
# flags (every architecture that LibTorch was built for, -DONNX_NAMESPACE, ...)
# to CMAKE_CUDA_FLAGS of the directory that finds it; they would reach this
# project's CUDA targets in that directory and below (nvcc 13 rejects
# compute_50). Inside a function those variables stay local: the caller gets
# the imported `torch` target and the results below.
function(moe_route_find_torch)
  find_package(Torch QUIET)
  foreach(result IN ITEMS Torch_FOUND TORCH_LIBRARIES TORCH_INSTALL_PREFIX TORCH_CXX_FLAGS CAFFE2_USE_CUDA)
    set(${result} "${${result}}" PARENT_SCOPE)
  endforeach()
endfunction()
