// SPDX-License-Identifier: Apache-2.0
// Sparse attention forward on 64x64 tiles with mma.sync (sm80+), DESIGN 8: one CTA per (local query
// block, query head) walks the row's active KV blocks, then its vertical tokens gathered 64 at a time,
// with an fp32 online softmax (exp2), and merges this step's O and LSE into the fp32 running state.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "stria/core/config.hpp"
#include "stria/core/numeric.cuh"
#include "stria/core/softmax_merge.hpp"
#include "stria/index/step_index.hpp"
#include "stria/kernel/attention_tile.cuh"
#include "stria/kernel/pipeline.cuh"
#include "stria/kernel/wgmma.cuh"

namespace stria::kernel {

/// The mma.sync forward is held to 168 registers so that three CTAs (12 warps) share an SM: at
/// 170-175 registers only two fit, which measured 10-20% slower.
inline constexpr int forward_ctas_per_sm = 3;
template <class T>
struct forward_params {
  step_index_view index;  // device pointers
  const T* q;             // [Sq, Hq, D]
  const T* k;             // [Sk, Hkv, D]
  const T* v;             // [Sk, Hkv, D]
  float* out;             // [Sq, Hq, D]  running output (fp32); null on a single step with final_out
  float* lse;             // [Hq, Sq]     running LSE (natural log)
  index_t heads_q;
  index_t heads_kv;
  index_t query_tokens;
  float scale_log2;  // softmax scale * log2(e)
  bool merge;        // merge into the running state (false: overwrite it, the first step)
  T* final_out;      // [Sq, Hq, D] or null: the last step writes the merged output here in T, not to `out`
};

namespace detail {

/// One step of the online softmax (FlashAttention-2) over N tiles of the row at once: masks this
/// warp's raw scores `s` (the causal triangle of a diagonal tile; columns past `valid` of the last
/// vertical gather), updates the running row statistics (log2 domain) and leaves P in `s`. The scale
/// enters once per element, fused into the exponent's argument as s scale log2 e - max (the maximum is
/// taken over raw scores: the scale is positive). The output must then be multiplied by `correction`
/// (rescale_rows), which the Hopper kernel defers until its previous P V product has landed. Over two
/// tiles the row maxima, the quad shuffles and the correction are paid once per 128 keys.
template <int N>
__device__ void softmax_tiles(float (&s)[N][8][4], float (&row_max)[2], float (&row_sum)[2], float (&correction)[2], float scale_log2,
                              const bool (&diagonal)[N], const int (&valid)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    // Most tiles skip the mask arithmetic. The test is a warp vote although its value is the same
    // in every lane: ptxas cannot see that, and as a plain branch it put a convergence region
    // (BSSY/BSYNC) around the paired forward's P V issue; a vote's branch needs none (SASS,
    // tests/tools/sass_loops.py). Its time did not change (RESULTS, 2026-12-04, seventh).
    if (__any_sync(0xffffffffu, diagonal[i] || valid[i] < block_tokens)) {
      const int warp_row0 = 16 * static_cast<int>((threadIdx.x / 32) % 4);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = warp_row0 + fragment_row(e), c = fragment_col(j, e);
          if (c >= valid[i] || (diagonal[i] && c > r)) s[i][j][e] = -INFINITY;
        }
    }
  }
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[i][j][e]);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float new_max = fmaxf(row_max[half], quad_max(tile_max[half]) * scale_log2);
    const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row masked so far stays at 0
    correction[half] = exp2_ftz(row_max[half] - base);
    row_max[half] = new_max;
    row_sum[half] *= correction[half];
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[i][j][2 * half] = exp2_ftz(fmaf(s[i][j][2 * half], scale_log2, -base));
        s[i][j][2 * half + 1] = exp2_ftz(fmaf(s[i][j][2 * half + 1], scale_log2, -base));
        row_sum[half] += s[i][j][2 * half] + s[i][j][2 * half + 1];
      }
  }
}

