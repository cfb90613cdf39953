// SPDX-License-Identifier: Apache-2.0
// topology::flat_ring: at step s rank r computes with the KV of rank (r - s) mod W while it passes
// its current KV to r + 1 (double buffered); in backward the dK/dV partials follow one step behind.
#pragma once

#include <string>
#include <string_view>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"

namespace stria::topology {

struct flat_ring {
  static constexpr std::string_view name = "flat_ring";

  constexpr flat_ring() = default;
  explicit flat_ring(index_t world_size) : world_(world_size) {
    if (world_size < 1) throw invalid_argument("world_size", world_size, "a ring needs at least 1 rank");
    if (world_size > max_world_size) throw invalid_argument("world_size", world_size, "must be at most " + std::to_string(max_world_size) + " ranks");
  }

  /// Throws unless the ring was built for `world_size` ranks (e.g. the communicator's size).
  void check_world(index_t world_size) const {
    if (world_size != world_)
      throw invalid_argument("world_size", world_size, "does not match flat_ring(" + std::to_string(world_) + ")");
  }

  [[nodiscard]] constexpr index_t world_size() const { return world_; }
  [[nodiscard]] constexpr index_t num_steps() const { return world_; }

  [[nodiscard]] constexpr index_t kv_source_rank(index_t rank, index_t step) const { return wrap(rank - step); }
  [[nodiscard]] constexpr int kv_buffer(index_t, index_t step) const { return step % 2; }

  [[nodiscard]] constexpr transfer_list transfers(index_t rank, index_t step) const {
    transfer_list list;
    if (step + 1 < world_)
      list.push({ring_channel::inner, wrap(rank + 1), wrap(rank - 1), kv_source_rank(rank, step),
                 kv_source_rank(rank, step + 1), kv_buffer(rank, step), kv_buffer(rank, step + 1), step, step + 1});
    return list;
  }

  [[nodiscard]] constexpr transfer_list gradient_transfers(index_t rank, index_t step) const {
    transfer_list list;
    if (world_ > 1)  // the last step's move delivers every chunk's sum to its owner
      list.push({ring_channel::inner, wrap(rank + 1), wrap(rank - 1), kv_source_rank(rank, step),
                 kv_source_rank(rank, step + 1), step % 2, (step + 1) % 2, step, step + 1});
    return list;
  }

 private:
  [[nodiscard]] constexpr index_t wrap(index_t r) const { return ((r % world_) + world_) % world_; }

  index_t world_ = 1;
};
static_assert(ring_topology<flat_ring>);

}  // namespace stria::topology
