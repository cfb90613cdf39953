# SPDX-License-Identifier: Apache-2.0
# cmake -DNVCC=<nvcc> [-DCCBIN=<host compiler>] -DSOURCE=<.cu> -DINCLUDE=<include dir> -DOUTPUT=<cubin> -P check_ptxas.cmake
# Compiles SOURCE for sm_90a with ptxas's report (-Xptxas -v) and fails naming every kernel that
# ptxas serialized (its C75xx "Potential Performance Loss" notes: wgmma products waited for one by
# one, or waits it injected) or that spills registers. Both are silent in a normal build, and either
# one costs the Hopper kernels 10% or more: a change that looked harmless (one more register in the
# forward's copier) once made every product of the forward wait for the one before it.
foreach(var NVCC SOURCE INCLUDE OUTPUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_ptxas.cmake needs -D${var}=...")
  endif()
endforeach()
set(host_compiler "")
if(CCBIN)
  set(host_compiler "-ccbin=${CCBIN}")  # the build's CMAKE_CUDA_HOST_COMPILER, where one is set
endif()
execute_process(
  COMMAND "${NVCC}" ${host_compiler} -O3 -DNDEBUG -std=c++20 "-I${INCLUDE}" -gencode=arch=compute_90a,code=sm_90a -cubin -o "${OUTPUT}"
          "${SOURCE}" -Xptxas -v
  RESULT_VARIABLE result OUTPUT_VARIABLE report ERROR_VARIABLE report)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "nvcc failed on ${SOURCE}:\n${report}")
endif()
string(REPLACE "\n" ";" lines "${report}")
set(found "")
set(kernels 0)
set(current "")
foreach(line IN LISTS lines)
  if(line MATCHES "Function properties for ([A-Za-z0-9_]+)")
    set(current "${CMAKE_MATCH_1}")
    math(EXPR kernels "${kernels} + 1")
  elseif(line MATCHES "\\((C75[0-9][0-9])\\) (.*)")
    string(APPEND found "\n  ${CMAKE_MATCH_1}: ${CMAKE_MATCH_2}")
  elseif(line MATCHES "([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads")
    if(NOT CMAKE_MATCH_1 EQUAL 0 OR NOT CMAKE_MATCH_2 EQUAL 0)
      string(APPEND found "\n  ${current}: ${CMAKE_MATCH_1} bytes spill stores, ${CMAKE_MATCH_2} bytes spill loads")
    endif()
  endif()
endforeach()
if(kernels EQUAL 0)
  message(FATAL_ERROR "ptxas reported no function of ${SOURCE}:\n${report}")
endif()
if(found)
  message(FATAL_ERROR "ptxas serialized or spilled:\n  ${SOURCE}${found}")  # indented lines: message() does not rewrap them
endif()
message(STATUS "${kernels} functions of ${SOURCE}: no wgmma serialized, no spills")
