// SPDX-License-Identifier: Apache-2.0
// The sparse attention backward on Hopper (wgmma, sm_90a): the passes of sparse_backward.cuh (DESIGN 8)
// with every product of a tile on wgmma, one warpgroup per CTA and two CTAs per SM. dQ has its own
// pass in both modes, one CTA per (query block, head) over the row's tiles:
//   S = Q K^T and dP = dO V^T (A and B from shared memory), dS = P (dP - delta) scale, dQ += dS K
// with dS from registers. A dQ fused into the dK/dV passes (FlashAttention-2's scheme, the mma.sync
// atomic mode) must reach global memory by fp32 reductions, one 64 x D tile per 64x64 tile, and those
// made the fused Hopper passes L2-bound (RESULTS, 2026-12-01); the separate pass costs two more
// products per tile and no reductions. The dK/dV passes (per KV block over the transposed index, and
// per 64 vertical tokens over the query blocks that use them) form per tile
//   S^T = K Q^T and dP^T = V dO^T   (A and B from shared memory, K-major)
//   P^T = exp2(S^T scale log2 e - lse), dS^T = P^T (dP^T - delta) scale   (registers)
//   dV += P^T dO and dK += dS^T Q   (A from registers; B = dO, Q MN-major)
// The vertical tokens' dK/dV go to global memory by fp32 reductions (atomic mode) or to per-entry
// scratch folded in a fixed order (deterministic). The softmax scale is folded into dS, so neither
// dK nor dQ is scaled afterwards.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "stria/core/config.hpp"
#include "stria/index/step_index.hpp"
#include "stria/kernel/attention_tile.cuh"
#include "stria/kernel/sparse_backward.cuh"
#include "stria/kernel/wgmma.cuh"

namespace stria::kernel {

/// Two CTAs of one warpgroup share an SM: dK, dV, S^T and dP^T fill about 250 of a thread's 255
/// registers at D = 128, and one CTA's products run while the other's elementwise work does.
inline constexpr int backward_wgmma_ctas_per_sm = 2;

/// Shared memory of the Hopper dK/dV passes, from a 1024-byte aligned base: the CTA's K and V tiles,
/// two stages of (Q, dO) tiles, and two stages of row statistics (lse[64], delta[64]).
template <int D>
struct backward_wgmma_layout {
  static constexpr int tile = swizzled_tile<D>::bytes;
  static constexpr int stages = 2 * tile;          // stage s: Q at stages + 2 s tile, dO right after it
  static constexpr int stats = stages + 4 * tile;  // stage s: lse at stats + 2 s 64 floats, delta after it
  static constexpr int staging = stats + 2 * 2 * block_tokens * static_cast<int>(sizeof(float));  // the stored dS rows, 2 KiB per warp
  static constexpr std::size_t bytes = staging + block_tokens * 128 + 1024;  // + slack to align the base

  unsigned char* base;
  __device__ unsigned char* keys() const { return base; }
  __device__ unsigned char* values() const { return base + tile; }
  __device__ unsigned char* queries(int stage) const { return base + stages + 2 * stage * tile; }
  __device__ unsigned char* d_out(int stage) const { return queries(stage) + tile; }
  __device__ float* lse(int stage) const { return reinterpret_cast<float*>(base + stats) + 2 * stage * block_tokens; }
  __device__ float* delta(int stage) const { return lse(stage) + block_tokens; }
  __device__ unsigned char* ds_staging() const { return base + staging; }
};

template <int D>
constexpr std::size_t backward_wgmma_shared_bytes() {
  return backward_wgmma_layout<D>::bytes;
}

/// Shared memory of the Hopper dQ pass: the query and dO tiles and two stages of (K, V) tiles.
template <int D>
constexpr std::size_t backward_dq_wgmma_shared_bytes() {
  return 6 * swizzled_tile<D>::bytes + 1024;
}

namespace detail {

/// One tile of a Hopper dK/dV pass (see the file comment) runs in three parts, so that the passes can
/// issue a tile's scores while the tile before it still runs its dK product: scores_wgmma issues
/// S^T and dP^T; dkdv_gradients_wgmma forms P^T and dS^T around the dV product and ends with nothing
/// in flight; dkdv_dk_wgmma issues dK += dS^T Q. No product is in flight across a loop's back edge:
/// ptxas serializes every product of a kernel whose in-flight accumulators cross one (C7515).
///
/// The two score products of a 64x64 tile, issued as two commit groups: s = s_a s_b^T, then
/// dp = dp_a dp_b^T, every operand a K-major swizzled tile of D columns in shared memory. The dK/dV
/// passes form S^T = K Q^T and dP^T = V dO^T, the dQ pass S = Q K^T and dP = dO V^T.
template <class T, int D>
__device__ void scores_wgmma(float (&s)[8][4], float (&dp)[8][4], const unsigned char* s_a, const unsigned char* s_b, const unsigned char* dp_a,
                             const unsigned char* dp_b) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < D / 16; ++k)
    wgmma_ss<T, 64, 0, 0>(reinterpret_cast<float(&)[32]>(s), k_major_operand<D>(s_a, k), k_major_operand<D>(s_b, k), k > 0);
  wgmma_commit();
#pragma unroll
  for (int k = 0; k < D / 16; ++k)
    wgmma_ss<T, 64, 0, 0>(reinterpret_cast<float(&)[32]>(dp), k_major_operand<D>(dp_a, k), k_major_operand<D>(dp_b, k), k > 0);
  wgmma_commit();
}

