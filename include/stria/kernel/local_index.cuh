// SPDX-License-Identifier: Apache-2.0
// Kernels that turn a global selection into one (query rank, KV rank) step index on the GPU, the
// same arrays build_local_index makes on the host. Count passes size each list, a scan (CUB) turns
// counts into CSR pointers, fill passes write the entries already in ascending order.
#pragma once

#include <cuda_runtime.h>

#include "stria/core/config.hpp"
#include "stria/core/tile.hpp"

namespace stria::kernel {

/// Device pointers and sizes the index kernels read. Selection lists are per head, CSR, sorted;
/// explicit tiles are (query block, key block) pairs sorted by query block then key block.
struct index_build_params {
  index_t heads, local_blocks, num_blocks;
  bool causal;
  index_t query_rank, kv_rank;
  const index_t* query_global;  // [local_blocks]
  const index_t* kv_global;     // [local_blocks]
  const index_t* owner;         // [num_blocks] rank owning each global block
  const index_t* local_of;      // [num_blocks] its local block there
  const index_t* slash_ptr;     // [heads + 1]
  const index_t* slash;         // deltas, ascending
  const index_t* vertical_ptr;  // [heads + 1]
  const index_t* vertical;      // global tokens, ascending
  const index_t* tile_ptr;      // [heads + 1]
  const index_t* tile_query;    // explicit tiles' query blocks
  const index_t* tile_key;      // and key blocks
};

namespace detail {

__device__ inline bool contains(const index_t* first, const index_t* last, index_t value) {
  while (first < last) {
    const index_t* mid = first + (last - first) / 2;
    if (*mid < value) first = mid + 1;
    else if (*mid > value) last = mid;
    else return true;
  }
  return false;
}

__device__ inline bool explicit_tile(const index_build_params& p, index_t h, index_t q_block, index_t k_block) {
  index_t lo = p.tile_ptr[h], hi = p.tile_ptr[h + 1];
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    const bool less = p.tile_query[mid] < q_block || (p.tile_query[mid] == q_block && p.tile_key[mid] < k_block);
    if (less) lo = mid + 1;
    else hi = mid;
  }
  return lo < p.tile_ptr[h + 1] && p.tile_query[lo] == q_block && p.tile_key[lo] == k_block;
}

__device__ inline bool tile_active(const index_build_params& p, index_t h, index_t q_block, index_t k_block) {
  return contains(p.slash + p.slash_ptr[h], p.slash + p.slash_ptr[h + 1], q_block - k_block) || explicit_tile(p, h, q_block, k_block);
}

/// Walks row (h, local query block i): its tiles in ascending local KV block (slash diagonals from
/// the largest delta down, merged with the explicit tiles of this query block), then its vertical
/// tokens in ascending order. Calls tile(local_kv_block) and token(local_kv_token).
template <class Tile, class Token>
__device__ void walk_row(const index_build_params& p, index_t h, index_t i, Tile tile, Token token) {
  const index_t q_block = p.query_global[i];
  index_t s = p.slash_ptr[h + 1] - 1;
  // The explicit tiles of this query block (a contiguous, key-sorted range).
  index_t e = p.tile_ptr[h], e_end = p.tile_ptr[h + 1];
  while (e < e_end && p.tile_query[e] < q_block) ++e;
  index_t e_last = e;
  while (e_last < e_end && p.tile_query[e_last] == q_block) ++e_last;
  while (true) {
    // Next slash tile of this KV rank (key block ascending = delta descending).
    index_t slash_key = -1;
    for (; s >= p.slash_ptr[h]; --s) {
      const index_t k_block = q_block - p.slash[s];
      if (k_block < 0) continue;
      if (k_block >= p.num_blocks) break;
      if (p.owner[k_block] == p.kv_rank) {
        slash_key = k_block;
        break;
      }
    }
    // Next explicit tile of this KV rank that no slash diagonal already covers.
    index_t explicit_key = -1;
    for (; e < e_last; ++e) {
      const index_t k_block = p.tile_key[e];
      if (p.owner[k_block] == p.kv_rank && !contains(p.slash + p.slash_ptr[h], p.slash + p.slash_ptr[h + 1], q_block - k_block)) {
        explicit_key = k_block;
        break;
      }
    }
    if (slash_key < 0 && explicit_key < 0) break;
    if (explicit_key < 0 || (slash_key >= 0 && slash_key < explicit_key)) {
      tile(p.local_of[slash_key]);
      --s;
    } else {
      tile(p.local_of[explicit_key]);
      ++e;
    }
  }
  for (index_t v = p.vertical_ptr[h]; v < p.vertical_ptr[h + 1]; ++v) {
    const index_t t = p.vertical[v], k_block = t / block_tokens;
    if (p.owner[k_block] != p.kv_rank) continue;
    if (p.causal && k_block >= q_block) continue;  // must precede the whole query block
    if (tile_active(p, h, q_block, k_block)) continue;
    token(p.local_of[k_block] * block_tokens + t % block_tokens);
  }
}

}  // namespace detail

