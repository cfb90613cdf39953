// SPDX-License-Identifier: Apache-2.0
// sharding::placed_stripes: 64-token stripes placed on ranks by a table (one per layer, e.g. from
// balance_stripes in stria/index/stripe_balance.hpp), every rank owning the same number of them.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"

namespace stria::sharding {

/// A sharding whose owner of each 64-token block is runtime state: the table it was built from.
/// Each rank owns num_blocks / world_size blocks, so a ring moves the same bytes per step as with
/// striped<64>; each rank's local order keeps global order. Host-side maps: kernels and the GPU
/// index builder read the tables that are built from locate() and global_block() on the host.
class placed_stripes {
 public:
  static constexpr std::string_view name = "placed_stripes";

  /// An empty placement: validate() rejects every layout (std::semiregular needs the default).
  placed_stripes() = default;

  /// `owner_rank[b]`: the rank that owns global block b. Throws unless every rank in
  /// [0, world_size) owns exactly owner_rank.size() / world_size blocks.
  placed_stripes(std::vector<index_t> owner_rank, index_t world_size) : owner_(std::move(owner_rank)), world_(world_size) {
    const auto num_blocks = static_cast<index_t>(owner_.size());
    if (world_ < 1) throw invalid_argument("world_size", world_, "must be at least 1");
    if (num_blocks < 1 || num_blocks % world_ != 0)
      throw invalid_argument("owner_rank.size()", num_blocks,
                             "must be a positive multiple of world_size = " + std::to_string(world_) + " (one entry per 64-token block)");
    const index_t per_rank = num_blocks / world_;
    local_.resize(owner_.size());
    global_.assign(owner_.size(), -1);
    std::vector<index_t> count(static_cast<std::size_t>(world_), 0);
    for (index_t b = 0; b < num_blocks; ++b) {
      const index_t r = owner_[static_cast<std::size_t>(b)];
      if (r < 0 || r >= world_)
        throw invalid_argument("owner_rank[" + std::to_string(b) + "]", r, "must lie in [0, world_size = " + std::to_string(world_) + ")");
      index_t& next = count[static_cast<std::size_t>(r)];
      if (next == per_rank)
        throw invalid_argument("owner_rank", "(rank " + std::to_string(r) + " owns more than " + std::to_string(per_rank) + " blocks)",
                               "every rank must own num_blocks / world_size blocks, so that each ring step moves equal chunks");
      local_[static_cast<std::size_t>(b)] = next;  // blocks are visited in global order: local order keeps it
      global_[static_cast<std::size_t>(r) * static_cast<std::size_t>(per_rank) + static_cast<std::size_t>(next)] = b;
      ++next;
    }
  }

  /// The placement as given: owner rank per global block.
  [[nodiscard]] const std::vector<index_t>& owner_ranks() const { return owner_; }
  [[nodiscard]] index_t world_size() const { return world_; }

  void validate(shard_layout layout) const {
    if (layout.world_size < 1) throw invalid_argument("world_size", layout.world_size, "must be at least 1");
    if (layout.world_size != world_ || layout.num_blocks != static_cast<index_t>(owner_.size()))
      throw invalid_argument("seq_len", static_cast<long long>(layout.num_blocks) * 64,
                             "placed_stripes was built for seq_len " + std::to_string(static_cast<long long>(owner_.size()) * 64) +
                                 " and world_size " + std::to_string(world_) + ", this layout has world_size " +
                                 std::to_string(layout.world_size) + " (build the placement for the layout it is used with)");
  }

  [[nodiscard]] index_t local_blocks(shard_layout layout) const { return layout.num_blocks / layout.world_size; }

  [[nodiscard]] block_location locate(shard_layout, index_t global_block) const {
    const auto b = static_cast<std::size_t>(global_block);
    return {owner_[b], local_[b]};
  }

  [[nodiscard]] index_t global_block(shard_layout layout, block_location where) const {
    return global_[static_cast<std::size_t>(where.rank) * static_cast<std::size_t>(local_blocks(layout)) + static_cast<std::size_t>(where.local_block)];
  }

  friend bool operator==(const placed_stripes&, const placed_stripes&) = default;

 private:
  std::vector<index_t> owner_;   // [num_blocks] rank per global block
  std::vector<index_t> local_;   // [num_blocks] local block per global block
  std::vector<index_t> global_;  // [world_size, num_blocks / world_size] global block per (rank, local block)
  index_t world_ = 0;
};
static_assert(sharding_policy<placed_stripes>);

}  // namespace stria::sharding
