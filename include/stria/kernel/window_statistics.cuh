// SPDX-License-Identifier: Apache-2.0
// Kernels of the estimator's window statistics (DESIGN 7): the observation window (<= 64 query rows
// at the end of the sequence) against one rank's keys, one CTA per (local key block, query head).
// Scores are kept in the log2 domain (scale * log2(e) folded into the queries) so exp2 serves.
#pragma once

#include <cuda_runtime.h>

#include "stria/core/config.hpp"
#include "stria/core/numeric.cuh"
#include "stria/core/tile.hpp"

namespace stria::kernel {

inline constexpr int window_threads = 256;
inline constexpr int window_max_rows = block_tokens;

/// Dynamic shared memory of the window kernels: window queries and one key tile as floats with a
/// padded row (dim + 1, so that threads reading consecutive keys hit distinct banks), and scores.
STRIA_HOST_DEVICE constexpr std::size_t window_shared_bytes(index_t dim) {
  return sizeof(float) * (2 * static_cast<std::size_t>(window_max_rows) * (dim + 1) +
                          static_cast<std::size_t>(window_max_rows) * (block_tokens + 1));
}

namespace detail {

/// Scores of the window against local key block `local_block` for head h, into s[row][key]
/// (stride 65), -inf where causally masked or beyond `rows`.
template <class T>
__device__ void window_tile_scores(const float* __restrict__ window_q, const T* __restrict__ k, const index_t* __restrict__ key_global_block,
                                   index_t rows, index_t heads_q, index_t heads_kv, index_t dim, index_t first_row, float scale_log2,
                                   bool causal, index_t local_block, index_t h, float* qs, float* ks, float* s) {
  const index_t hk = h / (heads_q / heads_kv);
  const int stride = dim + 1;
  for (int i = threadIdx.x; i < rows * dim; i += blockDim.x) {
    const int r = i / dim, d = i % dim;
    qs[r * stride + d] = window_q[(static_cast<std::int64_t>(r) * heads_q + h) * dim + d] * scale_log2;
  }
  for (int i = threadIdx.x; i < block_tokens * dim; i += blockDim.x) {
    const int j = i / dim, d = i % dim;
    const std::int64_t token = static_cast<std::int64_t>(local_block) * block_tokens + j;
    ks[j * stride + d] = to_float(k[(token * heads_kv + hk) * dim + d]);
  }
  __syncthreads();
  // Thread (key, group): one key, rows group, group + 4, ... (warps share rows: q reads broadcast).
  const int key = threadIdx.x % block_tokens;
  const int group = threadIdx.x / block_tokens;
  constexpr int groups = window_threads / block_tokens;
  float acc[window_max_rows / groups];
#pragma unroll
  for (int i = 0; i < window_max_rows / groups; ++i) acc[i] = 0.0f;
  for (int d = 0; d < dim; ++d) {
    const float kv = ks[key * stride + d];
#pragma unroll
    for (int i = 0; i < window_max_rows / groups; ++i) {
      const int r = group + groups * i;
      if (r < rows) acc[i] += qs[r * stride + d] * kv;
    }
  }
  const index_t key_token = key_global_block[local_block] * block_tokens + key;
#pragma unroll
  for (int i = 0; i < window_max_rows / groups; ++i) {
    const int r = group + groups * i;
    if (r >= window_max_rows) continue;
    const bool masked = r >= rows || (causal && key_token > first_row + r);
    s[r * (block_tokens + 1) + key] = masked ? -INFINITY : acc[i];
  }
  __syncthreads();
}

__device__ inline float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ inline float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace detail

/// Pass 1: per (head, local block, window row) the max score and the sum of exp2(score - max).
///   window_q [rows, Hq, D] fp32   k [S_local, Hkv, D]   tile_max, tile_sum [Hq, local_blocks, rows]
template <class T>
__global__ void __launch_bounds__(window_threads)
    window_tile_partials(const float* __restrict__ window_q, const T* __restrict__ k, const index_t* __restrict__ key_global_block,
                         index_t rows, index_t heads_q, index_t heads_kv, index_t dim, index_t first_row, float scale_log2, bool causal,
                         float* __restrict__ tile_max, float* __restrict__ tile_sum) {
  extern __shared__ float shared[];
  float* qs = shared;
  float* ks = qs + window_max_rows * (dim + 1);
  float* s = ks + window_max_rows * (dim + 1);
  const index_t local_block = blockIdx.x, h = blockIdx.y, local_blocks = gridDim.x;
  detail::window_tile_scores(window_q, k, key_global_block, rows, heads_q, heads_kv, dim, first_row, scale_log2, causal, local_block, h, qs,
                             ks, s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += window_threads / 32) {
    const float a = s[r * (block_tokens + 1) + lane], b = s[r * (block_tokens + 1) + lane + 32];
    const float m = detail::warp_max(fmaxf(a, b));
    const float sum = m == -INFINITY ? 0.0f : detail::warp_sum(exp2f(a - m) + exp2f(b - m));
    if (lane == 0) {
      const std::int64_t out = (static_cast<std::int64_t>(h) * local_blocks + local_block) * rows + r;
      tile_max[out] = m;
      tile_sum[out] = sum;
    }
  }
}

/// Combines the per-block partials of pass 1 into this rank's (max, sum) per (head, row).
///   row_max, row_sum [Hq, rows]; one thread per (head, row).
__global__ void combine_row_partials(const float* __restrict__ tile_max, const float* __restrict__ tile_sum, index_t heads_q,
                                     index_t local_blocks, index_t rows, float* __restrict__ row_max, float* __restrict__ row_sum) {
  const index_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= heads_q * rows) return;
  const index_t h = i / rows, r = i % rows;
  float m = -INFINITY, sum = 0.0f;
  for (index_t b = 0; b < local_blocks; ++b) {
    const std::int64_t at = (static_cast<std::int64_t>(h) * local_blocks + b) * rows + r;
    const float tm = tile_max[at];
    if (tm == -INFINITY) continue;
    if (tm > m) {
      sum = sum * exp2f(m - tm) + tile_sum[at];
      m = tm;
    } else {
      sum += tile_sum[at] * exp2f(tm - m);
    }
  }
  row_max[i] = m;
  row_sum[i] = sum;
}

/// Pass 2, with the global (max, sum) of every row: the window probabilities, summed per key token
/// (vertical mass; -1 for tokens of the last `local_blocks` global blocks, which are never vertical
/// candidates) and per tile (the mass of the block diagonal this key block lies on).
///   vertical [Hq, S_local]   tile_mass [Hq, local_blocks]
template <class T>
__global__ void __launch_bounds__(window_threads)
    window_tile_probabilities(const float* __restrict__ window_q, const T* __restrict__ k, const index_t* __restrict__ key_global_block,
                              index_t rows, index_t heads_q, index_t heads_kv, index_t dim, index_t first_row, float scale_log2, bool causal,
                              const float* __restrict__ global_max, const float* __restrict__ global_sum, index_t first_local_block,
                              float* __restrict__ vertical, float* __restrict__ tile_mass) {
  extern __shared__ float shared[];
  float* qs = shared;
  float* ks = qs + window_max_rows * (dim + 1);
  float* s = ks + window_max_rows * (dim + 1);
  const index_t local_block = blockIdx.x, h = blockIdx.y, local_blocks = gridDim.x;
  detail::window_tile_scores(window_q, k, key_global_block, rows, heads_q, heads_kv, dim, first_row, scale_log2, causal, local_block, h, qs,
                             ks, s);
  for (int i = threadIdx.x; i < rows * block_tokens; i += blockDim.x) {
    const int r = i / block_tokens, key = i % block_tokens;
    float& x = s[r * (block_tokens + 1) + key];
    const float z = global_sum[h * rows + r];
    x = (x == -INFINITY || z == 0.0f) ? 0.0f : exp2f(x - global_max[h * rows + r]) / z;
  }
  __syncthreads();
  __shared__ float warp_total[block_tokens / 32];
  if (threadIdx.x < block_tokens) {
    float column = 0.0f;
    for (int r = 0; r < rows; ++r) column += s[r * (block_tokens + 1) + threadIdx.x];
    const bool local = key_global_block[local_block] >= first_local_block;
    vertical[static_cast<std::int64_t>(h) * local_blocks * block_tokens + static_cast<std::int64_t>(local_block) * block_tokens + threadIdx.x] =
        local ? -1.0f : column;
    const float total = detail::warp_sum(column);  // threads 0-63: two whole warps
    if (threadIdx.x % 32 == 0) warp_total[threadIdx.x / 32] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) tile_mass[static_cast<std::int64_t>(h) * local_blocks + local_block] = warp_total[0] + warp_total[1];
}

}  // namespace stria::kernel
