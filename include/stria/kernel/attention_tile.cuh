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
#include "stria/kernel/pipeline.cuh"
#include "stria/kernel/wgmma.cuh"

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

/// The byte offset of each 16-byte chunk of a 64-row tile in shared memory (a `Layout`): here the
/// padded rows of the mma.sync kernels; `swizzled_tile` (wgmma.cuh) is the other. Both advance by
/// `row_pitch` per row wherever the row moves by a multiple of 8, which the loaders below rely on.
template <class T, int D>
struct padded_tile {
  static constexpr int row_pitch = shared_tile<D>::stride * static_cast<int>(sizeof(T));
  __host__ __device__ static constexpr int offset(int row, int chunk) { return row * row_pitch + chunk * 16; }
};

namespace detail {

/// The chunk column and first row a thread of a warpgroup (128 threads) copies: it copies that chunk of rows
/// row0, row0 + rows_per_pass, ... (its chunk and its row modulo 8 stay fixed, so its shared address
/// advances by a constant, and so does its global address along a run of tokens).
template <class T, int D>
struct tile_copy_plan {
  static constexpr int chunks = D * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per row
  static constexpr int rows_per_pass = attention_threads / chunks;
  static constexpr int passes = block_tokens / rows_per_pass;
  static_assert(attention_threads % chunks == 0 && rows_per_pass % 8 == 0, "a pass must cover whole swizzle periods of 8 rows");
  int chunk = static_cast<int>(threadIdx.x % attention_threads) % chunks, row0 = static_cast<int>(threadIdx.x % attention_threads) / chunks;

