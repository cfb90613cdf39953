// SPDX-License-Identifier: Apache-2.0
// sharding::sequential: rank r owns the contiguous blocks [r * L, (r + 1) * L), L = num_blocks / world_size.
#pragma once

#include <string_view>

#include "stria/core/concepts.hpp"
#include "stria/sharding/validate.hpp"

namespace stria::sharding {

struct sequential {
  static constexpr std::string_view name = "sequential";

  void validate(shard_layout layout) const { detail::validate_layout(layout, 1, "sequential sharding needs seq_len to be a positive multiple of world_size * 64"); }

  STRIA_HOST_DEVICE constexpr index_t local_blocks(shard_layout layout) const { return layout.num_blocks / layout.world_size; }

  STRIA_HOST_DEVICE constexpr block_location locate(shard_layout layout, index_t global_block) const {
    const index_t per_rank = local_blocks(layout);
    return {global_block / per_rank, global_block % per_rank};
  }

  STRIA_HOST_DEVICE constexpr index_t global_block(shard_layout layout, block_location where) const {
    return where.rank * local_blocks(layout) + where.local_block;
  }
};
static_assert(sharding_policy<sequential>);

}  // namespace stria::sharding
