# SPDX-License-Identifier: Apache-2.0
# Runs a program that must reject its input: it passes when the program exits with EXIT_CODE and
# its output holds EXPECT (a literal string).
#   cmake -DCOMMAND="prog;arg;..." -DEXPECT="text" [-DEXIT_CODE=2] [-DNESTED_FILE=path -DNESTED_DEPTH=n] -P expect_error.cmake
# NESTED_FILE: first write a file of NESTED_DEPTH '[' characters there (an input too large to commit).
if(DEFINED NESTED_FILE)
  string(REPEAT "[" ${NESTED_DEPTH} nested)
  file(WRITE "${NESTED_FILE}" "${nested}")
endif()
if(NOT DEFINED EXIT_CODE)
  set(EXIT_CODE 2)
endif()
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(FIND "${out}${err}" "${EXPECT}" at)
if(NOT code STREQUAL "${EXIT_CODE}" OR at EQUAL -1)
  message(FATAL_ERROR "expected exit code ${EXIT_CODE} and the text \"${EXPECT}\"; got exit code ${code}, output:\n${out}${err}")
endif()
message(STATUS "rejected as expected (exit ${code}): ${EXPECT}")
