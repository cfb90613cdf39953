// SPDX-License-Identifier: Apache-2.0
// Kernels that turn a global selection into one (query rank, KV rank) step index on the GPU, the
// same arrays build_local_index makes on the host. Count passes size each list, a scan (CUB) turns
// counts into CSR pointers, fill passes write the entries already in ascending order.
// Kernels without template parameters get a dummy one (`template <int Unused = 0>`): a template's
// definition may appear in every translation unit that includes the header, a plain __global__
// function's may not (and `inline` is ignored on kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cub/block/block_reduce.cuh>

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
  // The vertical tokens this KV rank owns, per head, as local tokens in ascending order (built by
  // filter_vertical_tokens), and where each local block's tokens start in that list.
  const index_t* owned_token;      // [<= total vertical entries]
  const index_t* owned_block_ptr;  // [heads, local_blocks + 1], absolute positions in owned_token
  // Each head's slash deltas as a bitmap (bit delta + num_blocks of the head's slash_words words,
  // built once per batch by mark_slash_bits): "is this tile on a selected diagonal" is one load.
  const std::uint32_t* slash_bits;  // [heads, slash_words]
  index_t slash_words;
};

/// Words of one head's slash bitmap: deltas lie in [-num_blocks, num_blocks].
constexpr index_t slash_bitmap_words(index_t num_blocks) { return (2 * num_blocks + 1 + 31) / 32; }

namespace detail {

/// Where head h's first slash delta >= `delta` lies in p.slash (p.slash_ptr[h + 1] if none does).
__device__ inline index_t first_slash_from(const index_build_params& p, index_t h, index_t delta) {
  index_t lo = p.slash_ptr[h], hi = p.slash_ptr[h + 1];
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    if (p.slash[mid] < delta) lo = mid + 1;
    else hi = mid;
  }
  return lo;
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

/// Whether head h selected the diagonal q_block - k_block = delta.
__device__ inline bool on_slash(const index_build_params& p, index_t h, index_t delta) {
  const index_t bit = delta + p.num_blocks;
  return (p.slash_bits[static_cast<std::int64_t>(h) * p.slash_words + bit / 32] >> (bit % 32)) & 1u;
}

__device__ inline bool tile_active(const index_build_params& p, index_t h, index_t q_block, index_t k_block) {
  return on_slash(p, h, q_block - k_block) || explicit_tile(p, h, q_block, k_block);
}

/// Walks the tiles of row (h, local query block i) in ascending local KV block (slash diagonals from
/// the largest delta down, merged with the explicit tiles of this query block): tile(local_kv_block).
/// Only the diagonals that cross the KV rank's span of global blocks [kv_global[0], kv_global[last]]
/// are visited (local order keeps global order): for a sequential layout, only the rank's own.
template <class Tile>
__device__ void walk_row_tiles(const index_build_params& p, index_t h, index_t i, Tile tile) {
  const index_t q_block = p.query_global[i], k_last = p.kv_global[p.local_blocks - 1];
  // The last delta <= q_block - kv_global[0] (its key block is the first >= the span's start).
  index_t s = first_slash_from(p, h, q_block - p.kv_global[0] + 1) - 1;
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
      if (k_block > k_last) break;
      if (p.owner[k_block] == p.kv_rank) {
        slash_key = k_block;
        break;
      }
    }
    // Next explicit tile of this KV rank that no slash diagonal already covers.
    index_t explicit_key = -1;
    for (; e < e_last; ++e) {
      const index_t k_block = p.tile_key[e];
      if (p.owner[k_block] == p.kv_rank && !on_slash(p, h, q_block - k_block)) {
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
}

/// A warp's pass over a list of `n` candidates, 32 at a time: keep(k) decides candidate k;
/// emit(k, position) receives the kept ones in order. Returns the number kept (on every lane).
template <class Keep, class Emit>
__device__ index_t warp_compact(index_t n, Keep keep, Emit emit) {
  const unsigned lane = threadIdx.x % 32;
  index_t kept = 0;
  for (index_t base = 0; base < n; base += 32) {
    const index_t k = base + static_cast<index_t>(lane);
    const bool mine = k < n && keep(k);
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (mine) emit(k, kept + __popc(ballot & ((1u << lane) - 1u)));
    kept += __popc(ballot);
  }
  return kept;
}

}  // namespace detail

inline constexpr unsigned index_warps_per_block = 4;  // the warp-per-item kernels run 128-thread blocks

/// Number of local KV blocks whose global block precedes `q_block` (all of them for full
/// attention): the row's vertical tokens come from those blocks only.
__device__ inline index_t preceding_blocks(const index_build_params& p, index_t q_block) {
  if (!p.causal) return p.local_blocks;
  index_t lo = 0, hi = p.local_blocks;  // kv_global ascends (local order keeps global order)
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    if (p.kv_global[mid] < q_block) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/// One thread per row r = h * local_blocks + i: its tiles, and its vertical tokens = the owned tokens
/// of the preceding blocks minus those inside the row's own tiles (O(tiles), no token walk).
template <int Unused = 0>
__global__ void count_index_rows(index_build_params p, index_t* tile_count, index_t* token_count) {
  const index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.heads * p.local_blocks) return;
  const index_t h = r / p.local_blocks, i = r % p.local_blocks;
  const index_t* block_ptr = p.owned_block_ptr + static_cast<std::int64_t>(h) * (p.local_blocks + 1);
  const index_t preceding = preceding_blocks(p, p.query_global[i]);
  index_t tiles = 0, tokens = block_ptr[preceding] - block_ptr[0];
  detail::walk_row_tiles(p, h, i, [&](index_t k) {
    ++tiles;
    if (k < preceding) tokens -= block_ptr[k + 1] - block_ptr[k];
  });
  tile_count[r] = tiles;
  token_count[r] = tokens;
}

/// One thread per row: its tiles.
template <int Unused = 0>
__global__ void fill_row_tiles(index_build_params p, const index_t* block_ptr, index_t* block_col) {
  const index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.heads * p.local_blocks) return;
  index_t* out = block_col + block_ptr[r];
  detail::walk_row_tiles(p, r / p.local_blocks, r % p.local_blocks, [&](index_t k) { *out++ = k; });
}

