// SPDX-License-Identifier: Apache-2.0
// Kernels of the estimator's window statistics (DESIGN 7): the observation window (<= 64 query rows
// at the end of the sequence) against one rank's keys, one CTA per (local key block, query head).
// Scores are kept in the log2 domain (scale * log2(e) folded into the queries) so exp2 serves.
// Kernels without template parameters get a dummy one (`template <int Unused = 0>`): a template's
// definition may appear in every translation unit that includes the header, a plain __global__
// function's may not (and `inline` is ignored on kernels).
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cuda/std/bit>

#include <cstdint>
#include <type_traits>

#include "stria/core/config.hpp"
#include "stria/core/numeric.cuh"
#include "stria/core/tile.hpp"
#include "stria/kernel/mma.cuh"

namespace stria::kernel {

inline constexpr int window_threads = 256;
inline constexpr int window_max_rows = block_tokens;

/// Dynamic shared memory of the window kernels: window queries and one key tile with a padded row,
/// then the scores. 16-bit inputs stay 16-bit for the tensor cores (row dim + 8: 32-bit fragment
/// loads of 8 rows hit distinct banks); fp32 inputs use rows of dim + 1 floats.
template <class T>
STRIA_HOST_DEVICE constexpr std::size_t window_shared_bytes(index_t dim) {
  const std::size_t row = sizeof(T) == 2 ? static_cast<std::size_t>(dim + 8) : static_cast<std::size_t>(dim + 1);
  return 2 * sizeof(T) * window_max_rows * row + sizeof(float) * window_max_rows * (block_tokens + 1);
}

namespace detail {

/// Copies `count` elements of T from global to shared memory in 16-byte vectors when both sides
/// allow it (rows of `dim` elements; `stride` elements between shared rows), else element by element.
template <class T, class Load>
__device__ void load_rows(T* shared, int stride, int rows, int dim, Load row_pointer) {
  constexpr int per_vector = 16 / sizeof(T);
  if (dim % per_vector == 0 && stride % per_vector == 0) {
    const int vectors = dim / per_vector;
    for (int i = threadIdx.x; i < rows * vectors; i += blockDim.x) {
      const int r = i / vectors, v = i % vectors;
      const T* source = row_pointer(r);
      uint4 value = make_uint4(0, 0, 0, 0);
      if (source) value = *reinterpret_cast<const uint4*>(source + v * per_vector);
      *reinterpret_cast<uint4*>(shared + r * stride + v * per_vector) = value;
    }
  } else {
    for (int i = threadIdx.x; i < rows * dim; i += blockDim.x) {
      const int r = i / dim, d = i % dim;
      const T* source = row_pointer(r);
      shared[r * stride + d] = source ? source[d] : T{};
    }
  }
}

/// Operand row stride in shared memory, in elements: 16-bit inputs use dim + 8 (rows 16-byte
/// aligned for vector stores, and 32-bit fragment loads of 8 rows hit distinct banks); fp32 inputs
/// use dim + 1 (the fp32 loop reads 32 consecutive keys of one column: distinct banks).
template <class T>
__device__ constexpr int operand_stride(int dim) {
  return sizeof(T) == 2 ? dim + 8 : dim + 1;
}

/// Loads the window queries of head h once per CTA (rows past `rows` are zero).
template <class T>
__device__ void load_window(const T* __restrict__ window_q, index_t rows, index_t heads_q, index_t dim, index_t h, T* qs) {
  load_rows(qs, operand_stride<T>(dim), window_max_rows, dim,
            [&](int r) -> const T* { return r < rows ? window_q + (static_cast<std::int64_t>(r) * heads_q + h) * dim : nullptr; });
}

/// Scores of the window (already in qs) against local key block `local_block`, into s[row][key]
/// (stride 65, log2 domain), -inf where causally masked or beyond `rows`.
template <class T>
__device__ void score_tile(const T* __restrict__ k, const index_t* __restrict__ key_global_block, index_t rows, index_t heads_q,
                           index_t heads_kv, index_t dim, index_t first_row, float scale_log2, bool causal, index_t local_block, index_t h,
                           const T* qs, T* ks, float* s) {
  const index_t hk = h / (heads_q / heads_kv);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int stride = operand_stride<T>(dim);
  const std::int64_t first_token = static_cast<std::int64_t>(local_block) * block_tokens;
  const index_t key_token = key_global_block[local_block] * block_tokens;
  load_rows(ks, stride, block_tokens, dim, [&](int j) -> const T* { return k + ((first_token + j) * heads_kv + hk) * dim; });
  __syncthreads();
  auto store = [&](int r, int key, float score) {
    const bool masked = r >= rows || (causal && key_token + key > first_row + r);
    s[r * (block_tokens + 1) + key] = masked ? -INFINITY : score * scale_log2;
  };
  if constexpr (sizeof(T) == 2) {
    // Tensor cores: S = Q K^T, warp w owns rows 16 (w % 4) .. + 15 and keys 32 (w / 4) .. + 31.
    const int group = lane / 4, pair = 2 * (lane % 4);  // fragment coordinates (PTX ISA)
    const int row0 = 16 * (warp % 4), key0 = 32 * (warp / 4);
    float acc[4][4] = {};
    auto word = [](const T* at) { return *reinterpret_cast<const unsigned*>(at); };
    for (int k0 = 0; k0 < dim; k0 += 16) {
      const unsigned a[4] = {word(qs + (row0 + group) * stride + k0 + pair), word(qs + (row0 + group + 8) * stride + k0 + pair),
                             word(qs + (row0 + group) * stride + k0 + pair + 8), word(qs + (row0 + group + 8) * stride + k0 + pair + 8)};
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const T* key = ks + (key0 + 8 * n + group) * stride + k0 + pair;
        const unsigned b[2] = {word(key), word(key + 8)};
        mma_16816<T>(acc[n], a, b);
      }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int key = key0 + 8 * n + pair;
      store(row0 + group, key, acc[n][0]);
      store(row0 + group, key + 1, acc[n][1]);
      store(row0 + group + 8, key, acc[n][2]);
      store(row0 + group + 8, key + 1, acc[n][3]);
    }
  } else {
    // fp32 on CUDA cores: warp w scores rows 8w .. 8w + 7, lane l keys l and l + 32. Per head-dim
    // step: 8 row values (broadcast over the warp) and 2 keys (distinct banks) for 16 multiply-adds.
    constexpr int rows_per_warp = window_max_rows / (window_threads / 32);
    float acc[rows_per_warp][2];
#pragma unroll
    for (int i = 0; i < rows_per_warp; ++i) acc[i][0] = acc[i][1] = 0.0f;
    const T* q_rows = qs + warp * rows_per_warp * stride;
    for (int d = 0; d < dim; ++d) {
      const float k0 = to_float(ks[lane * stride + d]), k1 = to_float(ks[(lane + 32) * stride + d]);
#pragma unroll
      for (int i = 0; i < rows_per_warp; ++i) {
        const float q = to_float(q_rows[i * stride + d]);
        acc[i][0] += q * k0;
        acc[i][1] += q * k1;
      }
    }
#pragma unroll
    for (int i = 0; i < rows_per_warp; ++i) {
      store(warp * rows_per_warp + i, lane, acc[i][0]);
      store(warp * rows_per_warp + i, lane + 32, acc[i][1]);
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

/// Key blocks each CTA walks with the window queries kept in shared memory.
inline constexpr index_t window_blocks_per_cta = 4;

/// Shared-memory carve-up of the window kernels: queries, one key tile, scores.
template <class T>
__device__ void window_shared(unsigned char* shared, index_t dim, T*& qs, T*& ks, float*& s) {
  qs = reinterpret_cast<T*>(shared);
  ks = qs + window_max_rows * detail::operand_stride<T>(dim);
  s = reinterpret_cast<float*>(ks + window_max_rows * detail::operand_stride<T>(dim));
}

/// Pass 1: per (head, local block, window row) the max score and the sum of exp2(score - max).
///   window_q [rows, Hq, D]   k [S_local, Hkv, D]   tile_max, tile_sum [Hq, local_blocks, rows]
/// Grid: (ceil(local_blocks / window_blocks_per_cta), Hq).
template <class T>
__global__ void __launch_bounds__(window_threads)
    window_tile_partials(const T* __restrict__ window_q, const T* __restrict__ k, const index_t* __restrict__ key_global_block,
                         index_t rows, index_t heads_q, index_t heads_kv, index_t dim, index_t first_row, float scale_log2, bool causal,
                         index_t local_blocks, float* __restrict__ tile_max, float* __restrict__ tile_sum) {
  extern __shared__ __align__(16) unsigned char shared[];
  T *qs, *ks;
  float* s;
  window_shared<T>(shared, dim, qs, ks, s);
  const index_t h = blockIdx.y;
  detail::load_window(window_q, rows, heads_q, dim, h, qs);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const index_t first_block = blockIdx.x * window_blocks_per_cta;
  for (index_t local_block = first_block; local_block < min(first_block + window_blocks_per_cta, local_blocks); ++local_block) {
    detail::score_tile(k, key_global_block, rows, heads_q, heads_kv, dim, first_row, scale_log2, causal, local_block, h, qs, ks, s);
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
    __syncthreads();  // the next tile overwrites ks and s
  }
}

/// Combines the per-block partials of pass 1 into this rank's (max, sum) per (head, row): one CTA
/// of 256 threads per (head, row), each thread folding a strided share of the blocks.
template <int Unused = 0>
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
///   vertical [Hq, S_local]   tile_mass [Hq, local_blocks]; grid as pass 1.
template <class T>
__global__ void __launch_bounds__(window_threads)
    window_tile_probabilities(const T* __restrict__ window_q, const T* __restrict__ k, const index_t* __restrict__ key_global_block,
                              index_t rows, index_t heads_q, index_t heads_kv, index_t dim, index_t first_row, float scale_log2, bool causal,
                              index_t local_blocks, const float* __restrict__ global_max, const float* __restrict__ global_sum,
                              index_t first_local_block, float* __restrict__ vertical, float* __restrict__ tile_mass) {
  extern __shared__ __align__(16) unsigned char shared[];
  T *qs, *ks;
  float* s;
  window_shared<T>(shared, dim, qs, ks, s);
  __shared__ float warp_total[block_tokens / 32];
  const index_t h = blockIdx.y;
  detail::load_window(window_q, rows, heads_q, dim, h, qs);
  const index_t first_block = blockIdx.x * window_blocks_per_cta;
  for (index_t local_block = first_block; local_block < min(first_block + window_blocks_per_cta, local_blocks); ++local_block) {
    detail::score_tile(k, key_global_block, rows, heads_q, heads_kv, dim, first_row, scale_log2, causal, local_block, h, qs, ks, s);
    for (int i = threadIdx.x; i < rows * block_tokens; i += blockDim.x) {
      const int r = i / block_tokens, key = i % block_tokens;
      float& x = s[r * (block_tokens + 1) + key];
      const float z = global_sum[h * rows + r];
      x = (x == -INFINITY || z == 0.0f) ? 0.0f : exp2f(x - global_max[h * rows + r]) / z;
    }
    __syncthreads();
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
    __syncthreads();  // warp_total, ks and s are reused by the next tile
  }
}

/// Radix-sortable key of a candidate: ascending order of (head, mass descending). Masses are >= 0
/// except the -1 sentinel of local-block tokens; the usual float-to-ordered-bits map, inverted.
STRIA_HOST_DEVICE constexpr std::uint32_t descending_bits(float mass) {
  const std::uint32_t bits = cuda::std::bit_cast<std::uint32_t>(mass);
  const std::uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // ascending in mass
  return ~ordered;
}
STRIA_HOST_DEVICE constexpr float mass_of_descending_bits(std::uint32_t key) {
  const std::uint32_t ordered = ~key;
  const std::uint32_t bits = (ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered;
  return cuda::std::bit_cast<float>(bits);
}

/// keys[i] = (head << 32) | descending_bits(vertical[i]), values[i] = global token of local key token
/// j (i = h * S_local + j): one device-wide sort then orders every head's candidates.
template <int Unused = 0>
__global__ void candidate_keys(const float* __restrict__ vertical, const index_t* __restrict__ key_global_block, index_t heads,
                               index_t local_tokens, std::uint64_t* __restrict__ keys, index_t* __restrict__ values) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(heads) * local_tokens) return;
  const auto h = static_cast<std::uint64_t>(i / local_tokens);
  const index_t j = static_cast<index_t>(i % local_tokens);
  keys[i] = (h << 32) | descending_bits(vertical[i]);
  values[i] = key_global_block[j / block_tokens] * block_tokens + j % block_tokens;
}

/// Each head's sketch of its sorted candidates (engine::rank_share::sketch): the masses at positions
/// ceil((i + 1) * per_rank / points) - 1, i < points (engine::sketch_position). Grid: Hq; block: points.
template <int Unused = 0>
__global__ void candidate_sketch(const std::uint64_t* __restrict__ sorted_keys, index_t local_tokens, index_t per_rank, float* __restrict__ sketch) {
  const std::int64_t h = blockIdx.x, i = threadIdx.x, points = blockDim.x;
  const std::int64_t position = ((i + 1) * per_rank + points - 1) / points - 1;
  sketch[h * points + i] = mass_of_descending_bits(static_cast<std::uint32_t>(sorted_keys[h * local_tokens + position]));
}

/// One rank's statistics are already global (the collectives over one rank are identities): the
/// tile masses become slash masses (each key block lies on one block diagonal), their sum the window
/// mass, and each head's first `per_rank` sorted candidates its candidate row (-1 pads included).
///   tile_mass [Hq, local_blocks]   sorted_keys, sorted_tokens [Hq, local_tokens]
///   slash_mass [Hq, diagonals]   window_mass [Hq]   candidate_mass, candidate_token [Hq, per_rank]
/// Grid: Hq, 256 threads.
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    single_rank_statistics(const float* __restrict__ tile_mass, const index_t* __restrict__ key_global_block,
                           const std::uint64_t* __restrict__ sorted_keys, const index_t* __restrict__ sorted_tokens, index_t local_blocks,
                           index_t local_tokens, index_t per_rank, index_t num_blocks, index_t diagonals, index_t diagonal_offset,
                           float* __restrict__ slash_mass, float* __restrict__ window_mass, float* __restrict__ candidate_mass,
                           index_t* __restrict__ candidate_token) {
  using reduce = cub::BlockReduce<double, 256>;
  __shared__ typename reduce::TempStorage temp;
  const index_t h = blockIdx.x;
  float* slash = slash_mass + static_cast<std::int64_t>(h) * diagonals;
  const float* tiles = tile_mass + static_cast<std::int64_t>(h) * local_blocks;
  for (index_t i = threadIdx.x; i < diagonals; i += blockDim.x) slash[i] = 0.0f;
  __syncthreads();
  double total = 0;
  for (index_t b = threadIdx.x; b < local_blocks; b += blockDim.x) {
    slash[num_blocks - 1 - key_global_block[b] + diagonal_offset] = tiles[b];
    total += tiles[b];
  }
  total = reduce(temp).Sum(total);
  if (threadIdx.x == 0) window_mass[h] = float(total);
  for (index_t i = threadIdx.x; i < per_rank; i += blockDim.x) {
    const std::int64_t from = static_cast<std::int64_t>(h) * local_tokens + i, to = static_cast<std::int64_t>(h) * per_rank + i;
    candidate_mass[to] = mass_of_descending_bits(static_cast<std::uint32_t>(sorted_keys[from]));
    candidate_token[to] = sorted_tokens[from];
  }
}

}  // namespace stria::kernel
