# Builds tests/consumer against the library both ways and runs the result.
# Arguments: SOURCE_DIR, WORK_DIR, GENERATOR, CUDA (ON/OFF).
file(REMOVE_RECURSE ${WORK_DIR})
set(consumer ${SOURCE_DIR}/tests/consumer)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer_project: command failed (${rc}): ${ARGN}")
  endif()
endfunction()

set(cuda_flags -DCONSUMER_CUDA=${CUDA} -DCMAKE_CUDA_ARCHITECTURES=80)

# 1. From source with add_subdirectory.
run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/subdir -G ${GENERATOR} -DMOE_ROUTE_SOURCE=${SOURCE_DIR} ${cuda_flags})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/subdir)
run(${WORK_DIR}/subdir/consumer)

# 2. Built and installed (headers, moe_route::runtime), then found with find_package(moe_route CONFIG).
# Debug: this checks the package, not the optimiser (the suite's own build is
# Release), and the runtime routers take minutes to optimise with their
# run-time x86-64-v3 copy.
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/lib -G ${GENERATOR} -DMOE_ROUTE_BUILD_TESTS=OFF
    -DMOE_ROUTE_BUILD_BENCHMARKS=OFF -DMOE_ROUTE_BUILD_EXAMPLES=OFF -DMOE_ROUTE_BUILD_TOOLS=OFF -DMOE_ROUTE_ENABLE_CUDA=OFF
    -DMOE_ROUTE_BUILD_PYTHON=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/lib)
run(${CMAKE_COMMAND} --install ${WORK_DIR}/lib)
run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/installed -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix ${cuda_flags})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/installed)
run(${WORK_DIR}/installed/consumer)
message(STATUS "consumer_project: add_subdirectory and find_package builds passed")
