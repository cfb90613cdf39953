// SPDX-License-Identifier: Apache-2.0
// The launcher of the GPU step-index builder (index/local_index.cuh): a batch of indices is counted,
// its totals read back in one host synchronisation, then filled, by the kernels of
// kernel/local_index.cuh on one stream. Also the scans and grid sizes other launchers share.
#pragma once

#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <span>
#include <utility>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/device/launch.cuh"
#include "stria/index/device_index.cuh"
#include "stria/index/local_index.hpp"
#include "stria/index/step_index.hpp"
#include "stria/kernel/local_index.cuh"

namespace stria {

namespace detail {

/// counts[0..n) -> exclusive prefix sums in ptr[0..n) (one CUB call; queued on `stream`).
template <class T>
void exclusive_scan(const T* counts, T* ptr, std::int64_t n, cudaStream_t stream) {
  std::size_t temp_bytes = 0;
  STRIA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, counts, ptr, static_cast<int>(n), stream));
  device_buffer<unsigned char> temp(std::max<std::size_t>(temp_bytes, 1), stream);
  STRIA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.data(), temp_bytes, counts, ptr, static_cast<int>(n), stream));
}

/// counts[0..n) (with a 0 tail) -> exclusive prefix sums in ptr[0..n]; ptr[n] is the total. Queued on `stream`.
inline void exclusive_scan(const device_buffer<index_t>& counts_with_tail, device_buffer<index_t>& ptr, cudaStream_t stream) {
  exclusive_scan(counts_with_tail.data(), ptr.data(), static_cast<std::int64_t>(counts_with_tail.size()), stream);
}

