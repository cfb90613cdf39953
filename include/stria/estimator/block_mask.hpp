// SPDX-License-Identifier: Apache-2.0
// estimator::block_mask: a user-given 64x64 block mask per head, in global block coordinates. For
// causal attention the diagonal tiles are always added, so no query row is ever empty.
#pragma once

#include <algorithm>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::estimator {

struct block_mask {
  static constexpr std::string_view name = "block_mask";

  std::vector<std::vector<block_pair>> blocks;  // [num_heads]: active (query block, key block) tiles

  /// Head count and ranges; whether tiles above the diagonal are allowed depends on the call's
  /// causality, which select() checks.
  void validate(index_t seq_len, index_t num_heads) const {
    if (seq_len <= 0 || seq_len % block_tokens != 0)
      throw invalid_argument("seq_len", seq_len, "must be a positive multiple of 64 (the block size)");
    if (static_cast<index_t>(blocks.size()) != num_heads)
      throw invalid_argument("block_mask.blocks.size()", blocks.size(),
                             "must equal the number of query heads " + std::to_string(num_heads));
    const index_t nb = seq_len / block_tokens;
    for (std::size_t h = 0; h < blocks.size(); ++h)
      for (const block_pair& b : blocks[h])
        if (b.query_block < 0 || b.query_block >= nb || b.key_block < 0 || b.key_block >= nb) {
          std::ostringstream tile;
          tile << "(" << b.query_block << ", " << b.key_block << ")";
          throw invalid_argument("block_mask.blocks[" + std::to_string(h) + "]", tile.str(),
                                 "both blocks must lie in [0, seq_len / 64 = " + std::to_string(nb) + ")");
        }
  }
  [[nodiscard]] statistics_request request(index_t) const { return {}; }

  [[nodiscard]] global_selection select(const vs_statistics& s) const {
    validate(s.seq_len, s.num_heads);
    global_selection g = build(s);
    g.validate();  // for causal attention: no tile above the diagonal
    return g;
  }

 private:
  [[nodiscard]] global_selection build(const vs_statistics& s) const {
    global_selection g{s.seq_len, s.causal, {}};
    for (const auto& tiles : blocks) {
      head_selection head;
      head.blocks = tiles;
      std::sort(head.blocks.begin(), head.blocks.end());
      head.blocks.erase(std::unique(head.blocks.begin(), head.blocks.end()), head.blocks.end());
      if (s.causal) head.slash_deltas = {0};
      g.heads.push_back(std::move(head));
    }
    return g;
  }
};
static_assert(index_estimator<block_mask>);

}  // namespace stria::estimator
