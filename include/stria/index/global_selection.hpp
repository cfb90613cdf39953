// SPDX-License-Identifier: Apache-2.0
// global_selection: the per-head sparse pattern in global coordinates, identical on all ranks (DESIGN 6).
#pragma once

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"

namespace stria {

/// A 64x64 tile named by global query block and global key block.
struct block_pair {
  index_t query_block;
  index_t key_block;

  friend constexpr bool operator==(const block_pair&, const block_pair&) = default;
  friend constexpr auto operator<=>(const block_pair&, const block_pair&) = default;
};

/// One query head's selection. A (query token n, key token m) entry is active when
/// - m is a vertical token, or
/// - block(n) - block(m) is a selected slash diagonal, or
/// - (block(n), block(m)) is an explicit block (user block masks),
/// and, for causal attention, m <= n.
struct head_selection {
  std::vector<index_t> vertical_tokens;  // sorted, unique global key tokens
  std::vector<index_t> slash_deltas;     // sorted, unique query_block - key_block; 0 always present when causal
  std::vector<block_pair> blocks;        // sorted, unique explicit tiles

  friend bool operator==(const head_selection&, const head_selection&) = default;
};

struct global_selection {
  index_t seq_len = 0;
  bool causal = true;
  std::vector<head_selection> heads;  // one per query head

  friend bool operator==(const global_selection&, const global_selection&) = default;

  [[nodiscard]] index_t num_blocks() const { return seq_len / block_tokens; }
  [[nodiscard]] index_t num_heads() const { return static_cast<index_t>(heads.size()); }

  /// Throws stria::invalid_argument unless every list is sorted, unique and in range, and every
  /// causal head selects block diagonal 0 (so no query row is empty).
  void validate() const {
    if (seq_len <= 0 || seq_len % block_tokens != 0)
      throw invalid_argument("global_selection.seq_len", seq_len, "must be a positive multiple of 64");
    if (heads.empty()) throw invalid_argument("global_selection.heads.size()", 0, "must be at least 1");
    const index_t nb = num_blocks();
    for (index_t h = 0; h < num_heads(); ++h) {
      const head_selection& head = heads[static_cast<std::size_t>(h)];
      const std::string where = "global_selection.heads[" + std::to_string(h) + "]";
      check_sorted_in_range(head.vertical_tokens, 0, seq_len - 1, where + ".vertical_tokens");
      check_sorted_in_range(head.slash_deltas, causal ? 0 : -(nb - 1), nb - 1, where + ".slash_deltas");
      if (causal && !std::binary_search(head.slash_deltas.begin(), head.slash_deltas.end(), 0))
        throw invalid_argument(where + ".slash_deltas", "(no 0)",
                               "must contain block diagonal 0 for causal attention, so that no query row is empty");
      for (std::size_t i = 0; i < head.blocks.size(); ++i) {
        const block_pair& b = head.blocks[i];
        const auto name = [&] { return where + ".blocks[" + std::to_string(i) + "]"; };  // built only to throw
        if (b.query_block < 0 || b.query_block >= nb || b.key_block < 0 || b.key_block >= nb)
          throw invalid_argument(name(), pair_text(b), "both blocks must lie in [0, seq_len / 64)");
        if (causal && b.key_block > b.query_block)
          throw invalid_argument(name(), pair_text(b), "key_block must not exceed query_block for causal attention");
        if (i > 0 && !(head.blocks[i - 1] < b))
          throw invalid_argument(name(), pair_text(b), "blocks must be sorted by (query_block, key_block) and unique");
      }
    }
  }

 private:
  static std::string pair_text(const block_pair& b) {
    std::ostringstream text;  // (not "(" + std::to_string(...): GCC 12 warns falsely on that, PR 105329)
    text << "(" << b.query_block << ", " << b.key_block << ")";
    return text.str();
  }

  static void check_sorted_in_range(const std::vector<index_t>& values, index_t lo, index_t hi,
                                    const std::string& name) {
    for (std::size_t i = 0; i < values.size(); ++i) {
      const auto at = [&] { return name + "[" + std::to_string(i) + "]"; };  // built only to throw
      if (values[i] < lo || values[i] > hi)
        throw invalid_argument(at(), values[i], "must lie in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
      if (i > 0 && values[i] <= values[i - 1])
        throw invalid_argument(at(), values[i], "must be greater than the previous entry (sorted, no duplicates)");
    }
  }
};

}  // namespace stria