/// softmax_tiles over one tile.
__device__ inline void softmax_tile(float (&s)[8][4], float (&row_max)[2], float (&row_sum)[2], float (&correction)[2], float scale_log2,
                                    bool diagonal, int valid) {
  const bool diagonals[1] = {diagonal};
  const int valids[1] = {valid};
  softmax_tiles<1>(reinterpret_cast<float(&)[1][8][4]>(s), row_max, row_sum, correction, scale_log2, diagonals, valids);
}

template <int D>
__device__ void rescale_rows(float (&o)[D / 8][4], const float (&correction)[2]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] *= correction[e / 2];
}

/// Epilogue: normalises this warp's rows and overwrites or merges the running state (each CTA
/// owns its rows, so plain read-modify-write); on the last step (`final_out`) the merged rows go
/// out in T instead, which saves the running output's write and a pass that casts it.
template <class T, int D>
__device__ void write_forward_rows(const forward_params<T>& p, index_t q_block, index_t h, const float (&o)[D / 8][4],
                                   const float (&row_max)[2], const float (&row_sum)[2]) {
  constexpr float ln2 = 0.693147180559945309f;
  const int lane = threadIdx.x % 32, warp_row0 = 16 * static_cast<int>((threadIdx.x / 32) % 4);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const index_t token = q_block * block_tokens + warp_row0 + fragment_row(2 * half);
    const float sum = quad_sum(row_sum[half]);
    // Only an empty row (sum exactly 0) is -inf: a NaN sum (a NaN score) must stay NaN, or the next
    // step's merge would drop this step's rows as empty and the output would be silently wrong.
    const bool empty = sum == 0.0f;
    const float step_lse = empty ? -INFINITY : (row_max[half] + log2f(sum)) * ln2;
    const float inverse = empty ? 0.0f : 1.0f / sum;
    float* out_row = p.out ? p.out + (static_cast<std::int64_t>(token) * p.heads_q + h) * D : nullptr;  // null: one step, final_out
    float* lse_at = p.lse + static_cast<std::int64_t>(h) * p.query_tokens + token;
    float weight_old = 0.0f, weight_new = 1.0f, lse = step_lse;
    if (p.merge) {
      const lse_merge<float> m = merge_lse(*lse_at, step_lse);
      weight_old = m.weight_a;
      weight_new = m.weight_b;
      lse = m.lse;
    }
    __syncwarp();  // every lane of the quad has read the old LSE before lane 0 replaces it
    // The row's old running output, every load before the first store, and one store loop per
    // destination: with each piece loaded right after the store of the one before it, in the same
    // lines, a ring's middle step ran 15.7x slower than its first (the suspected cause; RESULTS
    // 2026-12-05, fifth). A zero weight drops the old side, so an empty row cannot give 0 * inf.
    float2 old[D / 8];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      old[j] = weight_old != 0.0f ? *reinterpret_cast<const float2*>(out_row + fragment_col(j, 0)) : make_float2(0.0f, 0.0f);
    asm volatile("" ::: "memory");  // keeps the loads above the stores in NVVM (ptxas may still reorder)
    const auto merged = [&](int j) {
      return make_float2(o[j][2 * half] * inverse * weight_new + weight_old * old[j].x,
                         o[j][2 * half + 1] * inverse * weight_new + weight_old * old[j].y);
    };
    if (p.final_out) {
      T* final_row = p.final_out + (static_cast<std::int64_t>(token) * p.heads_q + h) * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float2 value = merged(j);
        *reinterpret_cast<unsigned*>(final_row + fragment_col(j, 0)) = pack_pair<T>(value.x, value.y);
      }
    } else {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) *reinterpret_cast<float2*>(out_row + fragment_col(j, 0)) = merged(j);
    }
    if (lane % 4 == 0) *lse_at = lse;
  }
}

}  // namespace detail

/// Dynamic shared memory of the forward: two K and two V tiles (double buffer). The query tile is
/// staged through the second V tile: its fragments live in registers before that tile is refilled.
template <int D, class T>
constexpr std::size_t forward_shared_bytes() {
  return 4 * sizeof(T) * shared_tile<D>::elements;
}

