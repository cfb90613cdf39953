// SPDX-License-Identifier: Apache-2.0
// Global selection -> local step indices, against brute force: over all ranks and steps every selected
// (query token, key token) entry appears exactly once, nothing else appears, and everything is causal.
#include <doctest/doctest.h>

#include <utility>
#include <vector>

#include "stria/index/local_index.hpp"
#include "stria/sharding/placed_stripes.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "support/selection.hpp"

using namespace stria;

namespace {

/// The selection's entry set, straight from its definition (global_selection's comment).
bool selected(const global_selection& g, index_t h, index_t n, index_t m) {
  if (g.causal && m > n) return false;
  const head_selection& head = g.heads[static_cast<std::size_t>(h)];
  const index_t qb = n / block_tokens, kb = m / block_tokens;
  return std::binary_search(head.vertical_tokens.begin(), head.vertical_tokens.end(), m) ||
         std::binary_search(head.slash_deltas.begin(), head.slash_deltas.end(), qb - kb) ||
         std::binary_search(head.blocks.begin(), head.blocks.end(), block_pair{qb, kb});
}

template <class Sharding, class Topology>
void check_against_brute_force(const global_selection& g, const Sharding& sharding, const Topology& topology) {
  const index_t seq = g.seq_len, heads = g.num_heads();
  std::vector<unsigned char> seen(static_cast<std::size_t>(heads) * seq * seq, 0);
  for (index_t r = 0; r < topology.world_size(); ++r) {
    const std::vector<step_index> indices = build_ring_indices(g, sharding, topology, r);
    for (const step_index& index : indices) {
      REQUIRE_NOTHROW(index.validate());
      const step_index_view v = index.view();
      auto mark = [&](index_t h, index_t q_local_token, index_t k_local_token) {
        const index_t n = v.query_global_block[q_local_token / 64] * 64 + q_local_token % 64;
        const index_t m = v.kv_global_block[k_local_token / 64] * 64 + k_local_token % 64;
        INFO("head ", h, " query ", n, " key ", m);
        REQUIRE(selected(g, h, n, m));  // nothing unselected, nothing non-causal
        REQUIRE(++seen[(static_cast<std::size_t>(h) * seq + n) * seq + m] == 1);  // nothing twice
      };
      for (index_t h = 0; h < heads; ++h)
        for (index_t qb = 0; qb < index.shape.num_query_blocks; ++qb) {
          const index_t row = v.row(h, qb);
          for (index_t a = 0; a < 64; ++a) {
            for (index_t e = v.block_ptr[row]; e < v.block_ptr[row + 1]; ++e) {
              const index_t kb = v.block_col[e];
              const index_t last = v.needs_causal_mask(qb, kb) ? a : 63;
              for (index_t b = 0; b <= last; ++b) mark(h, qb * 64 + a, kb * 64 + b);
            }
            for (index_t e = v.col_ptr[row]; e < v.col_ptr[row + 1]; ++e) mark(h, qb * 64 + a, v.col_token[e]);
          }
        }
    }
  }
  // Everything selected was seen.
  for (index_t h = 0; h < heads; ++h)
    for (index_t n = 0; n < seq; ++n)
      for (index_t m = 0; m < seq; ++m)
        if (selected(g, h, n, m)) {
          INFO("head ", h, " query ", n, " key ", m);
          REQUIRE(seen[(static_cast<std::size_t>(h) * seq + n) * seq + m] == 1);
        }
}

}  // namespace

TEST_CASE("local indices cover the global selection exactly once, for every sharding, ring and world size") {
  STRIA_SEEDED_RNG(rng);
  for (const index_t world : {1, 2, 3, 4, 5, 8})
    for (const bool causal : {true, false}) {
      if (!test::full_sweep && world != 3 && world != 8) continue;
      CAPTURE(world);
      CAPTURE(causal);
      const index_t seq = 2 * world * 64 * (world <= 4 ? 2 : 1);
      const global_selection g = test::random_selection(rng, seq, 2, causal, 0.3, 0.03);
      REQUIRE_NOTHROW(g.validate());
      check_against_brute_force(g, sharding::sequential{}, topology::flat_ring(world));
      check_against_brute_force(g, sharding::zigzag{}, topology::flat_ring(world));
      check_against_brute_force(g, sharding::striped<64>{}, topology::flat_ring(world));
      if (world == 4 || world == 8) check_against_brute_force(g, sharding::striped<64>{}, topology::hierarchical_ring(2, world / 2));
    }
}

TEST_CASE("with striped<64>, block diagonal delta appears at step delta mod W on every rank (DESIGN 6)") {
  const index_t world = 4, seq = 64 * 32;
  global_selection g{seq, true, {}};
  g.heads.push_back({{}, {0, 5, 6, 13}, {}});
  for (index_t r = 0; r < world; ++r) {
    const std::vector<step_index> indices = build_ring_indices(g, sharding::striped<64>{}, topology::flat_ring(world), r);
    for (index_t s = 0; s < world; ++s) {
      const step_index& index = indices[static_cast<std::size_t>(s)];
      for (index_t qb = 0; qb < index.shape.num_query_blocks; ++qb)
        for (index_t e = index.block_ptr[static_cast<std::size_t>(qb)]; e < index.block_ptr[static_cast<std::size_t>(qb) + 1]; ++e) {
          const index_t delta = index.query_global_block[static_cast<std::size_t>(qb)] - index.kv_global_block[static_cast<std::size_t>(index.block_col[static_cast<std::size_t>(e)])];
          CHECK(delta % world == s);
        }
    }
  }
}

