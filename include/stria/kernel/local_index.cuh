// SPDX-License-Identifier: Apache-2.0
// Kernels that turn a global selection into one (query rank, KV rank) step index on the GPU, the
// same arrays build_local_index makes on the host. One count kernel sizes every list, one scan (CUB)
// of all the counts makes the CSR pointers, one fill kernel writes the entries in ascending order.
// Kernels without template parameters get a dummy one (`template <int Unused = 0>`): a template's
// definition may appear in every translation unit that includes the header, a plain __global__
// function's may not (and `inline` is ignored on kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "stria/core/config.hpp"
#include "stria/core/tile.hpp"
#include "stria/kernel/search.cuh"

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
  // owned_vertical_flags, a scan and scatter_owned_vertical), and where each local block's tokens
  // start in that list.
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
  return lower_bound_in(p.slash, p.slash_ptr[h], p.slash_ptr[h + 1], delta);
}

/// Where head h's first explicit tile of a query block >= `q_block` lies in p.tile_query: a query
/// block's explicit tiles are the contiguous, key-sorted range between this and the next block's.
__device__ inline index_t first_tile_of_query(const index_build_params& p, index_t h, index_t q_block) {
  return lower_bound_in(p.tile_query, p.tile_ptr[h], p.tile_ptr[h + 1], q_block);
}

/// Whether p.tile_key[begin, end), one query block's explicit tiles (key-sorted), holds `k_block`.
__device__ inline bool key_in(const index_build_params& p, index_t begin, index_t end, index_t k_block) {
  const index_t at = lower_bound_in(p.tile_key, begin, end, k_block);
  return at < end && p.tile_key[at] == k_block;
}

__device__ inline bool explicit_tile(const index_build_params& p, index_t h, index_t q_block, index_t k_block) {
  const index_t begin = first_tile_of_query(p, h, q_block);
  const index_t end = upper_bound_in(p.tile_query, begin, p.tile_ptr[h + 1], q_block);
  return key_in(p, begin, end, k_block);
}

/// Whether head h selected the diagonal q_block - k_block = delta.
__device__ inline bool on_slash(const index_build_params& p, index_t h, index_t delta) {
  const index_t bit = delta + p.num_blocks;
  return (__ldg(p.slash_bits + static_cast<std::int64_t>(h) * p.slash_words + bit / 32) >> (bit % 32)) & 1u;
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
  index_t e = first_tile_of_query(p, h, q_block), e_last = first_tile_of_query(p, h, q_block + 1);
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

/// A warp's pass over `n` candidates, 32 at a time: candidate(k) is the value to keep for candidate
/// k, or -1 to drop it; the kept values go to out[0, kept) in candidate order, compacted by a ballot.
/// Every iteration loads a whole warp of candidates and stores the kept ones contiguously.
template <class Candidate>
__device__ void warp_compact(index_t n, Candidate candidate, index_t* out) {
  const unsigned lane = threadIdx.x % 32;
  index_t kept = 0;
  for (index_t base = 0; base < n; base += 32) {
    const index_t k = base + static_cast<index_t>(lane);
    const index_t value = k < n ? candidate(k) : -1;
    const unsigned ballot = __ballot_sync(0xffffffffu, value >= 0);
    if (value >= 0) out[kept + __popc(ballot & ((1u << lane) - 1u))] = value;
    kept += __popc(ballot);
  }
}

}  // namespace detail

/// Threads per CTA of the fused count and fill kernels. Their parts take one item per thread (a walk
/// of one row's or one column's tiles) or one per warp (a ballot compaction), in CTAs of their own.
inline constexpr unsigned index_threads = 128;
inline constexpr unsigned index_warps_per_block = index_threads / 32;

/// Number of local KV blocks whose global block precedes `q_block` (all of them for full
/// attention): the row's vertical tokens come from those blocks only.
__device__ inline index_t preceding_blocks(const index_build_params& p, index_t q_block) {
  if (!p.causal) return p.local_blocks;
  // kv_global ascends (local order keeps global order)
  return detail::lower_bound_in(p.kv_global, 0, p.local_blocks, q_block);
}

