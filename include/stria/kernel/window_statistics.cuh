// SPDX-License-Identifier: Apache-2.0
// Kernels of the estimator's window statistics (DESIGN 7): the observation window (<= 64 query rows
// at the end of the sequence) against one rank's keys. A CTA of 4 warps holds one query head's
// window in registers (warp w: rows 16w .. 16w + 15, as the attention kernels hold Q) and walks a
// chunk of consecutive key blocks through a ring of cp.async stages, scoring each 64-key tile with
// the attention kernels' mma.sync product. Scores are kept in the log2 domain (scale * log2(e)) so
// exp2 serves. Small kernels around the collectives pack a rank's share and combine every rank's
// (as engine::combine_shares does on the host). Kernels without template parameters get a dummy
// one (`template <int Unused = 0>`): a template's definition may appear in every translation unit
// that includes the header, a plain __global__ function's may not (and `inline` is ignored on
// kernels).
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/std/bit>

#include <cstdint>
#include <type_traits>

#include "stria/core/config.hpp"
#include "stria/core/softmax_merge.hpp"
#include "stria/core/numeric.cuh"
#include "stria/core/tile.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/kernel/attention_tile.cuh"
#include "stria/kernel/mma.cuh"
#include "stria/kernel/search.cuh"

namespace stria::kernel {

inline constexpr int window_threads = attention_threads;
inline constexpr int window_max_rows = block_tokens;
/// Key tiles in flight per CTA; the window's query tile goes through the last stage first.
inline constexpr int window_stages = 3;

/// Dynamic shared memory of the window kernels: the ring of key tiles (padded rows, as the
/// mma.sync attention kernels').
template <class T, int D>
constexpr std::size_t window_shared_bytes() {
  return window_stages * sizeof(T) * shared_tile<D>::elements;
}

/// What both window passes read: the window and this rank's keys, bf16 or fp16.
template <class T>
struct window_params {
  const T* window_q;                // [rows, Hq, D]
  const T* k;                       // [S_local, Hkv, D]
  const index_t* key_global_block;  // [local_blocks]
  index_t rows, heads_q, heads_kv, local_blocks;
  index_t chunk_blocks;  // key blocks per CTA: its window rows are loaded once for them, pass 1 writes one partial per row
  index_t first_row;     // global token of window row 0
  float scale_log2;   // softmax scale * log2(e)
  bool causal;
};

namespace detail {

__device__ inline float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ inline float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

/// The walk both passes share. This CTA (query head blockIdx.x, chunk blockIdx.y of
/// p.chunk_blocks key blocks) scores its window rows against each key block of the chunk in
/// order and calls on_tile(s, local_block) with this warp's 16 x 64 scores (the mma accumulator
/// layout, log2 domain), -inf where the key lies causally after the row or the row is past the
/// window. Heads vary fastest over the grid, so the heads that read a chunk's keys run together and
/// find them in L2.
template <class T, int D, class OnTile>
__device__ void for_each_window_tile(const window_params<T>& p, OnTile&& on_tile) {
  static_assert(sizeof(T) == 2, "the window kernels score on 16-bit tensor cores");
  extern __shared__ __align__(16) unsigned char window_ring[];
  using layout = padded_tile<T, D>;
  constexpr int tile = shared_tile<D>::elements;
  T* const ring = reinterpret_cast<T*>(window_ring);
  const index_t h = blockIdx.x, hk = h / (p.heads_q / p.heads_kv);
  const index_t first = static_cast<index_t>(blockIdx.y) * p.chunk_blocks;
  const index_t count = min(p.chunk_blocks, p.local_blocks - first);
  const std::int64_t stride = std::int64_t{p.heads_kv} * D;
  auto load_keys = [&](index_t i) {
    load_strided_rows_async<layout, T, D>(ring + (i % window_stages) * tile, p.k + (std::int64_t{first + i} * block_tokens) * stride + hk * D,
                                          stride);
  };
  // Prologue: the window (rows past p.rows zero) into the last stage with key tile 0, then tiles
  // 1 .. stages - 2: one copy group each.
  load_strided_rows_async<layout, T, D>(ring + (window_stages - 1) * tile, p.window_q + std::int64_t{h} * D, std::int64_t{p.heads_q} * D, p.rows);
#pragma unroll
  for (int i = 0; i < window_stages - 1; ++i) {
    if (i < count) load_keys(i);
    cp_async_commit();
  }
  cp_async_wait<window_stages - 2>();
  __syncthreads();
  unsigned qf[D / 16][4];
  load_row_fragments<T, D>(qf, ring + (window_stages - 1) * tile);

  const int warp_row0 = 16 * static_cast<int>(threadIdx.x / 32);
  index_t key_block = count > 0 ? p.key_global_block[first] : 0;
  for (index_t i = 0; i < count; ++i) {
    // Groups committed: 2 + i, one per tile; tile i's has landed once at most stages - 2 are pending.
    // The barrier also ends every warp's reads of the stage tile i + stages - 1 goes to (tile i - 1's,
    // or the window's).
    cp_async_wait<window_stages - 2>();
    __syncthreads();
    if (i + window_stages - 1 < count) load_keys(i + window_stages - 1);
    cp_async_commit();
    const index_t next_block = i + 1 < count ? p.key_global_block[first + i + 1] : 0;  // read under the product
    float s[8][4] = {};
    product_abt<T, D>(s, qf, ring + (i % window_stages) * tile);
    const index_t key_token = key_block * block_tokens;
    const bool mask = p.rows < window_max_rows || (p.causal && key_token + block_tokens - 1 > p.first_row);  // CTA-uniform
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = warp_row0 + fragment_row(e);
        const bool out = mask && (r >= p.rows || (p.causal && key_token + fragment_col(j, e) > p.first_row + r));
        s[j][e] = out ? -INFINITY : s[j][e] * p.scale_log2;
      }
    on_tile(s, first + i);
    key_block = next_block;
  }
}

}  // namespace detail

