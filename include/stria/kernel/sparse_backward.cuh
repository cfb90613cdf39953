// SPDX-License-Identifier: Apache-2.0
// Sparse attention backward on 64x64 tiles with mma.sync (sm80+), DESIGN 8. Deterministic mode: three
// passes over one step index, each the sole writer of what it accumulates (no atomics in the block passes):
//   dq:       one CTA per (local query block, query head) over the forward form (blocks, verticals);
//   dkdv:     one CTA per (local KV block, KV head) over the transposed form, all query heads of its group;
//   vertical: one CTA per 64 of a head's vertical tokens over the queries that use them; its dK/dV go
//             by fp32 atomics, or (deterministic) to per-entry scratch that add_vertical_gradients
//             folds in a fixed order. In the atomic mode the queries are split further into
//             gridDim.y ranges of query blocks, one CTA each (the early tokens' lists are long).
// Atomic mode: no dq pass; the two dK/dV passes also form dQ = dS K per tile (dS^T through shared
// memory) and add it by fp32 atomics (FlashAttention-2's scheme), 5 products per tile instead of 7.
// P is recomputed from the final LSE: P = exp(scale q.k - lse), dS = P (dP - delta), delta = rowsum(dO O).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "stria/core/config.hpp"
#include "stria/core/numeric.cuh"
#include "stria/index/step_index.hpp"
#include "stria/kernel/attention_tile.cuh"
#include "stria/kernel/search.cuh"