/// With the tile's two score groups the only ones in flight: P^T = exp2(S^T scale log2 e - lse) while
/// dP^T runs, dV += P^T dO issued while dS^T = P^T (dP^T - delta) scale is formed into `dsf` (rounded
/// to T: the dK product's A operand). Returns with every product complete. `masked(key, query)` drops
/// entries (positions within the tile).
template <class T, int D, class Masked>
__device__ void dkdv_gradients_wgmma(float (&dv)[D / 8][4], float (&s)[8][4], float (&dp)[8][4], unsigned (&dsf)[4][4], const unsigned char* dos,
                                     const float* lse, const float* delta, float scale, float scale_log2, Masked masked) {
  wgmma_wait<1>();  // S^T; dP^T may still run
  fence_registers(reinterpret_cast<float(&)[32]>(s));
  const int lane = threadIdx.x % 32, key0 = 16 * static_cast<int>((threadIdx.x / 32) % 4) + lane / 4;
  unsigned pf[4][4];  // P^T as the A operand, 16 queries per k-step
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int j = 2 * k; j < 2 * k + 2; ++j) {
      const int query = 8 * j + 2 * (lane % 4);
      const float2 row_lse = *reinterpret_cast<const float2*>(lse + query);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float l = (e & 1) ? row_lse.y : row_lse.x;
        s[j][e] = masked(key0 + (e >= 2 ? 8 : 0), query + (e & 1)) ? 0.0f : exp2_ftz(s[j][e] * scale_log2 - l);
      }
    }
    accumulator_to_operand<T>(pf[k], s[2 * k], s[2 * k + 1]);
  }
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k) wgmma_rs<T, D, 1>(reinterpret_cast<float(&)[D / 2]>(dv), pf[k], mn_major_operand<D>(dos, k), true);
  wgmma_commit();
  wgmma_wait<1>();  // dP^T; the dV product may still run
  fence_registers(reinterpret_cast<float(&)[32]>(dp));
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // P^T and dP^T die as dS^T is packed
#pragma unroll
    for (int j = 2 * k; j < 2 * k + 2; ++j) {
      const int query = 8 * j + 2 * (lane % 4);
      const float2 row_delta = *reinterpret_cast<const float2*>(delta + query);
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * scale * (dp[j][e] - ((e & 1) ? row_delta.y : row_delta.x));  // dS^T, scaled
    }
    accumulator_to_operand<T>(dsf[k], dp[2 * k], dp[2 * k + 1]);
  }
  wgmma_wait<0>();
  fence_registers(reinterpret_cast<float(&)[D / 2]>(dv));
  fence_registers(pf);
}

/// dK += dS^T Q, issued and left in flight (one commit group): dk and `dsf` stay untouched until
/// dkdv_dk_complete.
template <class T, int D>
__device__ void dkdv_dk_wgmma(float (&dk)[D / 8][4], unsigned (&dsf)[4][4], const unsigned char* qs) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k) wgmma_rs<T, D, 1>(reinterpret_cast<float(&)[D / 2]>(dk), dsf[k], mn_major_operand<D>(qs, k), true);
  wgmma_commit();
}

/// The dK product completed, with at most `Pending` newer commit groups still in flight.
template <int Pending, int D>
__device__ void dkdv_dk_complete(float (&dk)[D / 8][4], unsigned (&dsf)[4][4]) {
  wgmma_wait<Pending>();
  fence_registers(reinterpret_cast<float(&)[D / 2]>(dk));
  fence_registers(dsf);
}

/// dS^T of a tile as the dQ pass will read it (rounded to T as its product rounds it), in two halves:
/// a lane holds 4 bytes of a row per 16-byte chunk, so stage_ds_rows puts each warp's 16 rows in
/// `staging` (2 KiB per warp; chunks swizzled by row, so that neither side conflicts), and
/// write_ds_rows writes them out as whole 128-byte rows to `ds_row(key)` (null: nowhere), 16 bytes per
/// lane (4-byte stores of quarter sectors slowed the pass by a third). The passes stage the rows as
/// soon as dS^T is formed, before the dK product reads `dsf`, and write them out while it runs.
__device__ inline void stage_ds_rows(const unsigned (&dsf)[4][4], unsigned char* staging) {
  const int lane = threadIdx.x % 32, warp = static_cast<int>((threadIdx.x / 32) % 4);
  unsigned char* rows = staging + warp * 16 * 128;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = lane / 4 + 8 * half;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      *reinterpret_cast<unsigned*>(rows + r * 128 + (((2 * k) ^ (r % 8)) * 16) + 4 * (lane % 4)) = dsf[k][half];
      *reinterpret_cast<unsigned*>(rows + r * 128 + (((2 * k + 1) ^ (r % 8)) * 16) + 4 * (lane % 4)) = dsf[k][2 + half];
    }
  }
  __syncwarp();
}
template <class T, class DsRow>
__device__ void write_ds_rows(const unsigned char* staging, DsRow ds_row) {
  const int lane = threadIdx.x % 32, warp = static_cast<int>((threadIdx.x / 32) % 4);
  const unsigned char* rows = staging + warp * 16 * 128;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 4 * i + lane / 8, chunk = lane % 8;
    T* row = ds_row(16 * warp + r);
    if (row) *reinterpret_cast<uint4*>(row + 8 * chunk) = *reinterpret_cast<const uint4*>(rows + r * 128 + ((chunk ^ (r % 8)) * 16));
  }
  __syncwarp();  // the next tile's rows go to the same place
}

