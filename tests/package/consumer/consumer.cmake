# SPDX-License-Identifier: Apache-2.0
# The consumer targets, shared by both consumer projects once stria::stria exists.
add_executable(stria_consumer ${CMAKE_CURRENT_LIST_DIR}/main.cpp)
target_link_libraries(stria_consumer PRIVATE stria::stria)

# Where the project has CUDA, a .cu file includes stria's device headers too (C++20 comes from the target).
include(CheckLanguage)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  enable_language(CUDA)
  target_sources(stria_consumer PRIVATE ${CMAKE_CURRENT_LIST_DIR}/device_part.cu)
  target_compile_definitions(stria_consumer PRIVATE STRIA_CONSUMER_HAS_CUDA=1)
  set_target_properties(stria_consumer PROPERTIES CUDA_ARCHITECTURES OFF)
  target_compile_options(stria_consumer PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a>)
endif()
