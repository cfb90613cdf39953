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

/// Every block diagonal in [first_delta, last_delta] (causal, full, sliding-window masks).
inline global_selection band_selection(index_t seq_len, index_t heads, index_t first_delta, index_t last_delta, bool causal) {
  global_selection g{seq_len, causal, {}};
  head_selection h;
  for (index_t d = first_delta; d <= last_delta; ++d) h.slash_deltas.push_back(d);
  g.heads.assign(static_cast<std::size_t>(heads), h);
  return g;
}

/// Causal attention within documents of random block lengths (explicit tiles).
inline global_selection document_selection(seeded_rng& rng, index_t seq_len, index_t heads) {
  const index_t nb = seq_len / block_tokens;
  global_selection g{seq_len, true, {}};
  head_selection h;
  h.slash_deltas.push_back(0);
  for (index_t start = 0; start < nb;) {
    const index_t end = std::min(nb, start + rng.integer(1, std::max<index_t>(1, nb / 3)));
    for (index_t q = start; q < end; ++q)
      for (index_t k = start; k < q; ++k) h.blocks.push_back({q, k});
    start = end;
  }
  g.heads.assign(static_cast<std::size_t>(heads), h);
  return g;
}

}  // namespace stria::test
