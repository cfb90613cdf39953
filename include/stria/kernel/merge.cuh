// SPDX-License-Identifier: Apache-2.0
// Merge of a partial attention result into an fp32 running state, for partials computed elsewhere
// (the dynamic solver returns a moved query chunk's partial O and LSE to the chunk's owner).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "stria/core/config.hpp"
#include "stria/core/softmax_merge.hpp"

namespace stria::kernel {

/// out, part_out [S, H, D] and lse, part_lse [H, S], fp32, both normalised: out takes the
/// LSE-weighted sum, lse the merged LSE. One warp per (token, head) row: every lane reads the two
/// LSEs before lane 0 overwrites the running one. A side with zero weight is dropped entirely, so
/// an empty row (lse = -inf) never injects 0 * inf = NaN.
/// (A template, as every kernel in a header is: one definition however many files include it.)
template <class Real = float>
__global__ void merge_partial(Real* __restrict__ out, Real* __restrict__ lse, const Real* __restrict__ part_out,
                              const Real* __restrict__ part_lse, index_t tokens, index_t heads, index_t dim) {
  const std::int64_t warp = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (warp >= static_cast<std::int64_t>(tokens) * heads) return;
  const auto token = static_cast<index_t>(warp / heads), head = static_cast<index_t>(warp % heads);
  const std::int64_t at = static_cast<std::int64_t>(head) * tokens + token;
  const lse_merge<Real> m = merge_lse(lse[at], part_lse[at]);
  Real* row = out + warp * dim;
  const Real* part_row = part_out + warp * dim;
  for (index_t d = lane; d < dim; d += 32) {
    const Real a = m.weight_a == Real(0) ? Real(0) : m.weight_a * row[d];
    const Real b = m.weight_b == Real(0) ? Real(0) : m.weight_b * part_row[d];
    row[d] = a + b;
  }
  __syncwarp();
  if (lane == 0) lse[at] = m.lse;
}

}  // namespace stria::kernel
