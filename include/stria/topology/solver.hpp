// SPDX-License-Identifier: Apache-2.0
// topology::solver: the dynamic alternative to a ring (DESIGN 9). No fixed schedule: each layer the
// front template counts its index's work per (query chunk, KV chunk) task, solves a placement
// (solver::solve) and moves query and KV chunks as the plan says. Needs sequential sharding, with
// `chunks_per_rank` chunks per rank.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "stria/core/config.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"
#include "stria/solver/dynamic_solver.hpp"

namespace stria::topology {

class solver {
 public:
  static constexpr std::string_view name = "solver";

  solver() = default;
  explicit solver(index_t world_size, index_t chunks_per_rank = 1, stria::solver::options options = {})
      : world_(world_size), chunks_per_rank_(chunks_per_rank), options_(options) {
    if (world_size < 1) throw invalid_argument("world_size", world_size, "must be at least 1");
    if (world_size > max_world_size) throw invalid_argument("world_size", world_size, "must be at most " + std::to_string(max_world_size) + " ranks");
    if (chunks_per_rank < 1) throw invalid_argument("chunks_per_rank", chunks_per_rank, "must be at least 1");
    // Checked in 64 bits: check_seq_len's product in index_t is what would overflow.
    if (const std::int64_t tokens = std::int64_t{world_size} * chunks_per_rank * block_tokens; tokens > std::numeric_limits<index_t>::max())
      throw invalid_argument("world_size x chunks_per_rank x 64", tokens,
                             "must be at most " + std::to_string(std::numeric_limits<index_t>::max()) + " (the shortest seq_len, one block per chunk, is an index_t)");
    options.validate();
  }

  [[nodiscard]] index_t world_size() const { return world_; }
  [[nodiscard]] index_t chunks_per_rank() const { return chunks_per_rank_; }
  [[nodiscard]] const stria::solver::options& options() const { return options_; }

  /// Throws unless `seq_len` splits into whole 64-token blocks per chunk.
  void check_seq_len(index_t seq_len) const {
    const index_t chunks = world_ * chunks_per_rank_;
    if (seq_len % (chunks * block_tokens) != 0)
      throw invalid_argument("seq_len", seq_len,
                             "must be divisible by world_size x chunks_per_rank x 64 = " + std::to_string(chunks * block_tokens) +
                                 " (topology::solver: whole blocks per chunk)");
  }

 private:
  index_t world_ = 1;
  index_t chunks_per_rank_ = 1;
  stria::solver::options options_;
};

/// Whether a topology policy is the dynamic solver (rather than a ring).
template <class T>
inline constexpr bool is_dynamic_solver = std::is_same_v<T, solver>;

}  // namespace stria::topology
