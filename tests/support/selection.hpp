// SPDX-License-Identifier: Apache-2.0
// Random global selections for tests: slash diagonals, vertical tokens and explicit tiles.
#pragma once

#include <algorithm>
#include <set>

#include "stria/index/global_selection.hpp"
#include "support/random.hpp"

namespace stria::test {

inline global_selection random_selection(seeded_rng& rng, index_t seq_len, index_t heads, bool causal,
                                         double slash_density = 0.25, double token_density = 0.02) {
  const index_t nb = seq_len / block_tokens;
  global_selection g{seq_len, causal, {}};
  for (index_t h = 0; h < heads; ++h) {
    head_selection head;
    for (index_t delta = causal ? 0 : -(nb - 1); delta < nb; ++delta)
      if (delta == 0 || rng.chance(slash_density)) head.slash_deltas.push_back(delta);
    for (index_t t = 0; t < seq_len; ++t)
      if (rng.chance(token_density)) head.vertical_tokens.push_back(t);
    std::set<block_pair> blocks;
    for (int i = 0; i < nb / 2; ++i) {
      const index_t q = rng.integer(0, nb - 1);
      const index_t k = rng.integer(0, causal ? q : nb - 1);
      blocks.insert({q, k});
    }
    head.blocks.assign(blocks.begin(), blocks.end());
    g.heads.push_back(std::move(head));
  }
  return g;
}

}  // namespace stria::test