namespace stria::kernel {

template <class T>
struct backward_params {
  step_index_view index;  // device pointers
  const T* q;             // [Sq, Hq, D]
  const T* k;             // [Sk, Hkv, D]
  const T* v;             // [Sk, Hkv, D]
  const T* d_out;         // [Sq, Hq, D]
  const float* lse;       // [Hq, Sq]  final LSE over all steps, log2 domain (log2_lse; +inf: no keys)
  const float* delta;     // [Hq, Sq]  rowsum(dO * O)
  float* dq;              // [Sq, Hq, D]   accumulated (+=)
  float* dk;              // [Sk, Hkv, D]  accumulated (+=)
  float* dv;              // [Sk, Hkv, D]  accumulated (+=)
  float* vertical_dk;     // [vertical entries, D] deterministic scratch, else null (atomics)
  float* vertical_dv;
  index_t heads_q;
  index_t heads_kv;
  index_t query_tokens;
  float scale;       // softmax scale
  float scale_log2;  // softmax scale * log2(e)
  // The Hopper backward with stored dS (all null: its dQ pass recomputes dS). The dK/dV passes write
  // each tile's dS^T as rows [key][64 queries] of T: block tile e of the forward form (its CSR entry)
  // at rows 64 e .. 64 e + 63 of ds_blocks, vertical entry c (the forward form's col_token entry) at
  // row c of ds_vertical; the dQ pass reads them back in each row's tile order.
  T* ds_blocks = nullptr;                   // [block entries * 64, 64]
  T* ds_vertical = nullptr;                 // [vertical entries, 64]
  const index_t* kv_query_entry = nullptr;  // [kv_query entries]  the forward-form entry of each transposed tile
  // [vertical groups, num_query_blocks]: for vertical group G (vertical_group::index) and query block q,
  // the col_token entry of row (head, q)'s first token at or after the group's first token.
  const index_t* vertical_group_entry = nullptr;
  // The Hopper passes work on query heads [head_begin, head_end) (the stored dS, a range of heads at a
  // time); ds_blocks and ds_vertical then hold the range's entries, from these forward-form entries on.
  index_t head_begin = 0, head_end = INT_MAX;
  index_t ds_first_block = 0, ds_first_vertical = 0;
  // [Sq, Hq, D] or null: the Hopper dQ passes write T(dq + this step's dQ) here instead of adding to
  // dq (the layer's last step; dq null: this step's alone), which saves dq's fp32 round trips. The
  // Hopper dQ passes need dq or final_dq (sparse_backward always sets one).
  T* final_dq = nullptr;
};

/// Dynamic shared memory of each pass.
template <int D, class T>
constexpr std::size_t backward_dq_shared_bytes() {
  return 6 * sizeof(T) * shared_tile<D>::elements;  // Q, dO, 2 x K, 2 x V
}
/// The dK/dV passes, plus the dS^T tile when they also produce dQ (FusedDq, the atomic mode).
template <int D, class T, bool FusedDq>
constexpr std::size_t backward_dkdv_shared_bytes() {
  return 6 * sizeof(T) * shared_tile<D>::elements + 4 * sizeof(float) * block_tokens +  // K, V, 2 x Q, 2 x dO, 2 x (lse, delta)
         (FusedDq ? sizeof(T) * block_tokens * (block_tokens + 8) : 0);
}
template <int D, class T, bool FusedDq>
constexpr std::size_t backward_vertical_shared_bytes() {
  return 4 * sizeof(T) * shared_tile<D>::elements + 2 * sizeof(float) * block_tokens +  // K, V, Q, dO, lse, delta
         (FusedDq ? sizeof(T) * block_tokens * (block_tokens + 8) : 0);
}

namespace detail {

inline constexpr float log2e = 1.4426950408889634f;
inline constexpr int ds_stride = block_tokens + 8;  // elements per row of the dS^T tile (padded like the operand tiles)

/// A row's LSE in the log2 domain; +inf for a row that saw no keys anywhere, so its P is 0.
__device__ inline float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * log2e; }

/// Query and dO rows of one (local query block, head), queued as cp.async copies into tiles of
/// `Layout` (padded for the mma.sync passes, swizzled for the Hopper ones).
template <class Layout, class T, int D>
__device__ void load_query_tiles(const backward_params<T>& p, index_t q_block, index_t h, void* qs, void* dos) {
  const std::int64_t stride = std::int64_t{p.heads_q} * D;
  load_strided_rows_async<Layout, T, D>(qs, block_start(p.q, q_block, p.heads_q, h, D), stride);
  load_strided_rows_async<Layout, T, D>(dos, block_start(p.d_out, q_block, p.heads_q, h, D), stride);
}

/// K and V rows of one (local KV block, KV head), likewise.
template <class Layout, class T, int D>
__device__ void load_key_tiles(const backward_params<T>& p, index_t kv_block, index_t hk, void* ks, void* vs) {
  const std::int64_t stride = std::int64_t{p.heads_kv} * D;
  load_strided_rows_async<Layout, T, D>(ks, block_start(p.k, kv_block, p.heads_kv, hk, D), stride);
  load_strided_rows_async<Layout, T, D>(vs, block_start(p.v, kv_block, p.heads_kv, hk, D), stride);
}

/// The 64 rows' lse (log2 domain) and delta of one (local query block, head), queued as cp.async
/// copies with the tiles (a plain load here stalled the loading warps, and with them the barrier,
/// for a global-memory round trip every tile).
template <class T>
__device__ void load_row_statistics(const backward_params<T>& p, index_t q_block, index_t h, float* lse, float* delta) {
  const int j = static_cast<int>(threadIdx.x);
  if (j < block_tokens) {
    const std::int64_t at = static_cast<std::int64_t>(h) * p.query_tokens + static_cast<std::int64_t>(q_block) * block_tokens + j;
    cp_async_4(lse + j, p.lse + at);
    cp_async_4(delta + j, p.delta + at);
  }
}

/// dV += P^T dO and dK += dS^T Q for one tile, the warp's 16 keys against 64 queries; `masked(key,
/// query)` (positions within the tile) drops entries.
template <class T, int D, class Masked>
__device__ void accumulate_dkdv(const backward_params<T>& p, float (&dk)[D / 8][4], float (&dv)[D / 8][4], const T* ks, const T* vs,
                                const T* qs, const T* dos, const float* lse, const float* delta, Masked masked, T* ds_out = nullptr) {
  float s[8][4] = {}, dp[8][4] = {};
  product_abt<T, D>(s, ks, qs);   // S^T = K Q^T
  product_abt<T, D>(dp, vs, dos);  // dP^T = V dO^T
  const int key0 = 16 * static_cast<int>(threadIdx.x / 32);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + fragment_row(e), query = fragment_col(j, e);
      const float prob = masked(key, query) ? 0.0f : exp2f(s[j][e] * p.scale_log2 - lse[query]);
      s[j][e] = prob;
      dp[j][e] = prob * (dp[j][e] - delta[query]);
    }
  if (ds_out) {  // dS^T for the fused dQ product: [key][query], rounded to T like the other operands
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<unsigned*>(ds_out + (key0 + fragment_row(2 * half)) * ds_stride + fragment_col(j, 0)) =
            pack_pair<T>(dp[j][2 * half], dp[j][2 * half + 1]);
  }
  product_pb<T, D>(dv, s, dos);
  product_pb<T, D>(dk, dp, qs);
}

