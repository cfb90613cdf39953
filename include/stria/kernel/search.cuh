// SPDX-License-Identifier: Apache-2.0
// Binary searches over the ascending lists the kernels read (step indices, selections, runs of
// candidate keys): one thread each, no library dependency.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "stria/core/config.hpp"

namespace stria::kernel::detail {

/// The first position in [lo, hi) of an ascending list whose value is >= x (hi if none is).
template <class T>
__device__ inline index_t lower_bound_in(const T* list, index_t lo, index_t hi, std::type_identity_t<T> x) {
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    if (list[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/// The first position in [lo, hi) of an ascending list whose value is > x (hi if none is).
__device__ inline index_t upper_bound_in(const index_t* list, index_t lo, index_t hi, index_t x) {
  return lower_bound_in(list, lo, hi, x + 1);  // index_t values: > x is >= x + 1 (x < the type's max: list values bound it)
}

}  // namespace stria::kernel::detail