  /// Whether `Layout` places every chunk of row r + rows_per_pass exactly rows_per_pass row pitches
  /// after the same chunk of row r: what lets a thread advance its shared address by a constant.
  template <class Layout>
  __host__ __device__ static constexpr bool fits() {
    for (int row = 0; row + rows_per_pass < block_tokens; ++row)
      for (int c = 0; c < chunks; ++c)
        if (Layout::offset(row + rows_per_pass, c) != Layout::offset(row, c) + rows_per_pass * Layout::row_pitch) return false;
    return true;
  }
};

/// The first row of 64-token block `block` of a [tokens, heads, d] tensor, at head h.
template <class T>
__device__ T* block_start(T* base, index_t block, index_t heads, index_t h, int d) {
  return base + (std::int64_t{block} * block_tokens * heads + h) * d;
}

/// Queues cp.async copies of the 64 rows of a tile by tile_copy_plan: row j (of pass p) from first +
/// offset(j, p) elements for j < count, zeros after. Every lane calls `offset` for every pass, past
/// the end too (load_row_tile_ahead_async shuffles in it); a value it returns there is not used.
template <class Layout, class T, int D, class Offset>
__device__ void load_rows_async(void* tile, const T* first, index_t count, Offset offset) {
  using plan = tile_copy_plan<T, D>;
  static_assert(plan::template fits<Layout>(), "the tile layout must advance by whole row pitches between a thread's rows");
  const plan at;
  unsigned char* to = static_cast<unsigned char*>(tile) + Layout::offset(at.row0, at.chunk);
  const T* column = first + at.chunk * (16 / static_cast<int>(sizeof(T)));
#pragma unroll
  for (int pass = 0; pass < plan::passes; ++pass) {
    const int j = at.row0 + pass * plan::rows_per_pass;
    const std::int64_t from = offset(j, pass);
    const bool valid = j < count;  // past the end: zero-fill, still naming a readable address (row 0)
    cp_async_16(to + pass * plan::rows_per_pass * Layout::row_pitch, column + (valid ? from : 0), valid);
  }
}

/// Queues cp.async copies of 64 rows at a constant stride (elements): row j from first + j x stride
/// for j < count (1 .. 64), zeros after.
template <class Layout, class T, int D>
__device__ void load_strided_rows_async(void* tile, const T* first, std::int64_t stride, index_t count = block_tokens) {
  load_rows_async<Layout, T, D>(tile, first, count, [stride](int j, int) { return j * stride; });
}

/// Queues cp.async copies of gathered rows: row j from base + tokens[j] x stride for j < count,
/// zeros after.
template <class Layout, class T, int D>
__device__ void load_gathered_rows_async(void* tile, const T* base, std::int64_t stride, const index_t* tokens, index_t count) {
  load_rows_async<Layout, T, D>(tile, base, count, [=](int j, int) { return j < count ? tokens[j] * stride : 0; });
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
  /// Valid columns of tile t (64 except in the last gather).
  __device__ int valid_columns(index_t t) const {
    if (t < num_blocks) return block_tokens;
    const index_t left = num_tokens - (t - num_blocks) * block_tokens;
    return left < block_tokens ? static_cast<int>(left) : block_tokens;
  }
};

/// Queues cp.async copies of tile t of a row from K or V ([Sk, Hkv, D]) at KV head `hk`: a block's
/// 64 tokens, or the next 64 of its vertical tokens (zeros past the last).
template <class Layout, class T, int D>
__device__ void load_row_tile_async(void* tile, const T* base, const row_tiles& row, index_t t, index_t heads_kv, index_t hk) {
  const std::int64_t stride = std::int64_t{heads_kv} * D;
  const T* head = base + std::int64_t{hk} * D;
  if (row.is_block(t)) {
    load_strided_rows_async<Layout, T, D>(tile, head + std::int64_t{row.blocks[t]} * block_tokens * stride, stride);
  } else {
    const index_t first = (t - row.num_blocks) * block_tokens;
    load_gathered_rows_async<Layout, T, D>(tile, head, stride, row.tokens + first, row.num_tokens - first);
  }
}

/// Which token of a gathered tile each lane of a warpgroup copying by tile_copy_plan reads ahead
/// (planned_token), and where each of its copies finds the token of its row (load_row_tile_ahead_async).
/// A warp copies 16 rows of a tile: its R = 32 / chunks first rows and those rows plus each pass's
/// rows_per_pass. Lane L (and L + 16) of warp w reads row R w + L % R + rows_per_pass ((L % 16) / R);
/// the pass p copy of lane L's row, R w + L / chunks + rows_per_pass p, is then in lane L / chunks +
/// R p. On the host too, where a test checks every thread and pass.
template <class T, int D>
struct token_plan {
  using plan = tile_copy_plan<T, D>;
  static constexpr int first_rows = 32 / plan::chunks;
  static_assert(32 % plan::chunks == 0 && first_rows * plan::passes == 16, "a warp copies 16 rows of a tile, one per lane of a half");
  STRIA_HOST_DEVICE static constexpr int row_read(int lane, int warp) {
    return first_rows * warp + lane % first_rows + plan::rows_per_pass * ((lane % 16) / first_rows);
  }
  STRIA_HOST_DEVICE static constexpr int source_lane(int lane, int pass) { return lane / plan::chunks + first_rows * pass; }
};

/// What a thread of a warpgroup copying by tile_copy_plan reads of the index for tile t of a row,
/// ahead of its copies (load_row_tile_ahead_async): for a block tile its local KV block, for a
/// gathered tile the token of row token_plan::row_read. 0 past the end.
template <class T, int D>
__device__ index_t planned_token(const row_tiles& row, index_t t) {
  if (t >= row.count()) return 0;
  if (row.is_block(t)) return row.blocks[t];
  const int read_row = token_plan<T, D>::row_read(static_cast<int>(threadIdx.x % 32), static_cast<int>(threadIdx.x / 32) % 4);
  const index_t first = (t - row.num_blocks) * block_tokens;
  return read_row < row.num_tokens - first ? row.tokens[first + read_row] : 0;
}

/// load_row_tile_async with the index read ahead by the caller: `read` is planned_token<T, D>(row,
/// t), so that no copy of the tile waits for a global-memory round trip to the index. By a whole
/// warpgroup, its warps converged (they shuffle).
template <class Layout, class T, int D>
__device__ void load_row_tile_ahead_async(void* tile, const T* base, const row_tiles& row, index_t t, index_t heads_kv, index_t hk, index_t read) {
  const std::int64_t stride = std::int64_t{heads_kv} * D;
  const T* head = base + std::int64_t{hk} * D;
  if (row.is_block(t)) {
    load_strided_rows_async<Layout, T, D>(tile, head + std::int64_t{read} * block_tokens * stride, stride);
  } else {
    const int lane = static_cast<int>(threadIdx.x % 32);
    load_rows_async<Layout, T, D>(tile, head, row.num_tokens - (t - row.num_blocks) * block_tokens, [=](int, int pass) {
      return __shfl_sync(0xffffffffu, read, token_plan<T, D>::source_lane(lane, pass)) * stride;
    });
  }
}

/// What a copier thread (`thread` 0 .. 63) reads of the index for tile t of a row, ahead of its
/// copies: for a gathered tile a token (lane L of warp w reads row 4 w + L % 4 + 8 (L / 4), exactly
/// the rows its warp copies, so that every pass of load_row_tile_swizzled_async finds its token one
/// shuffle away), for a block tile its local KV block (0 unless BlocksAhead: the copies read it
/// then). 0 past the end.
template <bool BlocksAhead = true>
__device__ index_t gathered_token(const row_tiles& row, index_t t, int thread) {
  if (t >= row.count()) return 0;
  if (row.is_block(t)) return BlocksAhead ? row.blocks[t] : 0;
  const index_t first = (t - row.num_blocks) * block_tokens;
  const int lane = thread % 32, warp = thread / 32;
  const int read_row = 4 * warp + lane % 4 + 8 * (lane / 4);
  return read_row < row.num_tokens - first ? row.tokens[first + read_row] : 0;
}

/// Queues cp.async copies of tile t of a row, as load_row_tile_async does, into a swizzled tile by
/// 64 threads (`thread` 0 .. 63): thread (r, c) = (thread / 8, thread % 8) copies chunk c of every
/// slab of rows r, r + 8, ..., so its rows keep one swizzle phase and its shared address advances by
/// a constant. A warpgroup's K and V copies thus run as two independent streams of two warps each.
/// `read_token`: gathered_token<BlocksAhead>(row, t, thread), which the caller reads ahead (one global
/// round trip that would otherwise sit before every tile's copies).
template <class T, int D, int SlabStride = swizzled_tile<D>::slab_bytes, bool BlocksAhead = true>
__device__ void load_row_tile_swizzled_async(unsigned char* tile, const T* base, const row_tiles& row, index_t t, index_t heads_kv, index_t hk,
                                             int thread, index_t read_token) {
  static_assert(sizeof(T) == 2, "a 128-byte slab holds 64 elements of 2 bytes");
  using layout = swizzled_tile<D>;
  constexpr int slabs = D / 64, passes = block_tokens / 8;
  const int r = thread / 8, c = thread % 8;
  const std::int64_t stride = std::int64_t{heads_kv} * D;
  const T* head = base + std::int64_t{hk} * D + c * 8;
  unsigned char* to = tile + layout::offset(r, c);
  if (row.is_block(t)) {
    const T* from = head + (std::int64_t{BlocksAhead ? read_token : row.blocks[t]} * block_tokens + r) * stride;
#pragma unroll
    for (int pass = 0; pass < passes; ++pass)
#pragma unroll
      for (int slab = 0; slab < slabs; ++slab)
        cp_async_16(to + pass * 8 * layout::row_pitch + slab * SlabStride, from + pass * 8 * stride + slab * 64, true);
  } else {
    const index_t count = row.num_tokens - (t - row.num_blocks) * block_tokens;
    const int warp = thread / 32;
#pragma unroll 1  // unrolled, the addresses of several passes stay live and spill the producer's registers
    for (int pass = 0; pass < passes; ++pass) {
      const int j = r + 8 * pass;
      const bool valid = j < count;  // past the end: zero-fill, still naming a readable address (token 0)
      const index_t token = __shfl_sync(0xffffffffu, read_token, r - 4 * warp + 4 * pass);
      const T* from = head + std::int64_t{token} * stride;
#pragma unroll
      for (int slab = 0; slab < slabs; ++slab)
        cp_async_16(to + pass * 8 * layout::row_pitch + slab * SlabStride, from + slab * 64, valid);
    }
  }
}

/// The K and V rings of a row's tiles (Hopper forward), with the global block of each block tile in
/// the K ring: what the consumer's causal-mask test needs, delivered with the tile so that no
/// global-memory round trip sits between its products and its softmax. Each ring is filled by its
/// own two producer warps. The K stages lie in pairs with their slabs interleaved
/// ([pair][slab][stage of the pair][64 rows][128 bytes]): the two K tiles of an even and the next
/// stage are then one 128-row K-major operand, so that a step's two tiles of scores are one
/// m64n128 product per k-step rather than two m64n64 ones.
template <int KStages, int VStages, int Consumers = 1>
struct row_tile_rings {
  static_assert(KStages % 2 == 0, "the K stages lie in pairs");
  static constexpr int copier_threads = 64;
  template <int D>
  static constexpr int k_slab_stride = 2 * swizzled_tile<D>::slab_bytes;
  stage_ring<KStages, copier_threads, 4 * Consumers> k;
  stage_ring<VStages, copier_threads, 4 * Consumers> v;
  index_t kv_global_block[KStages];

