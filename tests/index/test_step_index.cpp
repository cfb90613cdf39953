// SPDX-License-Identifier: Apache-2.0
// The local step index: built from row sets it round-trips, and the validator names every broken rule.
#include <doctest/doctest.h>

#include <map>
#include <set>

#include "stria/index/step_index.hpp"
#include "support/oracle.hpp"

using namespace stria;
using stria::test::random_row_sets;

namespace {

/// A rank-2-of-3 striped layout seen at step 1: query blocks 2, 5, 8, 11 attend to KV blocks 1, 4, 7, 10.
test::row_sets striped_step(test::seeded_rng& rng, bool causal = true) {
  const step_index_shape shape{3, 4, 4, causal};
  return random_row_sets(rng, shape, {2, 5, 8, 11}, {1, 4, 7, 10}, 0.5, 0.1);
}

/// Single-rank layout with diagonal tiles.
test::row_sets single_rank(test::seeded_rng& rng, index_t blocks = 5, index_t heads = 2) {
  std::vector<index_t> global(static_cast<std::size_t>(blocks));
  for (index_t i = 0; i < blocks; ++i) global[static_cast<std::size_t>(i)] = i;
  return random_row_sets(rng, {heads, blocks, blocks, true}, global, global, 0.4, 0.05);
}

}  // namespace

TEST_CASE("a step index built from row sets validates and lists exactly those sets, forward and transposed") {
  STRIA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 20; ++trial) {
    const test::row_sets sets = trial % 2 ? striped_step(rng, trial % 4 == 1) : single_rank(rng);
    const step_index index = sets.build();
    CHECK_NOTHROW(index.validate());
    const step_index_shape& s = sets.shape;
    for (index_t r = 0; r < s.num_rows(); ++r) {
      const std::set<index_t> blocks(index.block_col.begin() + index.block_ptr[r], index.block_col.begin() + index.block_ptr[r + 1]);
      const std::set<index_t> tokens(index.col_token.begin() + index.col_ptr[r], index.col_token.begin() + index.col_ptr[r + 1]);
      CHECK(blocks == sets.blocks[static_cast<std::size_t>(r)]);
      CHECK(tokens == sets.tokens[static_cast<std::size_t>(r)]);
    }
    // Transposed tiles: (h, q, k) listed under column (h, k) iff k is in row (h, q).
    for (index_t h = 0; h < s.num_heads; ++h)
      for (index_t k = 0; k < s.num_kv_blocks; ++k) {
        const auto c = static_cast<std::size_t>(h * s.num_kv_blocks + k);
        std::set<index_t> expected;
        for (index_t q = 0; q < s.num_query_blocks; ++q)
          if (sets.blocks[static_cast<std::size_t>(h * s.num_query_blocks + q)].count(k)) expected.insert(q);
        CHECK(std::set<index_t>(index.kv_query.begin() + index.kv_query_ptr[c], index.kv_query.begin() + index.kv_query_ptr[c + 1]) == expected);
      }
    // Transposed vertical tokens: per head, distinct tokens, each with the query blocks that list it.
    for (index_t h = 0; h < s.num_heads; ++h) {
      std::map<index_t, std::set<index_t>> expected;
      for (index_t q = 0; q < s.num_query_blocks; ++q)
        for (index_t t : sets.tokens[static_cast<std::size_t>(h * s.num_query_blocks + q)]) expected[t].insert(q);
      std::map<index_t, std::set<index_t>> got;
      for (index_t i = index.vtoken_head_ptr[static_cast<std::size_t>(h)]; i < index.vtoken_head_ptr[static_cast<std::size_t>(h) + 1]; ++i)
        got[index.vtoken[static_cast<std::size_t>(i)]] = std::set<index_t>(index.vtoken_query.begin() + index.vtoken_query_ptr[static_cast<std::size_t>(i)],
                                                                          index.vtoken_query.begin() + index.vtoken_query_ptr[static_cast<std::size_t>(i) + 1]);
      CHECK(got == expected);
    }
  }
}

TEST_CASE("active_entries counts exactly the token pairs the entry semantics allow") {
  STRIA_SEEDED_RNG(rng);
  for (int trial = 0; trial < 10; ++trial) {
    const test::row_sets sets = trial % 2 ? striped_step(rng) : single_rank(rng);
    const step_index index = sets.build();
    const test::entry_mask mask = sets.mask();
    std::int64_t expected = 0;
    for (index_t h = 0; h < sets.shape.num_heads; ++h)
      for (index_t i = 0; i < sets.shape.num_query_blocks * block_tokens; ++i)
        for (index_t j = 0; j < sets.shape.num_kv_blocks * block_tokens; ++j) expected += mask(h, i, j) ? 1 : 0;
    CHECK(index.active_entries() == expected);
  }
}

