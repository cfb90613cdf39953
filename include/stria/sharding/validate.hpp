// SPDX-License-Identifier: Apache-2.0
// The layout rule every built-in sharding shares: each rank owns the same whole number of units.
#pragma once

#include <string>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"

namespace stria::sharding::detail {

/// Throws unless the sequence splits into world_size * `units_per_rank` equal units of whole blocks.
/// `rule` says what the policy needs, e.g. "zigzag sharding needs seq_len to be a multiple of 2 * world_size * 64".
inline void validate_layout(shard_layout layout, index_t units_per_rank, const std::string& rule) {
  if (layout.world_size < 1) throw invalid_argument("world_size", layout.world_size, "must be at least 1");
  const long long divisor_blocks = static_cast<long long>(layout.world_size) * units_per_rank;
  const long long seq_len = static_cast<long long>(layout.num_blocks) * block_tokens;
  if (layout.num_blocks < 1 || layout.num_blocks % divisor_blocks != 0)
    throw invalid_argument("seq_len", seq_len,
                           rule + " = " + std::to_string(divisor_blocks * block_tokens) + " (world_size " +
                               std::to_string(layout.world_size) + ")");
}

}  // namespace stria::sharding::detail
