# ctest entries of the moe-route CLI: round trips on generated .npy files for
# every subcommand and every error path with its exit code (0 ok, 1 data
# error, 2 usage error). Included from tests/CMakeLists.txt.
set(F ${moe_route_cli_dir})
set(CLI $<TARGET_FILE:moe_route_cli>)
set(DRIVER ${CMAKE_CURRENT_LIST_DIR}/run_cli.cmake)

# moe_route_cli_test(name expect [EXISTS f,...] [ABSENT f,...] [MATCH regex] [SETUP fx] [REQUIRES fx...] ARGS ...)
function(moe_route_cli_test name expect)
  cmake_parse_arguments(T "" "EXISTS;ABSENT;MATCH;SETUP" "REQUIRES;ARGS" ${ARGN})
  add_test(NAME cli_${name}
    COMMAND ${CMAKE_COMMAND} -DEXPECT=${expect} "-DEXISTS_FILES=${T_EXISTS}" "-DABSENT=${T_ABSENT}"
            "-DOUTPUT_MATCH=${T_MATCH}" -P ${DRIVER} -- ${CLI} ${T_ARGS})
  set_tests_properties(cli_${name} PROPERTIES FIXTURES_REQUIRED "moe_route_cli;${T_REQUIRES}")
  if(T_SETUP)
    set_tests_properties(cli_${name} PROPERTIES FIXTURES_SETUP ${T_SETUP})
  endif()
endfunction()

set(routed indices.npy gates.npy counts.npy offsets.npy permutation.npy stats.json)
function(outputs_of dir var)
  set(l "")
  foreach(f IN LISTS routed)
    list(APPEND l ${dir}/${f})
  endforeach()
  string(REPLACE ";" "," l "${l}")
  set(${var} ${l} PARENT_SCOPE)
endfunction()

# --- route: round trips.
outputs_of(${F}/base ob)
outputs_of(${F}/post op)
moe_route_cli_test(route_base 0 SETUP cli_routed EXISTS ${ob} MATCH "routed 256 tokens over 16 experts"
  ARGS route --logits ${F}/logits_base.npy --k 2 --out ${F}/base)
moe_route_cli_test(route_post 0 SETUP cli_routed EXISTS ${op}
  ARGS route --logits ${F}/logits_post.npy --k 2 --out ${F}/post)
# The instruction sets (MOE_ROUTE_CPU_ISA): the baseline loops write the same
# files as the default (x86-64-v3 where the CPU has it); an unknown name is
# refused before anything is written.
outputs_of(${F}/base_baseline o)
moe_route_cli_test(route_isa_baseline 0 SETUP cli_routed_baseline EXISTS ${o}
  ARGS route --logits ${F}/logits_base.npy --k 2 --out ${F}/base_baseline)
set_tests_properties(cli_route_isa_baseline PROPERTIES ENVIRONMENT MOE_ROUTE_CPU_ISA=baseline)
foreach(f IN LISTS routed)
  add_test(NAME cli_route_isa_baseline_same_${f} COMMAND ${CMAKE_COMMAND} -E compare_files ${F}/base/${f}
           ${F}/base_baseline/${f})
  set_tests_properties(cli_route_isa_baseline_same_${f} PROPERTIES FIXTURES_REQUIRED "cli_routed;cli_routed_baseline")
endforeach()
outputs_of(${F}/isa_unknown o)
moe_route_cli_test(route_isa_unknown 1 ABSENT ${o} MATCH "MOE_ROUTE_CPU_ISA is 'avx9'"
  ARGS route --logits ${F}/logits_base.npy --k 2 --out ${F}/isa_unknown)
set_tests_properties(cli_route_isa_unknown PROPERTIES ENVIRONMENT MOE_ROUTE_CPU_ISA=avx9)
outputs_of(${F}/r_sigmoid o)
moe_route_cli_test(route_sigmoid_bias_groups 0 EXISTS ${o}
  ARGS route --logits ${F}/logits_base.npy --k 4 --gating sigmoid --normalize --scaling 2.5
       --expert-bias ${F}/expert_bias.npy --groups 4 --top-groups 2 --per-group-k 2 --out ${F}/r_sigmoid)
