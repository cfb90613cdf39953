// SPDX-License-Identifier: Apache-2.0
// Every rank's random share of the window statistics under a plan, in engine::rank_share's layout:
// what the host combine (engine tests) and the device combine (GPU tests) are checked on.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <vector>

#include "stria/engine/window_statistics_engine.hpp"
#include "support/random.hpp"

namespace stria::test {

/// Shares of every rank, rank after rank: mass [world, Hq, rank_blocks + 1] and candidates [world,
/// Hq, per_rank] as selection keys.
struct random_shares {
  std::vector<float> mass;
  std::vector<std::uint64_t> candidates;
};

/// Block and window masses on a grid; per head, each of the rank's tokens with a mass on a coarse
/// grid (many exact ties across ranks, a quarter zeros of either sign), the local blocks' tokens as
/// sentinels (mass -1), the first per_rank in selection order.
inline random_shares make_random_shares(const engine::window_plan& plan, seeded_rng& rng) {
  const index_t heads = plan.shape.num_heads, first_local_block = plan.shape.num_blocks() - plan.shape.local_blocks;
  random_shares shares;
  for (index_t r = 0; r < plan.world; ++r) {
    for (index_t i = 0; i < heads * (plan.rank_blocks + 1); ++i) shares.mass.push_back(static_cast<float>(rng.integer(0, 99)) / 97.0f);
    for (index_t h = 0; h < heads; ++h) {
      std::vector<vertical_candidate> run;
      for (const index_t block : plan.global_blocks(r))
        for (index_t t = 0; t < block_tokens; ++t) {
          const float m = rng.integer(0, 3) == 0 ? (rng.chance(0.5) ? -0.0f : 0.0f) : static_cast<float>(rng.integer(1, 12)) / 16.0f;
          run.push_back({block >= first_local_block ? -1.0f : m, block * block_tokens + t});
        }
      std::sort(run.begin(), run.end());
      std::transform(run.begin(), run.begin() + plan.per_rank, std::back_inserter(shares.candidates), stria::detail::selection_key);
    }
  }
  return shares;
}

}  // namespace stria::test