/// A block CTA of the Hopper dK/dV launch: one (local KV block, KV head) over the transposed index,
/// all query heads of its group, as sparse_backward_dkdv<T, D, false>. The tiles are software
/// pipelined: tile t + 1's S^T and dP^T are issued while tile t's dK product still runs, so that the
/// tensor pipe has work queued across the barriers, and tile t's stored dS rows go out under that
/// product. The Q and dO tiles are double-buffered: tile t + 2's copies start once every warp's
/// products of tile t have completed.
template <class T, int D>
__device__ void dkdv_block_cta(const backward_params<T>& p, const backward_wgmma_layout<D>& shared, index_t kv_block, index_t hk) {
  const detail::kv_column column{p.index, kv_block, hk, p.heads_q / p.heads_kv, p.head_begin, p.head_end};
  const index_t tiles = column.tiles();
  if (tiles == 0) return;
  using tile_layout = swizzled_tile<D>;
  auto load = [&](detail::kv_column::cursor c, index_t q_block, int stage) {
    const index_t h = column.head(c);
    detail::load_query_tiles<tile_layout, T, D>(p, q_block, h, shared.queries(stage), shared.d_out(stage));
    detail::load_row_statistics(p, q_block, h, shared.lse(stage), shared.delta(stage));
  };
  // P^T, dV and dS^T of the tile in `stage` (dkdv_gradients_wgmma), its scores issued by the caller;
  // its dS rows are staged at once.
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  unsigned dsf[4][4];  // dS^T of the tile whose dK product is next
  auto gradients = [&](float (&s)[8][4], float (&dp)[8][4], int stage, bool diagonal) {
    // A test on a value, not a branch around the tile: its scores are in flight.
    detail::dkdv_gradients_wgmma<T, D>(dv, s, dp, dsf, shared.d_out(stage), shared.lse(stage), shared.delta(stage), p.scale, p.scale_log2,
                                       [diagonal](int key, int query) { return diagonal && query < key; });
    if (p.ds_blocks) detail::stage_ds_rows(dsf, shared.ds_staging());
  };
  // The staged dS rows of the tile whose forward-form entry is `entry`, written to that entry's 64 rows.
  auto write_ds = [&](index_t entry) {
    T* const ds = p.ds_blocks + std::int64_t{entry - p.ds_first_block} * block_tokens * block_tokens;
    detail::write_ds_rows<T>(shared.ds_staging(), [ds](int key) { return ds + key * block_tokens; });
  };
  detail::load_key_tiles<tile_layout, T, D>(p, kv_block, hk, shared.keys(), shared.values());
  // The index runs ahead of the tiles, so that no index read waits between a barrier and the
  // products (ncu: a fifth of the pass's stall samples did): a tile's query block is read a tile
  // before its copies are queued, its mask test and dS entry when they are.
  detail::kv_column::cursor ahead = column.first();  // of the next tile to load, and its query block
  index_t q_ahead = column.query_block(ahead);
  bool masked = false, next_masked = false;
  index_t ds_entry = 0, next_ds_entry = 0;
  auto load_ahead = [&](index_t t, int stage) {  // tile t, the one `ahead` holds
    load(ahead, q_ahead, stage);
    next_masked = p.index.needs_causal_mask(q_ahead, kv_block);
    if (p.ds_blocks) next_ds_entry = p.kv_query_entry[ahead.e];
    if (t + 1 < tiles) {
      ahead = column.next(ahead);
      q_ahead = column.query_block(ahead);
    }
  };
  load_ahead(0, 0);
  detail::cp_async_commit();
  masked = next_masked;
  ds_entry = next_ds_entry;
  if (tiles > 1) load_ahead(1, 1);
  detail::cp_async_commit();
  detail::cp_async_wait<1>();
  detail::fence_async_shared();
  __syncthreads();
  {
    float s[8][4], dp[8][4];
    detail::scores_wgmma<T, D>(s, dp, shared.keys(), shared.queries(0), shared.values(), shared.d_out(0));
    gradients(s, dp, 0, masked);
  }
  // Tile t's dK product, then tile t + 1's scores and gradients.
  for (index_t t = 0; t + 1 < tiles; ++t) {
    const int stage = static_cast<int>(t % 2);
    detail::dkdv_dk_wgmma<T, D>(dk, dsf, shared.queries(stage));
    if (p.ds_blocks) write_ds(ds_entry);
    detail::cp_async_wait<0>();
    detail::fence_async_shared();
    __syncthreads();  // tile t + 1's copies are visible
    float s[8][4], dp[8][4];
    detail::scores_wgmma<T, D>(s, dp, shared.keys(), shared.queries(stage ^ 1), shared.values(), shared.d_out(stage ^ 1));
    detail::dkdv_dk_complete<2, D>(dk, dsf);
    masked = next_masked;
    ds_entry = next_ds_entry;
    __syncthreads();  // every warp's products of tile t have completed: its stage is free
    if (t + 2 < tiles) load_ahead(t + 2, stage);
    detail::cp_async_commit();
    gradients(s, dp, stage ^ 1, masked);
  }
  detail::dkdv_dk_wgmma<T, D>(dk, dsf, shared.queries(static_cast<int>((tiles - 1) % 2)));
  if (p.ds_blocks) write_ds(ds_entry);
  detail::dkdv_dk_complete<0, D>(dk, dsf);
  auto rows = [&](float* base) {
    return [=, &p](int r) { return base + ((static_cast<std::int64_t>(kv_block) * block_tokens + r) * p.heads_kv + hk) * D; };
  };
  // The scale is in dS already. In the atomic mode the launch's vertical CTAs add into the same
  // rows by reductions, so these rows are added by reductions too.
  if (p.vertical_dk) {
    detail::add_rows<D>(dk, 1.0f, rows(p.dk));
    detail::add_rows<D>(dv, 1.0f, rows(p.dv));
  } else {
    detail::reduce_rows<D>(dk, rows(p.dk));
    detail::reduce_rows<D>(dv, rows(p.dv));
  }
}

