# ctest helper: runs `${CLI} ${ARGS}` (ARGS: one space-separated string) and passes when the CLI
# rejects it cleanly: exit code 2 (not a crash, not an exception) and exactly one line on stderr,
# "deltastate: error: ...", that matches EXPECT when given.
separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND "${CLI}" ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "2")
  message(FATAL_ERROR "expected exit code 2, got '${rc}'; stderr: ${err}")
endif()
if(NOT err MATCHES "^deltastate: error: [^\n]*\n$")
  message(FATAL_ERROR "expected one 'deltastate: error:' line on stderr, got: ${err}")
endif()
if(DEFINED EXPECT AND NOT err MATCHES "${EXPECT}")
  message(FATAL_ERROR "stderr does not match '${EXPECT}': ${err}")
endif()
message(STATUS "rejected as expected: ${err}")
