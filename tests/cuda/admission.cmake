# GPU parity of admission, expert choice and dispatch metadata (cuda:: == cpu::,
# bit for bit): one more CUDA translation unit. Included from
# tests/cuda/CMakeLists.txt; built whenever nvcc exists; without a device its
# cases report as skipped and the executable exits 0.
add_executable(moe_route_gpu_admission_tests ${CMAKE_CURRENT_LIST_DIR}/admission_parity.cu)
target_link_libraries(moe_route_gpu_admission_tests PRIVATE
  moe_route::cuda moe_route_project_flags doctest::doctest CUDA::cudart)
target_include_directories(moe_route_gpu_admission_tests PRIVATE ${CMAKE_CURRENT_LIST_DIR}/..)
target_compile_options(moe_route_gpu_admission_tests PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra --threads=0>)
add_test(NAME gpu_admission_tests COMMAND moe_route_gpu_admission_tests)