/// A vertical CTA of the Hopper dK/dV launch: 64 of a head's vertical tokens (g; in the atomic mode,
/// over one range of query blocks) against the query blocks that use them, as
/// sparse_backward_vertical<T, D, false>. The walk runs two rounds ahead, so that a query block's
/// tiles load while the one before it is computed, and the rounds are pipelined as the block pass's
/// tiles: the next round's scores are issued while this round's dK product runs.
template <class T, int D>
__device__ void dkdv_vertical_cta(const backward_params<T>& p, const backward_wgmma_layout<D>& shared, const detail::vertical_group& g) {
  unsigned char *ks = shared.keys(), *vs = shared.values();
  // Per stage (the walk runs ahead of the barriers): nonzero where the column's token uses the
  // round's query block (with stored dS: its rank, 1-based, among those columns), the walk's per-warp
  // minima and counts, and the round's first vertical entry of that query block's row in the group.
  __shared__ index_t used[2][block_tokens];
  __shared__ index_t warp_min[2][4];
  __shared__ index_t round_entry[2];

  using tile_layout = swizzled_tile<D>;
  detail::load_vertical_key_tiles<tile_layout, T, D>(p, g, ks, vs);
  auto load = [&](index_t q_block, int stage) {
    detail::load_query_tiles<tile_layout, T, D>(p, q_block, g.h, shared.queries(stage), shared.d_out(stage));
    detail::load_row_statistics(p, q_block, g.h, shared.lse(stage), shared.delta(stage));
    if (p.ds_vertical && threadIdx.x == 0)
      detail::cp_async_4(&round_entry[stage], p.vertical_group_entry + std::int64_t{g.index} * p.index.shape.num_query_blocks + q_block);
  };
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  unsigned dsf[4][4];  // dS^T of the round whose dK product is next
  auto gradients = [&](float (&s)[8][4], float (&dp)[8][4], int stage) {
    const index_t* round_used = used[stage];
    detail::dkdv_gradients_wgmma<T, D>(dv, s, dp, dsf, shared.d_out(stage), shared.lse(stage), shared.delta(stage), p.scale, p.scale_log2,
                                       [round_used](int key, int) { return round_used[key] == 0; });
    if (p.ds_vertical) detail::stage_ds_rows(dsf, shared.ds_staging());
  };
  // The staged dS rows of the round in `stage`, written to a used column's row among the group's entries.
  auto write_ds = [&](int stage) {
    const index_t* round_used = used[stage];
    const index_t round_first = round_entry[stage] - 1 - p.ds_first_vertical;
    detail::write_ds_rows<T>(shared.ds_staging(), [=, &p](int key) -> T* {
      const index_t rank = round_used[key];
      return rank > 0 ? p.ds_vertical + std::int64_t{round_first + rank} * block_tokens : nullptr;
    });
  };

  detail::vertical_walk walk(p.index, g, p.ds_vertical != nullptr);
  const index_t q_first = walk.next(used[0], warp_min[0]);
  if (q_first == INT_MAX) {  // no query block of the range uses a column
    detail::cp_async_wait<0>();
    if (p.vertical_dk) detail::write_vertical_gradients<T, D>(p, g, dk, dv, 1.0f);  // zeros: the scratch must be written
    return;
  }
  load(q_first, 0);
  detail::cp_async_commit();
  index_t q_next = walk.next(used[1], warp_min[1]);
  if (q_next != INT_MAX) load(q_next, 1);
  detail::cp_async_commit();
  detail::cp_async_wait<1>();
  detail::fence_async_shared();
  __syncthreads();
  {
    float s[8][4], dp[8][4];
    detail::scores_wgmma<T, D>(s, dp, ks, shared.queries(0), vs, shared.d_out(0));
    gradients(s, dp, 0);
  }
  // The round in `stage`'s dK product, then the next round's scores and gradients.
  int stage = 0;
  for (; q_next != INT_MAX; stage ^= 1) {
    detail::dkdv_dk_wgmma<T, D>(dk, dsf, shared.queries(stage));
    if (p.ds_vertical) write_ds(stage);
    detail::cp_async_wait<0>();
    detail::fence_async_shared();
    __syncthreads();  // the next round's copies are visible
    float s[8][4], dp[8][4];
    detail::scores_wgmma<T, D>(s, dp, ks, shared.queries(stage ^ 1), vs, shared.d_out(stage ^ 1));
    detail::dkdv_dk_complete<2, D>(dk, dsf);
    // The walk's barrier also ends every warp's use of this stage (tiles, `used`, round entry).
    q_next = walk.next(used[stage], warp_min[stage]);
    if (q_next != INT_MAX) load(q_next, stage);
    detail::cp_async_commit();
    gradients(s, dp, stage ^ 1);
  }
  detail::dkdv_dk_wgmma<T, D>(dk, dsf, shared.queries(stage));
  if (p.ds_vertical) write_ds(stage);
  detail::dkdv_dk_complete<0, D>(dk, dsf);
  detail::write_vertical_gradients<T, D>(p, g, dk, dv, 1.0f);  // the scale is in dS already
}

}  // namespace detail