outputs_of(${F}/r_mixtral o)
moe_route_cli_test(route_softmax_after_topk 0 EXISTS ${o}
  ARGS route --logits ${F}/logits_base.npy --k 2 --gating softmax_after_topk --out ${F}/r_mixtral)
outputs_of(${F}/r_soft o)
moe_route_cli_test(route_prior_soft 0 EXISTS ${o}
  ARGS route --logits ${F}/logits_post.npy --k 2 --prior ${F}/prior.npy --prior-rows ${F}/prior_rows.npy
       --beta 1.0 --prior-mode soft --prior-eps 0.05 --prior-cap 5 --out ${F}/r_soft)
outputs_of(${F}/r_hard o)
moe_route_cli_test(route_prior_hard 0 EXISTS ${o} MATCH "routed"
  ARGS route --logits ${F}/logits_post.npy --k 2 --prior ${F}/prior.npy --prior-rows ${F}/prior_rows.npy
       --prior-mode hard --out ${F}/r_hard)
outputs_of(${F}/r_cipher o)
moe_route_cli_test(route_cipher_strict 0 EXISTS ${o}
  ARGS route --logits ${F}/logits_base.npy --k 2 --admission cipher_strict --tau 0.01 --capacity-factor 1.0
       --hidden-norms ${F}/hidden_norms.npy --weight-norms ${F}/weight_norms.npy --out ${F}/r_cipher)
outputs_of(${F}/r_reroute o)
moe_route_cli_test(route_cipher_reroute 0 EXISTS ${o}
  ARGS route --logits ${F}/logits_base.npy --k 2 --admission cipher_reroute --tau 0.0 --capacity-factor 1.0
       --fill-factor 1.0 --hidden-norms ${F}/hidden_norms.npy --weight-norms ${F}/weight_norms.npy --out ${F}/r_reroute)
outputs_of(${F}/r_cap o)
moe_route_cli_test(route_capacity_probs 0 EXISTS ${o}
  ARGS route --logits ${F}/logits_base.npy --k 2 --admission capacity_probs --capacity-factor 0.8 --min-capacity 4
       --out ${F}/r_cap)
outputs_of(${F}/r_ec o)
moe_route_cli_test(route_expert_choice 0 EXISTS ${o}
  ARGS route --logits ${F}/logits_base.npy --k 2 --admission expert_choice --capacity-factor 1.0 --out ${F}/r_ec)

# --- route: error paths.
moe_route_cli_test(route_missing_file 1 ABSENT ${F}/e1 MATCH "file not found"
  ARGS route --logits ${F}/does_not_exist.npy --k 2 --out ${F}/e1)
moe_route_cli_test(route_bad_dtype 1 ABSENT ${F}/e2/indices.npy MATCH "dtype <f8"
  ARGS route --logits ${F}/bad_dtype.npy --k 2 --out ${F}/e2)
moe_route_cli_test(route_bad_shape 1 ABSENT ${F}/e3/indices.npy MATCH "expected \\[N, E\\]"
  ARGS route --logits ${F}/bad_shape.npy --k 2 --out ${F}/e3)
moe_route_cli_test(route_not_npy 1 ABSENT ${F}/e4/indices.npy MATCH "not a .npy file"
  ARGS route --logits ${F}/not_npy.npy --k 2 --out ${F}/e4)
# .npy headers that lie about their data: refused by name, before allocating, nothing written.
foreach(bad truncated header_only trailing_bytes huge_shape negative_shape overflowing_shape)
  if(bad STREQUAL "truncated" OR bad STREQUAL "header_only")
    set(match "needs 16384 bytes of data, the file holds [0-9]+ \\(truncated\\)")
  elseif(bad STREQUAL "trailing_bytes")
    set(match "the file holds 16388 \\(trailing bytes\\)")
  elseif(bad STREQUAL "huge_shape")
    set(match "needs 64000000000000 bytes of data, the file holds 0 \\(truncated\\)")
  elseif(bad STREQUAL "negative_shape")
    set(match "--logits: .*negative_shape.npy: .npy shape entry '-5' is not a dimension")
  elseif(bad STREQUAL "overflowing_shape")
    set(match "has more bytes than can be addressed")
  endif()
  moe_route_cli_test(route_npy_${bad} 1 ABSENT ${F}/e_${bad} MATCH "${match}"
    ARGS route --logits ${F}/${bad}.npy --k 2 --out ${F}/e_${bad})