/// CTAs of `threads` threads that cover `n` items (one per thread).
inline unsigned blocks_for(std::int64_t n, unsigned threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

/// The selection's device lists, in the builder kernels' parameter block.
inline void fill_selection(const device_selection& sel, kernel::index_build_params& p) {
  const device_selection::lists& lists = sel.device_lists();
  p.slash_ptr = lists.slash_ptr.data();
  p.slash = lists.slash.data();
  p.vertical_ptr = lists.vertical_ptr.data();
  p.vertical = lists.vertical.data();
  p.tile_ptr = lists.tile_ptr.data();
  p.tile_query = lists.tile_query.data();
  p.tile_key = lists.tile_key.data();
}

/// An index between its two phases: its pointer arrays are built (counts scanned on the device),
/// its entry arrays not yet sized; what the fill kernel still reads lives here.
struct index_in_build {
  device_step_index out;
  kernel::index_build_params p{};
  device_buffer<index_t> owned_token, owned_block_ptr, position, query_offset;
  std::int64_t allowed_tiles = -1;  // of a complete index (stria::allowed_tiles)
};

/// Where each of an index's five count arrays starts in the back-to-back count buffer
/// (kernel::count_layout; each array has one zero after its counts): per row tiles, tokens and
/// transposed tiles (`rows` each), per vertical entry used flags and query counts (`total` each).
inline kernel::count_layout count_layout_for(index_t rows, index_t total) {
  kernel::count_layout at{};
  const index_t sizes[kernel::index_counts] = {rows, rows, rows, total, total};
  for (int a = 0; a < kernel::index_counts; ++a) at.start[a + 1] = at.start[a] + sizes[a] + 1;
  return at;
}

/// Counts laid out as `at` says, turned into each array's CSR pointers (at.ptr) by one 64-bit scan
/// of them all, then split; totals[a] receives array a's entry count in 64 bits. Queued on `stream`;
/// `prefix` holds at.start[index_counts] values of scratch.
inline void scan_counts(const std::int64_t* counts, std::int64_t* prefix, const kernel::count_layout& at, unsigned long long* totals,
                        cudaStream_t stream) {
  const std::int64_t n = at.start[kernel::index_counts];
  exclusive_scan(counts, prefix, n, stream);
  const auto ctas = static_cast<unsigned>(std::min<std::int64_t>((n + kernel::split_threads - 1) / kernel::split_threads, 1024));
  device::detail::launch<&kernel::split_scanned_counts<>>("split_scanned_counts", {ctas, kernel::split_threads, 0, stream}, prefix, at, totals);
}

/// What every index of a batch reads: where each global block lives, and each head's slash bitmap.
struct batch_tables {
  device_buffer<index_t> owner, local_of;
  device_buffer<std::uint32_t> slash_bits;
  index_t slash_words = 0;

  template <class Sharding>
  batch_tables(const device_selection& sel, const Sharding& sharding, const shard_layout& layout, cudaStream_t stream)
      : slash_words(kernel::slash_bitmap_words(layout.num_blocks)) {
    std::vector<index_t> owner_h(static_cast<std::size_t>(layout.num_blocks)), local_of_h(owner_h.size());
    for (index_t b = 0; b < layout.num_blocks; ++b) {
      const block_location where = sharding.locate(layout, b);
      owner_h[static_cast<std::size_t>(b)] = where.rank;
      local_of_h[static_cast<std::size_t>(b)] = where.local_block;
    }
    owner = device_buffer<index_t>(std::span<const index_t>(owner_h), stream);
    local_of = device_buffer<index_t>(std::span<const index_t>(local_of_h), stream);
    slash_bits = device_buffer<std::uint32_t>(static_cast<std::size_t>(sel.num_heads()) * static_cast<std::size_t>(slash_words), stream);
    slash_bits.fill_bytes(0);
    kernel::index_build_params p{};
    fill_selection(sel, p);
    device::detail::launch<&kernel::mark_slash_bits<>>("mark_slash_bits", {static_cast<unsigned>(sel.num_heads()), 128, 0, stream}, p.slash_ptr,
                                                       p.slash, layout.num_blocks, slash_words, slash_bits.data());
  }
};

/// Phase 1 of one index, queued on `stream`: the owned vertical tokens, every count and one scan.
/// `totals` receives the device addresses of its five totals (tiles, tokens, column entries, used
/// tokens, their queries), read once for the whole batch.
inline index_in_build count_local_index(const device_selection& sel, const shard_layout& layout, index_t local, const batch_tables& shared,
                                        std::span<const index_t> query_global, std::span<const index_t> kv_global,
                                        const index_request& request, cudaStream_t stream, unsigned long long* totals) {
  const index_t heads = sel.num_heads(), rows = heads * local, total = sel.num_vertical();
  index_in_build b;
  device_step_index& out = b.out;
  out.shape = {heads, local, local, sel.causal()};
  out.origin = request.origin;
  out.origin.seq_len = sel.seq_len();
  out.origin.world_size = layout.world_size;
  out.origin.rank = request.query_rank;
  out.origin.kv_source_rank = request.kv_rank;
  out.query_global_block = device_buffer<index_t>(query_global, stream);
  out.kv_global_block = device_buffer<index_t>(kv_global, stream);
  b.allowed_tiles = stria::allowed_tiles(query_global, kv_global, sel.causal(), heads);

  kernel::index_build_params& p = b.p;
  p.heads = heads;
  p.local_blocks = local;
  p.num_blocks = layout.num_blocks;
  p.causal = sel.causal();
  p.query_rank = request.query_rank;
  p.kv_rank = request.kv_rank;
  p.query_global = out.query_global_block.data();
  p.kv_global = out.kv_global_block.data();
  p.owner = shared.owner.data();
  p.local_of = shared.local_of.data();
  p.slash_bits = shared.slash_bits.data();
  p.slash_words = shared.slash_words;
  fill_selection(sel, p);
  constexpr unsigned threads = 128;

  // 0. The vertical tokens this KV rank owns, per head in order, and each local block's offset.
  device_buffer<index_t> owned_flag(static_cast<std::size_t>(total) + 1, stream), owned_position(static_cast<std::size_t>(total) + 1, stream);
  b.owned_token = device_buffer<index_t>(static_cast<std::size_t>(std::max<index_t>(total, 1)), stream);
  b.owned_block_ptr = device_buffer<index_t>(static_cast<std::size_t>(heads) * (static_cast<std::size_t>(local) + 1), stream);
  owned_flag.fill_bytes(0);
  if (total > 0) {
    device::detail::launch<&kernel::owned_vertical_flags<>>("owned_vertical_flags", {blocks_for(total, threads), threads, 0, stream}, p, total,
                                                            owned_flag.data());
  }
  exclusive_scan(owned_flag, owned_position, stream);
  if (total > 0) {
    device::detail::launch<&kernel::scatter_owned_vertical<>>("scatter_owned_vertical", {blocks_for(total, threads), threads, 0, stream}, p, total,
                                                              owned_position.data(), b.owned_token.data());
  }
  p.owned_token = b.owned_token.data();
  device::detail::launch<&kernel::owned_block_offsets<>>("owned_block_offsets", {blocks_for(heads * (local + 1), threads), threads, 0, stream}, p,
                                                         owned_position.data(), b.owned_block_ptr.data());
  p.owned_block_ptr = b.owned_block_ptr.data();

  // 1. Every count (per row: tiles, tokens, transposed tiles; per vertical entry: used, queries) in
  // one launch, back to back in one buffer whose second half is the scan's output.
  out.block_ptr = device_buffer<index_t>(static_cast<std::size_t>(rows) + 1, stream);
  out.col_ptr = device_buffer<index_t>(static_cast<std::size_t>(rows) + 1, stream);
  out.kv_query_ptr = device_buffer<index_t>(static_cast<std::size_t>(rows) + 1, stream);
  b.position = device_buffer<index_t>(static_cast<std::size_t>(total) + 1, stream);
  b.query_offset = device_buffer<index_t>(static_cast<std::size_t>(total) + 1, stream);
  kernel::count_layout at = count_layout_for(rows, total);
  index_t* const pointers[kernel::index_counts] = {out.block_ptr.data(), out.col_ptr.data(), out.kv_query_ptr.data(), b.position.data(),
                                                   b.query_offset.data()};
  std::copy(std::begin(pointers), std::end(pointers), at.ptr);
  const std::int64_t n = at.start[kernel::index_counts];
  device_buffer<std::int64_t> counts(2 * static_cast<std::size_t>(n), stream);
  counts.fill_bytes(0);  // the zero after each array
  const unsigned row_ctas = blocks_for(rows, kernel::index_threads);
  device::detail::launch<&kernel::count_index<>>("count_index",
                                                 {2 * row_ctas + blocks_for(total, kernel::index_threads), kernel::index_threads, 0, stream}, p,
                                                 sel.vertical_head(), total, at, counts.data());

  // 2. One scan makes every pointer array; the five totals come out of it in 64 bits.
  scan_counts(counts.data(), counts.data() + n, at, totals, stream);
  return b;  // the counts are freed in stream order, after the kernels that read them
}

/// Phase 2 of one index, queued on `stream`: its entry arrays, sized from its five totals, filled by one kernel.
inline device_step_index fill_local_index(index_in_build&& b, const device_selection& sel, std::span<const index_t, 5> totals,
                                          cudaStream_t stream) {
  const index_t tiles = totals[0], tokens = totals[1], column_entries = totals[2], used_tokens = totals[3], used_queries = totals[4];
  const index_t heads = sel.num_heads(), rows = heads * b.p.local_blocks, total = sel.num_vertical();
  device_step_index& out = b.out;
  out.complete = stria::holds_every_allowed_tile(b.allowed_tiles, tiles, tokens);
  out.block_col = device_buffer<index_t>(static_cast<std::size_t>(tiles), stream);
  out.col_token = device_buffer<index_t>(static_cast<std::size_t>(tokens), stream);
  out.kv_query = device_buffer<index_t>(static_cast<std::size_t>(column_entries), stream);
  out.vtoken = device_buffer<index_t>(static_cast<std::size_t>(used_tokens), stream);
  out.vtoken_query = device_buffer<index_t>(static_cast<std::size_t>(used_queries), stream);
  out.vtoken_query_ptr = device_buffer<index_t>(static_cast<std::size_t>(used_tokens) + 1, stream);
  out.vtoken_head_ptr = device_buffer<index_t>(static_cast<std::size_t>(heads) + 1, stream);
  const kernel::index_fill_arrays arrays{out.block_ptr.data(),  out.col_ptr.data(),      out.kv_query_ptr.data(), b.position.data(),
                                         b.query_offset.data(), out.block_col.data(),    out.col_token.data(),    out.kv_query.data(),
                                         out.vtoken_head_ptr.data(), out.vtoken.data(), out.vtoken_query_ptr.data(), out.vtoken_query.data(),
                                         sel.vertical_head(),   total,                   used_tokens,             used_queries};
  const unsigned ctas = 2 * blocks_for(rows, kernel::index_threads) + blocks_for(rows, kernel::index_warps_per_block) +
                        blocks_for(total, kernel::index_warps_per_block);
  device::detail::launch<&kernel::fill_index<>>("fill_index", {ctas, kernel::index_threads, 0, stream}, b.p, arrays);
  return std::move(out);  // the temporaries in `b` are freed in stream order, after this kernel
}

}  // namespace detail