/// The row's vertical-token count: the owned tokens of the preceding blocks minus those inside the
/// row's own tiles (O(tiles), no token walk); and its tile count.
__device__ inline void count_row(const index_build_params& p, index_t r, std::int64_t* tile_count, std::int64_t* token_count) {
  const index_t h = r / p.local_blocks, i = r % p.local_blocks;
  const index_t* block_ptr = p.owned_block_ptr + static_cast<std::int64_t>(h) * (p.local_blocks + 1);
  const index_t preceding = preceding_blocks(p, p.query_global[i]);
  index_t tiles = 0, tokens = block_ptr[preceding] - block_ptr[0];
  detail::walk_row_tiles(p, h, i, [&](index_t k) {
    ++tiles;
    if (k < preceding) tokens -= block_ptr[k + 1] - block_ptr[k];
  });
  *tile_count = tiles;
  *token_count = tokens;
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

/// First local query block whose global block follows `k_block` (0 for full attention): a vertical
/// token is used by query blocks from there on, except where its tile is active.
__device__ inline index_t first_following_query(const index_build_params& p, index_t k_block) {
  if (!p.causal) return 0;
  return detail::upper_bound_in(p.query_global, 0, p.local_blocks, k_block);
}

/// How many local query blocks use vertical entry v's token (0 when another rank owns it): the
/// following query blocks minus those whose tile with the token's block is active (one per selected
/// diagonal or explicit tile that lands on this query rank).
__device__ inline index_t count_vertical_token(const index_build_params& p, index_t h, index_t v) {
  const index_t t = p.vertical[v], k_block = t / block_tokens;
  if (p.owner[k_block] != p.kv_rank) return 0;
  index_t n = p.local_blocks - first_following_query(p, k_block);
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
  return n;
}

/// The counts of one index, back to back in one 64-bit buffer so that a single scan turns them all
/// into CSR pointers: per row its tiles, its vertical tokens and (as column h * local_blocks + k)
/// its transposed tiles; per vertical entry whether the token is used, and by how many query blocks.
/// Each array is followed by one zero, so its exclusive scan ends with its total.
enum index_count : int { tile_counts, token_counts, column_counts, used_counts, query_counts, index_counts };

struct count_layout {
  std::int64_t start[index_counts + 1];  // array a: counts [start[a], start[a + 1] - 1), then the zero
  index_t* ptr[index_counts];            // array a's CSR pointers, [start[a + 1] - start[a]]
};

/// Every count of one index in one launch (three walks that used to be three kernels, so that the
/// long serial walks of rows, columns and vertical tokens overlap): CTAs [0, n) take a row each
/// thread, [n, 2n) a column, the rest a vertical entry, with n = CTAs for the rows.
template <int Unused = 0>
__global__ void __launch_bounds__(index_threads)
    count_index(index_build_params p, const index_t* head_of, index_t total, count_layout at, std::int64_t* counts) {
  const index_t rows = p.heads * p.local_blocks;
  const auto row_ctas = static_cast<unsigned>((rows + index_threads - 1) / index_threads);
  const auto item = static_cast<index_t>((blockIdx.x % row_ctas) * index_threads + threadIdx.x);
  if (blockIdx.x < row_ctas) {
    if (item < rows) count_row(p, item, counts + at.start[tile_counts] + item, counts + at.start[token_counts] + item);
  } else if (blockIdx.x < 2 * row_ctas) {
    if (item < rows) {
      index_t n = 0;
      walk_column(p, item / p.local_blocks, item % p.local_blocks, [&](index_t) { ++n; });
      counts[at.start[column_counts] + item] = n;
    }
  } else {
    const auto v = static_cast<index_t>((blockIdx.x - 2 * row_ctas) * index_threads + threadIdx.x);
    if (v < total) {
      const index_t n = count_vertical_token(p, head_of[v], v);
      counts[at.start[query_counts] + v] = n;
      counts[at.start[used_counts] + v] = n > 0 ? 1 : 0;
    }
  }
}

/// Threads per CTA of split_scanned_counts.
inline constexpr unsigned split_threads = 256;

/// Each array's CSR pointers from the one scan of all counts (`prefix`: exclusive 64-bit sums of
/// the back-to-back counts): ptr[a][x] = prefix[start[a] + x] - prefix[start[a]], and totals[a]
/// the array's entry count in 64 bits. The host checks that every total fits the 32-bit offsets
/// before any pointer is read; past 2^31 - 1 the pointers are wrapped, never used.
template <int Unused = 0>
__global__ void __launch_bounds__(split_threads) split_scanned_counts(const std::int64_t* __restrict__ prefix, count_layout at,
                                                                      unsigned long long* totals) {
  const std::int64_t end = at.start[index_counts];
  for (std::int64_t x = std::int64_t{blockIdx.x} * split_threads + threadIdx.x; x < end; x += std::int64_t{gridDim.x} * split_threads) {
    // The array that x falls in (unrolled, so that `at` stays in registers).
    int array = 0;
    std::int64_t begin = at.start[0], end_of_array = at.start[1];
    index_t* ptr = at.ptr[0];
#pragma unroll
    for (int a = 1; a < index_counts; ++a)
      if (x >= at.start[a]) {
        array = a;
        begin = at.start[a];
        end_of_array = at.start[a + 1];
        ptr = at.ptr[a];
      }
    const std::int64_t value = prefix[x] - prefix[begin];
    ptr[x - begin] = static_cast<index_t>(value);
    if (x == end_of_array - 1) totals[array] = static_cast<unsigned long long>(value);
  }
}

/// One warp per row, its vertical tokens: the owned tokens of the preceding blocks that no tile of
/// the row covers, in order. The warp walks all of the row's source tokens (its head's owned list up
/// to the preceding blocks) 32 at a time and compacts them with a ballot, so every iteration loads
/// and stores a whole warp. (Copying the runs between tiles one at a time, as before, left most
/// iterations partial, since runs average ~25 tokens at 128K, and waited on three dependent loads
/// per run.) Whether a token's block is a tile is one bitmap load for the slash diagonals and, only
/// in rows that have explicit tiles, a search among those few.
__device__ inline void fill_row_tokens(const index_build_params& p, index_t r, const index_t* col_ptr, index_t* col_token) {
  const index_t h = r / p.local_blocks, i = r % p.local_blocks, q_block = p.query_global[i];
  const index_t* owned_at = p.owned_block_ptr + static_cast<std::int64_t>(h) * (p.local_blocks + 1);  // block -> first owned token
  const index_t first = owned_at[0], sources = owned_at[preceding_blocks(p, q_block)] - first;
  const index_t tiles_begin = detail::first_tile_of_query(p, h, q_block), tiles_end = detail::first_tile_of_query(p, h, q_block + 1);
  detail::warp_compact(
      sources,
      [&](index_t k) {
        const index_t token = __ldg(p.owned_token + first + k), k_block = __ldg(p.kv_global + token / block_tokens);
        const bool covered = detail::on_slash(p, h, q_block - k_block) ||
                              (tiles_begin < tiles_end && detail::key_in(p, tiles_begin, tiles_end, k_block));
        return covered ? -1 : token;
      },
      col_token + col_ptr[r]);
}

/// One warp per vertical entry v: if its token is used, its place in the compacted token list and
/// pointers (position = scan of the used flags), and its query blocks: the following ones whose
/// tile with the token's block is not active, compacted with a ballot. A head's explicit tiles are
/// searched only if one of them has this key block (the warp looks once), so a Vertical-Slash
/// selection's test per candidate is a coalesced load of its global block and one bitmap load.
__device__ inline void fill_vertical_token(const index_build_params& p, index_t h, index_t v, const index_t* position,
                                           const index_t* query_offset, index_t* vtoken, index_t* vtoken_query_ptr,
                                           index_t* vtoken_query) {
  const index_t at = position[v];
  if (position[v + 1] == at) return;  // unused token (uniform across the warp)
  const unsigned lane = threadIdx.x % 32;
  const index_t t = p.vertical[v], k_block = t / block_tokens;
  if (lane == 0) {
    vtoken[at] = p.local_of[k_block] * block_tokens + t % block_tokens;
    vtoken_query_ptr[at] = query_offset[v];
  }
  bool explicit_key = false;
  for (index_t e = p.tile_ptr[h] + static_cast<index_t>(lane); e < p.tile_ptr[h + 1]; e += 32) explicit_key |= p.tile_key[e] == k_block;
  explicit_key = __any_sync(0xffffffffu, explicit_key);
  const index_t first = first_following_query(p, k_block);
  detail::warp_compact(
      p.local_blocks - first,
      [&](index_t c) {
        const index_t q_block = __ldg(p.query_global + first + c);
        const bool active = detail::on_slash(p, h, q_block - k_block) || (explicit_key && detail::explicit_tile(p, h, q_block, k_block));
        return active ? -1 : first + c;
      },
      vtoken_query + query_offset[v]);
}

/// What the fill kernel writes, with the pointers the scan made and the totals the host read.
struct index_fill_arrays {
  const index_t *block_ptr, *col_ptr, *kv_query_ptr;
  const index_t *position, *query_offset;  // per vertical entry: place among used tokens, first query entry
  index_t *block_col, *col_token, *kv_query;
  index_t *vtoken_head_ptr, *vtoken, *vtoken_query_ptr, *vtoken_query;
  const index_t* head_of;  // [total] the head of each vertical entry
  index_t total, used_tokens, used_queries;
};

/// Every entry array of one index in one launch. CTAs, in order: a row's tiles per thread, a
/// column's query blocks per thread (the serial walks, first, so that they start early and run
/// under the rest), a row's vertical tokens per warp, a vertical entry's query blocks per warp.
/// The writes of the last two (every row's tokens and every token's query blocks, ~270 MB each at
/// 128K) bound the kernel; none of the parts reads what another writes, so they run side by side.
template <int Unused = 0>
__global__ void __launch_bounds__(index_threads) fill_index(index_build_params p, index_fill_arrays a) {
  const index_t rows = p.heads * p.local_blocks;
  const auto row_ctas = static_cast<unsigned>((rows + index_threads - 1) / index_threads);
  const auto row_warp_ctas = static_cast<unsigned>((rows + index_warps_per_block - 1) / index_warps_per_block);
  const auto thread_item = static_cast<index_t>((blockIdx.x % row_ctas) * index_threads + threadIdx.x);
  if (blockIdx.x < row_ctas) {
    if (thread_item < rows) {
      index_t* out = a.block_col + a.block_ptr[thread_item];
      detail::walk_row_tiles(p, thread_item / p.local_blocks, thread_item % p.local_blocks, [&](index_t k) { *out++ = k; });
    }
    // The per-head token pointers, and the end of the token query pointers (the host's total).
    if (blockIdx.x == 0) {
      for (index_t h = static_cast<index_t>(threadIdx.x); h <= p.heads; h += index_threads) a.vtoken_head_ptr[h] = a.position[p.vertical_ptr[h]];
      if (threadIdx.x == 0) a.vtoken_query_ptr[a.used_tokens] = a.used_queries;
    }
  } else if (blockIdx.x < 2 * row_ctas) {
    if (thread_item < rows) {
      index_t* out = a.kv_query + a.kv_query_ptr[thread_item];
      walk_column(p, thread_item / p.local_blocks, thread_item % p.local_blocks, [&](index_t q) { *out++ = q; });
    }
  } else {
    const unsigned warp_cta = blockIdx.x - 2 * row_ctas;
    const auto warp = static_cast<index_t>((warp_cta % row_warp_ctas) * index_warps_per_block + threadIdx.x / 32);
    if (warp_cta < row_warp_ctas) {
      if (warp < rows) fill_row_tokens(p, warp, a.col_ptr, a.col_token);
    } else {
      const auto v = static_cast<index_t>((warp_cta - row_warp_ctas) * index_warps_per_block + threadIdx.x / 32);
      if (v < a.total)
        fill_vertical_token(p, a.head_of[v], v, a.position, a.query_offset, a.vtoken, a.vtoken_query_ptr, a.vtoken_query);
    }
  }
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
  owned_block_ptr[x] = detail::lower_bound_in(p.owned_token, position[p.vertical_ptr[h]], position[p.vertical_ptr[h + 1]], b * block_tokens);
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

}  // namespace stria::kernel
