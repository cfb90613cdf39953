// SPDX-License-Identifier: Apache-2.0
// vs_statistics: what every rank knows about the observation window's attention after the
// estimator's collectives: slash mass per block diagonal, and vertical candidates (DESIGN 7).
#pragma once

#include <cstdint>
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

namespace detail {

/// A candidate as one integer whose order is selection order (vertical_candidate's operator<,
/// smaller first), so that a merge compares one integer instead of two fields, and one array carries
/// a rank's candidates: the mass's bits, turned to sort heavier first, above token * 2 (tokens lie
/// in [0, 2^31)), and in the last bit the sign of a zero mass (-0.0 == 0.0 in selection order, so
/// both share their mass bits). A NaN mass has no place in selection order; here it sorts as its
/// bits say. __builtin_bit_cast, not std::bit_cast: kernels call these too.
STRIA_HOST_DEVICE constexpr std::uint64_t selection_key(const vertical_candidate& c) {
  const auto bits = __builtin_bit_cast(std::uint32_t, c.mass);
  const std::uint32_t negative_zero = bits == 0x80000000u, mass = bits & ~(negative_zero << 31);
  // Non-negative masses: their 31 bits reversed, heaviest first; then the negative ones as they are.
  const std::uint32_t order = mass ^ (((mass >> 31) - 1u) & 0x7fffffffu);
  return std::uint64_t{order} << 32 | static_cast<std::uint64_t>(c.token) << 1 | negative_zero;
}
STRIA_HOST_DEVICE constexpr vertical_candidate candidate_of(std::uint64_t key) {
  const auto order = static_cast<std::uint32_t>(key >> 32), mass = order ^ (((order >> 31) - 1u) & 0x7fffffffu);
  return {__builtin_bit_cast(float, key & 1 ? 0x80000000u : mass), static_cast<index_t>(static_cast<std::uint32_t>(key) >> 1)};
}
/// The first selection key of a negative mass (a sentinel): every lighter candidate's key is at least this.
inline constexpr std::uint64_t negative_masses = std::uint64_t{1} << 63;

}  // namespace detail

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