endforeach()
moe_route_cli_test(route_npy_repeated_key 1 ABSENT ${F}/e_repeated MATCH "unexpected or repeated key 'shape'"
  ARGS route --logits ${F}/repeated_key.npy --k 2 --out ${F}/e_repeated)
# Fortran order is read into C order: the same routing as the C-order file, byte for byte.
outputs_of(${F}/fortran o)
moe_route_cli_test(route_npy_fortran_order 0 SETUP cli_fortran EXISTS ${o}
  ARGS route --logits ${F}/logits_base_fortran.npy --k 2 --out ${F}/fortran)
add_test(NAME cli_route_npy_fortran_same COMMAND ${CMAKE_COMMAND} -E compare_files ${F}/base/indices.npy
         ${F}/fortran/indices.npy)
set_tests_properties(cli_route_npy_fortran_same PROPERTIES FIXTURES_REQUIRED "cli_routed;cli_fortran")
moe_route_cli_test(route_npy_truncated_prior_rows 1 ABSENT ${F}/e_rows MATCH "--prior-rows: .*\\(truncated\\)"
  ARGS route --logits ${F}/logits_post.npy --k 2 --prior ${F}/prior.npy --prior-rows ${F}/truncated_rows.npy
       --out ${F}/e_rows)
moe_route_cli_test(route_k_exceeds_experts 1 ABSENT ${F}/e5/indices.npy MATCH "exceeds the number of experts E = 8"
  ARGS route --logits ${F}/logits_narrow.npy --k 9 --out ${F}/e5)
# K is at most the runtime routers' MaxK (16), as in the Python extension.
moe_route_cli_test(route_k_above_max 2 ABSENT ${F}/e5/indices.npy MATCH "--k must be in \\[1, 16\\]"
  ARGS route --logits ${F}/logits_base.npy --k 17 --out ${F}/e5)
moe_route_cli_test(route_bad_bias_shape 1 ABSENT ${F}/e6/indices.npy MATCH "expected \\[E\\]"
  ARGS route --logits ${F}/logits_base.npy --k 2 --gating sigmoid --expert-bias ${F}/hidden_norms.npy --out ${F}/e6)
moe_route_cli_test(route_missing_k 2 ARGS route --logits ${F}/logits_base.npy --out ${F}/e7)
moe_route_cli_test(route_unknown_gating 2 ARGS route --logits ${F}/logits_base.npy --k 2 --gating relu --out ${F}/e7)
moe_route_cli_test(route_prior_without_rows 2 MATCH "go together"
  ARGS route --logits ${F}/logits_base.npy --k 2 --prior ${F}/prior.npy --out ${F}/e7)
moe_route_cli_test(route_cipher_without_norms 2 MATCH "hidden-norms"
  ARGS route --logits ${F}/logits_base.npy --k 2 --admission cipher_strict --tau 0.1 --out ${F}/e7)
moe_route_cli_test(route_topk_softmax_with_bias 2
  ARGS route --logits ${F}/logits_base.npy --k 2 --gating softmax_after_topk --expert-bias ${F}/expert_bias.npy --out ${F}/e7)
if(NOT MOE_ROUTE_HAS_CUDA)
  # Built without CUDA: --backend cuda is a data error that says so.
  moe_route_cli_test(route_cuda_backend 1 ABSENT ${F}/e8/indices.npy MATCH "CUDA"
    ARGS route --logits ${F}/logits_base.npy --k 2 --backend cuda --out ${F}/e8)
