# Runs route_hash and compares its output with the committed hashes
# (tests/route_hash.expected). Arguments: HASH (the executable), EXPECTED.
execute_process(COMMAND ${HASH} OUTPUT_VARIABLE actual RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "route_hash failed (${rc})")
endif()
file(READ ${EXPECTED} expected)
if(NOT actual STREQUAL expected)
  message(FATAL_ERROR "route_hash: the CPU backend's results changed.\nexpected:\n${expected}\nactual:\n${actual}\n"
                      "If the change is intended, regenerate tests/route_hash.expected (docs/development.md).")
endif()
message(STATUS "route_hash: every section matches tests/route_hash.expected")