/// Fused dQ (the atomic mode): this warp's 16 query rows of dS K, from the dS^T tile of all four
/// warps (ds [key][query], transposed by ldmatrix) and the K tile, added to dq by fp32 atomics.
/// `query_row(r)` points at query row r of this head's dq.
template <class T, int D, class QueryRow>
__device__ void add_dq_atomic(const backward_params<T>& p, const T* ds, const T* ks, QueryRow query_row) {
  constexpr int stride = shared_tile<D>::stride;
  constexpr int part = D / 2;  // head-dim columns per round: half the accumulators, while dK and dV stay live
  const int lane = threadIdx.x % 32, query0 = 16 * static_cast<int>(threadIdx.x / 32);
#pragma unroll
  for (int first = 0; first < D; first += part) {
    float acc[part / 8][4] = {};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // keys 16k .. 16k + 15
      unsigned af[4];
      const int matrix = lane / 8;
      ldmatrix_x4_trans(af, ds + (16 * k + lane % 8 + (matrix / 2) * 8) * ds_stride + query0 + (matrix % 2) * 8);
#pragma unroll
      for (int n = 0; n < part / 16; ++n) {
        unsigned bf[4];
        ldmatrix_x4_trans(bf, ks + (16 * k + lane % 8 + ((lane / 8) % 2) * 8) * stride + first + 16 * n + (lane / 16) * 8);
        mma_16816<T>(acc[2 * n], af, bf[0], bf[1]);
        mma_16816<T>(acc[2 * n + 1], af, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float* row = query_row(query0 + fragment_row(2 * half)) + first;
#pragma unroll
      for (int j = 0; j < part / 8; ++j) {
        float* at = row + fragment_col(j, 0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2*>(at), make_float2(p.scale * acc[j][2 * half], p.scale * acc[j][2 * half + 1]));
#else
        atomicAdd(at, p.scale * acc[j][2 * half]);
        atomicAdd(at + 1, p.scale * acc[j][2 * half + 1]);
#endif
      }
    }
  }
}

/// Adds `scale * acc` (this warp's 16 rows x D of its warpgroup's 64) to rows of an fp32 tensor: row_pointer(r) for the
/// tile row r, null to skip. One writer per row, plain read-modify-write.
template <int D, class RowPointer>
__device__ void add_rows(const float (&acc)[D / 8][4], float scale, RowPointer row_pointer) {
  const int row0 = 16 * static_cast<int>((threadIdx.x / 32) % 4);  // the warp's rows within its warpgroup
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float* row = row_pointer(row0 + fragment_row(2 * half));
    if (!row) continue;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      float2* at = reinterpret_cast<float2*>(row + fragment_col(j, 0));
      float2 value = *at;
      value.x += scale * acc[j][2 * half];
      value.y += scale * acc[j][2 * half + 1];
      *at = value;
    }
  }
}

/// at[0] += x, at[1] += y (8-byte aligned, global memory) as one vector reduction (sm90; two
/// atomics before).
__device__ inline void reduce_add_v2(float* at, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(at), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(at, x);
  atomicAdd(at + 1, y);
#endif
}

/// add_rows by fp32 vector reductions, for rows that other CTAs of the same launch add to as well.
template <int D, class RowPointer>
__device__ void reduce_rows(const float (&acc)[D / 8][4], RowPointer row_pointer) {
  const int row0 = 16 * static_cast<int>((threadIdx.x / 32) % 4);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float* row = row_pointer(row0 + fragment_row(2 * half));
#pragma unroll
    for (int j = 0; j < D / 8; ++j) reduce_add_v2(row + fragment_col(j, 0), acc[j][2 * half], acc[j][2 * half + 1]);
  }
}

/// The query tiles of one (local KV block, KV head) in the transposed index, in the order the dK/dV
/// block passes walk them: for each query head of the group in turn, its ascending query blocks
/// whose tile with the block is active. A cursor names a query head of the group, an entry and the
/// end of that head's list.
struct kv_column {
  struct cursor {
    index_t j, e, end;  // entry e of the list of the group's head j, which ends at `end`
  };
  const step_index_view& index;
  index_t kv_block, hk, group;
  index_t j_begin, j_end;  // the group's heads walked: hk * group + [j_begin, j_end), from [head_begin, head_end)