/// Grouped: the launch order (launched_row_unit).
template <class T, int D, bool Grouped = false>
__global__ void __launch_bounds__(attention_threads, forward_ctas_per_sm) sparse_forward(forward_params<T> p) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int tile = shared_tile<D>::elements;
  T* ks = reinterpret_cast<T*>(shared);  // 2 tiles
  T* vs = ks + 2 * tile;                 // 2 tiles

  const detail::launched_unit unit = detail::launched_row_unit<Grouped>();
  const index_t q_block = unit.unit, h = unit.head;
  const index_t hk = h / (p.heads_q / p.heads_kv);
  const detail::row_tiles row = detail::row_tiles::of(p.index, p.index.row(h, q_block));
  const index_t tiles = row.count();

  using layout = padded_tile<T, D>;
  auto load_tile = [&](const T* base, index_t t, T* to) { detail::load_row_tile_async<layout, T, D>(to, base, row, t, p.heads_kv, hk); };

  // Prologue: the query tile (into V buffer 1) and tile 0, one copy group each for K and V.
  detail::load_strided_rows_async<layout, T, D>(vs + tile, detail::block_start(p.q, q_block, p.heads_q, h, D), std::int64_t{p.heads_q} * D);
  if (tiles > 0) {
    load_tile(p.k, 0, ks);
    detail::cp_async_commit();
    load_tile(p.v, 0, vs);
  }
  detail::cp_async_commit();
  unsigned qf[D / 16][4];
  detail::cp_async_wait<0>();
  __syncthreads();
  detail::load_row_fragments<T, D>(qf, vs + tile);

  float o[D / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 domain, rows g and g + 8 of the warp
  float row_sum[2] = {0.0f, 0.0f};            // this lane's share; summed over the quad at the end

  for (index_t t = 0; t < tiles; ++t) {
    const int buffer = static_cast<int>(t % 2);
    // Copy groups in flight here: K(t), V(t) (complete for t = 0). The barrier also ends every
    // warp's use of the other buffer (tile t - 1, or the query tile), so tile t + 1 may go there.
    detail::cp_async_wait<1>();
    __syncthreads();
    if (t + 1 < tiles) load_tile(p.k, t + 1, ks + (buffer ^ 1) * tile);
    detail::cp_async_commit();
    if (t + 1 < tiles) load_tile(p.v, t + 1, vs + (buffer ^ 1) * tile);
    detail::cp_async_commit();

    float s[8][4] = {};
    detail::product_abt<T, D>(s, qf, ks + buffer * tile);

    const bool diagonal = row.is_block(t) && p.index.needs_causal_mask(q_block, row.blocks[t]);
    float correction[2];
    detail::softmax_tile(s, row_max, row_sum, correction, p.scale_log2, diagonal, row.valid_columns(t));
    detail::rescale_rows<D>(o, correction);
    detail::cp_async_wait<2>();  // V(t); K(t + 1) and V(t + 1) may still be in flight
    __syncthreads();
    detail::product_pb<T, D>(o, s, vs + buffer * tile);
  }

  detail::write_forward_rows<T, D>(p, q_block, h, o, row_max, row_sum);
}

