// SPDX-License-Identifier: Apache-2.0
// Host conversion of a global selection into local step indices: for one query rank and one KV
// source rank under a sharding policy, the active tiles and vertical tokens in local coordinates.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/index/step_index.hpp"

namespace stria {

namespace detail {

/// Throws unless both ranks lie in [0, world_size).
inline void check_index_ranks(index_t world_size, index_t query_rank, index_t kv_rank) {
  if (query_rank < 0 || query_rank >= world_size)
    throw invalid_argument("query_rank", query_rank, "must lie in [0, world_size = " + std::to_string(world_size) + ")");
  if (kv_rank < 0 || kv_rank >= world_size)
    throw invalid_argument("kv_rank", kv_rank, "must lie in [0, world_size = " + std::to_string(world_size) + ")");
}

}  // namespace detail

/// The index of `query_rank`'s local query blocks against the KV shard of `kv_rank`. `origin`
/// records the ring step it is for. Entries: tiles on selected block diagonals and explicit tiles
/// (causal ones only when causal); vertical tokens that precede the whole query block (any, when
/// full) and are not inside an active tile of the row.
template <sharding_policy Sharding>
step_index build_local_index(const global_selection& selection, const Sharding& sharding, index_t world_size,
                             index_t query_rank, index_t kv_rank, step_index_origin origin = {}) {
  selection.validate();  // its tokens and blocks index the sharding's tables: one out of range wrote outside them
  const index_t nb = selection.num_blocks();
  const shard_layout layout{nb, world_size};
  sharding.validate(layout);
  detail::check_index_ranks(world_size, query_rank, kv_rank);

  const index_t local = sharding.local_blocks(layout);
  const index_t heads = selection.num_heads();
  std::vector<index_t> query_global(static_cast<std::size_t>(local)), kv_global(static_cast<std::size_t>(local));
  for (index_t i = 0; i < local; ++i) {
    query_global[static_cast<std::size_t>(i)] = sharding.global_block(layout, {query_rank, i});
    kv_global[static_cast<std::size_t>(i)] = sharding.global_block(layout, {kv_rank, i});
  }

  std::vector<std::vector<index_t>> blocks(static_cast<std::size_t>(heads * local)), tokens(blocks.size());
  for (index_t h = 0; h < heads; ++h) {
    const head_selection& head = selection.heads[static_cast<std::size_t>(h)];
    for (index_t i = 0; i < local; ++i) {
      const index_t q_block = query_global[static_cast<std::size_t>(i)];
      auto& row = blocks[static_cast<std::size_t>(h * local + i)];
      for (const index_t delta : head.slash_deltas) {
        const index_t k_block = q_block - delta;
        if (k_block < 0 || k_block >= nb) continue;
        const block_location where = sharding.locate(layout, k_block);
        if (where.rank == kv_rank) row.push_back(where.local_block);
      }
    }
    for (const block_pair& b : head.blocks) {
      const block_location q = sharding.locate(layout, b.query_block);
      const block_location k = sharding.locate(layout, b.key_block);
      if (q.rank == query_rank && k.rank == kv_rank) blocks[static_cast<std::size_t>(h * local + q.local_block)].push_back(k.local_block);
    }
    for (index_t i = 0; i < local; ++i) {
      auto& row = blocks[static_cast<std::size_t>(h * local + i)];
      std::sort(row.begin(), row.end());
      row.erase(std::unique(row.begin(), row.end()), row.end());  // a tile may be both slash and explicit
    }
    for (const index_t token : head.vertical_tokens) {
      const index_t k_block = token / block_tokens;
      const block_location where = sharding.locate(layout, k_block);
      if (where.rank != kv_rank) continue;
      const index_t local_token = where.local_block * block_tokens + token % block_tokens;
      for (index_t i = 0; i < local; ++i) {
        if (selection.causal && k_block >= query_global[static_cast<std::size_t>(i)]) continue;
        const auto& row = blocks[static_cast<std::size_t>(h * local + i)];
        if (!std::binary_search(row.begin(), row.end(), where.local_block))
          tokens[static_cast<std::size_t>(h * local + i)].push_back(local_token);
      }
    }
  }
  origin.seq_len = selection.seq_len;
  origin.world_size = world_size;
  origin.rank = query_rank;
  origin.kv_source_rank = kv_rank;
  return build_step_index({heads, local, local, selection.causal}, origin, std::move(query_global), std::move(kv_global),
                          std::move(blocks), std::move(tokens));
}

/// Every step's index of `rank` under a ring topology: element s is for step s.
template <sharding_policy Sharding, ring_topology Topology>
std::vector<step_index> build_ring_indices(const global_selection& selection, const Sharding& sharding,
                                           const Topology& topology, index_t rank) {
  std::vector<step_index> indices;
  indices.reserve(static_cast<std::size_t>(topology.num_steps()));
  for (index_t step = 0; step < topology.num_steps(); ++step) {
    step_index_origin origin;
    origin.step = step;
    indices.push_back(build_local_index(selection, sharding, topology.world_size(), rank,
                                        topology.kv_source_rank(rank, step), origin));
  }
  return indices;
}

}  // namespace stria
