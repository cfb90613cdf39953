// SPDX-License-Identifier: Apache-2.0
// The policy concepts accept policies written as a third party would, and reject incomplete ones.
#include <doctest/doctest.h>

#include <algorithm>
#include <string_view>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/tile.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/global_selection.hpp"

namespace third_party {

using stria::index_t;

/// Round-robin over ranks in reverse: block b lives on rank W-1 - b mod W (a toy layout).
struct reversed_round_robin {
  static constexpr std::string_view name = "reversed_round_robin";
  void validate(stria::shard_layout layout) const {
    if (layout.num_blocks % layout.world_size != 0)
      throw stria::invalid_argument("seq_len / 64", layout.num_blocks, "must be divisible by world_size");
  }
  index_t local_blocks(stria::shard_layout layout) const { return layout.num_blocks / layout.world_size; }
  stria::block_location locate(stria::shard_layout layout, index_t global_block) const {
    return {layout.world_size - 1 - global_block % layout.world_size, global_block / layout.world_size};
  }
  index_t global_block(stria::shard_layout layout, stria::block_location where) const {
    return where.local_block * layout.world_size + (layout.world_size - 1 - where.rank);
  }
};
static_assert(stria::sharding_policy<reversed_round_robin>);

/// A ring that turns the other way: at step s rank r holds the KV of rank r + s.
struct counter_ring {
  static constexpr std::string_view name = "counter_ring";
  index_t world = 1;
  index_t world_size() const { return world; }
  index_t num_steps() const { return world; }
  index_t kv_source_rank(index_t rank, index_t step) const { return (rank + step) % world; }
  int kv_buffer(index_t, index_t step) const { return step % 2; }
  stria::transfer_list transfers(index_t rank, index_t step) const {
    stria::transfer_list list;
    if (step + 1 < world)
      list.items[list.count++] = {stria::ring_channel::inner, (rank - 1 + world) % world, (rank + 1) % world,
                                  kv_source_rank(rank, step), kv_source_rank(rank, step + 1), step % 2, (step + 1) % 2,
                                  step, step + 1};
    return list;
  }
  stria::transfer_list gradient_transfers(index_t, index_t) const { return {}; }
};
static_assert(stria::ring_topology<counter_ring>);

/// Selects the first `count` vertical tokens and nothing else but the diagonal.
struct first_tokens {
  static constexpr std::string_view name = "first_tokens";
  index_t count = 4;
  stria::statistics_request request(index_t) const { return {}; }
  void validate(index_t seq_len, index_t) const {
    if (count > seq_len) throw stria::invalid_argument("count", count, "must not exceed seq_len");
  }
  stria::global_selection select(const stria::vs_statistics& s) const {
    stria::global_selection g{s.seq_len, s.causal, {}};
    for (index_t h = 0; h < s.num_heads; ++h) {
      stria::head_selection head;
      for (index_t t = 0; t < count; ++t) head.vertical_tokens.push_back(t);
      head.slash_deltas = {0};
      g.heads.push_back(head);
    }
    return g;
  }
};
static_assert(stria::index_estimator<first_tokens>);

struct my_tile {
  static constexpr index_t block_q = 64, block_kv = 64, head_dim = 128;
};
static_assert(stria::tile_traits<my_tile>);

// Incomplete or wrong policies are rejected.
struct no_inverse {
  static constexpr std::string_view name = "no_inverse";
  void validate(stria::shard_layout) const {}
  index_t local_blocks(stria::shard_layout) const { return 0; }
  stria::block_location locate(stria::shard_layout, index_t) const { return {}; }
};
static_assert(!stria::sharding_policy<no_inverse>);
struct ring_without_buffers {
  static constexpr std::string_view name = "x";
  index_t world_size() const { return 1; }
  index_t num_steps() const { return 1; }
  index_t kv_source_rank(index_t, index_t) const { return 0; }
};
static_assert(!stria::ring_topology<ring_without_buffers>);
struct tile_32 {
  static constexpr index_t block_q = 32, block_kv = 64, head_dim = 128;
};
static_assert(!stria::tile_traits<tile_32>);
struct estimator_without_name {
  stria::statistics_request request(index_t) const { return {}; }
  void validate(index_t, index_t) const {}
  stria::global_selection select(const stria::vs_statistics&) const { return {}; }
};
static_assert(!stria::index_estimator<estimator_without_name>);

}  // namespace third_party

TEST_CASE("third-party policies satisfy the concepts and behave as declared") {
  const third_party::reversed_round_robin sharding;
  const stria::shard_layout layout{12, 3};
  for (stria::index_t b = 0; b < 12; ++b) CHECK(sharding.global_block(layout, sharding.locate(layout, b)) == b);
  CHECK_THROWS_AS(sharding.validate({10, 3}), stria::invalid_argument);

  const third_party::counter_ring ring{5};
  for (stria::index_t r = 0; r < 5; ++r) {
    std::vector<int> seen(5, 0);
    for (stria::index_t s = 0; s < ring.num_steps(); ++s) ++seen[static_cast<std::size_t>(ring.kv_source_rank(r, s))];
    CHECK(std::count(seen.begin(), seen.end(), 1) == 5);
  }

  const third_party::first_tokens estimator{3};
  stria::vs_statistics shape_only;
  shape_only.seq_len = 256;
  shape_only.num_heads = 2;
  const stria::global_selection g = estimator.select(shape_only);
  CHECK_NOTHROW(g.validate());
  CHECK(g.heads.size() == 2);
  CHECK(g.heads[1].vertical_tokens == std::vector<stria::index_t>{0, 1, 2});
}