/// One warp per row, after fill_row_tiles: copies the owned tokens of the preceding blocks that no
/// tile of the row covers. They are runs of the head's owned list (its tokens are grouped by block,
/// in order), between the row's tiles: the warp copies each run, 32 tokens at a time.
template <int Unused = 0>
__global__ void fill_row_tokens(index_build_params p, const index_t* block_ptr, const index_t* block_col, const index_t* col_ptr,
                                index_t* col_token) {
  const index_t r = static_cast<index_t>((blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = static_cast<index_t>(threadIdx.x % 32);
  if (r >= p.heads * p.local_blocks) return;
  const index_t h = r / p.local_blocks, i = r % p.local_blocks;
  const index_t* tiles = block_col + block_ptr[r];
  const index_t tile_count = block_ptr[r + 1] - block_ptr[r];
  const index_t* owned_at = p.owned_block_ptr + static_cast<std::int64_t>(h) * (p.local_blocks + 1);  // block -> first owned token
  const index_t preceding = preceding_blocks(p, p.query_global[i]);
  index_t* out = col_token + col_ptr[r];
  index_t from = 0;  // the next run starts at this local block
  for (index_t t = 0; t <= tile_count && from < preceding; ++t) {
    const index_t stop = t < tile_count ? min(tiles[t], preceding) : preceding;  // the run: blocks [from, stop)
    const index_t first = owned_at[from], last = owned_at[max(from, stop)];
    for (index_t k = first + lane; k < last; k += 32) out[k - first] = p.owned_token[k];
    out += last - first;
    if (t < tile_count) from = max(from, tiles[t] + 1);
  }
}

/// Column c = h * local_blocks + k: the local query blocks whose tile with KV block k is active,
/// ascending. Only the diagonals that cross the query rank's span of global blocks are visited.
template <class Emit>
__device__ void walk_column(const index_build_params& p, index_t h, index_t k, Emit emit) {
  const index_t k_block = p.kv_global[k], q_last = p.query_global[p.local_blocks - 1];
  // Query blocks ascending: slash deltas ascending, merged with the explicit tiles of this key block.
  index_t s = detail::first_slash_from(p, h, p.query_global[0] - k_block);
  index_t e = p.tile_ptr[h];
  while (true) {
    index_t slash_query = -1;
    for (; s < p.slash_ptr[h + 1]; ++s) {
      const index_t q_block = k_block + p.slash[s];
      if (q_block > q_last) break;
      if (p.owner[q_block] == p.query_rank) {
        slash_query = q_block;
        break;
      }
    }
    index_t explicit_query = -1;
    for (; e < p.tile_ptr[h + 1]; ++e) {
      const index_t q_block = p.tile_query[e];
      if (p.tile_key[e] == k_block && p.owner[q_block] == p.query_rank && !detail::on_slash(p, h, q_block - k_block)) {
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

template <int Unused = 0>
__global__ void count_index_columns(index_build_params p, index_t* counts) {
  const index_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.heads * p.local_blocks) return;
  index_t n = 0;
  walk_column(p, c / p.local_blocks, c % p.local_blocks, [&](index_t) { ++n; });
  counts[c] = n;
}

template <int Unused = 0>
__global__ void fill_index_columns(index_build_params p, const index_t* ptr, index_t* queries) {
  const index_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.heads * p.local_blocks) return;
  index_t* out = queries + ptr[c];
  walk_column(p, c / p.local_blocks, c % p.local_blocks, [&](index_t q) { *out++ = q; });
}

/// First local query block whose global block follows `k_block` (0 for full attention): a vertical
/// token is used by query blocks from there on, except where its tile is active.
__device__ inline index_t first_following_query(const index_build_params& p, index_t k_block) {
  if (!p.causal) return 0;
  index_t lo = 0, hi = p.local_blocks;
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    if (p.query_global[mid] <= k_block) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/// One thread per entry v of the flattened vertical lists: how many local query blocks use the token
/// (0 when another rank owns it) = the following query blocks minus those whose tile with the token's
/// block is active (one per selected diagonal or explicit tile that lands on this query rank).
template <int Unused = 0>
__global__ void count_vertical_tokens(index_build_params p, const index_t* head_of, index_t total, index_t* query_count, index_t* used) {
  const index_t v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= total) return;
  const index_t h = head_of[v], t = p.vertical[v], k_block = t / block_tokens;
  index_t n = 0;
  if (p.owner[k_block] == p.kv_rank) {
    n = p.local_blocks - first_following_query(p, k_block);
    // The diagonals that cross the query rank's span of global blocks.
    const index_t q_last = p.query_global[p.local_blocks - 1];
    for (index_t s = detail::first_slash_from(p, h, p.query_global[0] - k_block); s < p.slash_ptr[h + 1]; ++s) {
      const index_t q_block = k_block + p.slash[s];
      if (q_block > q_last) break;
      if (p.causal && q_block <= k_block) continue;
      if (p.owner[q_block] == p.query_rank) --n;
    }
    for (index_t e = p.tile_ptr[h]; e < p.tile_ptr[h + 1]; ++e) {
      const index_t q_block = p.tile_query[e];
      if (p.tile_key[e] != k_block || p.owner[q_block] != p.query_rank || (p.causal && q_block <= k_block)) continue;
      if (!detail::on_slash(p, h, q_block - k_block)) --n;
    }
  }
  query_count[v] = n;
  used[v] = n > 0 ? 1 : 0;
}

/// Writes the compacted token list, its query pointers and lists; position = scan of `used`.
template <int Unused = 0>
__global__ void fill_vertical_tokens(index_build_params p, const index_t* head_of, index_t total, const index_t* position,
                                     const index_t* query_offset, index_t* vtoken, index_t* vtoken_query_ptr, index_t* vtoken_query) {
  const index_t v = static_cast<index_t>((blockIdx.x * blockDim.x + threadIdx.x) / 32);
  if (v >= total) return;
  if (position[v + 1] == position[v]) return;  // unused token (uniform across the warp)
  const index_t h = head_of[v], t = p.vertical[v];
  if (threadIdx.x % 32 == 0) {
    vtoken[position[v]] = p.local_of[t / block_tokens] * block_tokens + t % block_tokens;
    vtoken_query_ptr[position[v]] = query_offset[v];
  }
  index_t* out = vtoken_query + query_offset[v];
  const index_t first = first_following_query(p, t / block_tokens);
  detail::warp_compact(
      p.local_blocks - first, [&](index_t i) { return !detail::tile_active(p, h, p.query_global[first + i], t / block_tokens); },
      [&](index_t i, index_t at) { out[at] = first + i; });
}

/// flag[v] = 1 when this KV rank owns vertical entry v's token.
template <int Unused = 0>
__global__ void owned_vertical_flags(index_build_params p, index_t total, index_t* flag) {
  const index_t v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v < total) flag[v] = p.owner[p.vertical[v] / block_tokens] == p.kv_rank ? 1 : 0;
}

/// Compacts the owned entries (position = scan of the flags) into local tokens, per head in order.
template <int Unused = 0>
__global__ void scatter_owned_vertical(index_build_params p, index_t total, const index_t* position, index_t* owned_token) {
  const index_t v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= total || position[v + 1] == position[v]) return;
  const index_t t = p.vertical[v];
  owned_token[position[v]] = p.local_of[t / block_tokens] * block_tokens + t % block_tokens;
}

/// owned_block_ptr[h, b]: where local block b's tokens start in head h's owned list (one thread per
/// (head, b) with b in [0, local_blocks]; a binary search in the head's ascending owned tokens).
template <int Unused = 0>
__global__ void owned_block_offsets(index_build_params p, const index_t* position, index_t* owned_block_ptr) {
  const index_t x = blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= p.heads * (p.local_blocks + 1)) return;
  const index_t h = x / (p.local_blocks + 1), b = x % (p.local_blocks + 1);
  index_t lo = position[p.vertical_ptr[h]], hi = position[p.vertical_ptr[h + 1]];
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    if (p.owned_token[mid] < b * block_tokens) lo = mid + 1;
    else hi = mid;
  }
  owned_block_ptr[x] = lo;
}

