// SPDX-License-Identifier: Apache-2.0
// sharding::zigzag: 2W equal chunks; rank r owns chunk r and chunk 2W-1-r, which balances dense causal attention.
#pragma once

#include <string_view>

#include "stria/core/concepts.hpp"
#include "stria/sharding/validate.hpp"

namespace stria::sharding {

struct zigzag {
  static constexpr std::string_view name = "zigzag";

  void validate(shard_layout layout) const { detail::validate_layout(layout, 2, "zigzag sharding needs seq_len to be a positive multiple of 2 * world_size * 64"); }

  STRIA_HOST_DEVICE constexpr index_t local_blocks(shard_layout layout) const { return layout.num_blocks / layout.world_size; }

  STRIA_HOST_DEVICE constexpr block_location locate(shard_layout layout, index_t global_block) const {
    const index_t chunk_blocks = layout.num_blocks / (2 * layout.world_size);
    const index_t chunk = global_block / chunk_blocks;
    const index_t offset = global_block % chunk_blocks;
    if (chunk < layout.world_size) return {chunk, offset};
    return {2 * layout.world_size - 1 - chunk, chunk_blocks + offset};  // the mirrored chunk comes second locally
  }

  STRIA_HOST_DEVICE constexpr index_t global_block(shard_layout layout, block_location where) const {
    const index_t chunk_blocks = layout.num_blocks / (2 * layout.world_size);
    if (where.local_block < chunk_blocks) return where.rank * chunk_blocks + where.local_block;
    return (2 * layout.world_size - 1 - where.rank) * chunk_blocks + (where.local_block - chunk_blocks);
  }
};
static_assert(sharding_policy<zigzag>);

}  // namespace stria::sharding
