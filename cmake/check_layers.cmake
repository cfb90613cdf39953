# SPDX-License-Identifier: Apache-2.0
# cmake -DROOT=<source dir> -P check_layers.cmake
# The one launch layer (DESIGN 3): every kernel launch (`<<<`) is in include/stria/device/launch.cuh
# (device::detail::launch, which the rest of device/ calls), and only kernel/ and device/ include
# stria/kernel/. And no header names thrust::cuda::par or thrust::device, the policies that
# synchronize the stream after a call (a ring step's host would wait for the device there; other
# spellings and thrust calls that return a value, which block under any policy, are not caught).
# Fails naming every file that breaks a rule.
get_filename_component(ROOT "${ROOT}" ABSOLUTE)
file(GLOB_RECURSE headers RELATIVE "${ROOT}/include" "${ROOT}/include/*.hpp" "${ROOT}/include/*.cuh" "${ROOT}/include/*.h")
list(LENGTH headers count)
if(count EQUAL 0)
  message(FATAL_ERROR "no headers under ${ROOT}/include")
endif()
set(broken "")
foreach(header IN LISTS headers)
  file(READ "${ROOT}/include/${header}" text)
  if(text MATCHES "thrust::(cuda::par|device)[^_a-zA-Z0-9]")
    string(APPEND broken "\n  include/${header}: calls thrust with a policy that synchronizes the stream (use thrust::cuda::par_nosync.on(stream))")
  endif()
  string(FIND "${text}" "<<<" launch)
  if(NOT launch EQUAL -1 AND NOT header STREQUAL "stria/device/launch.cuh")
    string(APPEND broken "\n  include/${header}: launches a kernel (<<<) outside include/stria/device/launch.cuh (call device::detail::launch)")
  endif()
  if(NOT header MATCHES "^stria/(kernel|device)/" AND text MATCHES "#[ \t]*include[ \t]*[<\"]stria/kernel/")
    string(APPEND broken "\n  include/${header}: includes stria/kernel/ outside kernel/ and device/")
  endif()
endforeach()
if(broken)
  message(FATAL_ERROR "the layer rules are broken:${broken}")
endif()
message(STATUS "${count} headers: every launch in device/launch.cuh, kernel/ included only from kernel/ and device/, no synchronizing thrust policy")
