// SPDX-License-Identifier: Apache-2.0
// Sharding policies: bijective maps that keep global order locally, the documented formulas,
// clear layout errors, and dispatch/undispatch round trips.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/placed_stripes.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "support/random.hpp"

using namespace stria;

namespace {

/// For every (rank, local block): the global block maps back, every global block is hit once, and
/// local order keeps global order.
template <class Policy>
void check_bijection(const Policy& policy, shard_layout layout) {
  CAPTURE(layout.num_blocks);
  CAPTURE(layout.world_size);
  REQUIRE_NOTHROW(policy.validate(layout));
  const index_t local = policy.local_blocks(layout);
  REQUIRE(local * layout.world_size == layout.num_blocks);
  std::vector<int> hits(static_cast<std::size_t>(layout.num_blocks), 0);
  for (index_t r = 0; r < layout.world_size; ++r)
    for (index_t i = 0; i < local; ++i) {
      const index_t g = policy.global_block(layout, {r, i});
      REQUIRE(g >= 0);
      REQUIRE(g < layout.num_blocks);
      ++hits[static_cast<std::size_t>(g)];
      CHECK(policy.locate(layout, g) == block_location{r, i});
      if (i > 0) CHECK(policy.global_block(layout, {r, i - 1}) < g);
    }
  for (int h : hits) CHECK(h == 1);
}

/// A random placement with num_blocks / world blocks per rank.
sharding::placed_stripes random_placement(test::seeded_rng& rng, shard_layout layout) {
  std::vector<index_t> owner(static_cast<std::size_t>(layout.num_blocks));
  for (index_t b = 0; b < layout.num_blocks; ++b) owner[static_cast<std::size_t>(b)] = b % layout.world_size;
  std::shuffle(owner.begin(), owner.end(), rng.engine);
  return {owner, layout.world_size};
}

}  // namespace

TEST_CASE("every sharding is a bijection that keeps global order, over many sizes and world sizes") {
  for (index_t world = 1; world <= 16; ++world)
    for (index_t multiple = 1; multiple <= 4; ++multiple) {
      check_bijection(sharding::sequential{}, {world * multiple, world});
      check_bijection(sharding::zigzag{}, {2 * world * multiple, world});
      check_bijection(sharding::striped<64>{}, {world * multiple, world});
      check_bijection(sharding::striped<128>{}, {2 * world * multiple, world});
      check_bijection(sharding::striped<256>{}, {4 * world * multiple, world});
    }
  check_bijection(sharding::striped<64>{}, {2048, 64});  // 128K tokens over 64 ranks
  check_bijection(sharding::zigzag{}, {2048, 8});
}

TEST_CASE("placed stripes: any table with equal counts is a bijection that keeps global order") {
  STRIA_SEEDED_RNG(rng);
  for (index_t world = 1; world <= 16; ++world)
    for (index_t multiple = 1; multiple <= 4; ++multiple) check_bijection(random_placement(rng, {world * multiple, world}), {world * multiple, world});
  check_bijection(random_placement(rng, {2048, 32}), {2048, 32});
  // The table it was built from reads back, and a round-robin table is striped<64>.
  std::vector<index_t> round_robin(48);
  for (index_t b = 0; b < 48; ++b) round_robin[static_cast<std::size_t>(b)] = b % 6;
  const sharding::placed_stripes placed(round_robin, 6);
  CHECK(placed.owner_ranks() == round_robin);
  CHECK(placed.world_size() == 6);
  for (index_t b = 0; b < 48; ++b) CHECK(placed.locate({48, 6}, b) == sharding::striped<64>{}.locate({48, 6}, b));
}