/// Tuning of the Hopper forward, per head dim. A CTA is a consumer warpgroup and a producer
/// warpgroup; `setmaxnreg` moves registers from the producer to the consumer, which keeps the scores
/// of the next step, P of this one, O and Q's fragments live while both products run. On each SM
/// sub-partition every CTA places one warp of each; the CTA is launched with the registers its share
/// of the SM allows (65536 / (256 x ctas_per_sm), rounded down to a multiple of 8), and the consumer can
/// only take what the producer gives back, so the two counts sum to at most twice that (setmaxnreg
/// would wait forever for more). The producer's copies fill its registers: it needs 32 (with 24 its
/// gathers spill), which leaves the consumer 128 at D 64 and 224 at D 128.
///
/// A consumer step covers `tiles_per_step` tiles of the row (128 keys at D 128: one softmax, one set
/// of shuffles and one rescale per two tiles, as FlashAttention-3's 128-key blocks); `k_stages` K and
/// `v_stages` V tiles are in flight. A step holds its two K tiles until their scores land: with three K
/// stages the consumer waited for K 15% of its time (ncu, vs95) while the V ring stayed full, so D 128
/// has four K stages and three V (two K and four V measured slower still). Against one-tile steps over
/// three stages of each: 2-3% faster on H200 (RESULTS, 2026-12-02). At D 64 two-tile steps need more
/// registers than three CTAs per SM leave the consumer, and at two CTAs per SM they measured 7% slower
/// than one-tile steps at three (RESULTS, 2026-12-03, third).
///
/// Paired (D 128, complete indices only: every row holds every tile the causal rule allows): a CTA
/// is one producer and two consumer warpgroups, query blocks 2p and 2p + 1 of a head, and one CTA per
/// SM. Block 2p + 1's row holds every tile of block 2p's (local query blocks ascend in their global
/// blocks), so the producer streams that row once for both consumers and the first masks what lies
/// past its diagonal: each K and V tile leaves L2 once per 128 query rows instead of 64. Dense causal
/// 128K on an H200: 138.9-139.8 -> 134.9-135.2 ms, where a probe kernel of the same design ran
/// 119.3-121.6 ms; the gap is not understood: neither the producer's index reads nor the tiles' L2
/// locality explain it (RESULTS, 2026-12-04 sixth and seventh, 2026-12-06 and its second). Over
/// the union of two sparse rows the probe measured 8-25% slower than two CTAs of one row each, so
/// sparse rows keep those.
///
/// A CTA per row, not persistent CTAs: four persistent forms (static walks, a dynamic walk from a
/// counter) were none faster by more than 1% and most slower, by up to 19% (dense 128K), with ptxas
/// spilling the producer's 32 registers in every one; with two or three CTAs per SM a CTA's start
/// already overlaps the others' main loops (RESULTS, 2026-12-03 second, 2026-12-04, 2026-12-04
/// second, 2026-12-06 fifth).
struct forward_wgmma_tuning {
  int k_stages;
  int v_stages;
  int tiles_per_step;
  int ctas_per_sm;
  int producer_registers;
  int consumer_registers;
  int consumers = 1;  // consumer warpgroups per CTA (2: the paired forward)

  STRIA_HOST_DEVICE constexpr int threads() const { return (consumers + 1) * attention_threads; }
  STRIA_HOST_DEVICE constexpr int launch_registers() const { return 65536 / (threads() * ctas_per_sm) / 8 * 8; }
};
template <int D, bool Paired = false>
inline constexpr forward_wgmma_tuning forward_wgmma_config =
    Paired     ? forward_wgmma_tuning{.k_stages = 6, .v_stages = 6, .tiles_per_step = 2, .ctas_per_sm = 1, .producer_registers = 40,
                                      .consumer_registers = 232, .consumers = 2}  // 192 KiB
    : D == 128 ? forward_wgmma_tuning{.k_stages = 4, .v_stages = 3, .tiles_per_step = 2, .ctas_per_sm = 2, .producer_registers = 32,
                                      .consumer_registers = 224}  // 112 KiB
               : forward_wgmma_tuning{.k_stages = 4, .v_stages = 4, .tiles_per_step = 1, .ctas_per_sm = 3, .producer_registers = 32,
                                      .consumer_registers = 128};  // 64 KiB

template <int D, bool Paired = false>
inline constexpr int forward_wgmma_threads = forward_wgmma_config<D, Paired>.threads();
/// The kernel names its step size through this variable template: a local constexpr copy used as an
/// array bound inside the kernel's lambdas crashes nvcc 13.0's front end (cudafe++).
template <int D>
inline constexpr int forward_step_tiles = forward_wgmma_config<D>.tiles_per_step;