  __device__ kv_column(const step_index_view& index, index_t kv_block, index_t hk, index_t group, index_t head_begin = 0,
                       index_t head_end = INT_MAX)
      : index(index), kv_block(kv_block), hk(hk), group(group), j_begin(max(0, min(group, head_begin - hk * group))),
        j_end(max(0, min(group, head_end - hk * group))) {}

  __device__ index_t list_start(index_t j) const { return index.kv_query_ptr[(hk * group + j) * index.shape.num_kv_blocks + kv_block]; }
  __device__ index_t list_end(index_t j) const { return index.kv_query_ptr[(hk * group + j) * index.shape.num_kv_blocks + kv_block + 1]; }
  __device__ index_t tiles() const {
    index_t count = 0;
    for (index_t j = j_begin; j < j_end; ++j) count += list_end(j) - list_start(j);
    return count;
  }
  /// c, moved past the heads whose lists are done (index reads only there: within a list, moving
  /// on is register arithmetic).
  __device__ cursor settle(cursor c) const {
    while (c.j < j_end && c.e == c.end) {
      ++c.j;
      if (c.j < j_end) c = {c.j, list_start(c.j), list_end(c.j)};
    }
    return c;
  }
  /// Only where tiles() > 0.
  __device__ cursor first() const { return settle({j_begin, list_start(j_begin), list_end(j_begin)}); }
  __device__ cursor next(cursor c) const { return settle({c.j, c.e + 1, c.end}); }
  __device__ index_t head(cursor c) const { return hk * group + c.j; }
  __device__ index_t query_block(cursor c) const { return index.kv_query[c.e]; }
};

/// One CTA's share of a vertical-token pass: entries [first, last) (at most 64) of head h's vertical
/// token list against the query blocks [begin, end_block). The launch is linear over the heads'
/// groups (blockIdx.x), its queries split into gridDim.y ranges; or, with `head_fastest`, (head,
/// group) = (blockIdx.x, blockIdx.y), queries unsplit, so that every head's first group (whose early
/// tokens reach nearly every query block) starts first.
struct vertical_group {
  index_t h = 0, first = 0, last = 0, begin = 0, end_block = 0;
  index_t index = 0;  // of the group among all heads' groups: id(h, group) below

  /// A number for group k of head h, distinct across heads and below (vertical tokens) / 64 + heads:
  /// a head's groups start at its first entry / 64 + h (the previous head's end at most).
  __host__ __device__ static constexpr index_t id(index_t head_first_entry, index_t h, index_t k) { return head_first_entry / block_tokens + h + k; }
  static constexpr std::int64_t id_bound(std::int64_t vertical_tokens, index_t heads) { return vertical_tokens / block_tokens + heads; }

  /// This CTA's group; false where it has none (past the last group, or past its head's).
  /// Groups of heads outside [head_begin, head_end) have none either.
  __device__ static bool of(const step_index_view& index, bool head_fastest, vertical_group& g, index_t head_begin = 0,
                            index_t head_end = INT_MAX) {
    return at(index, head_fastest, g, blockIdx.x, blockIdx.y, gridDim.y, head_begin, head_end);
  }
  /// The group of the CTA at (x, y) of a launch whose queries are split into `ranges` (of(), for a
  /// CTA that is one part of a larger launch).
  __device__ static bool at(const step_index_view& index, bool head_fastest, vertical_group& g, index_t x, index_t y, index_t ranges,
                            index_t head_begin = 0, index_t head_end = INT_MAX) {
    auto groups_of = [&](index_t h) { return (index.vtoken_head_ptr[h + 1] - index.vtoken_head_ptr[h] + block_tokens - 1) / block_tokens; };
    index_t group = x, range = y;
    if (head_fastest) {
      g.h = x, group = y, ranges = 1, range = 0;
      if (group >= groups_of(g.h)) return false;
    } else {
      for (g.h = 0; g.h < index.shape.num_heads; ++g.h) {
        const index_t groups = groups_of(g.h);
        if (group < groups) break;
        group -= groups;
      }
      if (g.h == index.shape.num_heads) return false;
    }
    if (g.h < head_begin || g.h >= head_end) return false;
    g.first = index.vtoken_head_ptr[g.h] + group * block_tokens;
    g.last = min(index.vtoken_head_ptr[g.h + 1], g.first + block_tokens);
    g.index = id(index.vtoken_head_ptr[g.h], g.h, group);
    const index_t span = (index.shape.num_query_blocks + ranges - 1) / ranges;
    g.begin = range * span;
    g.end_block = g.begin + span;
    return true;
  }
};