TEST_CASE("placed stripes reject tables with unequal counts and layouts they were not built for") {
  CHECK_THROWS_WITH_AS(sharding::placed_stripes({0, 1, 1, 1}, 2), doctest::Contains("rank 1 owns more than 2 blocks"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::placed_stripes({0, 2, 1, 1}, 2), "stria: owner_rank[1] = 2: must lie in [0, world_size = 2)", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::placed_stripes({0, 1, 0}, 2), doctest::Contains("owner_rank.size() = 3: must be a positive multiple of world_size = 2"),
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::placed_stripes({0}, 0), "stria: world_size = 0: must be at least 1", stria::invalid_argument);
  const sharding::placed_stripes placed({0, 1, 1, 0}, 2);
  CHECK_NOTHROW(placed.validate({4, 2}));
  CHECK_THROWS_WITH_AS(placed.validate({8, 2}),
                       "stria: seq_len = 512: placed_stripes was built for seq_len 256 and world_size 2, this layout has world_size 2 "
                       "(build the placement for the layout it is used with)",
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(placed.validate({4, 4}), doctest::Contains("this layout has world_size 4"), stria::invalid_argument);
  CHECK_THROWS_AS(sharding::placed_stripes{}.validate({4, 2}), stria::invalid_argument);  // the default placement fits no layout
}

TEST_CASE("the documented formulas hold") {
  const shard_layout layout{48, 6};
  for (index_t r = 0; r < 6; ++r)
    for (index_t i = 0; i < 8; ++i) {
      CHECK(sharding::striped<64>{}.global_block(layout, {r, i}) == i * 6 + r);  // DESIGN 4
      CHECK(sharding::sequential{}.global_block(layout, {r, i}) == r * 8 + i);
      // zigzag: chunks of 4 blocks; rank r has chunk r, then chunk 11 - r.
      CHECK(sharding::zigzag{}.global_block(layout, {r, i}) == (i < 4 ? r * 4 + i : (11 - r) * 4 + i - 4));
    }
  // striped<128>: stripes of 2 blocks dealt round-robin.
  CHECK(sharding::striped<128>{}.locate({24, 3}, 7) == block_location{0, 3});  // stripe 3 -> rank 0, its second stripe
  static_assert(sharding::striped<64>{}.global_block({16, 4}, {3, 2}) == 11);  // constexpr, usable in kernels
}

TEST_CASE("layouts that cannot be sharded are rejected with the numbers") {
  CHECK_THROWS_WITH_AS(sharding::zigzag{}.validate({24, 8}),
                       "stria: seq_len = 1536: zigzag sharding needs seq_len to be a positive multiple of 2 * world_size * 64 = 1024 (world_size 8)",
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::striped<256>{}.validate({8, 3}),
                       doctest::Contains("striped<256> sharding needs seq_len to be a positive multiple of world_size * 256 = 768"),
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::sequential{}.validate({10, 4}), doctest::Contains("seq_len = 640: sequential sharding"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::sequential{}.validate({10, 0}), doctest::Contains("world_size = 0: must be at least 1"), stria::invalid_argument);
}

TEST_CASE("dispatch then undispatch returns the global tensor, and shards hold the right tokens") {
  STRIA_SEEDED_RNG(rng);
  const index_t world = 3, seq = 2 * world * 64 * 2, heads = 2, dim = 4;
  const std::vector<float> global = rng.values<float>(static_cast<std::size_t>(seq) * heads * dim);
  const std::vector<float> global_lse = rng.values<float>(static_cast<std::size_t>(heads) * seq);
  auto run = [&](const auto& policy) {
    std::vector<std::vector<float>> shards(world, std::vector<float>(global.size() / world));
    std::vector<std::vector<float>> lse_shards(world, std::vector<float>(global_lse.size() / world));
    std::vector<tensor_view<float, 3>> views;
    std::vector<tensor_view<float, 2>> lse_views;
    for (index_t r = 0; r < world; ++r) {
      views.emplace_back(shards[static_cast<std::size_t>(r)].data(), std::array<index_t, 3>{seq / world, heads, dim});
      lse_views.emplace_back(lse_shards[static_cast<std::size_t>(r)].data(), std::array<index_t, 2>{heads, seq / world});
    }
    sharding::dispatch(policy, tensor_view<const float, 3>(global.data(), {seq, heads, dim}), std::span<const tensor_view<float, 3>>(views));
    sharding::dispatch(policy, tensor_view<const float, 2>(global_lse.data(), {heads, seq}), std::span<const tensor_view<float, 2>>(lse_views), 1);
    const shard_layout layout{seq / 64, world};
    for (index_t r = 0; r < world; ++r)
      for (index_t t = 0; t < seq / world; ++t) {
        const index_t g = policy.global_block(layout, {r, t / 64}) * 64 + t % 64;
        CHECK(views[static_cast<std::size_t>(r)](t, 1, 3) == global[(static_cast<std::size_t>(g) * heads + 1) * dim + 3]);
        CHECK(lse_views[static_cast<std::size_t>(r)](1, t) == global_lse[static_cast<std::size_t>(seq) + g]);
      }
    std::vector<float> back(global.size(), 0.0f);
    std::vector<tensor_view<const float, 3>> const_views(views.begin(), views.end());
    sharding::undispatch(policy, std::span<const tensor_view<const float, 3>>(const_views), tensor_view<float, 3>(back.data(), {seq, heads, dim}));
    CHECK(back == global);
  };
  // The owning split / join round trip, also along the LSE's token dimension.
  const auto shards = sharding::split(sharding::zigzag{}, std::span<const float>(global), std::array<index_t, 3>{seq, heads, dim}, world);
  CHECK(shards.size() == static_cast<std::size_t>(world));
  CHECK(sharding::join(sharding::zigzag{}, shards, std::array<index_t, 3>{seq, heads, dim}) == global);
  const auto lse_shards = sharding::split(sharding::striped<64>{}, std::span<const float>(global_lse), std::array<index_t, 2>{heads, seq}, world, 1);
  CHECK(sharding::join(sharding::striped<64>{}, lse_shards, std::array<index_t, 2>{heads, seq}, 1) == global_lse);
  run(sharding::sequential{});
  run(sharding::zigzag{});
  run(sharding::striped<64>{});
  run(sharding::striped<128>{});
  run(random_placement(rng, {seq / 64, world}));

  std::vector<float> wrong(global.size() / 2);
  std::vector<tensor_view<float, 3>> two{{wrong.data(), {seq / 2, heads, dim}}, {wrong.data(), {seq / 2 - 64, heads, dim}}};
  CHECK_THROWS_WITH_AS(sharding::dispatch(sharding::striped<64>{}, tensor_view<const float, 3>(global.data(), {seq, heads, dim}),
                                          std::span<const tensor_view<float, 3>>(two)),
                       doctest::Contains("shards[1].extent(0) = 320: must be 384 (the global extent / world_size)"), stria::invalid_argument);
}

TEST_CASE("split and join refuse vectors that do not hold their extents, and a token_dim past the rank") {
  // They laid views of `extents` over the vectors unchecked: a global vector shorter than its
  // extents was read past its end, shards of unequal sizes were written past theirs (ASan
  // heap-buffer-overflow), and token_dim 5 of a rank-2 tensor indexed an std::array out of bounds
  // before dispatch's own check.
  const std::vector<float> ten(10), global(256 * 2);
  const std::array<index_t, 2> extents{256, 2};
  CHECK_THROWS_WITH_AS(sharding::split(sharding::sequential{}, std::span<const float>(ten), extents, 2),
                       "stria: global.size() = 10: must equal the elements of extents [256, 2] = 512", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::split(sharding::sequential{}, std::span<const float>(global), extents, 2, 5),
                       "stria: token_dim = 5: must name a dimension of the tensor (rank 2)", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(sharding::split(sharding::sequential{}, std::span<const float>(global), std::array<index_t, 2>{-256, -2}, 2),
                       "stria: extents = [-256, -2]: must not be negative", stria::invalid_argument);
  const std::vector<std::vector<float>> unequal{std::vector<float>(256), std::vector<float>(10)};
  CHECK_THROWS_WITH_AS(sharding::join(sharding::sequential{}, unequal, extents),
                       "stria: shards[1].size() = 10: must be 1/2 (one per shard) of the elements of extents [256, 2] = 512", stria::invalid_argument);
  const std::vector<std::vector<float>> halves{std::vector<float>(256), std::vector<float>(256)};
  CHECK_THROWS_WITH_AS(sharding::join(sharding::sequential{}, halves, std::array<index_t, 2>{512, 2}),
                       doctest::Contains("shards[0].size() = 256: must be 1/2 (one per shard) of the elements of extents [512, 2] = 1024"),
                       stria::invalid_argument);
  CHECK_THROWS_AS(sharding::join(sharding::sequential{}, halves, extents, 2), stria::invalid_argument);
  CHECK(sharding::join(sharding::sequential{}, sharding::split(sharding::sequential{}, std::span<const float>(global), extents, 2), extents) == global);
}