/// counts[r] for row r = h * local_blocks + i: number of tiles, and of vertical tokens.
__global__ void count_index_rows(index_build_params p, index_t* tile_count, index_t* token_count) {
  const index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.heads * p.local_blocks) return;
  index_t tiles = 0, tokens = 0;
  detail::walk_row(p, r / p.local_blocks, r % p.local_blocks, [&](index_t) { ++tiles; }, [&](index_t) { ++tokens; });
  tile_count[r] = tiles;
  token_count[r] = tokens;
}

__global__ void fill_index_rows(index_build_params p, const index_t* block_ptr, index_t* block_col, const index_t* col_ptr,
                                index_t* col_token) {
  const index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.heads * p.local_blocks) return;
  index_t* tiles = block_col + block_ptr[r];
  index_t* tokens = col_token + col_ptr[r];
  detail::walk_row(p, r / p.local_blocks, r % p.local_blocks, [&](index_t k) { *tiles++ = k; }, [&](index_t t) { *tokens++ = t; });
}

/// Column c = h * local_blocks + k: the local query blocks whose tile with KV block k is active, ascending.
template <class Emit>
__device__ void walk_column(const index_build_params& p, index_t h, index_t k, Emit emit) {
  const index_t k_block = p.kv_global[k];
  // Query blocks ascending: slash deltas ascending, merged with the explicit tiles of this key block.
  index_t s = p.slash_ptr[h];
  index_t e = p.tile_ptr[h];
  while (true) {
    index_t slash_query = -1;
    for (; s < p.slash_ptr[h + 1]; ++s) {
      const index_t q_block = k_block + p.slash[s];
      if (q_block < 0) continue;
      if (q_block >= p.num_blocks) break;
      if (p.owner[q_block] == p.query_rank) {
        slash_query = q_block;
        break;
      }
    }
    index_t explicit_query = -1;
    for (; e < p.tile_ptr[h + 1]; ++e) {
      const index_t q_block = p.tile_query[e];
      if (p.tile_key[e] == k_block && p.owner[q_block] == p.query_rank &&
          !detail::contains(p.slash + p.slash_ptr[h], p.slash + p.slash_ptr[h + 1], q_block - k_block)) {
        explicit_query = q_block;
        break;
      }
    }
    if (slash_query < 0 && explicit_query < 0) break;
    if (explicit_query < 0 || (slash_query >= 0 && slash_query < explicit_query)) {
      emit(p.local_of[slash_query]);
      ++s;
    } else {
      emit(p.local_of[explicit_query]);
      ++e;
    }
  }
}

__global__ void count_index_columns(index_build_params p, index_t* counts) {
  const index_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.heads * p.local_blocks) return;
  index_t n = 0;
  walk_column(p, c / p.local_blocks, c % p.local_blocks, [&](index_t) { ++n; });
  counts[c] = n;
}

__global__ void fill_index_columns(index_build_params p, const index_t* ptr, index_t* queries) {
  const index_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.heads * p.local_blocks) return;
  index_t* out = queries + ptr[c];
  walk_column(p, c / p.local_blocks, c % p.local_blocks, [&](index_t q) { *out++ = q; });
}

/// For entry v of the flattened vertical lists (head found by the caller's `head_of`): how many local
/// query blocks use the token (0 when another rank owns it), and a 0/1 flag for "used at all".
template <class Emit>
__device__ void walk_vertical_token(const index_build_params& p, index_t h, index_t v, Emit emit) {
  const index_t t = p.vertical[v], k_block = t / block_tokens;
  if (p.owner[k_block] != p.kv_rank) return;
  for (index_t i = 0; i < p.local_blocks; ++i) {
    const index_t q_block = p.query_global[i];
    if (p.causal && k_block >= q_block) continue;
    if (detail::tile_active(p, h, q_block, k_block)) continue;
    emit(i);
  }
}

__global__ void count_vertical_tokens(index_build_params p, const index_t* head_of, index_t total, index_t* query_count, index_t* used) {
  const index_t v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= total) return;
  index_t n = 0;
  walk_vertical_token(p, head_of[v], v, [&](index_t) { ++n; });
  query_count[v] = n;
  used[v] = n > 0 ? 1 : 0;
}

/// Writes the compacted token list, its query pointers and lists; position = scan of `used`.
__global__ void fill_vertical_tokens(index_build_params p, const index_t* head_of, index_t total, const index_t* position,
                                     const index_t* query_offset, index_t* vtoken, index_t* vtoken_query_ptr, index_t* vtoken_query) {
  const index_t v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= total) return;
  if (position[v + 1] == position[v]) return;  // unused token
  const index_t t = p.vertical[v], k_block = t / block_tokens;
  vtoken[position[v]] = p.local_of[k_block] * block_tokens + t % block_tokens;
  vtoken_query_ptr[position[v]] = query_offset[v];
  index_t* out = vtoken_query + query_offset[v];
  walk_vertical_token(p, head_of[v], v, [&](index_t i) { *out++ = i; });
}

}  // namespace stria::kernel