/// The walk of a vertical group's columns over their query blocks: thread c < 64 follows column c's
/// ascending query list within [begin, end_block); each round takes the smallest query block still
/// ahead of any column, and the columns whose cursor is on it. With `ranked` (for the stored dS), a
/// column on the round's block reports 1 + the number of such columns before it, instead of 1: the
/// row's tokens within the group's span are exactly those columns, in order, so this is the
/// column's place in the row's vertical list after the group's base entry.
class vertical_walk {
 public:
  __device__ vertical_walk(const step_index_view& index, const vertical_group& g, bool ranked = false)
      : list_(index.vtoken_query), ranked_(ranked) {
    const int tid = static_cast<int>(threadIdx.x);
    if (tid < block_tokens && g.first + tid < g.last) {
      const index_t from = index.vtoken_query_ptr[g.first + tid], to = index.vtoken_query_ptr[g.first + tid + 1];
      position_ = lower_bound_in(list_, from, to, g.begin);
      end_ = lower_bound_in(list_, position_, to, g.end_block);
      candidate_ = position_ < end_ ? list_[position_] : INT_MAX;
    }
  }

  /// The next round's query block, INT_MAX once every column is done; then used[c] is nonzero (1, or
  /// the rank) for the columns on it and 0 for the others. `warps` holds each column warp's minimum and
  /// how many of its columns are on it. Every thread of the CTA calls it (it holds a barrier).
  __device__ index_t next(index_t (&used)[block_tokens], index_t (&warps)[4]) {
    const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
    const index_t candidate = candidate_;
    if (tid < block_tokens) {
      index_t m = candidate;
      for (int offset = 16; offset > 0; offset /= 2) m = min(m, __shfl_xor_sync(0xffffffffu, m, offset));
      const int on_min = __popc(__ballot_sync(0xffffffffu, candidate == m));
      if (lane == 0) {
        warps[tid / 32] = m;
        warps[2 + tid / 32] = on_min;
      }
    }
    __syncthreads();
    const index_t q_block = min(warps[0], warps[1]);
    if (q_block != INT_MAX && tid < block_tokens) {
      const unsigned on = __ballot_sync(0xffffffffu, candidate == q_block);
      const index_t before = __popc(on & ((1u << lane) - 1u)) + (tid >= 32 && warps[0] == q_block ? warps[2] : 0);
      used[tid] = candidate == q_block ? (ranked_ ? before + 1 : 1) : 0;
      if (candidate == q_block) {
        ++position_;
        candidate_ = position_ < end_ ? list_[position_] : INT_MAX;  // read now, needed a round later
      }
    }
    return q_block;
  }

 private:
  const index_t* list_;
  bool ranked_;
  index_t position_ = 0, end_ = 0;
  index_t candidate_ = INT_MAX;  // list_[position_], read a round before the walk needs it
};

/// K and V rows of a vertical group's tokens (zeros past the last), queued as cp.async copies into
/// tiles of `Layout`.
template <class Layout, class T, int D>
__device__ void load_vertical_key_tiles(const backward_params<T>& p, const vertical_group& g, void* ks, void* vs) {
  const index_t hk = g.h / (p.heads_q / p.heads_kv);
  const std::int64_t stride = std::int64_t{p.heads_kv} * D;
  const index_t* tokens = p.index.vtoken + g.first;
  load_gathered_rows_async<Layout, T, D>(ks, p.k + std::int64_t{hk} * D, stride, tokens, g.last - g.first);
  load_gathered_rows_async<Layout, T, D>(vs, p.v + std::int64_t{hk} * D, stride, tokens, g.last - g.first);
}

