// SPDX-License-Identifier: Apache-2.0
// global_selection::validate: sorted, unique, in range, causal, and diagonal 0 always present.
#include <doctest/doctest.h>

#include "stria/index/global_selection.hpp"

using namespace stria;

namespace {
global_selection example(bool causal = true) {
  global_selection g{512, causal, {}};
  g.heads.push_back({{0, 1, 100}, {0, 2, 5}, {{3, 1}, {7, 0}}});
  g.heads.push_back({{}, {0}, {}});
  return g;
}
}  // namespace

TEST_CASE("a well-formed global selection validates") {
  CHECK_NOTHROW(example().validate());
  global_selection full = example(false);
  full.heads[1].slash_deltas = {-7, -1, 3};  // full attention: negative diagonals, no 0 required
  full.heads[1].blocks = {{0, 7}};
  CHECK_NOTHROW(full.validate());
  CHECK(full.num_blocks() == 8);
}

TEST_CASE("global selection errors name the list, the position and the rule") {
  auto expect = [](auto corrupt, const char* text) {
    global_selection g = example();
    corrupt(g);
    CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains(text), stria::invalid_argument);
  };
  expect([](global_selection& g) { g.seq_len = 500; }, "global_selection.seq_len = 500: must be a positive multiple of 64");
  expect([](global_selection& g) { g.heads.clear(); }, "global_selection.heads.size() = 0");
  expect([](global_selection& g) { g.heads[0].vertical_tokens = {5, 3}; }, "heads[0].vertical_tokens[1] = 3: must be greater than the previous entry");
  expect([](global_selection& g) { g.heads[0].vertical_tokens = {512}; }, "heads[0].vertical_tokens[0] = 512: must lie in [0, 511]");
  expect([](global_selection& g) { g.heads[1].slash_deltas = {0, 0}; }, "heads[1].slash_deltas[1] = 0");
  expect([](global_selection& g) { g.heads[1].slash_deltas = {-1, 0}; }, "heads[1].slash_deltas[0] = -1: must lie in [0, 7]");
  expect([](global_selection& g) { g.heads[1].slash_deltas = {1, 2}; }, "must contain block diagonal 0 for causal attention");
  expect([](global_selection& g) { g.heads[0].blocks = {{1, 3}}; }, "heads[0].blocks[0] = (1, 3): key_block must not exceed query_block");
  expect([](global_selection& g) { g.heads[0].blocks = {{7, 0}, {3, 1}}; }, "blocks[1] = (3, 1): blocks must be sorted");
  expect([](global_selection& g) { g.heads[0].blocks = {{8, 0}}; }, "both blocks must lie in [0, seq_len / 64)");
}
