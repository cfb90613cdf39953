// SPDX-License-Identifier: Apache-2.0
// Must not compile: the front template's sharding policy has no locate(), and the check names it.
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"

struct without_locate {
  static constexpr const char* name = "without_locate";
  void validate(stria::shard_layout) const {}
  stria::index_t local_blocks(stria::shard_layout layout) const { return layout.num_blocks / layout.world_size; }
  stria::index_t global_block(stria::shard_layout layout, stria::block_location at) const {
    return at.rank * (layout.num_blocks / layout.world_size) + at.local_block;
  }
};

int main() {
  using attention = stria::sparse_attention<stria::estimator::vertical_slash_top_p, without_locate, stria::topology::flat_ring, stria::tile<64, 64, 64>>;
  return static_cast<int>(sizeof(attention)) == 0;
}
