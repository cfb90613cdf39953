# SPDX-License-Identifier: Apache-2.0
# cmake -DDOC=README.md -DROOT=<source dir> -P check_snippets.cmake
# Every code block that follows a `<!-- snippet: PATH -->` line in DOC must appear verbatim in PATH,
# so documentation shows only code that is compiled and tested.
file(READ "${DOC}" doc)
string(REPLACE ";" "@SEMICOLON@" doc "${doc}")  # keep code semicolons from splitting CMake lists
string(REGEX MATCHALL "<!-- snippet: [^ ]+ -->\n```[a-z]*\n[^`]*```" blocks "${doc}")
list(LENGTH blocks count)
if(count EQUAL 0)
  message(FATAL_ERROR "${DOC}: no snippet blocks found")
endif()
foreach(block IN LISTS blocks)
  string(REGEX MATCH "<!-- snippet: ([^ ]+) -->" _ "${block}")
  set(path "${CMAKE_MATCH_1}")
  string(REGEX REPLACE "^<!-- snippet: [^ ]+ -->\n```[a-z]*\n" "" code "${block}")
  string(REGEX REPLACE "```$" "" code "${code}")
  file(READ "${ROOT}/${path}" source)
  string(REPLACE ";" "@SEMICOLON@" source "${source}")
  string(FIND "${source}" "${code}" at)
  if(at EQUAL -1)
    string(REPLACE "@SEMICOLON@" ";" code "${code}")
    message(FATAL_ERROR "${DOC}: a snippet no longer matches ${path}:\n${code}")
  endif()
  message(STATUS "snippet from ${path}: matches")
endforeach()