else()
  # A CUDA build: with a device the GPU run must match the CPU run byte for
  # byte; without one it must exit 1 naming the problem (cuda_backend.cmake).
  set(P "--prior,${F}/prior.npy,--prior-rows,${F}/prior_rows.npy")
  set(N "--hidden-norms,${F}/hidden_norms.npy,--weight-norms,${F}/weight_norms.npy")
  set(cuda_cases
    "base|--logits,${F}/logits_base.npy,--k,2"
    "prior_soft|--logits,${F}/logits_post.npy,--k,2,${P},--beta,0.7,--prior-mode,soft"
    "prior_hard|--logits,${F}/logits_post.npy,--k,2,${P},--prior-mode,hard,--gating,sigmoid,--normalize"
    "sigmoid_bias_groups|--logits,${F}/logits_base.npy,--k,4,--gating,sigmoid,--normalize,--scaling,2.5,--expert-bias,${F}/expert_bias.npy,--groups,4,--top-groups,2"
    "sqrt_softplus_bias|--logits,${F}/logits_base.npy,--k,3,--gating,sqrt_softplus,--expert-bias,${F}/expert_bias.npy"
    "softmax_after_topk|--logits,${F}/logits_base.npy,--k,2,--gating,softmax_after_topk"
    "capacity_probs_soft|--logits,${F}/logits_post.npy,--k,2,${P},--prior-mode,soft,--admission,capacity_probs,--capacity-factor,0.8,--min-capacity,4"
    "cipher_reroute|--logits,${F}/logits_base.npy,--k,2,--admission,cipher_reroute,--tau,0.0,--capacity-factor,1.0,--fill-factor,1.0,${N}"
    "expert_choice|--logits,${F}/logits_base.npy,--k,2,--admission,expert_choice,--capacity-factor,1.0")
  foreach(c IN LISTS cuda_cases)
    # "name|arg,arg,...": no ';' inside a case, so that each is one list item.
    string(REPLACE "|" ";" c "${c}")
    string(REPLACE "," ";" c "${c}")
    list(GET c 0 cname)
    list(REMOVE_AT c 0)
    add_test(NAME cli_route_cuda_${cname}
      COMMAND ${CMAKE_COMMAND} -DOUT=${F}/cuda_${cname} -P ${CMAKE_CURRENT_LIST_DIR}/cuda_backend.cmake -- ${CLI} route ${c})
    set_tests_properties(cli_route_cuda_${cname} PROPERTIES FIXTURES_REQUIRED moe_route_cli)
  endforeach()
endif()
moe_route_cli_test(no_subcommand 2 ARGS)

# --- route killed with SIGKILL at many points: each output is absent or complete (route_sigkill.py,
# standard library only; it writes its own 128 MiB of logits and removes everything when it passes).
find_package(Python3 REQUIRED COMPONENTS Interpreter)
add_test(NAME cli_route_sigkill
  COMMAND Python3::Interpreter ${CMAKE_CURRENT_LIST_DIR}/route_sigkill.py ${CLI} ${CMAKE_CURRENT_BINARY_DIR}/cli_sigkill)
set_tests_properties(cli_route_sigkill PROPERTIES TIMEOUT 300)

# --- No tokens and one token (docs/reliability.md, "Integer edges"): route with
# each kind of admission, prior build, and analyze, which needs a token.
outputs_of(${F}/r_empty o)
moe_route_cli_test(route_no_tokens 0 EXISTS ${o} MATCH "routed 0 tokens over 16 experts.*executed 0 of 0 slots"
  ARGS route --logits ${F}/logits_empty.npy --k 2 --out ${F}/r_empty)
outputs_of(${F}/r_one o)
moe_route_cli_test(route_one_token 0 EXISTS ${o} MATCH "routed 1 tokens over 16 experts.*executed 2 of 2 slots"
  ARGS route --logits ${F}/logits_one.npy --k 2 --out ${F}/r_one)
foreach(n empty one)
  foreach(admission cipher_reroute capacity_probs expert_choice)
    outputs_of(${F}/r_${n}_${admission} o)
    moe_route_cli_test(route_${n}_${admission} 0 EXISTS ${o}
      ARGS route --logits ${F}/logits_${n}.npy --k 2 --admission ${admission} --capacity-factor 1 --tau 0.1
           --hidden-norms ${F}/hidden_norms_${n}.npy --weight-norms ${F}/weight_norms.npy
           --out ${F}/r_${n}_${admission})
  endforeach()
