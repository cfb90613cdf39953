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
__global__ void merge_partial(float* __restrict__ out, float* __restrict__ lse, const float* __restrict__ part_out,
                              const float* __restrict__ part_lse, index_t tokens, index_t heads, index_t dim) {
  const std::int64_t warp = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (warp >= static_cast<std::int64_t>(tokens) * heads) return;
  const auto token = static_cast<index_t>(warp / heads), head = static_cast<index_t>(warp % heads);
  const std::int64_t at = static_cast<std::int64_t>(head) * tokens + token;
  const lse_merge<float> m = merge_lse(lse[at], part_lse[at]);
  float* row = out + warp * dim;
  const float* part_row = part_out + warp * dim;
  for (index_t d = lane; d < dim; d += 32) {
    const float a = m.weight_a == 0.0f ? 0.0f : m.weight_a * row[d];
    const float b = m.weight_b == 0.0f ? 0.0f : m.weight_b * part_row[d];
    row[d] = a + b;
  }
  __syncwarp();
  if (lane == 0) lse[at] = m.lse;
}

}  // namespace stria::kernel