/// One CTA per head: sets bit (delta + num_blocks) of the head's slash bitmap (zeroed before) for
/// each of its slash deltas.
template <int Unused = 0>
__global__ void mark_slash_bits(const index_t* slash_ptr, const index_t* slash, index_t num_blocks, index_t words, std::uint32_t* bits) {
  const index_t h = blockIdx.x;
  for (index_t s = slash_ptr[h] + static_cast<index_t>(threadIdx.x); s < slash_ptr[h + 1]; s += static_cast<index_t>(blockDim.x)) {
    const index_t bit = slash[s] + num_blocks;
    atomicOr(bits + static_cast<std::int64_t>(h) * words + bit / 32, 1u << (bit % 32));
  }
}

/// Threads per CTA of sum_counts.
inline constexpr int sum_counts_threads = 256;

/// *total += counts[0] + ... + counts[n - 1] (counts are >= 0) in 64 bits. The builder's scans of
/// these counts are 32-bit: this sum is what says whether their total, the entry count of one
/// array of the index, fits.
template <int Unused = 0>
__global__ void __launch_bounds__(sum_counts_threads) sum_counts(const index_t* __restrict__ counts, std::int64_t n, unsigned long long* total) {
  using block_reduce = cub::BlockReduce<unsigned long long, sum_counts_threads>;
  __shared__ typename block_reduce::TempStorage temp;
  unsigned long long mine = 0;
  for (std::int64_t i = std::int64_t{blockIdx.x} * sum_counts_threads + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * sum_counts_threads)
    mine += static_cast<unsigned long long>(counts[i]);
  const unsigned long long block = block_reduce(temp).Sum(mine);
  if (threadIdx.x == 0 && block != 0) atomicAdd(total, block);
}

/// vtoken_head_ptr[h] = position[vertical_ptr[h]] for h in [0, heads]; and the last query pointer.
template <int Unused = 0>
__global__ void finish_vertical_pointers(const index_t* vertical_ptr, const index_t* position, index_t heads, index_t* vtoken_head_ptr,
                                         const index_t* query_offset_total, index_t used_tokens, index_t* vtoken_query_ptr) {
  const index_t h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h <= heads) vtoken_head_ptr[h] = position[vertical_ptr[h]];
  if (h == 0) vtoken_query_ptr[used_tokens] = *query_offset_total;
}

}  // namespace stria::kernel