endforeach()
moe_route_cli_test(prior_build_no_tokens 0 EXISTS ${F}/pi_empty.npy MATCH "from 0 tokens.*no token.*: 0 1 2 3"
  ARGS prior build --logits ${F}/logits_empty.npy --prior-rows ${F}/prior_rows_empty.npy --rows 4
       --out ${F}/pi_empty.npy)
moe_route_cli_test(prior_build_one_token 0 EXISTS ${F}/pi_one.npy MATCH "from 1 tokens.*no token.*: 0 1 3"
  ARGS prior build --logits ${F}/logits_one.npy --prior-rows ${F}/prior_rows_one.npy --rows 4 --threads 0
       --out ${F}/pi_one.npy)
moe_route_cli_test(analyze_no_tokens 1 ABSENT ${F}/a_empty.json MATCH "at least one layer, token and slot"
  ARGS analyze --base ${F}/trace_empty.npy --post ${F}/trace_empty.npy --experts 16 --json ${F}/a_empty.json)

# --- analyze.
moe_route_cli_test(analyze 0 REQUIRES cli_routed EXISTS ${F}/a1.json MATCH "mean"
  ARGS analyze --base ${F}/base/indices.npy --post ${F}/post/indices.npy --rho 0.2 --nulls 10 --seed 0
       --domains ${F}/domains.npy --json ${F}/a1.json)
set_tests_properties(cli_analyze PROPERTIES FIXTURES_SETUP cli_analyzed)
moe_route_cli_test(analyze_again 0 REQUIRES cli_routed EXISTS ${F}/a2.json
  ARGS analyze --base ${F}/base/indices.npy --post ${F}/post/indices.npy --rho 0.2 --nulls 10 --seed 0
       --domains ${F}/domains.npy --json ${F}/a2.json)
set_tests_properties(cli_analyze_again PROPERTIES FIXTURES_SETUP cli_analyzed)
add_test(NAME cli_analyze_deterministic COMMAND ${CMAKE_COMMAND} -E compare_files ${F}/a1.json ${F}/a2.json)
set_tests_properties(cli_analyze_deterministic PROPERTIES FIXTURES_REQUIRED cli_analyzed)
moe_route_cli_test(analyze_layers_leiden_plot 0 EXISTS
  ${F}/plots/coactivation_layer0_base.png,${F}/plots/coactivation_layer1_post.png,${F}/plots/utilisation_layer1.png,${F}/a3.json
  MATCH "leiden"
  ARGS analyze --base ${F}/trace3_base.npy --post ${F}/trace3_post.npy --detector leiden --nulls 5 --seed 1
       --json ${F}/a3.json --plot ${F}/plots)
moe_route_cli_test(analyze_missing_file 1 ABSENT ${F}/a_err.json MATCH "file not found"
  ARGS analyze --base ${F}/nope.npy --post ${F}/trace3_post.npy --json ${F}/a_err.json)
moe_route_cli_test(analyze_bad_dtype 1 ABSENT ${F}/a_err.json MATCH "expected int32"
  ARGS analyze --base ${F}/bad_trace_dtype.npy --post ${F}/bad_trace_dtype.npy --json ${F}/a_err.json)
moe_route_cli_test(analyze_shape_mismatch 1 ABSENT ${F}/a_err.json MATCH "same shape"
  REQUIRES cli_routed ARGS analyze --base ${F}/base/indices.npy --post ${F}/short_trace.npy --json ${F}/a_err.json)
moe_route_cli_test(analyze_bad_rho 2 ARGS analyze --base ${F}/trace3_base.npy --post ${F}/trace3_post.npy --rho 0)
moe_route_cli_test(analyze_bad_detector 2
  ARGS analyze --base ${F}/trace3_base.npy --post ${F}/trace3_post.npy --detector spectral)

