// SPDX-License-Identifier: Apache-2.0
// The 64x64 tile machinery the sparse attention kernels share (DESIGN 8): shared-memory tiles of 64
// token rows, their asynchronous loads, and the two warp products every pass is made of.
// A CTA has 4 warps; warp w owns rows 16w .. 16w + 15 of a 64-row tile, so a product of a 64-row
// tile with another 64-row tile is 16 x 64 per warp (8 accumulator column tiles of 8).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "stria/core/config.hpp"
#include "stria/core/tile.hpp"
#include "stria/index/step_index.hpp"
#include "stria/kernel/mma.cuh"

namespace stria::kernel {

inline constexpr int attention_threads = 128;  // 4 warps x 16 rows = one 64-row block

/// A shared-memory tile of 64 token rows of `D` 16-bit elements. Rows are padded by 16 bytes so the
/// 8 row addresses of an ldmatrix fall into distinct bank groups.
template <int D>
struct shared_tile {
  static_assert(D % 16 == 0, "head dim must be a multiple of 16 (one mma k-step)");
  static constexpr int stride = D + 8;                   // elements between rows
  static constexpr int elements = block_tokens * stride;  // per tile
};

namespace detail {

/// Queues cp.async copies of a 64-row tile: row j from `row_pointer(j)`, or zeros where it is null
/// (`any_valid` is a readable address the zero-fill form still names). Commit and wait separately.
template <class T, int D, class RowPointer>
__device__ void load_tile_async(T* tile, const T* any_valid, RowPointer row_pointer) {
  constexpr int chunks = D * static_cast<int>(sizeof(T)) / 16;  // 16-byte pieces per row
  constexpr int per_chunk = 16 / static_cast<int>(sizeof(T));
  for (int i = threadIdx.x; i < block_tokens * chunks; i += attention_threads) {
    const int row = i / chunks, chunk = i % chunks;
    const T* source = row_pointer(row);
    cp_async_16(tile + row * shared_tile<D>::stride + chunk * per_chunk, source ? source + chunk * per_chunk : any_valid,
                source != nullptr);
  }
}

/// acc (16 x 64, this warp's rows of A) += A B^T, where A and B are 64-row shared tiles of D
/// columns: S = Q K^T, dP = dO V^T, and their transposes K Q^T, V dO^T.
template <class T, int D>
__device__ void product_abt(float (&acc)[8][4], const T* a, const T* b) {
  constexpr int stride = shared_tile<D>::stride;
  const int lane = threadIdx.x % 32, row0 = 16 * (threadIdx.x / 32);
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    unsigned af[4];
    ldmatrix_x4(af, a + (row0 + lane % 16) * stride + k0 + (lane / 16) * 8);
#pragma unroll
    for (int n = 0; n < 4; ++n) {  // B rows 16n .. 16n + 15 -> accumulator column tiles 2n, 2n + 1
      unsigned bf[4];
      ldmatrix_x4(bf, b + (16 * n + lane % 8 + (lane / 16) * 8) * stride + k0 + ((lane / 8) % 2) * 8);
      mma_16816<T>(acc[2 * n], af, bf[0], bf[1]);
      mma_16816<T>(acc[2 * n + 1], af, bf[2], bf[3]);
    }
  }
}

/// As product_abt with this warp's A fragments already in registers (the forward keeps Q there).
template <class T, int D>
__device__ void product_abt(float (&acc)[8][4], const unsigned (&af)[D / 16][4], const T* b) {
  constexpr int stride = shared_tile<D>::stride;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      unsigned bf[4];
      ldmatrix_x4(bf, b + (16 * n + lane % 8 + (lane / 16) * 8) * stride + 16 * k + ((lane / 8) % 2) * 8);
      mma_16816<T>(acc[2 * n], af[k], bf[0], bf[1]);
      mma_16816<T>(acc[2 * n + 1], af[k], bf[2], bf[3]);
    }
  }
}