/// Pass 1: per (head, chunk, window row) the max score over the chunk's keys and the sum of exp2
/// of the scores against it (the online softmax's running pair, FlashAttention-2's).
///   partial_max, partial_sum [Hq, chunks, rows]. Grid: (Hq, chunks), window_threads.
template <class T, int D>
__global__ void __launch_bounds__(window_threads) window_partials(window_params<T> p, float* __restrict__ partial_max, float* __restrict__ partial_sum) {
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // rows g and g + 8 of the warp; this lane's share of the sum
  detail::for_each_window_tile<T, D>(p, [&](const float (&s)[8][4], index_t) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, fmaxf(s[j][2 * half], s[j][2 * half + 1]));
      const float next = fmaxf(row_max[half], detail::quad_max(m));
      if (next == -INFINITY) continue;  // every key so far masked: nothing to add
      row_sum[half] *= detail::exp2_ftz(row_max[half] - next);
#pragma unroll
      for (int j = 0; j < 8; ++j) row_sum[half] += detail::exp2_ftz(s[j][2 * half] - next) + detail::exp2_ftz(s[j][2 * half + 1] - next);
      row_max[half] = next;
    }
  });
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float sum = detail::quad_sum(row_sum[half]);
    const int r = 16 * static_cast<int>(threadIdx.x / 32) + detail::fragment_row(2 * half);
    if (lane % 4 == 0 && r < p.rows) {
      const std::int64_t at = (std::int64_t{blockIdx.x} * gridDim.y + blockIdx.y) * p.rows + r;
      partial_max[at] = row_max[half];
      partial_sum[at] = sum;
    }
  }
}