# --- prior.
moe_route_cli_test(prior_build 0 SETUP cli_prior EXISTS ${F}/pi.npy MATCH "prior \\[4 x 16\\]"
  ARGS prior build --logits ${F}/logits_base.npy --prior-rows ${F}/prior_rows.npy --out ${F}/pi.npy)
# Every thread count and the baseline loops build the same file.
moe_route_cli_test(prior_build_threads 0 SETUP cli_prior_threads EXISTS ${F}/pi_threads.npy
  ARGS prior build --logits ${F}/logits_base.npy --prior-rows ${F}/prior_rows.npy --threads 0 --out ${F}/pi_threads.npy)
set_tests_properties(cli_prior_build_threads PROPERTIES ENVIRONMENT MOE_ROUTE_CPU_ISA=baseline)
add_test(NAME cli_prior_build_threads_same COMMAND ${CMAKE_COMMAND} -E compare_files ${F}/pi.npy ${F}/pi_threads.npy)
set_tests_properties(cli_prior_build_threads_same PROPERTIES FIXTURES_REQUIRED "cli_prior;cli_prior_threads")
moe_route_cli_test(prior_build_bad_threads 2 ABSENT ${F}/pi_err.npy MATCH "--threads must be >= 0"
  ARGS prior build --logits ${F}/logits_base.npy --prior-rows ${F}/prior_rows.npy --threads -1 --out ${F}/pi_err.npy)
moe_route_cli_test(prior_shuffle_within 0 SETUP cli_prior EXISTS ${F}/pi_within.npy
  ARGS prior shuffle --prior ${F}/prior.npy --scope within --communities ${F}/communities.npy --seed 3 --out ${F}/pi_within.npy)
moe_route_cli_test(prior_shuffle_global 0 EXISTS ${F}/pi_global.npy
  ARGS prior shuffle --prior ${F}/prior.npy --scope global --seed 3 --out ${F}/pi_global.npy)
moe_route_cli_test(prior_validate 0 REQUIRES cli_prior EXISTS ${F}/pv.json MATCH "change rate"
  ARGS prior validate --prior ${F}/prior.npy --shuffled ${F}/pi_within.npy --k 2 --beta 1 --json ${F}/pv.json)
moe_route_cli_test(prior_build_bad_rows_shape 1 ABSENT ${F}/pi_err.npy
  ARGS prior build --logits ${F}/logits_base.npy --prior-rows ${F}/communities.npy --out ${F}/pi_err.npy)
moe_route_cli_test(prior_build_bad_dtype 1 ABSENT ${F}/pi_err.npy MATCH "dtype"
  ARGS prior build --logits ${F}/bad_dtype.npy --prior-rows ${F}/prior_rows.npy --out ${F}/pi_err.npy)
moe_route_cli_test(prior_shuffle_within_needs_communities 2
  ARGS prior shuffle --prior ${F}/prior.npy --scope within --out ${F}/pi_err.npy)
moe_route_cli_test(prior_validate_shape_mismatch 1 ABSENT ${F}/pv_err.json
  ARGS prior validate --prior ${F}/prior.npy --shuffled ${F}/logits_base.npy --k 2 --json ${F}/pv_err.json)
moe_route_cli_test(prior_no_action 2 ARGS prior)

# --- capacity (Table 7 of CIPHER: d = 6586; B_e = 6 for mu = 1, eps = 0.1, eta = 0.01).
moe_route_cli_test(capacity 0 EXISTS ${F}/cap.json MATCH "smallest d = 6586"
  ARGS capacity --experts 256 --epsilon 0.1 --eta 0.01 --mu 1 --a0 0.9 --beta-exposure 1 --pool 1000
       --delta 0.05 --kappa 2 --dimension 4096 --pi 0.01 --json ${F}/cap.json)
moe_route_cli_test(capacity_invalid_range 1 MATCH "eta"
  ARGS capacity --experts 256 --epsilon 0.1 --eta 0.2 --mu 1 --a0 0.9 --beta-exposure 1 --pool 1000)
moe_route_cli_test(capacity_missing_flag 2 ARGS capacity --experts 256 --epsilon 0.1)
