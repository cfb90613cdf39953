// SPDX-License-Identifier: Apache-2.0
// STRIA_CUDA_CHECK: turns a failing CUDA runtime call into stria::cuda_error with the call text and file:line.
#pragma once

#include <cuda_runtime_api.h>

#include <source_location>

#include "stria/core/error.hpp"

namespace stria::detail {

inline void check_cuda(cudaError_t status, const char* call, std::source_location where) {
  if (status != cudaSuccess) {
    // Clear a sticky launch error so the next check reports its own failure, not this one.
    (void)cudaGetLastError();
    throw cuda_error(call, static_cast<int>(status),
                     std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status), where);
  }
}

/// The calling thread's current device (a failure reports the caller's file:line).
inline int current_device(std::source_location where = std::source_location::current()) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice", where);
  return device;
}

}  // namespace stria::detail

#define STRIA_CUDA_CHECK(call) ::stria::detail::check_cuda((call), #call, std::source_location::current())

/// After a kernel launch: a bad configuration shows up in cudaGetLastError, not in the launch itself.
#define STRIA_CUDA_CHECK_LAUNCH(kernel_name) \
  ::stria::detail::check_cuda(cudaGetLastError(), "launch of " kernel_name, std::source_location::current())