/// The vertical CTAs of the Hopper dK/dV launch: a grid of `groups` x `ranges` (atomic mode: the
/// heads' groups of 64 tokens, linear, by ranges of query blocks) or `heads` x `groups`
/// (deterministic: head-fastest, queries unsplit).
struct vertical_launch {
  index_t x = 0, y = 0;
  __host__ __device__ constexpr std::int64_t ctas() const { return std::int64_t{x} * y; }
};

/// The Hopper dK/dV passes as one launch: vertical.ctas() vertical CTAs first, then one block CTA per
/// (local KV block, KV head), KV block fastest. The vertical CTAs go first because they are the long
/// ones (a walk over up to a range's 256 query blocks against some 30 tiles of a block column), and
/// the short block CTAs then fill the SMs behind them; two launches each ended on their own tail.
/// In the atomic mode the last query ranges, which the most tokens reach, start first. The two kinds
/// write disjoint dS rows; their dK/dV rows meet only in the atomic mode, where both add them by
/// reductions (deterministic: the vertical CTAs write per-entry scratch).
template <class T, int D>
__global__ void __launch_bounds__(attention_threads, backward_wgmma_ctas_per_sm)
    sparse_backward_dkdv_wgmma(backward_params<T> p, vertical_launch vertical) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const backward_wgmma_layout<D> shared{detail::align_1024(shared_raw)};
  const std::int64_t cta = blockIdx.x;
  if (cta < vertical.ctas()) {
    const bool head_fastest = p.vertical_dk != nullptr;
    const auto x = static_cast<index_t>(cta % vertical.x), y = static_cast<index_t>(cta / vertical.x);
    detail::vertical_group g;
    if (detail::vertical_group::at(p.index, head_fastest, g, x, head_fastest ? y : vertical.y - 1 - y, vertical.y, p.head_begin, p.head_end))
      detail::dkdv_vertical_cta<T, D>(p, shared, g);
    return;
  }
  const std::int64_t block = cta - vertical.ctas();
  const index_t kv_blocks = p.index.shape.num_kv_blocks;
  detail::dkdv_block_cta<T, D>(p, shared, static_cast<index_t>(block % kv_blocks), static_cast<index_t>(block / kv_blocks));
}

namespace detail {

/// The end of a Hopper dQ pass: this warpgroup's rows of dq (query block, head h) += acc, or with
/// final_dq, T(dq + acc) written there (acc alone where dq is null; one of the two is set). The scale
/// is in dS already. acc is overwritten: every old value is added into it before the first store (a
/// store through final_dq may alias dq as far as the compiler knows, and interleaved, each read waited
/// for the store before it: sixteen dependent DRAM round trips per thread made the D 64 pass 2.7x
/// slower).
template <class T, int D>
__device__ void finish_dq_rows(const backward_params<T>& p, index_t q_block, index_t h, float (&acc)[D / 8][4]) {
  const int row0 = 16 * static_cast<int>((threadIdx.x / 32) % 4);
  auto at = [&](int half, int j) {
    const std::int64_t row = (static_cast<std::int64_t>(q_block) * block_tokens + row0 + fragment_row(2 * half)) * p.heads_q + h;
    return row * D + fragment_col(j, 0);
  };
  if (p.dq) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float2 old = *reinterpret_cast<const float2*>(p.dq + at(half, j));
        acc[j][2 * half] += old.x;
        acc[j][2 * half + 1] += old.y;
      }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      if (p.final_dq) *reinterpret_cast<unsigned*>(p.final_dq + at(half, j)) = pack_pair<T>(acc[j][2 * half], acc[j][2 * half + 1]);
      else *reinterpret_cast<float2*>(p.dq + at(half, j)) = make_float2(acc[j][2 * half], acc[j][2 * half + 1]);
    }
}

}  // namespace detail

