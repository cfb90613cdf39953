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
  for (int i = threadIdx.x; i < window_max_rows * dim; i += blockDim.x) {
    const int r = i / dim, d = i % dim;  // rows past `rows` are zero (their scores are masked anyway)
    qs[r * stride + d] = r < rows ? window_q[(static_cast<std::int64_t>(r) * heads_q + h) * dim + d] * scale_log2 : 0.0f;
  }
  for (int i = threadIdx.x; i < block_tokens * dim; i += blockDim.x) {
    const int j = i / dim, d = i % dim;
    const std::int64_t token = static_cast<std::int64_t>(local_block) * block_tokens + j;
    ks[j * stride + d] = to_float(k[(token * heads_kv + hk) * dim + d]);
  }
  __syncthreads();
  // Warp w scores rows 8w .. 8w + 7; lane l keys l and l + 32. Per head-dim step a thread loads 8
  // row values (the same for the whole warp: broadcast) and 2 keys (consecutive across the warp,
  // distinct banks thanks to the padded stride) for 16 multiply-adds.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int rows_per_warp = window_max_rows / (window_threads / 32);
  float acc[rows_per_warp][2];
#pragma unroll
  for (int i = 0; i < rows_per_warp; ++i) acc[i][0] = acc[i][1] = 0.0f;
  const float* q_rows = qs + warp * rows_per_warp * stride;
  for (int d = 0; d < dim; ++d) {
    const float k0 = ks[lane * stride + d], k1 = ks[(lane + 32) * stride + d];
#pragma unroll
    for (int i = 0; i < rows_per_warp; ++i) {
      const float q = q_rows[i * stride + d];
      acc[i][0] += q * k0;
      acc[i][1] += q * k1;
    }
  }
  const index_t key_token = key_global_block[local_block] * block_tokens;
#pragma unroll
  for (int i = 0; i < rows_per_warp; ++i) {
    const int r = warp * rows_per_warp + i;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int key = lane + 32 * j;
      const bool masked = r >= rows || (causal && key_token + key > first_row + r);
      s[r * (block_tokens + 1) + key] = masked ? -INFINITY : acc[i][j];
    }
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

/// Combines the per-block partials of pass 1 into this rank's (max, sum) per (head, row): one CTA
/// of 256 threads per (head, row), each thread folding a strided share of the blocks.
__global__ void __launch_bounds__(256)
    combine_row_partials(const float* __restrict__ tile_max, const float* __restrict__ tile_sum, index_t heads_q, index_t local_blocks,
                         index_t rows, float* __restrict__ row_max, float* __restrict__ row_sum) {
  const index_t h = blockIdx.x / rows, r = blockIdx.x % rows;
  float m = -INFINITY, sum = 0.0f;
  for (index_t b = threadIdx.x; b < local_blocks; b += blockDim.x) {
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
  // Block reduction of (max, sum) pairs: first the max, then sums rescaled to it.
  __shared__ float shared_max[8], shared_sum[8];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float warp_top = detail::warp_max(m);
  if (lane == 0) shared_max[warp] = warp_top;
  __syncthreads();
  float top = shared_max[0];
  for (int w = 1; w < 8; ++w) top = fmaxf(top, shared_max[w]);
  const float mine = m == -INFINITY ? 0.0f : sum * exp2f(m - top);
  const float warp_total = detail::warp_sum(mine);
  if (lane == 0) shared_sum[warp] = warp_total;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < 8; ++w) total += shared_sum[w];
    row_max[blockIdx.x] = top;
    row_sum[blockIdx.x] = top == -INFINITY ? 0.0f : total;
  }
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

/// values[h * S_local + j] = global token of local key token j (the payload of the candidate sort).
__global__ void key_token_values(const index_t* __restrict__ key_global_block, index_t heads, index_t local_tokens, index_t* __restrict__ values) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(heads) * local_tokens) return;
  const index_t j = static_cast<index_t>(i % local_tokens);
  values[i] = key_global_block[j / block_tokens] * block_tokens + j % block_tokens;
}

}  // namespace stria::kernel
