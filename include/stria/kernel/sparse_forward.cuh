// SPDX-License-Identifier: Apache-2.0
// Sparse attention forward on 64x64 tiles with mma.sync (sm80+), DESIGN 8: one CTA per (local query
// block, query head) walks the row's active KV blocks, then its vertical tokens gathered 64 at a time,
// with an fp32 online softmax (exp2), and merges this step's O and LSE into the fp32 running state.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "stria/core/config.hpp"
#include "stria/core/numeric.cuh"
#include "stria/core/softmax_merge.hpp"
#include "stria/index/step_index.hpp"
#include "stria/kernel/attention_tile.cuh"

namespace stria::kernel {

template <class T>
struct forward_params {
  step_index_view index;  // device pointers
  const T* q;             // [Sq, Hq, D]
  const T* k;             // [Sk, Hkv, D]
  const T* v;             // [Sk, Hkv, D]
  float* out;             // [Sq, Hq, D]  running output (fp32)
  float* lse;             // [Hq, Sq]     running LSE (natural log)
  index_t heads_q;
  index_t heads_kv;
  index_t query_tokens;
  float scale_log2;  // softmax scale * log2(e)
  bool merge;        // merge into the running state (false: overwrite it, the first step)
};

/// Dynamic shared memory of the forward: the query tile and two K and two V tiles (double buffer).
template <int D, class T>
constexpr std::size_t forward_shared_bytes() {
  return 5 * sizeof(T) * shared_tile<D>::elements;
}

template <class T, int D>
__global__ void __launch_bounds__(attention_threads) sparse_forward(forward_params<T> p) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int tile = shared_tile<D>::elements;
  T* qs = reinterpret_cast<T*>(shared);
  T* ks = qs + tile;      // 2 tiles
  T* vs = ks + 2 * tile;  // 2 tiles

  const index_t q_block = blockIdx.x, h = blockIdx.y;
  const index_t hk = h / (p.heads_q / p.heads_kv);
  const detail::row_tiles row = detail::row_tiles::of(p.index, p.index.row(h, q_block));
  const index_t tiles = row.count();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  auto load_kv = [&](index_t t, int buffer) {
    auto key_row = [&](const T* base) {
      return [&row, t, base, hk, &p](int j) -> const T* {
        const index_t token = row.token(t, j);
        return token < 0 ? nullptr : base + (static_cast<std::int64_t>(token) * p.heads_kv + hk) * D;
      };
    };
    detail::load_tile_async<T, D>(ks + buffer * tile, p.k, key_row(p.k));
    detail::load_tile_async<T, D>(vs + buffer * tile, p.v, key_row(p.v));
  };

  detail::load_tile_async<T, D>(qs, p.q, [&](int j) {
    return p.q + ((static_cast<std::int64_t>(q_block) * block_tokens + j) * p.heads_q + h) * D;
  });
  if (tiles > 0) load_kv(0, 0);
  detail::cp_async_commit();

  float o[D / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 domain, rows g and g + 8 of the warp
  float row_sum[2] = {0.0f, 0.0f};            // this lane's share; summed over the quad at the end
  unsigned qf[D / 16][4];

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
    if (t == 0) detail::load_row_fragments<T, D>(qf, qs);

    float s[8][4] = {};
    detail::product_abt<T, D>(s, qf, ks + buffer * tile);

    // Scale into the log2 domain and mask: inside the causal triangle of a diagonal tile, and past
    // the end of the last vertical gather. Other tiles need no mask.
    const bool diagonal = row.is_block(t) && p.index.needs_causal_mask(q_block, row.blocks[t]);
    const int valid = row.valid_columns(t);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * warp + detail::fragment_row(e), c = detail::fragment_col(j, e);
        const bool masked = c >= valid || (diagonal && c > r);
        s[j][e] = masked ? -INFINITY : s[j][e] * p.scale_log2;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[j][e]);
      }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float new_max = fmaxf(row_max[half], detail::quad_max(tile_max[half]));
      const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row masked so far stays at 0
      const float correction = exp2f(row_max[half] - base);
      row_max[half] = new_max;
      row_sum[half] *= correction;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * half] *= correction;
        o[j][2 * half + 1] *= correction;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[j][2 * half] = exp2f(s[j][2 * half] - base);
        s[j][2 * half + 1] = exp2f(s[j][2 * half + 1] - base);
        row_sum[half] += s[j][2 * half] + s[j][2 * half + 1];
      }
    }
    detail::product_pb<T, D>(o, s, vs + buffer * tile);
    __syncthreads();  // the buffer is refilled two tiles later
  }

  // Epilogue: normalise, then overwrite or merge the running state (each CTA owns its rows).
  constexpr float ln2 = 0.693147180559945309f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const index_t token = q_block * block_tokens + 16 * warp + lane / 4 + 8 * half;
    const float sum = detail::quad_sum(row_sum[half]);
    const float step_lse = sum > 0.0f ? (row_max[half] + log2f(sum)) * ln2 : -INFINITY;
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    float* out_row = p.out + (static_cast<std::int64_t>(token) * p.heads_q + h) * D;
    float* lse_at = p.lse + static_cast<std::int64_t>(h) * p.query_tokens + token;
    float weight_old = 0.0f, weight_new = 1.0f, lse = step_lse;
    if (p.merge) {
      const lse_merge<float> m = merge_lse(*lse_at, step_lse);
      weight_old = m.weight_a;
      weight_new = m.weight_b;
      lse = m.lse;
    }
    __syncwarp();  // every lane of the quad has read the old LSE before lane 0 replaces it
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      float2* at = reinterpret_cast<float2*>(out_row + detail::fragment_col(j, 0));
      float2 value = make_float2(o[j][2 * half] * inverse * weight_new, o[j][2 * half + 1] * inverse * weight_new);
      if (weight_old != 0.0f) {  // a zero weight drops the old side, so an empty row cannot give 0 * inf
        const float2 old = *at;
        value.x += weight_old * old.x;
        value.y += weight_old * old.y;
      }
      *at = value;
    }
    if (lane % 4 == 0) *lse_at = lse;
  }
}

/// out[i] = running[i] rounded to T: the last step's cast of the fp32 running output.
template <class T>
__global__ void write_output(const float* __restrict__ running, T* __restrict__ out, std::int64_t count) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(running[i]);
}

}  // namespace stria::kernel