/// The end of a vertical pass: this warp's rows of the group's dK (times `dk_scale`) and dV, written
/// to the entries' scratch rows (deterministic mode) or added to dk, dv by reductions.
template <class T, int D>
__device__ void write_vertical_gradients(const backward_params<T>& p, const vertical_group& g, const float (&dk)[D / 8][4],
                                         const float (&dv)[D / 8][4], float dk_scale) {
  const index_t hk = g.h / (p.heads_q / p.heads_kv);
  const int row0 = 16 * static_cast<int>((threadIdx.x / 32) % 4);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const index_t entry = g.first + row0 + fragment_row(2 * half);
    if (entry >= g.last) continue;
    const std::int64_t token = p.index.vtoken[entry];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int d = fragment_col(j, 0);
      const float2 k_part = make_float2(dk_scale * dk[j][2 * half], dk_scale * dk[j][2 * half + 1]);
      const float2 v_part = make_float2(dv[j][2 * half], dv[j][2 * half + 1]);
      if (p.vertical_dk) {
        *reinterpret_cast<float2*>(p.vertical_dk + static_cast<std::int64_t>(entry) * D + d) = k_part;
        *reinterpret_cast<float2*>(p.vertical_dv + static_cast<std::int64_t>(entry) * D + d) = v_part;
      } else {
        reduce_add_v2(p.dk + (token * p.heads_kv + hk) * D + d, k_part.x, k_part.y);
        reduce_add_v2(p.dv + (token * p.heads_kv + hk) * D + d, v_part.x, v_part.y);
      }
    }
  }
}

}  // namespace detail

/// out[i] = the final LSE lse[i] in the log2 domain (+inf for a row that saw no keys), what the
/// backward passes read.
template <int Unused = 0>
__global__ void log2_lse(const float* __restrict__ lse, float* __restrict__ out, std::int64_t count) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = detail::lse_log2(lse[i]);
}

/// delta[h, t] = sum_d dO[t, h, d] * O[t, h, d], one warp per (token, head).
template <class T>
__global__ void backward_delta(const T* __restrict__ out, const T* __restrict__ d_out, index_t tokens, index_t heads, index_t dim,
                               float* __restrict__ delta) {
  const std::int64_t row = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (row >= static_cast<std::int64_t>(tokens) * heads) return;
  const int lane = threadIdx.x % 32;
  const T* o = out + row * dim;
  const T* g = d_out + row * dim;
  float sum = 0.0f;
  for (int d = lane; d < dim; d += 32) sum += to_float(o[d]) * to_float(g[d]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[(row % heads) * tokens + row / heads] = sum;
}

/// backward_delta with 16-byte loads of 2-byte elements: `Lanes` threads per row of Lanes * 8 elements
/// (D 64: 8, D 128: 16), out and d_out 16-byte aligned. The scalar kernel above loads one element per
/// lane at a time and reached about half the copy bandwidth.
template <class T, int Lanes>
__global__ void backward_delta_vectorized(const T* __restrict__ out, const T* __restrict__ d_out, index_t tokens, index_t heads,
                                          float* __restrict__ delta) {
  static_assert(sizeof(T) == 2, "eight elements per 16-byte load: bf16 or fp16");
  static_assert(Lanes >= 1 && Lanes <= 32 && (Lanes & (Lanes - 1)) == 0, "a row's lanes are a power-of-two part of a warp");
  constexpr int dim = 8 * Lanes;
  const std::int64_t thread = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t rows = static_cast<std::int64_t>(tokens) * heads, row = thread / Lanes;
  const int part = static_cast<int>(thread % Lanes);
  float sum = 0.0f;
  if (row < rows) {  // no early return: the whole warp takes part in the shuffles
    const uint4 o = *reinterpret_cast<const uint4*>(out + row * dim + 8 * part);
    const uint4 g = *reinterpret_cast<const uint4*>(d_out + row * dim + 8 * part);
    const T* op = reinterpret_cast<const T*>(&o);
    const T* gp = reinterpret_cast<const T*>(&g);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += to_float(op[i]) * to_float(gp[i]);
  }
#pragma unroll
  for (int offset = Lanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (row < rows && part == 0) delta[(row % heads) * tokens + row / heads] = sum;
}

template <class T, int D>
__global__ void __launch_bounds__(attention_threads) sparse_backward_dq(backward_params<T> p) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int tile = shared_tile<D>::elements;
  T* qs = reinterpret_cast<T*>(shared);
  T* dos = qs + tile;
  T* ks = dos + tile;     // 2 tiles
  T* vs = ks + 2 * tile;  // 2 tiles

  const index_t q_block = detail::launched_query_block(), h = blockIdx.y;
  const index_t hk = h / (p.heads_q / p.heads_kv);
  const detail::row_tiles row = detail::row_tiles::of(p.index, p.index.row(h, q_block));
  const index_t tiles = row.count();
  const int warp = threadIdx.x / 32;
  if (tiles == 0) return;  // nothing of this step reaches the row: dq unchanged

  auto load_kv = [&](index_t t, int buffer) {
    detail::load_row_tile_async<padded_tile<T, D>, T, D>(ks + buffer * tile, p.k, row, t, p.heads_kv, hk);
    detail::load_row_tile_async<padded_tile<T, D>, T, D>(vs + buffer * tile, p.v, row, t, p.heads_kv, hk);
  };
  detail::load_query_tiles<padded_tile<T, D>, T, D>(p, q_block, h, qs, dos);
  load_kv(0, 0);
  detail::cp_async_commit();

  float lse[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t at = static_cast<std::int64_t>(h) * p.query_tokens + q_block * block_tokens + 16 * warp + detail::fragment_row(2 * half);
    lse[half] = p.lse[at];
    delta[half] = p.delta[at];
  }

  float dq[D / 8][4] = {};
  for (index_t t = 0; t < tiles; ++t) {
    const int buffer = static_cast<int>(t % 2);
    if (t + 1 < tiles) {
      load_kv(t + 1, buffer ^ 1);
      detail::cp_async_commit();
      detail::cp_async_wait<1>();
    } else {
      detail::cp_async_wait<0>();
    }
    __syncthreads();
    float s[8][4] = {}, dp[8][4] = {};
    detail::product_abt<T, D>(s, qs, ks + buffer * tile);   // S = Q K^T
    detail::product_abt<T, D>(dp, dos, vs + buffer * tile);  // dP = dO V^T
    const bool diagonal = row.is_block(t) && p.index.needs_causal_mask(q_block, row.blocks[t]);
    const int valid = row.valid_columns(t);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * warp + detail::fragment_row(e), c = detail::fragment_col(j, e);
        const bool masked = c >= valid || (diagonal && c > r);
        const float prob = masked ? 0.0f : exp2f(s[j][e] * p.scale_log2 - lse[e / 2]);
        s[j][e] = prob * (dp[j][e] - delta[e / 2]);  // dS
      }
    detail::product_pb<T, D>(dq, s, ks + buffer * tile);  // dQ += dS K
    __syncthreads();
  }
  detail::add_rows<D>(dq, p.scale, [&](int r) {
    return p.dq + ((static_cast<std::int64_t>(q_block) * block_tokens + r) * p.heads_q + h) * D;
  });
}