  /// The slots start at -1: lane 0 reads its stage's slot for every tile, gathered tiles too, whose
  /// slot no copy has written yet when they come first.
  __device__ void init() {
    k.init();
    v.init();
    for (index_t& global : kv_global_block) global = -1;
  }
  /// The first byte of K stage `stage` in the K ring `ks`.
  template <int D>
  __device__ static unsigned char* k_tile(unsigned char* ks, int stage) {
    return ks + (stage / 2) * 2 * swizzled_tile<D>::bytes + (stage % 2) * swizzled_tile<D>::slab_bytes;
  }

  /// The producer warpgroup: its first two warps copy K(t) of every tile of the row into the K ring,
  /// its last two V(t) into the V ring (`ks`, `vs`: the stages' swizzled tiles), each tile once its
  /// stage is free. Apart, the K stream is not held back by a full V ring, nor the other way round.
  /// Each copier reads a tile's index entries (its tokens; with BlocksAhead a block tile's block too)
  /// while it waits for the tile before it to have a stage.
  template <class T, int D, bool BlocksAhead = true>
  __device__ void produce(const row_tiles& row, const step_index_view& index, const T* keys, const T* values, unsigned char* ks,
                          unsigned char* vs, index_t heads_kv, index_t hk) {
    constexpr int bytes = swizzled_tile<D>::bytes;
    const int thread = static_cast<int>(threadIdx.x % attention_threads);
    const index_t tiles = row.count();
    if (thread < copier_threads) {
      index_t token = gathered_token<BlocksAhead>(row, 0, thread);
      for (index_t t = 0; t < tiles; ++t) {
        const index_t next_token = gathered_token<BlocksAhead>(row, t + 1, thread);  // in flight while the stage frees
        k.acquire(t);
        load_row_tile_swizzled_async<T, D, k_slab_stride<D>, BlocksAhead>(k_tile<D>(ks, k.stage(t)), keys, row, t, heads_kv, hk, thread, token);
        if (thread == 0 && row.is_block(t)) cp_async_4(&kv_global_block[k.stage(t)], index.kv_global_block + (BlocksAhead ? token : row.blocks[t]));
        token = next_token;
        k.commit(t);
      }
    } else {
      index_t token = gathered_token<BlocksAhead>(row, 0, thread - copier_threads);
      for (index_t t = 0; t < tiles; ++t) {
        const index_t next_token = gathered_token<BlocksAhead>(row, t + 1, thread - copier_threads);
        v.acquire(t);
        load_row_tile_swizzled_async<T, D, swizzled_tile<D>::slab_bytes, BlocksAhead>(vs + v.stage(t) * bytes, values, row, t, heads_kv, hk, thread - copier_threads, token);
        token = next_token;
        v.commit(t);
      }
    }
    cp_async_wait_all();
  }

