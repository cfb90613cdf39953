// SPDX-License-Identifier: Apache-2.0
// topology::hierarchical_ring: N nodes x C cards (rank = node * C + card). An inner ring rotates KV
// among a node's cards; an outer ring moves KV between nodes, each outer transfer hidden behind a
// whole inner round (MTraining's hierarchical balanced ring; LoongTrain's double ring).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"

namespace stria::topology {

/// Step s = outer * C + inner. Rank (n, c) computes with the KV of (n - outer, c - inner).
/// KV slots: 0 and 1 double-buffer the inner ring; 2 and 3 double-buffer the outer ring, which the
/// inner ring only reads (its first inner step sends from the outer slot).
struct hierarchical_ring {
  static constexpr std::string_view name = "hierarchical_ring";
  static constexpr int outer_slot = 2;

  constexpr hierarchical_ring() = default;
  hierarchical_ring(index_t nodes, index_t cards_per_node) : nodes_(nodes), cards_(cards_per_node) {
    if (nodes < 1) throw invalid_argument("nodes", nodes, "a hierarchical ring needs at least 1 node");
    if (cards_per_node < 1) throw invalid_argument("cards_per_node", cards_per_node, "a hierarchical ring needs at least 1 card per node");
    // Checked in 64 bits: the product in index_t is what would overflow.
    if (const std::int64_t ranks = std::int64_t{nodes} * cards_per_node; ranks > max_world_size)
      throw invalid_argument("nodes x cards_per_node", ranks, "must be at most " + std::to_string(max_world_size) + " ranks");
  }

  /// Throws unless the ring was built for `world_size` ranks.
  void check_world(index_t world_size) const {
    if (world_size != world_size_of())
      throw invalid_argument("world_size", world_size,
                             "does not match hierarchical_ring(" + std::to_string(nodes_) + " nodes x " +
                                 std::to_string(cards_) + " cards) = " + std::to_string(world_size_of()) + " ranks");
  }

  [[nodiscard]] constexpr index_t nodes() const { return nodes_; }
  [[nodiscard]] constexpr index_t cards_per_node() const { return cards_; }
  [[nodiscard]] constexpr index_t world_size() const { return world_size_of(); }
  [[nodiscard]] constexpr index_t num_steps() const { return world_size_of(); }
  [[nodiscard]] constexpr index_t node_of(index_t rank) const { return rank / cards_; }
  [[nodiscard]] constexpr index_t card_of(index_t rank) const { return rank % cards_; }

  [[nodiscard]] constexpr index_t kv_source_rank(index_t rank, index_t step) const {
    return at(node_of(rank) - step / cards_, card_of(rank) - step % cards_);
  }

  [[nodiscard]] constexpr int kv_buffer(index_t, index_t step) const {
    const index_t outer = step / cards_, inner = step % cards_;
    return inner == 0 ? outer_slot + outer % 2 : (inner - 1) % 2;
  }

  [[nodiscard]] constexpr transfer_list transfers(index_t rank, index_t step) const {
    const index_t n = node_of(rank), c = card_of(rank);
    const index_t outer = step / cards_, inner = step % cards_;
    transfer_list list;
    if (inner == 0 && outer + 1 < nodes_) {
      // The KV held at the start of this outer step goes to the next node, for its next outer step.
      const index_t ready = (outer + 1) * cards_;
      list.push({ring_channel::outer, at(n + 1, c), at(n - 1, c), kv_source_rank(rank, step),
                 kv_source_rank(rank, ready), kv_buffer(rank, step), kv_buffer(rank, ready), step, ready});
    }
    if (inner + 1 < cards_)
      list.push({ring_channel::inner, at(n, c + 1), at(n, c - 1), kv_source_rank(rank, step),
                 kv_source_rank(rank, step + 1), kv_buffer(rank, step), kv_buffer(rank, step + 1), step, step + 1});
    return list;
  }

  /// Inner: the partial of the chunk just computed goes to the next card; after the last inner step
  /// that move returns each chunk's node partial to the card where the chunk entered the node.
  /// Outer (after the last inner step): the node partial, plus the partial of earlier nodes, goes to
  /// the next node, where it is added at the end of that node's round; the last one reaches the owner.
  [[nodiscard]] constexpr transfer_list gradient_transfers(index_t rank, index_t step) const {
    const index_t n = node_of(rank), c = card_of(rank);
    const index_t outer = step / cards_, inner = step % cards_;
    const bool last_inner = inner + 1 == cards_;
    transfer_list list;
    if (cards_ > 1) {
      // At the last inner step the partial that arrives is consumed by this step end's outer send.
      const index_t ready = !last_inner ? step + 1 : nodes_ > 1 ? step : num_steps();
      list.push({ring_channel::inner, at(n, c + 1), at(n, c - 1), kv_source_rank(rank, step),
                 at(n - outer, c - 1 - inner), inner % 2, (inner + 1) % 2, step, ready});
    }
    if (nodes_ > 1 && last_inner) {
      const index_t ready = outer + 1 < nodes_ ? step + cards_ : num_steps();
      list.push({ring_channel::outer, at(n + 1, c), at(n - 1, c), at(n - outer, c), at(n - 1 - outer, c),
                 outer_slot + outer % 2, outer_slot + (outer + 1) % 2, step, ready});
    }
    return list;
  }

 private:
  [[nodiscard]] constexpr index_t world_size_of() const { return nodes_ * cards_; }
  /// The rank of (node, card), both taken modulo their ring sizes.
  [[nodiscard]] constexpr index_t at(index_t node, index_t card) const {
    return ((node % nodes_) + nodes_) % nodes_ * cards_ + ((card % cards_) + cards_) % cards_;
  }

  index_t nodes_ = 1;
  index_t cards_ = 1;
};
static_assert(ring_topology<hierarchical_ring>);

}  // namespace stria::topology
