# mpi_expert_parallel: moe_route_ep's single-process reference against real
# MPI runs with 2 and 4 ranks, for both router configurations and three
# admission policies, then checks that the comparison rejects wrong results.
# Arguments: EP (the moe_route_ep binary), MPIEXEC, NUMPROC_FLAG, WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

# Open MPI refuses root without the two variables and more ranks than cores
# without --oversubscribe; its CMA single copy fails in unprivileged
# containers. Other MPIs ignore the variables.
set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
set(ENV{OMPI_MCA_btl_vader_single_copy_mechanism} none)
execute_process(COMMAND ${MPIEXEC} --version OUTPUT_VARIABLE mpi_version ERROR_VARIABLE mpi_version)
set(mpi_flags)
if(mpi_version MATCHES "Open MPI|OpenRTE|open-mpi")
  set(mpi_flags --oversubscribe)
endif()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "mpi_expert_parallel: failed (${rc}): ${ARGN}\n${out}${err}")
  endif()
endfunction()

# One configuration: the reference and an MPI run for R = 2 and 4, compared.
function(check_case name)
  foreach(ranks 2 4)
    set(ref ${WORK_DIR}/${name}_ref${ranks}.json)
    set(mpi ${WORK_DIR}/${name}_mpi${ranks}.json)
    run(${EP} --ranks-simulated ${ranks} ${ARGN} --out ${ref})
    run(${MPIEXEC} ${NUMPROC_FLAG} ${ranks} ${mpi_flags} ${EP} ${ARGN} --out ${mpi})
    execute_process(COMMAND ${EP} --compare ${ref} ${mpi} RESULT_VARIABLE rc OUTPUT_VARIABLE report)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "mpi_expert_parallel: ${name}, ${ranks} ranks: the MPI run differs from the reference\n${report}")
    endif()
    message(STATUS "${name}, ${ranks} ranks: agree")
  endforeach()
endfunction()

set(common --tokens-per-rank 8 --steps 3 --seed 7)
check_case(balanced_probs --router balanced --admission capacity_probs --capacity-factor 1.0 ${common})
check_case(balanced_dropless --router balanced --admission dropless ${common})
check_case(aux_free_strict --router aux_free --admission cipher_strict --renormalize --tau 0.0 --capacity-factor 1.0
           ${common})
check_case(aux_free_reroute --router aux_free --admission cipher_reroute --tau -0.5 --capacity-factor 1.0 ${common})

# The cases must exercise what they claim: drops, reroutes, a moving bias.
function(expect case field pattern failure)
  file(READ ${WORK_DIR}/${case}_mpi4.json result)
  string(JSON value GET ${result} steps 0 ${field})
  if(NOT value MATCHES "${pattern}")
    message(FATAL_ERROR "mpi_expert_parallel: ${case}: ${failure} at step 0; the case does not test it")
  endif()
endfunction()
expect(balanced_probs admitted "-1" "no slot dropped")
expect(aux_free_strict admitted "-1" "no slot dropped")
expect(aux_free_strict expert_bias "[1-9]" "the expert bias did not move")
file(READ ${WORK_DIR}/aux_free_reroute_mpi4.json reroute)
string(JSON routed GET ${reroute} steps 0 indices)
string(JSON admitted GET ${reroute} steps 0 admitted)
if(routed STREQUAL admitted)
  message(FATAL_ERROR "mpi_expert_parallel: aux_free_reroute rerouted nothing at step 0; the case does not test it")
endif()

# The comparison must fail on wrong results: data of another seed under the
# same header, one element of the outputs changed, one element of the
# all-reduced router gradient changed.
function(expect_rejection what file)
  execute_process(COMMAND ${EP} --compare ${WORK_DIR}/balanced_probs_ref2.json ${file} RESULT_VARIABLE rc
                  OUTPUT_QUIET)
  if(rc EQUAL 0)
    message(FATAL_ERROR "mpi_expert_parallel: the comparison accepted ${what}")
  endif()
  message(STATUS "rejected: ${what}")
endfunction()

run(${EP} --ranks-simulated 2 --router balanced --admission capacity_probs --capacity-factor 1.0 --tokens-per-rank 8
    --steps 3 --seed 8 --out ${WORK_DIR}/other_seed.json)
file(READ ${WORK_DIR}/other_seed.json other)
string(JSON other SET ${other} layer seed 7)
file(WRITE ${WORK_DIR}/other_seed.json ${other})
expect_rejection("another seed's data" ${WORK_DIR}/other_seed.json)

file(READ ${WORK_DIR}/balanced_probs_mpi2.json good)
foreach(field outputs grad_router)
  string(JSON first GET ${good} steps 2 ${field} 0)
  string(JSON second GET ${good} steps 2 ${field} 1)
  if(first STREQUAL second)
    message(FATAL_ERROR "mpi_expert_parallel: ${field}[0] = ${field}[1]; pick other elements to perturb")
  endif()
  string(JSON bad SET ${good} steps 2 ${field} 0 ${second})
  file(WRITE ${WORK_DIR}/bad_${field}.json ${bad})
  expect_rejection("a changed element of ${field}" ${WORK_DIR}/bad_${field}.json)
endforeach()

# Bad input: refused, naming the option or the file, and no record written.
function(expect_refusal what needle)
  execute_process(COMMAND ${EP} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "${needle}")
    message(FATAL_ERROR "mpi_expert_parallel: ${what}: exit ${rc}, expected a refusal naming ${needle}\n${out}${err}")
  endif()
  message(STATUS "refused: ${what}")
endfunction()
expect_refusal("--steps 0" "--steps" --ranks-simulated 2 --steps 0 --out ${WORK_DIR}/refused.json)
expect_refusal("--tau nan" "--tau" --ranks-simulated 2 --tau nan --out ${WORK_DIR}/refused.json)
expect_refusal("--ranks-simulated 3" "--ranks-simulated" --ranks-simulated 3 --out ${WORK_DIR}/refused.json)
expect_refusal("--admission cipher" "--admission" --ranks-simulated 2 --admission cipher --out ${WORK_DIR}/refused.json)
if(EXISTS ${WORK_DIR}/refused.json)
  message(FATAL_ERROR "mpi_expert_parallel: a refused command line wrote its record")
endif()
file(WRITE ${WORK_DIR}/overflow.json "{\"layer\": {\"seed\": 1e999}}")
expect_refusal("a number past double's range" "overflow.json: not JSON"
               --compare ${WORK_DIR}/overflow.json ${WORK_DIR}/balanced_probs_ref2.json)
file(WRITE ${WORK_DIR}/no_steps.json "{\"layer\": {}, \"final\": {}}")
expect_refusal("a record without steps" "no_steps.json: not a moe_route_ep record"
               --compare ${WORK_DIR}/balanced_probs_ref2.json ${WORK_DIR}/no_steps.json)