template <class T, int D, bool FusedDq>
__global__ void __launch_bounds__(attention_threads) sparse_backward_dkdv(backward_params<T> p) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int tile = shared_tile<D>::elements;
  T* ks = reinterpret_cast<T*>(shared);
  T* vs = ks + tile;
  T* qs = vs + tile;       // 2 tiles
  T* dos = qs + 2 * tile;  // 2 tiles
  float* lse = reinterpret_cast<float*>(dos + 2 * tile);  // 2 x 64
  float* delta = lse + 2 * block_tokens;                 // 2 x 64
  T* ds = reinterpret_cast<T*>(delta + 2 * block_tokens);  // [64 keys][64 + 8] when FusedDq

  const index_t kv_block = blockIdx.x, hk = blockIdx.y;
  const detail::kv_column column{p.index, kv_block, hk, p.heads_q / p.heads_kv};
  const index_t tiles = column.tiles();
  if (tiles == 0) return;
  auto load = [&](detail::kv_column::cursor c, int buffer) {
    const index_t h = column.head(c), q_block = column.query_block(c);
    detail::load_query_tiles<padded_tile<T, D>, T, D>(p, q_block, h, qs + buffer * tile, dos + buffer * tile);
    detail::load_row_statistics(p, q_block, h, lse + buffer * block_tokens, delta + buffer * block_tokens);
  };

  detail::load_key_tiles<padded_tile<T, D>, T, D>(p, kv_block, hk, ks, vs);
  detail::kv_column::cursor current = column.first();
  load(current, 0);
  detail::cp_async_commit();

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (index_t t = 0; t < tiles; ++t) {
    const int buffer = static_cast<int>(t % 2);
    const detail::kv_column::cursor next = column.next(current);
    if (t + 1 < tiles) {
      load(next, buffer ^ 1);
      detail::cp_async_commit();
      detail::cp_async_wait<1>();
    } else {
      detail::cp_async_wait<0>();
    }
    __syncthreads();
    const index_t q_block = column.query_block(current);
    const bool diagonal = p.index.needs_causal_mask(q_block, kv_block);
    detail::accumulate_dkdv<T, D>(p, dk, dv, ks, vs, qs + buffer * tile, dos + buffer * tile, lse + buffer * block_tokens,
                                  delta + buffer * block_tokens, [diagonal](int key, int query) { return diagonal && query < key; },
                                  FusedDq ? ds : nullptr);
    if constexpr (FusedDq) {
      __syncthreads();  // dS^T of all four warps
      const index_t h = column.head(current);
      detail::add_dq_atomic<T, D>(p, ds, ks, [&](int r) {
        return p.dq + ((static_cast<std::int64_t>(q_block) * block_tokens + r) * p.heads_q + h) * D;
      });
    }
    __syncthreads();
    current = next;
  }
  auto rows = [&](float* base) {
    return [=, &p](int r) { return base + ((static_cast<std::int64_t>(kv_block) * block_tokens + r) * p.heads_kv + hk) * D; };
  };
  detail::add_rows<D>(dk, p.scale, rows(p.dk));
  detail::add_rows<D>(dv, 1.0f, rows(p.dv));
}