/// This warp's A fragments (its 16 rows of a 64-row shared tile) for all D / 16 k-steps.
template <class T, int D>
__device__ void load_row_fragments(unsigned (&af)[D / 16][4], const T* a) {
  constexpr int stride = shared_tile<D>::stride;
  const int lane = threadIdx.x % 32, row0 = 16 * (threadIdx.x / 32);
#pragma unroll
  for (int k = 0; k < D / 16; ++k) ldmatrix_x4(af[k], a + (row0 + lane % 16) * stride + 16 * k + (lane / 16) * 8);
}

/// acc (16 x D) += P B, where P (16 x 64) is this warp's fp32 accumulator, rounded to T, and B a
/// 64-row shared tile: O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.
template <class T, int D>
__device__ void product_pb(float (&acc)[D / 8][4], const float (&p)[8][4], const T* b) {
  constexpr int stride = shared_tile<D>::stride;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // 16 of P's 64 columns (B's rows) per step
    unsigned af[4];
    accumulator_to_operand<T>(af, p[2 * k], p[2 * k + 1]);
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      unsigned bf[4];
      ldmatrix_x4_trans(bf, b + (16 * k + lane % 8 + ((lane / 8) % 2) * 8) * stride + 16 * n + (lane / 16) * 8);
      mma_16816<T>(acc[2 * n], af, bf[0], bf[1]);
      mma_16816<T>(acc[2 * n + 1], af, bf[2], bf[3]);
    }
  }
}

/// Coordinates of accumulator element acc[j][e] in the warp's 16 x N block: row (0-15), column.
__device__ inline int fragment_row(int e) { return static_cast<int>(threadIdx.x % 32) / 4 + (e >= 2 ? 8 : 0); }
__device__ inline int fragment_col(int j, int e) { return 8 * j + 2 * (static_cast<int>(threadIdx.x % 32) % 4) + (e & 1); }

/// One row's KV tiles in order: its active blocks, then its vertical tokens gathered 64 at a time.
struct row_tiles {
  const index_t* blocks;  // local KV blocks
  index_t num_blocks;
  const index_t* tokens;  // local KV tokens
  index_t num_tokens;

  __device__ static row_tiles of(const step_index_view& index, index_t row) {
    const index_t b = index.block_ptr[row], t = index.col_ptr[row];
    return {index.block_col + b, index.block_ptr[row + 1] - b, index.col_token + t, index.col_ptr[row + 1] - t};
  }
  __device__ index_t count() const { return num_blocks + (num_tokens + block_tokens - 1) / block_tokens; }
  __device__ bool is_block(index_t t) const { return t < num_blocks; }
  /// Local KV token of row j of tile t, or -1 past the end of the last gather.
  __device__ index_t token(index_t t, int j) const {
    if (t < num_blocks) return blocks[t] * block_tokens + j;
    const index_t at = (t - num_blocks) * block_tokens + j;
    return at < num_tokens ? tokens[at] : -1;
  }
  /// Row j of tile t in a [Sk, Hkv, D] tensor (K or V) at KV head `hk`; null past the last gather.
  template <int D, class T>
  __device__ const T* kv_row(const T* base, index_t heads_kv, index_t hk, index_t t, int j) const {
    const index_t at = token(t, j);
    return at < 0 ? nullptr : base + (static_cast<std::int64_t>(at) * heads_kv + hk) * D;
  }
  /// Valid columns of tile t (64 except in the last gather).
  __device__ int valid_columns(index_t t) const {
    if (t < num_blocks) return block_tokens;
    const index_t left = num_tokens - (t - num_blocks) * block_tokens;
    return left < block_tokens ? static_cast<int>(left) : block_tokens;
  }
};

/// The local query block of a CTA launched over (query blocks, heads). Later query blocks have longer
/// lists under causal attention, so they are launched first (a shorter tail).
__device__ inline index_t launched_query_block() { return static_cast<index_t>(gridDim.x - 1 - blockIdx.x); }

}  // namespace detail
}  // namespace stria::kernel