/// Combines pass 1's partials into this rank's (max, sum) per (head, row): one CTA of 256 threads
/// per (head, row), each thread folding a strided share of the row's `parts` partials.
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    combine_row_partials(const float* __restrict__ partial_max, const float* __restrict__ partial_sum, index_t parts, index_t rows,
                         float* __restrict__ row_max, float* __restrict__ row_sum) {
  const index_t h = blockIdx.x / rows, r = blockIdx.x % rows;
  float m = -INFINITY, sum = 0.0f;
  for (index_t b = threadIdx.x; b < parts; b += blockDim.x) {
    const std::int64_t at = (static_cast<std::int64_t>(h) * parts + b) * rows + r;
    const float tm = partial_max[at];
    if (tm == -INFINITY) continue;
    if (tm > m) {
      sum = sum * exp2f(m - tm) + partial_sum[at];
      m = tm;
    } else {
      sum += partial_sum[at] * exp2f(tm - m);
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

/// Every rank's normaliser, [world, 2, count] (each rank's row maxes, then its sums of exp2 against
/// them), into the global ones: combine_normaliser_row (core/softmax_merge.hpp) per row.
/// Grid: ceil(count / 256), 256 threads.
template <int Unused = 0>
__global__ void __launch_bounds__(256) combine_normalisers(const float* __restrict__ every_rank, index_t world, index_t count,
                                                           float* __restrict__ max, float* __restrict__ sum) {
  const index_t i = static_cast<index_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= count) return;
  const row_normaliser row = combine_normaliser_row<true>(every_rank, world, count, i);
  max[i] = row.max;
  sum[i] = row.sum;
}

/// Pass 2, with the global (max, sum) of every row [Hq, rows]: the window probabilities, summed per
/// key token (vertical mass; -1 for tokens of global blocks >= first_local_block, which are never
/// vertical candidates) and per key block (the mass of the block diagonal it lies on). The sums run
/// in a fixed order (rows within a warp by shuffles, then the 4 warps in turn), so a rank's
/// statistics do not change from run to run on one device (the chunk size follows the SM count).
///   vertical [Hq, S_local]   tile_mass [Hq, local_blocks]. Grid: (Hq, chunks), window_threads.
template <class T, int D>
__global__ void __launch_bounds__(window_threads)
    window_probabilities(window_params<T> p, const float* __restrict__ global_max, const float* __restrict__ global_sum,
                         index_t first_local_block, float* __restrict__ vertical, float* __restrict__ tile_mass) {
  constexpr int warps = window_threads / 32;
  __shared__ float column_part[warps][block_tokens];  // each warp's column sums over its 16 rows
  __shared__ float warp_mass[warps];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const index_t h = blockIdx.x;
  float row_max[2], inverse[2];  // rows g and g + 8 of the warp; inverse 0 for rows past the window or empty
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 16 * warp + detail::fragment_row(2 * half);
    const float z = r < p.rows ? global_sum[h * p.rows + r] : 0.0f;
    row_max[half] = z > 0.0f ? global_max[h * p.rows + r] : 0.0f;
    inverse[half] = z > 0.0f ? 1.0f / z : 0.0f;
  }
  detail::for_each_window_tile<T, D>(p, [&](const float (&s)[8][4], index_t local_block) {
    float column[8][2];  // this lane's two rows added, per column it holds
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        column[j][c] = detail::exp2_ftz(s[j][c] - row_max[0]) * inverse[0] + detail::exp2_ftz(s[j][2 + c] - row_max[1]) * inverse[1];
    // Summed over the warp's 8 row groups (lanes 4 apart): lanes 0-3 then hold its column sums.
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2) column[j][c] += __shfl_xor_sync(0xffffffffu, column[j][c], offset);
    float total = 0.0f;
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          column_part[warp][detail::fragment_col(j, c)] = column[j][c];
          total += column[j][c];
        }
    }
    total = detail::quad_sum(total);
    if (lane == 0) warp_mass[warp] = total;
    __syncthreads();
    if (threadIdx.x < block_tokens) {
      float sum = column_part[0][threadIdx.x];
#pragma unroll
      for (int w = 1; w < warps; ++w) sum += column_part[w][threadIdx.x];
      const bool local = p.key_global_block[local_block] >= first_local_block;
      vertical[std::int64_t{h} * p.local_blocks * block_tokens + std::int64_t{local_block} * block_tokens + threadIdx.x] = local ? -1.0f : sum;
    }
    if (threadIdx.x == 0) tile_mass[std::int64_t{h} * p.local_blocks + local_block] = warp_mass[0] + warp_mass[1] + warp_mass[2] + warp_mass[3];
    // The next tile writes column_part and warp_mass only after for_each_window_tile's barrier.
  });
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