template <class T, int D, bool FusedDq>
__global__ void __launch_bounds__(attention_threads) sparse_backward_vertical(backward_params<T> p) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int tile = shared_tile<D>::elements;
  T* ks = reinterpret_cast<T*>(shared);
  T* vs = ks + tile;
  T* qs = vs + tile;
  T* dos = qs + tile;
  float* lse = reinterpret_cast<float*>(dos + tile);
  float* delta = lse + block_tokens;
  T* ds = reinterpret_cast<T*>(delta + block_tokens);  // [64 keys][64 + 8] when FusedDq
  __shared__ index_t used[block_tokens];  // 1 where the token of the column uses the current query block
  __shared__ index_t warp_min[4];

  detail::vertical_group g;
  if (!detail::vertical_group::of(p.index, false, g)) return;
  detail::load_vertical_key_tiles<padded_tile<T, D>, T, D>(p, g, ks, vs);
  detail::cp_async_commit();

  detail::vertical_walk walk(p.index, g);
  bool worked = false;  // whether any query block of the range used a column
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (;;) {
    const index_t q_block = walk.next(used, warp_min);
    if (q_block == INT_MAX) break;
    worked = true;
    detail::load_query_tiles<padded_tile<T, D>, T, D>(p, q_block, g.h, qs, dos);
    detail::load_row_statistics(p, q_block, g.h, lse, delta);
    detail::cp_async_commit();
    detail::cp_async_wait<0>();
    __syncthreads();
    detail::accumulate_dkdv<T, D>(p, dk, dv, ks, vs, qs, dos, lse, delta, [&](int key, int) { return used[key] == 0; },
                                  FusedDq ? ds : nullptr);
    if constexpr (FusedDq) {
      __syncthreads();  // dS^T of all four warps
      detail::add_dq_atomic<T, D>(p, ds, ks, [&](int r) {
        return p.dq + ((static_cast<std::int64_t>(q_block) * block_tokens + r) * p.heads_q + g.h) * D;
      });
    }
    __syncthreads();
  }
  if (!worked && p.vertical_dk == nullptr) return;  // no atomics of zeros (the scratch must be written)
  detail::write_vertical_gradients<T, D>(p, g, dk, dv, p.scale);
}

/// Deterministic mode: adds the scratch dK/dV of the vertical entries of query heads h with
/// h % group == offset to their tokens. Within one launch no two entries share a (token, KV head);
/// launching offsets 0, 1, ... in order fixes the summation order.
template <int D>
__global__ void add_vertical_gradients(step_index_view index, const float* __restrict__ vertical_dk, const float* __restrict__ vertical_dv,
                                       index_t entries, index_t heads_kv, index_t group, index_t offset, float* dk, float* dv) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<std::int64_t>(entries) * D) return;
  const index_t entry = static_cast<index_t>(i / D);
  const int d = static_cast<int>(i % D);
  index_t lo = 0, hi = index.shape.num_heads;  // the head: the last h with vtoken_head_ptr[h] <= entry
  while (hi - lo > 1) {
    const index_t mid = (lo + hi) / 2;
    if (index.vtoken_head_ptr[mid] <= entry) lo = mid;
    else hi = mid;
  }
  if (lo % group != offset) return;
  const std::int64_t at = (static_cast<std::int64_t>(index.vtoken[entry]) * heads_kv + lo / group) * D + d;
  dk[at] += vertical_dk[i];
  dv[at] += vertical_dv[i];
}

}  // namespace stria::kernel