/// The forward's rings of stages: their barriers live in dynamic shared memory after the tiles.
template <int D, bool Paired = false>
using forward_rings = detail::row_tile_rings<forward_wgmma_config<D, Paired>.k_stages, forward_wgmma_config<D, Paired>.v_stages,
                                             forward_wgmma_config<D, Paired>.consumers>;

/// Dynamic shared memory of the Hopper forward: the K and V rings in the swizzled layout, then their
/// barriers. The kernel declares no static shared memory, so the dynamic block starts on a 1024-byte
/// boundary (the swizzle's period; the kernel checks) and no alignment slack is asked for: at D 128,
/// 4 + 3 stages of 16 KiB and two CTAs per SM fill the SM's 228 KiB to within 1.75 KiB.
template <int D, bool Paired = false>
constexpr std::size_t forward_wgmma_shared_bytes() {
  constexpr forward_wgmma_tuning tuning = forward_wgmma_config<D, Paired>;
  return (tuning.k_stages + tuning.v_stages) * swizzled_tile<D>::bytes + sizeof(forward_rings<D, Paired>);
}
// The SM's 228 KiB hold ctas_per_sm blocks and the 1 KiB each reserves: a stage more would silently
// leave one CTA per SM.
static_assert(forward_wgmma_config<128>.ctas_per_sm * (forward_wgmma_shared_bytes<128>() + 1024) <= 228 * 1024 &&
                  forward_wgmma_config<64>.ctas_per_sm * (forward_wgmma_shared_bytes<64>() + 1024) <= 228 * 1024 &&
                  forward_wgmma_shared_bytes<128, true>() + 1024 <= 228 * 1024,
              "the forward's rings no longer fit ctas_per_sm CTAs on an SM");

namespace detail {

/// This warp's A fragments of the query block (rows 16w .. 16w + 15) straight from global memory:
/// the fragment layout of mma.sync's A operand, which is also wgmma's register A.
template <class T, int D>
__device__ void load_query_fragments(unsigned (&qf)[D / 16][4], const T* block, std::int64_t stride) {
  const int lane = static_cast<int>(threadIdx.x % 32), row = 16 * static_cast<int>((threadIdx.x / 32) % 4) + lane / 4;
  const T* low = block + row * stride + 2 * (lane % 4);
  const T* high = low + 8 * stride;
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    qf[k][0] = __ldg(reinterpret_cast<const unsigned*>(low + 16 * k));
    qf[k][1] = __ldg(reinterpret_cast<const unsigned*>(high + 16 * k));
    qf[k][2] = __ldg(reinterpret_cast<const unsigned*>(low + 16 * k + 8));
    qf[k][3] = __ldg(reinterpret_cast<const unsigned*>(high + 16 * k + 8));
  }
}

/// The consumer waits for K tiles t .. t + N - 1 and reads what their softmax needs (the first N
/// entries of `diagonal` and `valid`). Beyond (the paired forward's consumers, which walk the later
/// block's row): a block tile past `query_global` has no valid column; -1 is no causal mask, and -2
/// (a consumer without a query block) masks every block tile.
template <int N, bool Beyond = false, class Rings, int Size>
__device__ void wait_keys(Rings& rings, const row_tiles& row, index_t t, index_t query_global, bool (&diagonal)[Size], int (&valid)[Size]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    rings.k.wait(t + i);
    diagonal[i] = rings.diagonal(row, t + i, query_global);
    valid[i] = row.valid_columns(t + i);
    if constexpr (Beyond) {
      // The slot again, though diagonal() has shuffled it: one shuffle for both tests (the value
      // shared) made ptxas serialize the paired consumers' products (C7511, 2026-12-04).
      const index_t global = rings.global_block(t + i);  // every lane shuffles: not behind the && (a branch)
      if (query_global != -1 && row.is_block(t + i) && global > query_global) valid[i] = 0;
    }
  }
}

}  // namespace detail