TEST_CASE("the validator names the field and the rule for each kind of broken index") {
  STRIA_SEEDED_RNG(rng);
  // A fixed single-rank index: rows 0..3 have tiles {0}, {1}, {0, 2}, {3}; row 3 also vertical tokens 5 and 70.
  const step_index_shape shape{1, 4, 4, true};
  std::vector<std::vector<index_t>> blocks{{0}, {1}, {0, 2}, {3}};
  std::vector<std::vector<index_t>> tokens{{}, {}, {}, {5, 70}};
  const step_index good = build_step_index(shape, {}, {0, 1, 2, 3}, {0, 1, 2, 3}, blocks, tokens);
  REQUIRE_NOTHROW(good.validate());

  auto expect_error = [&](auto corrupt, const char* field, const char* rule) {
    step_index bad = good;
    corrupt(bad);
    INFO("field ", field, ", rule ", rule);
    CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains(field), stria::invalid_argument);
    CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains(rule), stria::invalid_argument);
  };
  expect_error([](step_index& x) { std::swap(x.block_col[2], x.block_col[3]); }, "block_col[3]", "not sorted ascending");
  expect_error([](step_index& x) { x.block_col[3] = 0; }, "block_col[3]", "duplicate entry");
  expect_error([](step_index& x) { x.block_col[2] = 9; }, "block_col[2]", "out of range [0, 4)");
  expect_error([](step_index& x) { x.block_col[1] = 3; }, "block_col[1]", "non-causal");
  expect_error([](step_index& x) { x.block_col[4] = 0; }, "col_token[0]", "already covered by active KV block 0");
  expect_error([](step_index& x) { x.col_token[1] = 300; }, "col_token[1]", "out of range [0, 256)");
  expect_error([](step_index& x) { x.block_ptr[2] = 0; }, "block_ptr[2]", "must not be less than the previous entry");
  expect_error([](step_index& x) { x.block_ptr.pop_back(); }, "block_ptr.size()", "must be 5");
  expect_error([](step_index& x) { x.block_ptr.back() = 4; }, "block_ptr[4]", "must equal block_col.size() = 5");
  expect_error([](step_index& x) { x.kv_query[0] = 1; }, "kv_query[0]", "that the forward form does not have");
  expect_error([](step_index& x) { x.vtoken[0] = 6; }, "vtoken_query[0]", "that the forward form does not have");
  expect_error([](step_index& x) { x.query_global_block = {0, 2, 1, 3}; }, "query_global_block[2]", "local order keeps global order");
  expect_error([](step_index& x) { x.kv_global_block.resize(3); }, "kv_global_block.size()", "must be 4");
  expect_error([](step_index& x) { x.shape.num_heads = 0; }, "shape.num_heads", "at least 1");

  // A vertical token inside the diagonal block is non-causal for the rows above it.
  std::vector<std::vector<index_t>> diagonal_token{{}, {}, {2 * 64 + 7}, {3}};
  const step_index bad = build_step_index(shape, {}, {0, 1, 2, 3}, {0, 1, 2, 3}, {{0}, {1}, {0}, {3}}, diagonal_token);
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("non-causal for part of the query block"), stria::invalid_argument);
  // Random corruption of a random index is always caught (out-of-range tile).
  for (int trial = 0; trial < 10; ++trial) {
    step_index x = single_rank(rng).build();
    if (x.block_col.empty()) continue;
    x.block_col[static_cast<std::size_t>(rng.integer(0, static_cast<int>(x.block_col.size()) - 1))] = x.shape.num_kv_blocks;
    CHECK_THROWS_AS(x.validate(), stria::invalid_argument);
  }
}

TEST_CASE("an index built for another configuration is rejected with both numbers") {
  const step_index_shape built{16, 8, 8, true};
  CHECK_NOTHROW(check_index_shape(built, built));
  CHECK_THROWS_WITH_AS(check_index_shape(built, {8, 8, 8, true}),
                       doctest::Contains("index.shape.num_heads = 16: the index was built for another configuration: the tensors have 8 query heads"),
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(check_index_shape(built, {16, 4, 8, true}), doctest::Contains("num_query_blocks = 8"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(check_index_shape(built, {16, 8, 8, false}), doctest::Contains("asks for full attention"), stria::invalid_argument);
}

TEST_CASE("entry counts past the 32-bit CSR offsets are an error, not a wrapped offset") {
  CHECK(csr_offset(0, "tiles") == 0);
  CHECK(csr_offset(2147483647u, "tiles") == 2147483647);
  CHECK_THROWS_WITH_AS(csr_offset(std::size_t{2147483648u}, "step index tiles"),
                       "stria: step index tiles = 2147483648: exceed the 32-bit offsets of a step index (2147483647): fewer heads or tokens "
                       "per rank, or more ranks",
                       stria::invalid_argument);
}