/// The dQ pass on Hopper (deterministic mode): one CTA per (local query block, query head) over the
/// row's tiles (its blocks, then its vertical tokens 64 at a time), the sole writer of its dq rows:
/// S = Q K^T and dP = dO V^T (shared-memory operands), dS = P (dP - delta) scale, dQ += dS K with dS
/// from registers. K and V tiles are double-buffered: tile t + 2's copies start once every warp's
/// product of tile t has completed. Grouped: the launch order, as the forward's (launched_row_unit).
template <class T, int D, bool Grouped = false>
__global__ void __launch_bounds__(attention_threads, backward_wgmma_ctas_per_sm) sparse_backward_dq_wgmma(backward_params<T> p) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  unsigned char* shared = detail::align_1024(shared_raw);
  constexpr int tile = swizzled_tile<D>::bytes;
  unsigned char* qs = shared;
  unsigned char* dos = qs + tile;
  auto ks = [&](int stage) { return dos + tile + 2 * stage * tile; };
  auto vs = [&](int stage) { return ks(stage) + tile; };

  const detail::launched_unit unit = detail::launched_row_unit<Grouped>();
  const index_t q_block = unit.unit, h = unit.head;
  const index_t hk = h / (p.heads_q / p.heads_kv);
  const detail::row_tiles row = detail::row_tiles::of(p.index, p.index.row(h, q_block));
  const index_t tiles = row.count();
  if (tiles == 0) {  // nothing of this step reaches the row: dq unchanged, or written out as it is
    if (p.final_dq) {
      float zero[D / 8][4] = {};
      detail::finish_dq_rows<T, D>(p, q_block, h, zero);
    }
    return;
  }

  using tile_layout = swizzled_tile<D>;
  // Warps 0-1 copy K, warps 2-3 V; each copier thread reads its token of a gathered tile (a block
  // tile's block) a load before the tile's copies are queued, and a tile's causal-mask test is read when they are, so that
  // no index read waits before a tile's copies or between the barrier and its softmax.
  const int copier = static_cast<int>(threadIdx.x % 64);
  // One code path for both halves (the operands chosen, not the call): copies queued on a branch
  // while products are in flight would serialize them (ptxas C7520).
  const bool copies_keys = threadIdx.x < 64;
  auto load_kv = [&](index_t t, int stage, index_t token) {
    detail::load_row_tile_swizzled_async<T, D>(copies_keys ? ks(stage) : vs(stage), copies_keys ? p.k : p.v, row, t, p.heads_kv, hk, copier, token);
  };
  auto diagonal_at = [&](index_t t) { return row.is_block(t) && p.index.needs_causal_mask(q_block, row.blocks[t]); };
  detail::load_query_tiles<tile_layout, T, D>(p, q_block, h, qs, dos);
  load_kv(0, 0, detail::gathered_token(row, 0, copier));
  detail::cp_async_commit();
  index_t token = detail::gathered_token(row, 1, copier);
  bool diagonal = diagonal_at(0);

  const int lane = threadIdx.x % 32, row0 = 16 * static_cast<int>(threadIdx.x / 32) + lane / 4;
  float lse[2], delta[2];  // rows row0 and row0 + 8, log2 domain
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t at = static_cast<std::int64_t>(h) * p.query_tokens + std::int64_t{q_block} * block_tokens + row0 + 8 * half;
    lse[half] = p.lse[at];
    delta[half] = p.delta[at];
  }

  // S and dP of the tile in `stage`, issued (two commit groups).
  auto scores = [&](float (&s)[8][4], float (&dp)[8][4], int stage) { detail::scores_wgmma<T, D>(s, dp, qs, ks(stage), dos, vs(stage)); };
  // With tile t's scores the only products in flight: P while dP runs, then dS into dsf (the A
  // operand of dQ += dS K, 16 keys per k-step). Returns with nothing in flight.
  unsigned dsf[4][4];
  auto gradients = [&](float (&s)[8][4], float (&dp)[8][4], index_t t, bool diagonal) {
    detail::wgmma_wait<1>();  // S; dP may still run while P is formed
    detail::fence_registers(reinterpret_cast<float(&)[32]>(s));
    const int valid = row.valid_columns(t);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = row0 - lane / 4 + detail::fragment_row(e), c = detail::fragment_col(j, e);
        const bool masked = c >= valid || (diagonal && c > r);  // selects, no branch: the scores are in flight
        s[j][e] = masked ? 0.0f : detail::exp2_ftz(s[j][e] * p.scale_log2 - lse[e / 2]);
      }
    detail::wgmma_wait<0>();
    detail::fence_registers(reinterpret_cast<float(&)[32]>(dp));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int j = 2 * k; j < 2 * k + 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * p.scale * (dp[j][e] - delta[e / 2]);
      detail::accumulator_to_operand<T>(dsf[k], dp[2 * k], dp[2 * k + 1]);
    }
  };
  float dq[D / 8][4] = {};
  // dQ += dS K of the tile in `stage`, issued and left in flight (dq and dsf untouched until it completes).
  auto product = [&](int stage) {
    detail::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
      detail::wgmma_rs<T, D, 1>(reinterpret_cast<float(&)[D / 2]>(dq), dsf[k], detail::mn_major_operand<D>(ks(stage), k), true);
    detail::wgmma_commit();
  };

  // Tiles are software pipelined as in the dK/dV passes: tile t + 1's scores are issued while tile
  // t's dQ product runs, and no product is in flight across the loop's back edge (ptxas C7515).
  bool diagonal_loaded = false;  // of the last tile whose copies are queued
  if (tiles > 1) {
    const index_t ahead = detail::gathered_token(row, 2, copier);
    load_kv(1, 1, token);
    token = ahead;
    diagonal_loaded = diagonal_at(1);
  }
  detail::cp_async_commit();
  detail::cp_async_wait<1>();
  detail::fence_async_shared();
  __syncthreads();
  {
    float s[8][4], dp[8][4];
    scores(s, dp, 0);
    gradients(s, dp, 0, diagonal);
  }
  for (index_t t = 0; t + 1 < tiles; ++t) {
    const int stage = static_cast<int>(t % 2);
    product(stage);
    detail::cp_async_wait<0>();
    detail::fence_async_shared();
    __syncthreads();  // tile t + 1's copies are visible
    float s[8][4], dp[8][4];
    scores(s, dp, stage ^ 1);
    detail::wgmma_wait<2>();  // tile t's product; tile t + 1's scores may still run
    detail::fence_registers(reinterpret_cast<float(&)[D / 2]>(dq));
    detail::fence_registers(dsf);
    diagonal = diagonal_loaded;
    __syncthreads();  // every warp's product of tile t has completed: its stage is free
    if (t + 2 < tiles) {
      const index_t ahead = detail::gathered_token(row, t + 3, copier);
      load_kv(t + 2, stage, token);
      token = ahead;
      diagonal_loaded = diagonal_at(t + 2);
    }
    detail::cp_async_commit();
    gradients(s, dp, t + 1, diagonal);
  }
  product(static_cast<int>((tiles - 1) % 2));
  detail::wgmma_wait<0>();
  detail::fence_registers(reinterpret_cast<float(&)[D / 2]>(dq));
  detail::fence_registers(dsf);
  detail::finish_dq_rows<T, D>(p, q_block, h, dq);
}