  /// Consumer, after k.wait(t) and before k.release(t): whether tile t crosses the diagonal of the
  /// query block at `query_global` (-1 without the causal mask). Lane 0 alone reads the slot and
  /// hands it to its warp: stage_ring::release is lane 0's arrival, which orders only lane 0's own
  /// reads before the copier's next write into the stage.
  __device__ bool diagonal(const row_tiles& row, index_t t, index_t query_global) const {
    const index_t global = global_block(t);  // every lane shuffles: not behind the && (a branch)
    return row.is_block(t) && global == query_global;
  }
  /// The global block of block tile t (a gathered tile's slot holds no meaning), read by lane 0 as
  /// diagonal() reads it.
  __device__ index_t global_block(index_t t) const {
    return __shfl_sync(0xffffffffu, threadIdx.x % 32 == 0 ? kv_global_block[k.stage(t)] : 0, 0);
  }
};

/// The local query block of a CTA launched over (query blocks, heads). Later query blocks have longer
/// lists under causal attention, so they are launched first (a shorter tail).
__device__ inline index_t launched_query_block() { return static_cast<index_t>(gridDim.x - 1 - blockIdx.x); }

/// The (query unit, head) of a forward CTA: a unit is a query block, or the paired forward's pair.
/// Not Grouped: the launch is (units, heads), a head's units one after another, the last first
/// (launched_query_block). Grouped: (heads of a section, units, sections), the section's heads of
/// one unit one after another, units last first within a section; with a KV head's query heads as
/// the section, they run at once on the same query block, so the K and V tiles their selections
/// share are read at about the same time and found in L2 by all but the first. Every value comes
/// straight from blockIdx and gridDim: a division by the section's size here made ptxas spill the
/// D 64 forward's registers or serialize the D 128 forward's products (tests/cuda/wgmma_kernels.cu).
struct launched_unit {
  index_t unit, head;
};
/// launched_row_unit's arithmetic for block (x, y, z) of a grid of `grid_x` x `grid_y` x ...: on
/// the host too, where a test walks whole grids.
template <bool Grouped>
STRIA_HOST_DEVICE constexpr launched_unit row_unit_of(unsigned x, unsigned y, unsigned z, unsigned grid_x, unsigned grid_y) {
  if constexpr (Grouped) return {static_cast<index_t>(grid_y - 1 - y), static_cast<index_t>(z * grid_x + x)};
  else return {static_cast<index_t>(grid_x - 1 - x), static_cast<index_t>(y)};
}
template <bool Grouped>
__device__ launched_unit launched_row_unit() {
  return row_unit_of<Grouped>(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y);
}

}  // namespace detail
}  // namespace stria::kernel