// The paired Hopper forward's condition (device_step_index::complete): every row holds every tile
// the causal rule allows, the query blocks ascending. Dense selections give it on every ring step of
// every sharding; a selection that lacks one allowed tile, or has a vertical token, does not.
TEST_CASE("complete indices: every allowed tile in every row") {
  auto complete = [](const step_index& x) {
    return holds_every_allowed_tile(allowed_tiles(x.query_global_block, x.kv_global_block, x.shape.causal, x.shape.num_heads),
                                    static_cast<std::int64_t>(x.block_col.size()), static_cast<std::int64_t>(x.col_token.size()));
  };
  for (const bool causal : {true, false})
    for (const index_t world : {1, 2, 3}) {
      CAPTURE(causal);
      CAPTURE(world);
      const index_t nb = 6 * world;
      const global_selection all = test::band_selection(nb * block_tokens, 2, causal ? 0 : -(nb - 1), nb - 1, causal);
      for (index_t source = 0; source < world; ++source) {
        CHECK(complete(build_local_index(all, sharding::striped<64>{}, world, world - 1, source)));
        CHECK(complete(build_local_index(all, sharding::zigzag{}, world, world - 1, source)));
        CHECK(complete(build_local_index(all, sharding::sequential{}, world, world - 1, source)));
      }
      // A causal step whose KV blocks all follow the queries allows nothing: not complete (no tiles).
      if (causal && world > 1) CHECK_FALSE(complete(build_local_index(all, sharding::sequential{}, world, 0, 1)));
      // One diagonal fewer: rows lack an allowed tile.
      const global_selection band = test::band_selection(nb * block_tokens, 2, 0, nb - 2, causal);
      CHECK_FALSE(complete(build_local_index(band, sharding::sequential{}, 1, 0, 0)));
    }
  // The row-by-row check (what upload_step_index uses) agrees on valid indices, and rejects an
  // invalid one whose count matches: a row with a tile twice and one left out.
  {
    const global_selection all = test::band_selection(6 * block_tokens, 2, 0, 5, true);
    step_index x = build_local_index(all, sharding::sequential{}, 1, 0, 0);
    CHECK(holds_every_allowed_tile(x));
    CHECK(complete(x));
    x.block_col[static_cast<std::size_t>(x.block_ptr[3])] = x.block_col[static_cast<std::size_t>(x.block_ptr[3]) + 1];  // row 3: 1, 1, 2, 3
    CHECK(complete(x));  // the count cannot tell
    CHECK_FALSE(holds_every_allowed_tile(x));
    x.block_ptr.pop_back();  // malformed: false, without reading past the arrays
    CHECK_FALSE(holds_every_allowed_tile(x));
  }
  // A vertical token beside every block: not complete (the paired forward streams block tiles only).
  global_selection with_token = test::band_selection(8 * block_tokens, 2, 0, 7, true);
  with_token.heads[0].vertical_tokens.push_back(3);
  const step_index x = build_local_index(with_token, sharding::sequential{}, 1, 0, 0);
  CHECK(x.col_token.empty());  // inside an active tile of every row that could use it: not listed
  CHECK(complete(x));
  CHECK(holds_every_allowed_tile(x));
  // Query blocks that do not ascend are never complete.
  const std::vector<index_t> down{3, 1}, kv{0, 1, 2, 3};
  CHECK(allowed_tiles(down, kv, true, 1) == -1);
  CHECK(allowed_tiles(kv, kv, true, 2) == 2 * (1 + 2 + 3 + 4));
  CHECK(allowed_tiles(kv, kv, false, 1) == 16);
  const std::vector<index_t> kv_unsorted{3, 0, 2, 1}, q_sparse{1, 5};
  CHECK(allowed_tiles(q_sparse, kv_unsorted, true, 3) == 3 * (2 + 4));  // KV blocks in any order
  CHECK(allowed_tiles(q_sparse, kv, true, 3) == 3 * (2 + 4));
  CHECK_FALSE(holds_every_allowed_tile(20, 20, 1));
  CHECK(holds_every_allowed_tile(20, 20, 0));
}

TEST_CASE("build_local_index refuses a selection that breaks its rules, before indexing with it") {
  // It read the selection unchecked: an explicit block (-1, -1) wrote before a row of its table
  // (heap-buffer-overflow), a vertical token past seq_len read past placed_stripes' owner table, and
  // under sequential sharding such a token, or a causal head without diagonal 0, passed silently.
  const auto one_head = [](head_selection h) { return global_selection{256, true, {std::move(h)}}; };
  CHECK_THROWS_WITH_AS(build_local_index(one_head({{}, {0}, {{-1, -1}}}), sharding::sequential{}, 2, 0, 0),
                       "stria: global_selection.heads[0].blocks[0] = (-1, -1): both blocks must lie in [0, seq_len / 64)", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(build_local_index(one_head({{100000}, {0}, {}}), sharding::placed_stripes({0, 1, 0, 1}, 2), 2, 0, 0),
                       "stria: global_selection.heads[0].vertical_tokens[0] = 100000: must lie in [0, 255]", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(build_local_index(one_head({{100000}, {0}, {}}), sharding::sequential{}, 2, 0, 0),
                       doctest::Contains("vertical_tokens[0] = 100000: must lie in [0, 255]"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(build_local_index(one_head({{}, {1}, {}}), sharding::sequential{}, 1, 0, 0),
                       doctest::Contains("slash_deltas = (no 0): must contain block diagonal 0"), stria::invalid_argument);
  CHECK_THROWS_AS(build_ring_indices(one_head({{70, 5}, {0}, {}}), sharding::striped<64>{}, topology::flat_ring(2), 0), stria::invalid_argument);
}