/// Stages of (dS^T, K) tiles in flight in the dQ pass from stored dS: 73 KiB per CTA at D 128 and
/// 65 KiB at D 64, so that three CTAs share an SM (its reads come from DRAM: more of them in flight).
template <int D>
inline constexpr int stored_dq_stages = D == 128 ? 3 : 4;
inline constexpr int stored_dq_ctas_per_sm = 3;

/// Shared memory of the dQ pass from stored dS: its stages of one dS^T tile (64 keys x 64 queries)
/// and one K tile each.
template <int D>
constexpr std::size_t backward_dq_stored_shared_bytes() {
  return stored_dq_stages<D> * (swizzled_tile<64>::bytes + swizzled_tile<D>::bytes) + 1024;
}

namespace detail {

/// The row of CSR entry `entry`: the last row r with ptr[r] <= entry (ptr ascending, rows + 1 long).
__device__ inline index_t row_of_entry(const index_t* ptr, index_t rows, index_t entry) {
  index_t lo = 0, hi = rows;  // ptr[lo] <= entry < ptr[hi]
  while (hi - lo > 1) {
    const index_t mid = lo + (hi - lo) / 2;
    if (ptr[mid] <= entry) lo = mid;
    else hi = mid;
  }
  return lo;
}

}  // namespace detail

/// For the stored dS: entry[e] = the forward-form entry (block_col position) of the tile at position e
/// of the transposed form (kv_query), one thread per forward-form entry.
template <int Unused = 0>
__global__ void transposed_block_entries(step_index_view index, index_t entries, index_t* __restrict__ entry) {
  const index_t nq = index.shape.num_query_blocks, nk = index.shape.num_kv_blocks, rows = index.shape.num_heads * nq;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < entries; i += std::int64_t{gridDim.x} * blockDim.x) {
    const auto e = static_cast<index_t>(i);
    const index_t r = detail::row_of_entry(index.block_ptr, rows, e);
    const index_t column = (r / nq) * nk + index.block_col[e];
    entry[detail::lower_bound_in(index.kv_query, index.kv_query_ptr[column], index.kv_query_ptr[column + 1], r % nq)] = e;
  }
}

/// For the stored dS: entry[G, q] = the col_token entry of row (h, q)'s first vertical token at or after
/// the first token of head h's group k (G = vertical_group::id(h, k)); where the row uses tokens of the
/// group, they follow it in the order of the group's columns. One thread per (query block, head, group).
template <int Unused = 0>
__global__ void vertical_group_entries(step_index_view index, index_t* __restrict__ entry) {
  const index_t nq = index.shape.num_query_blocks, q = static_cast<index_t>(blockIdx.x * blockDim.x + threadIdx.x), h = blockIdx.y;
  if (q >= nq) return;
  const index_t head_first = index.vtoken_head_ptr[h], head_tokens = index.vtoken_head_ptr[h + 1] - head_first;
  const index_t r = h * nq + q, row_first = index.col_ptr[r], row_end = index.col_ptr[r + 1];
  for (index_t k = blockIdx.z; k * block_tokens < head_tokens; k += gridDim.z) {
    const index_t first_token = index.vtoken[head_first + k * block_tokens];
    entry[std::int64_t{detail::vertical_group::id(head_first, h, k)} * nq + q] = detail::lower_bound_in(index.col_token, row_first, row_end, first_token);
  }
}

