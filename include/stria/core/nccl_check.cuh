// SPDX-License-Identifier: Apache-2.0
// STRIA_NCCL_CHECK: turns a failing NCCL call into stria::nccl_error with the call text and file:line.
#pragma once

#include <nccl.h>

#include <source_location>
#include <string>

#include "stria/core/error.hpp"

namespace stria::detail {

inline void check_nccl(ncclResult_t status, const char* call, std::source_location where) {
  if (status != ncclSuccess && status != ncclInProgress) {
    throw nccl_error(call, static_cast<int>(status), ncclGetErrorString(status), where);
  }
}

}  // namespace stria::detail

#define STRIA_NCCL_CHECK(call) ::stria::detail::check_nccl((call), #call, std::source_location::current())