/// Threads and items per thread of candidate_top_k: it keeps up to 8192 candidates per head (the
/// top-p estimator's largest vertical cap); wider requests take the device-wide sort instead.
inline constexpr int top_k_threads = 512;
inline constexpr int top_k_items = 16;
inline constexpr index_t top_k_capacity = top_k_threads * top_k_items;

namespace detail {
using top_k_sort = cub::BlockRadixSort<std::uint64_t, top_k_threads, top_k_items>;
/// Bits of the 32-bit key that radix-select pass 0, 1, 2 decides, high to low.
STRIA_HOST_DEVICE constexpr int top_k_digit_bits(int pass) { return pass == 0 ? 12 : 10; }
}  // namespace detail

/// Dynamic shared memory of candidate_top_k: the block sort's storage, which also holds the
/// histograms of the radix select and the kept candidates before they are loaded for the sort.
constexpr std::size_t top_k_shared_bytes() {
  const std::size_t kept = sizeof(std::uint64_t) * top_k_capacity, histogram = sizeof(index_t) << detail::top_k_digit_bits(0);
  const std::size_t sort = sizeof(detail::top_k_sort::TempStorage);
  return sort > kept ? (sort > histogram ? sort : histogram) : (kept > histogram ? kept : histogram);
}

/// Each head's first `k` (<= top_k_capacity) candidates in the order of the device-wide sort they
/// replace: mass descending (descending_bits ascending), ties by ascending local token. One CTA per
/// head. A radix select over the 32-bit keys finds the k-th key K (three histogram passes over the
/// head's masses, which pass 2 just wrote and L2 still holds); the keys below K and as many of the
/// keys equal to K as are needed, the first by token, are kept as (key << 32 | token) and sorted in
/// shared memory. Only when K is tied beyond what is needed does the order of the ties matter: then
/// one warp takes them in token order. local_tokens is a multiple of 64, so the lanes of a warp run
/// the same iterations of the strided loops (their ballots need every lane).
///   vertical [Hq, S_local]   sorted_keys [Hq, k] (the descending bits), sorted_tokens [Hq, k] (global)
template <int Unused = 0>
__global__ void __launch_bounds__(top_k_threads)
    candidate_top_k(const float* __restrict__ vertical, const index_t* __restrict__ key_global_block, index_t local_tokens, index_t k,
                    std::uint64_t* __restrict__ sorted_keys, index_t* __restrict__ sorted_tokens) {
  // A kept candidate is (key << token_bits) | local token: the sort orders by key, then token.
  const int token_bits = 32 - __clz(static_cast<unsigned>(local_tokens - 1) | 1u);
  const std::uint64_t token_mask = (std::uint64_t{1} << token_bits) - 1;
  extern __shared__ __align__(16) unsigned char top_k_shared[];
  auto* histogram = reinterpret_cast<index_t*>(top_k_shared);
  auto* kept = reinterpret_cast<std::uint64_t*>(top_k_shared);
  auto& sort_storage = *reinterpret_cast<typename detail::top_k_sort::TempStorage*>(top_k_shared);
  using scan = cub::BlockScan<index_t, top_k_threads>;
  __shared__ typename scan::TempStorage scan_storage;
  __shared__ std::uint32_t prefix;
  __shared__ index_t still_needed, ties, count;
  const std::int64_t h = blockIdx.x;
  const float* mass = vertical + h * local_tokens;
  auto key_of = [&](index_t j) { return descending_bits(mass[j]); };

  // Radix select: after pass d, `prefix` holds the high bits of K decided so far, and
  // `still_needed` how many keys with those high bits belong to the first k.
  if (threadIdx.x == 0) {
    prefix = 0;
    still_needed = k;
  }
  int shift = 32;
  std::uint32_t decided = 0;  // mask of the bits `prefix` holds
#pragma unroll
  for (int pass = 0; pass < 3; ++pass) {
    const int bits = detail::top_k_digit_bits(pass), bins = 1 << bits, per_thread = bins / top_k_threads;
    shift -= bits;
    for (int b = threadIdx.x; b < bins; b += top_k_threads) histogram[b] = 0;
    __syncthreads();
    for (index_t j = threadIdx.x; j < local_tokens; j += top_k_threads)
      if (const std::uint32_t key = key_of(j); (key & decided) == prefix) atomicAdd(&histogram[(key >> shift) & (bins - 1)], 1);
    __syncthreads();
    // The first bin where the running count reaches still_needed: bins in blocked order over threads.
    index_t mine = 0;
    for (int i = 0; i < per_thread; ++i) mine += histogram[threadIdx.x * per_thread + i];
    const index_t needed = still_needed;  // read before the scan: the thread that finds the bin rewrites it
    index_t before = 0;
    scan(scan_storage).ExclusiveSum(mine, before);
    if (before < needed && before + mine >= needed) {  // exactly one thread
      index_t running = before;
      for (int i = 0; i < per_thread; ++i) {
        const int b = static_cast<int>(threadIdx.x) * per_thread + i;
        if (running + histogram[b] >= needed) {
          prefix |= static_cast<std::uint32_t>(b) << shift;
          still_needed = needed - running;
          ties = histogram[b];
          break;
        }
        running += histogram[b];
      }
    }
    decided |= static_cast<std::uint32_t>(bins - 1) << shift;
    __syncthreads();
  }
  const std::uint32_t threshold = prefix;
  const index_t tied_needed = still_needed;
  const bool all_ties = ties == tied_needed;

  // The keys below K in any order (they are sorted next), and the ties when all of them are needed.
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  for (index_t j = threadIdx.x; j < local_tokens; j += top_k_threads) {
    const std::uint32_t key = key_of(j);
    const bool take = key < threshold || (all_ties && key == threshold);
    const unsigned ballot = __ballot_sync(0xffffffffu, take);
    index_t base = 0;
    if (threadIdx.x % 32 == 0 && ballot != 0) base = atomicAdd(&count, __popc(ballot));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (take) kept[base + __popc(ballot & ((1u << (threadIdx.x % 32)) - 1u))] = (std::uint64_t{key} << token_bits) | static_cast<std::uint32_t>(j);
  }
  __syncthreads();
  if (!all_ties && threadIdx.x < 32) {  // the first tied_needed ties, in token order
    index_t taken = 0;
    for (index_t first = 0; first < local_tokens && taken < tied_needed; first += 32) {
      const index_t j = first + static_cast<index_t>(threadIdx.x);
      const bool tie = j < local_tokens && key_of(j) == threshold;
      const unsigned ballot = __ballot_sync(0xffffffffu, tie);
      const index_t rank = taken + __popc(ballot & ((1u << threadIdx.x) - 1u));
      if (tie && rank < tied_needed) kept[count + rank] = (std::uint64_t{threshold} << token_bits) | static_cast<std::uint32_t>(j);
      taken += __popc(ballot);
    }
  }
  __syncthreads();

  std::uint64_t items[top_k_items];
#pragma unroll
  for (int i = 0; i < top_k_items; ++i) {
    const index_t at = static_cast<index_t>(threadIdx.x) * top_k_items + i;
    items[i] = at < k ? kept[at] : ~std::uint64_t{0};
  }
  __syncthreads();  // the sort's storage overlays `kept`
  detail::top_k_sort(sort_storage).Sort(items, 0, 32 + token_bits);  // the padding (all ones) stays last
#pragma unroll
  for (int i = 0; i < top_k_items; ++i) {
    const index_t at = static_cast<index_t>(threadIdx.x) * top_k_items + i;
    if (at >= k) break;
    const auto j = static_cast<index_t>(items[i] & token_mask);
    sorted_keys[h * k + at] = items[i] >> token_bits;
    sorted_tokens[h * k + at] = key_global_block[j / block_tokens] * block_tokens + j % block_tokens;
  }
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

namespace detail {

/// A head's window mass on this rank: the fp64 sum of its `blocks` tile masses over the CTA's 256
/// threads, rounded to float; valid in thread 0. One sum for one rank and for several.
__device__ inline float window_mass_of(const float* tiles, index_t blocks) {
  using reduce = cub::BlockReduce<double, 256>;
  __shared__ typename reduce::TempStorage temp;
  double total = 0;
  for (index_t b = threadIdx.x; b < blocks; b += blockDim.x) total += tiles[b];
  return float(reduce(temp).Sum(total));
}

}  // namespace detail

/// One rank's share for the all-gathers (engine::rank_share): its tile masses with, per head, their
/// sum (detail::window_mass_of), then each head's first per_rank candidates as selection keys.
///   tile_mass [Hq, local_blocks]   sorted_keys, sorted_tokens [Hq, run_stride] (each head's run first)
///   mass [Hq, local_blocks + 1]   candidates [Hq, per_rank]. Grid: Hq, 256 threads.
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    pack_rank_share(const float* __restrict__ tile_mass, const std::uint64_t* __restrict__ sorted_keys, const index_t* __restrict__ sorted_tokens,
                    index_t local_blocks, index_t run_stride, index_t per_rank, float* __restrict__ mass, std::uint64_t* __restrict__ candidates) {
  const std::int64_t h = blockIdx.x;
  const float* tiles = tile_mass + h * local_blocks;
  float* row = mass + h * (local_blocks + 1);
  for (index_t b = threadIdx.x; b < local_blocks; b += blockDim.x) row[b] = tiles[b];
  for (index_t i = threadIdx.x; i < per_rank; i += blockDim.x) {
    const std::int64_t from = h * run_stride + i;
    candidates[h * per_rank + i] = stria::detail::selection_key({mass_of_descending_bits(static_cast<std::uint32_t>(sorted_keys[from])), sorted_tokens[from]});
  }
  if (const float window = detail::window_mass_of(tiles, local_blocks); threadIdx.x == 0) row[local_blocks] = window;
}

/// The block and window masses of every rank's share (engine::combine_shares, bit for bit): each
/// key block's mass onto its block diagonal (the others stay 0), and each head's window mass summed
/// in fp32 in rank order.
///   mass [world, Hq, rank_blocks + 1]   key_global_block [world, rank_blocks]
///   slash_mass [Hq, diagonals]   window_mass [Hq]. Grid: Hq, 256 threads.
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    combine_block_masses(const float* __restrict__ mass, const index_t* __restrict__ key_global_block, index_t world, index_t heads,
                         index_t rank_blocks, index_t num_blocks, index_t diagonals, index_t diagonal_offset, float* __restrict__ slash_mass,
                         float* __restrict__ window_mass) {
  const std::int64_t h = blockIdx.x, row = rank_blocks + 1;
  float* slash = slash_mass + h * diagonals;
  for (index_t i = threadIdx.x; i < diagonals; i += blockDim.x) slash[i] = 0.0f;
  __syncthreads();
  for (std::int64_t e = threadIdx.x; e < std::int64_t{world} * rank_blocks; e += blockDim.x) {  // e = rank * rank_blocks + local block
    const std::int64_t r = e / rank_blocks, b = e % rank_blocks;
    slash[num_blocks - 1 - key_global_block[e] + diagonal_offset] = mass[(r * heads + h) * row + b];
  }
  if (threadIdx.x == 0) {
    float window = mass[h * row + rank_blocks];
    for (std::int64_t r = 1; r < world; ++r) window += mass[(r * heads + h) * row + rank_blocks];
    window_mass[h] = window;
  }
}

/// Each head's union of the ranks' runs (engine::combine_shares, bit for bit): the first `width`
/// entries of the merge of the ranks' runs of selection keys, sentinels (negative masses) written as
/// mass -1 and token 0. Merge by rank: keys are unique (tokens differ), so an entry's place in the
/// union is its place in its own run plus the keys smaller than it in every other run, one binary
/// search each; every entry finds its place alone. Only a run's first `width` can reach the union.
///   runs [world, Hq, per_rank] (each ascending)   candidate_mass, candidate_token [Hq, width].
///   Grid: ceil(world * Hq * min(per_rank, width) / 256), 256 threads.
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    merge_candidate_runs(const std::uint64_t* __restrict__ runs, index_t world, index_t heads, index_t per_rank, index_t width,
                         float* __restrict__ candidate_mass, index_t* __restrict__ candidate_token) {
  const index_t reach = min(per_rank, width);  // of each run
  const std::int64_t entry = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (entry >= std::int64_t{world} * heads * reach) return;
  const std::int64_t run = entry / reach;  // = rank * heads + head
  const index_t i = static_cast<index_t>(entry % reach), r = static_cast<index_t>(run / heads), h = static_cast<index_t>(run % heads);
  const std::uint64_t key = runs[run * per_rank + i];
  std::int64_t place = i;
  for (index_t other = 0; other < world && place < width; ++other)
    if (other != r) place += detail::lower_bound_in(runs + (std::int64_t{other} * heads + h) * per_rank, 0, reach, key);
  if (place >= width) return;
  const bool sentinel = key >= stria::detail::negative_masses;
  const vertical_candidate c = stria::detail::candidate_of(key);
  candidate_mass[std::int64_t{h} * width + place] = sentinel ? -1.0f : c.mass;
  candidate_token[std::int64_t{h} * width + place] = sentinel ? 0 : c.token;
}

/// One rank's statistics are already global (the collectives over one rank are identities): the
/// tile masses become slash masses (each key block lies on one block diagonal), their sum the window
/// mass, and each head's first `per_rank` sorted candidates its candidate row (-1 pads included).
///   tile_mass [Hq, local_blocks]   sorted_keys, sorted_tokens [Hq, run_stride] (each head's run first)
///   slash_mass [Hq, diagonals]   window_mass [Hq]   candidate_mass, candidate_token [Hq, per_rank]
/// Grid: Hq, 256 threads.
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    single_rank_statistics(const float* __restrict__ tile_mass, const index_t* __restrict__ key_global_block,
                           const std::uint64_t* __restrict__ sorted_keys, const index_t* __restrict__ sorted_tokens, index_t local_blocks,
                           index_t run_stride, index_t per_rank, index_t num_blocks, index_t diagonals, index_t diagonal_offset,
                           float* __restrict__ slash_mass, float* __restrict__ window_mass, float* __restrict__ candidate_mass,
                           index_t* __restrict__ candidate_token) {
  const index_t h = blockIdx.x;
  float* slash = slash_mass + static_cast<std::int64_t>(h) * diagonals;
  const float* tiles = tile_mass + static_cast<std::int64_t>(h) * local_blocks;
  for (index_t i = threadIdx.x; i < diagonals; i += blockDim.x) slash[i] = 0.0f;
  __syncthreads();
  for (index_t b = threadIdx.x; b < local_blocks; b += blockDim.x) slash[num_blocks - 1 - key_global_block[b] + diagonal_offset] = tiles[b];
  if (const float window = detail::window_mass_of(tiles, local_blocks); threadIdx.x == 0) window_mass[h] = window;
  for (index_t i = threadIdx.x; i < per_rank; i += blockDim.x) {
    const std::int64_t from = static_cast<std::int64_t>(h) * run_stride + i, to = static_cast<std::int64_t>(h) * per_rank + i;
    candidate_mass[to] = mass_of_descending_bits(static_cast<std::uint32_t>(sorted_keys[from]));
    candidate_token[to] = sorted_tokens[from];
  }
}

}  // namespace stria::kernel