/// The forward on Hopper: the same walk, online softmax and epilogue as sparse_forward, with both
/// products on wgmma and the loads in a warp of their own (warp specialization, as FlashAttention-3):
/// a producer warpgroup copies the row's K and V tiles (blocks and vertical gathers alike) into two rings
/// of stages guarded by mbarriers, running ahead as far as the rings allow; the consumer warpgroup
/// computes S = Q K^T with Q's fragments in registers and K from shared memory (K-major), O += P V
/// with P in registers and V from shared memory (MN-major), `tiles_per_step` tiles per step. The
/// consumer is software pipelined (intra-warpgroup overlap): step n issues the scores of step n + 1,
/// rescales O by step n's correction, issues O += P(n) V(n), and runs the softmax of step n + 1 while
/// that product is in flight. Steps start at the row's first tile, so that a step's two K tiles lie in
/// a pair of stages (one m64n128 product for both tiles' scores); where the count is odd, the last step
/// takes the odd tile alone.
///
/// Paired (forward_wgmma_tuning): the CTA of pair p (its launched_row_unit) walks the row of query
/// block 2p + 1 (2p where that is the last block) and consumer c computes query block 2p + c; the
/// launch has (query blocks + 1) / 2 CTAs per head. Grouped: the launch order (launched_row_unit;
/// not for the paired kernel, whose products ptxas then serialized).
template <class T, int D, bool Paired = false, bool Grouped = false>
__global__ void __launch_bounds__(forward_wgmma_threads<D, Paired>, forward_wgmma_config<D, Paired>.ctas_per_sm)
    sparse_forward_wgmma(forward_params<T> p) {
  constexpr forward_wgmma_tuning tuning = forward_wgmma_config<D, Paired>;
  static_assert(!Paired || D == 128, "the paired forward is tuned for head dim 128");
  static_assert(!(Paired && Grouped), "the paired forward launches a head's pairs one after another");
  static_assert(tuning.producer_registers + tuning.consumers * tuning.consumer_registers <= (tuning.consumers + 1) * tuning.launch_registers(),
                "the consumers ask setmaxnreg for more registers than the producer gives back");
  constexpr int tile = swizzled_tile<D>::bytes;
  static_assert(forward_step_tiles<D> == 1 || forward_step_tiles<D> == 2,
                "one or two tiles per step: the last step takes the one odd tile alone, nothing more");
  static_assert(tuning.k_stages >= forward_step_tiles<D> && tuning.v_stages >= forward_step_tiles<D>, "a step's tiles must fit the rings at once");
  // Named apart from the other kernels' dynamic block (declared 16-byte aligned): one name with two
  // alignments in a translation unit is a warning.
  extern __shared__ __align__(1024) unsigned char forward_shared[];
  unsigned char* ks = forward_shared;                               // K(t) in ks + k.stage(t) * tile
  unsigned char* vs = ks + tuning.k_stages * tile;                  // V(t) in vs + v.stage(t) * tile
  auto& rings = *reinterpret_cast<forward_rings<D, Paired>*>(vs + tuning.v_stages * tile);
  // The swizzled tiles need a 1024-byte aligned base, which a dynamic block without static shared
  // memory has; a device that placed it elsewhere would read shifted operands: stop instead.
  if (detail::shared_address(forward_shared) % 1024 != 0) __trap();

  const detail::launched_unit unit = detail::launched_row_unit<Grouped>();
  const index_t launched = unit.unit, h = unit.head;
  const index_t hk = h / (p.heads_q / p.heads_kv);
  const index_t last_block = p.index.shape.num_query_blocks - 1;
  const index_t walked = Paired ? (2 * launched + 1 < last_block ? 2 * launched + 1 : last_block) : launched;  // the row streamed
  const detail::row_tiles row = detail::row_tiles::of(p.index, p.index.row(h, walked));
  const index_t tiles = row.count();
  if (threadIdx.x == 0) rings.init();
  __syncthreads();

  if (threadIdx.x >= tuning.consumers * attention_threads) {  // the producer warpgroup
    detail::set_registers_decrease<tuning.producer_registers>();
    // The paired kernel's producer reads a block tile's block as it copies it: reading it ahead made
    // ptxas serialize the paired consumers' products (C7511).
    rings.template produce<T, D, !Paired>(row, p.index, p.k, p.v, ks, vs, p.heads_kv, hk);
    return;
  }
  detail::set_registers_increase<tuning.consumer_registers>();

  const index_t q_block = Paired ? 2 * launched + static_cast<index_t>(threadIdx.x / attention_threads) : launched;
  const bool active = !Paired || q_block <= last_block;  // the last pair of an odd count has one block
  // A consumer without a query block reads the last one's (no branch here: ptxas then serialized
  // the products, C7511), masks every tile and writes nothing.
  unsigned qf[D / 16][4];
  detail::load_query_fragments<T, D>(qf, detail::block_start(p.q, active ? q_block : last_block, p.heads_q, h, D), std::int64_t{p.heads_q} * D);
  float o[D / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  unsigned pf[forward_step_tiles<D>][4][4];  // P of the step's tiles as the A operand of P V
  float correction[2];          // of the next step's softmax, applied to O before its P V
  const index_t q_global = !active ? -2 : p.index.shape.causal ? p.index.query_global_block[q_block] : -1;
  using none = std::integral_constant<int, 0>;
  using one = std::integral_constant<int, 1>;
  using whole = std::integral_constant<int, forward_step_tiles<D>>;
  using rings_type = forward_rings<D, Paired>;

  // Issue S of tiles t .. t + N - 1, uncommitted. Two tiles (t even, so their K stages are a pair)
  // are one m64n128 product per k-step.
  auto scores = [&](index_t t, float (&s)[forward_step_tiles<D>][8][4], auto count) {
    constexpr int N = decltype(count)::value;
    const unsigned char* first = rings_type::template k_tile<D>(ks, rings.k.stage(t));
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      const std::uint64_t keys = detail::k_major_operand<D, rings_type::template k_slab_stride<D>>(first, k);
      if constexpr (N == 2) detail::wgmma_rs<T, 128, 0>(reinterpret_cast<float(&)[64]>(s), qf[k], keys, k > 0);
      else detail::wgmma_rs<T, 64, 0>(reinterpret_cast<float(&)[32]>(s[0]), qf[k], keys, k > 0);
    }
  };
  auto to_operands = [&](float (&s)[forward_step_tiles<D>][8][4], auto count) {
    constexpr int N = decltype(count)::value;
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) detail::accumulator_to_operand<T>(pf[i][k], s[i][2 * k], s[i][2 * k + 1]);
  };

  // The first step's scores and softmax, alone: N tiles (one where the row has fewer than a step).
  auto first_step = [&](auto count) {
    constexpr int N = decltype(count)::value;
    float s[forward_step_tiles<D>][8][4];
    bool diagonal[forward_step_tiles<D>];
    int valid[forward_step_tiles<D>];
    detail::wait_keys<N, Paired>(rings, row, 0, q_global, diagonal, valid);
    detail::fence_async_shared();
    detail::wgmma_fence();
    scores(0, s, count);
    detail::wgmma_commit();
    detail::wgmma_wait<0>();
    detail::fence_registers(reinterpret_cast<float(&)[forward_step_tiles<D> * 32]>(s));
#pragma unroll
    for (int i = 0; i < N; ++i) rings.k.release(i);
    detail::softmax_tiles<N>(reinterpret_cast<float(&)[N][8][4]>(s), row_max, row_sum, correction, p.scale_log2,
                            reinterpret_cast<bool(&)[N]>(diagonal), reinterpret_cast<int(&)[N]>(valid));
    to_operands(s, count);
  };

  // The step over tiles t .. t + Cur - 1 (their P in pf), issuing the scores of the next Next tiles
  // (0: the row's last step). The body runs in separate copies, so that which products are in flight
  // never depends on a branch (the barrier waits and the rescale test branch too, but around the same
  // products on every path).
  auto step = [&](index_t t, auto current, auto next) {
    constexpr int Cur = decltype(current)::value;
    constexpr int Next = decltype(next)::value;
    float s[forward_step_tiles<D>][8][4];  // the next step's S, then P: registers of their own, apart from pf
    bool diagonal[forward_step_tiles<D>];
    int valid[forward_step_tiles<D>];
    if constexpr (Next > 0) {
      detail::wait_keys<Next, Paired>(rings, row, t + Cur, q_global, diagonal, valid);
      detail::fence_async_shared();
      detail::fence_registers(reinterpret_cast<float(&)[D / 2]>(o));
      detail::wgmma_fence();
      scores(t + Cur, s, next);
      detail::wgmma_commit();
    }
    // This step's correction, while the scores run. Once the rows' maxima settle (most tiles of a
    // long row), no row of the warp moves: skip the D / 2 multiplications by 1.
    if (__any_sync(0xffffffffu, correction[0] != 1.0f || correction[1] != 1.0f)) detail::rescale_rows<D>(o, correction);
#pragma unroll
    for (int i = 0; i < Cur; ++i) rings.v.wait(t + i);
    detail::fence_async_shared();
    detail::fence_registers(reinterpret_cast<float(&)[D / 2]>(o));
    detail::wgmma_fence();
#pragma unroll
    for (int i = 0; i < Cur; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        detail::wgmma_rs<T, D, 1>(reinterpret_cast<float(&)[D / 2]>(o), pf[i][k], detail::mn_major_operand<D>(vs + rings.v.stage(t + i) * tile, k),
                                  true);
    detail::wgmma_commit();
    if constexpr (Next > 0) {
      detail::wgmma_wait<1>();  // the next step's S; the P V product may still run
      detail::fence_registers(reinterpret_cast<float(&)[forward_step_tiles<D> * 32]>(s));
#pragma unroll
      for (int i = 0; i < Next; ++i) rings.k.release(t + Cur + i);
      detail::softmax_tiles<Next>(reinterpret_cast<float(&)[Next][8][4]>(s), row_max, row_sum, correction, p.scale_log2,
                                  reinterpret_cast<bool(&)[Next]>(diagonal), reinterpret_cast<int(&)[Next]>(valid));
    }
    detail::wgmma_wait<0>();
    detail::fence_registers(reinterpret_cast<float(&)[D / 2]>(o));
    detail::fence_registers(reinterpret_cast<unsigned(&)[forward_step_tiles<D> * 4][4]>(pf));
#pragma unroll
    for (int i = 0; i < Cur; ++i) rings.v.release(t + i);
    if constexpr (Next > 0) to_operands(s, next);
  };

  // Whole steps from the row's first tile, so that a step's two K tiles are a pair of stages; where
  // the count is odd, the last step takes the odd tile alone.
  if (tiles >= forward_step_tiles<D>) {
    first_step(whole{});
    index_t t = 0;
    for (; t + 2 * forward_step_tiles<D> <= tiles; t += forward_step_tiles<D>) step(t, whole{}, whole{});
    if constexpr (forward_step_tiles<D> > 1) {
      if (t + forward_step_tiles<D> < tiles) {
        step(t, whole{}, one{});
        step(t + forward_step_tiles<D>, one{}, none{});
      } else {
        step(t, whole{}, none{});
      }
    } else {
      step(t, whole{}, none{});
    }
  } else if (tiles > 0) {  // one tile, at two tiles per step
    first_step(one{});
    step(0, one{}, none{});
  }
  if (active) detail::write_forward_rows<T, D>(p, q_block, h, o, row_max, row_sum);
}

/// out[i] = running[i] rounded to T: the last step's cast of the fp32 running output.
template <class T>
__global__ void write_output(const float* __restrict__ running, T* __restrict__ out, std::int64_t count) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(running[i]);
}

}  // namespace stria::kernel
