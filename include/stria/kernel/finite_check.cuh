// SPDX-License-Identifier: Apache-2.0
// Checked mode's device pass (issue 20): the lowest flat index of a tensor whose value breaks its
// rule (NaN or +inf; -inf too unless allowed), with the value's kind, as one 64-bit key.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "stria/core/config.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/numeric.cuh"

namespace stria::kernel {

/// `found` holds ~0 before the pass (nothing found); a bad element at flat index i of kind k lowers
/// it to i * 4 + k, so after the pass it names the lowest bad index. Grid-stride: a thread's indices
/// rise, so its first bad element is its lowest and it stops there; finite tensors cost no atomics.
template <class T>
__global__ void first_non_finite(const T* __restrict__ x, std::int64_t count, bool negative_infinity_allowed,
                                 unsigned long long* __restrict__ found) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count; i += stride) {
    const int code = non_finite_code(to_float(x[i]), negative_infinity_allowed);
    if (code >= 0) {
      atomicMin(found, static_cast<unsigned long long>(i) * 4 + static_cast<unsigned long long>(code));
      return;
    }
  }
}

}  // namespace stria::kernel