/// The dQ pass from stored dS (both modes): one CTA per (local query block, query head of the range) over the
/// row's tiles, the sole writer of its dq rows: dQ += dS K, one product per tile, with dS^T [key][query]
/// read back from what the dK/dV passes stored (A = dS, MN-major) and K MN-major. Every thread copies:
/// `stored_dq_stages` tiles in flight, the products synchronous (the accumulation is one chain).
/// Grouped: the launch order over the range's heads, as the forward's (launched_row_unit).
template <class T, int D, bool Grouped = false>
__global__ void __launch_bounds__(attention_threads, stored_dq_ctas_per_sm) sparse_backward_dq_stored_wgmma(backward_params<T> p) {
  constexpr int stages = stored_dq_stages<D>, ds_bytes = swizzled_tile<64>::bytes, k_bytes = swizzled_tile<D>::bytes;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  unsigned char* const shared = detail::align_1024(shared_raw);
  auto ds_tile = [&](index_t t) { return shared + static_cast<int>(t % stages) * ds_bytes; };
  auto k_tile = [&](index_t t) { return shared + stages * ds_bytes + static_cast<int>(t % stages) * k_bytes; };

  const detail::launched_unit unit = detail::launched_row_unit<Grouped>();
  const index_t q_block = unit.unit, h = p.head_begin + unit.head;
  const index_t hk = h / (p.heads_q / p.heads_kv);
  const index_t r = p.index.row(h, q_block);
  const detail::row_tiles row = detail::row_tiles::of(p.index, r);
  const index_t tiles = row.count();
  if (tiles == 0) {  // nothing of this step reaches the row: dq unchanged, or written out as it is
    if (p.final_dq) {
      float zero[D / 8][4] = {};
      detail::finish_dq_rows<T, D>(p, q_block, h, zero);
    }
    return;
  }
  const T* const block_rows = p.ds_blocks + std::int64_t{p.index.block_ptr[r] - p.ds_first_block} * block_tokens * block_tokens;
  const T* const vertical_rows = p.ds_vertical + std::int64_t{p.index.col_ptr[r] - p.ds_first_vertical} * block_tokens;

  // `read`: planned_token<T, D>(row, t), read a step earlier (in the prologue, just before).
  auto load = [&](index_t t, index_t read) {
    if (row.is_block(t)) {
      detail::load_strided_rows_async<swizzled_tile<64>, T, 64>(ds_tile(t), block_rows + std::int64_t{t} * block_tokens * block_tokens, block_tokens);
    } else {
      const index_t first = (t - row.num_blocks) * block_tokens;
      // The last gather's missing keys: zero rows, which add nothing to dQ.
      detail::load_strided_rows_async<swizzled_tile<64>, T, 64>(ds_tile(t), vertical_rows + std::int64_t{first} * block_tokens, block_tokens,
                                                                row.num_tokens - first);
    }
    detail::load_row_tile_ahead_async<swizzled_tile<D>, T, D>(k_tile(t), p.k, row, t, p.heads_kv, hk, read);
  };
  // One copy group per tile, empty past the end, so that the count of groups in flight is fixed.
#pragma unroll 1
  for (index_t t = 0; t < stages - 1; ++t) {
    if (t < tiles) load(t, detail::planned_token<T, D>(row, t));
    detail::cp_async_commit();
  }

  float dq[D / 8][4] = {};
  index_t read = detail::planned_token<T, D>(row, stages - 1);
  for (index_t t = 0; t < tiles; ++t) {
    // The index of the tile copied in the next step, read now: a read just before the copies put a
    // global round trip into every step's critical path.
    const index_t read_next = detail::planned_token<T, D>(row, t + stages);
    detail::cp_async_wait<stages - 2>();  // tile t has landed
    detail::fence_async_shared();
    // Every warp's copies of tile t are visible, and every warp is done with tile t - 1, whose
    // stage tile t + stages - 1 refills.
    __syncthreads();
    detail::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
      detail::wgmma_ss<T, D, 1, 1>(reinterpret_cast<float(&)[D / 2]>(dq), detail::mn_major_operand<64>(ds_tile(t), k),
                                   detail::mn_major_operand<D>(k_tile(t), k), true);
    detail::wgmma_commit();
    // The copies of tile t + stages - 1 are queued while the product runs, from the index read a
    // step earlier.
    if (t + stages - 1 < tiles) load(t + stages - 1, read);
    detail::cp_async_commit();
    read = read_next;
    detail::wgmma_wait<0>();
    detail::fence_registers(reinterpret_cast<float(&)[D / 2]>(dq));
  }
  detail::finish_dq_rows<T, D>(p, q_block, h, dq);
}

}  // namespace stria::kernel
