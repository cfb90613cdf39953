// SPDX-License-Identifier: Apache-2.0
// vs_statistics: what every rank knows about the observation window's attention after the
// estimator's collectives: slash mass per block diagonal, and vertical candidates (DESIGN 7).
#pragma once

#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/tile.hpp"

namespace stria {

/// What an estimator needs gathered: the last `window_rows` (1 to 64) query tokens are the
/// observation window, all inside the last block, so each key token lies on one block diagonal for
/// every window row. Each rank contributes its top `vertical_candidates` key tokens per head, leaving
/// out the tokens of the last `local_blocks` key blocks (the local diagonals, selected anyway).
/// Zero rows: no statistics at all (dense, block masks).
struct statistics_request {
  index_t window_rows = 0;
  index_t vertical_candidates = 0;
  index_t local_blocks = 0;
};

/// One key token and the window probability that lands on it.
struct vertical_candidate {
  float mass;
  index_t token;  // global key token

  /// Selection order: larger mass first, ties broken by the smaller token, so every rank that sorts
  /// the same candidates picks the same ones.
  friend constexpr bool operator<(const vertical_candidate& a, const vertical_candidate& b) {
    return a.mass != b.mass ? a.mass > b.mass : a.token < b.token;
  }
  friend constexpr bool operator==(const vertical_candidate&, const vertical_candidate&) = default;
};

/// Identical on every rank. Estimators that need no statistics receive the shape alone.
struct vs_statistics {
  index_t seq_len = 0;
  index_t num_heads = 0;  // query heads
  bool causal = true;
  index_t window_rows = 0;
  /// [num_heads]: the window's total probability mass (rows with any key contribute 1 each).
  std::vector<float> window_mass;
  /// [num_heads, num_diagonals()]: window mass per block diagonal delta = query block - key block,
  /// at index delta + diagonal_offset().
  std::vector<float> slash_mass;
  /// Per head, in selection order: the union of every rank's top candidates, which contains the
  /// global top-k for any k up to the per-rank count (exact distributed top-k).
  std::vector<std::vector<vertical_candidate>> vertical;
  index_t local_blocks = 0;  // the candidates leave out the last local_blocks key blocks

  [[nodiscard]] index_t num_blocks() const { return seq_len / block_tokens; }
  [[nodiscard]] index_t num_diagonals() const { return causal ? num_blocks() : 2 * num_blocks() - 1; }
  [[nodiscard]] index_t diagonal_offset() const { return causal ? 0 : num_blocks() - 1; }
  [[nodiscard]] bool empty() const { return window_rows == 0; }
  /// The block diagonal a key token lies on for every window row (the window is in the last block).
  [[nodiscard]] index_t diagonal_of(index_t key_token) const { return num_blocks() - 1 - key_token / block_tokens; }
};

}  // namespace stria
