# SPDX-License-Identifier: Apache-2.0
# plan --cluster predicts no slower a layer on faster links: the fastest choice's layer time at 10,
# 100 and 1000 Gb/s between nodes (and 10x that within) never grows.
#   cmake -DPLAN=path/to/plan -P check_cluster_bandwidth.cmake
foreach(gbps IN ITEMS 10 100 1000)
  math(EXPR intra "${gbps} * 10")
  execute_process(COMMAND ${PLAN} --cluster 2x4 --seq-len 32768 --inter-gbps ${gbps} --intra-gbps ${intra} --json
                  RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "plan failed at ${gbps} Gb/s: ${err}")
  endif()
  foreach(phase IN ITEMS layer)
    string(JSON ms GET "${out}" predictions 0 ranking 0 ${phase}_ms)
    # CMake compares integers only: microseconds.
    string(REGEX MATCH "^([0-9]+)\\.?([0-9]*)$" matched "${ms}")
    if(NOT matched)
      message(FATAL_ERROR "${phase}_ms = ${ms}: not a plain decimal number")
    endif()
    string(SUBSTRING "${CMAKE_MATCH_2}000" 0 3 fraction)
    math(EXPR us "${CMAKE_MATCH_1} * 1000 + 1${fraction} - 1000")
    if(DEFINED previous_${phase} AND us GREATER previous_${phase})
      message(FATAL_ERROR "${phase} at ${gbps} Gb/s: ${ms} ms, slower than on the slower links")
    endif()
    set(previous_${phase} ${us})
  endforeach()
  message(STATUS "${gbps} Gb/s between nodes: fastest layer ${ms} ms")
endforeach()