namespace device {

/// build_local_indices_device (index/local_index.cuh): every index of the batch counted, the totals
/// read at once, every index filled, in order on `stream`. Returns the indices in request order.
template <sharding_policy Sharding>
std::vector<device_step_index> build_local_indices(const device_selection& sel, const Sharding& sharding, index_t world_size,
                                                   std::span<const index_request> requests, cudaStream_t stream) {
  const index_t nb = sel.seq_len() / block_tokens;
  const shard_layout layout{nb, world_size};
  sharding.validate(layout);
  for (const index_request& r : requests) stria::detail::check_index_ranks(world_size, r.query_rank, r.kv_rank);
  if (requests.empty()) return {};
  const index_t local = sharding.local_blocks(layout);

  const stria::detail::batch_tables shared(sel, sharding, layout, stream);
  const auto global_blocks = [&](index_t rank) {
    std::vector<index_t> blocks(static_cast<std::size_t>(local));
    for (index_t i = 0; i < local; ++i) blocks[static_cast<std::size_t>(i)] = sharding.global_block(layout, {rank, i});
    return blocks;
  };

  std::vector<stria::detail::index_in_build> building;
  building.reserve(requests.size());
  device_buffer<unsigned long long> wide_d(5 * requests.size(), stream);
  for (std::size_t i = 0; i < requests.size(); ++i)
    building.push_back(stria::detail::count_local_index(sel, layout, local, shared, global_blocks(requests[i].query_rank),
                                                        global_blocks(requests[i].kv_rank), requests[i], stream, wide_d.data() + 5 * i));

  // The batch's only host synchronisation: every index's five totals, read at once. Each must fit
  // the 32-bit offsets that the scans wrote (no partial sum of a scan exceeds its total).
  const std::vector<unsigned long long> wide = wide_d.download();
  static constexpr const char* arrays[5] = {"step index tiles", "step index vertical entries", "step index transposed tiles",
                                            "step index vertical tokens", "step index vertical token queries"};
  std::vector<index_t> totals(wide.size());
  for (std::size_t i = 0; i < wide.size(); ++i) totals[i] = csr_offset(static_cast<std::size_t>(wide[i]), arrays[i % 5]);

  std::vector<device_step_index> out;
  out.reserve(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i)
    out.push_back(stria::detail::fill_local_index(std::move(building[i]), sel, std::span<const index_t, 5>(totals.data() + 5 * i, 5), stream));
  return out;  // complete in stream order; temporaries are freed in stream order
}

}  // namespace device

}  // namespace stria
