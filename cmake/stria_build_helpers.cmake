# SPDX-License-Identifier: Apache-2.0
# Settings for stria's own targets (tests, examples, benchmarks); included only when stria is the top-level project.

set(STRIA_CUDA_GENCODE "-gencode=arch=compute_90a,code=sm_90a"
    CACHE STRING "nvcc -gencode flags for stria's own CUDA targets (Hopper sm_90a: wgmma, TMA, setmaxnreg)")
option(STRIA_WARNINGS_AS_ERRORS "Treat warnings in stria's own targets as errors" ON)

# Strict warnings for host code of our own targets.
function(stria_target_warnings target)
  set(flags -Wall -Wextra -Wpedantic -Wshadow)
  if(STRIA_WARNINGS_AS_ERRORS)
    list(APPEND flags -Werror)
  endif()
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${flags}>)
  string(REPLACE ";" "," cuda_host_flags "-Wall;-Wextra")
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${cuda_host_flags}>)
  if(STRIA_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
endfunction()

# Device code generation for our own CUDA targets.
function(stria_target_cuda target)
  separate_arguments(gencode UNIX_COMMAND "${STRIA_CUDA_GENCODE}")
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${gencode}>)
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES OFF)
endfunction()

# AddressSanitizer + UndefinedBehaviorSanitizer, failing on the first report.
function(stria_target_sanitizers target)
  set(flags -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -O1 -g)
  target_compile_options(${target} PRIVATE ${flags})
  target_link_options(${target} PRIVATE -fsanitize=address,undefined)
endfunction()
