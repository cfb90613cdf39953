// SPDX-License-Identifier: Apache-2.0
// vs_statistics: the observation window's attention mass per key token and per block diagonal (DESIGN 7).
#pragma once

#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/tile.hpp"

namespace stria {

/// Global statistics every rank holds after the estimator's all-reduces. Estimators that need no
/// statistics (dense, block masks) receive the shape alone, with both mass arrays empty.
struct vs_statistics {
  index_t seq_len = 0;
  index_t num_heads = 0;  // query heads
  bool causal = true;
  std::vector<float> vertical_mass;  // [num_heads, seq_len]: window probability that lands on each key token
  std::vector<float> slash_mass;     // [num_heads, num_diagonals]: window probability per block diagonal

  [[nodiscard]] index_t num_blocks() const { return seq_len / block_tokens; }
  /// Diagonals are indexed by delta = query_block - key_block, offset so that index 0 is the most
  /// negative delta: num_blocks diagonals when causal, 2 * num_blocks - 1 otherwise.
  [[nodiscard]] index_t num_diagonals() const { return causal ? num_blocks() : 2 * num_blocks() - 1; }
  [[nodiscard]] index_t diagonal_offset() const { return causal ? 0 : num_blocks() - 1; }
};

}  // namespace stria
