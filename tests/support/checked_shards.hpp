// SPDX-License-Identifier: Apache-2.0
// The checked-mode scenario's inputs on every rank (fp32, random) and room for what a host engine writes:
// shared by the host ring's and the host solver's checked-mode tests.
#pragma once

#include <cstddef>
#include <vector>

#include "support/checked_scenario.hpp"
#include "support/random.hpp"

namespace stria::test {

/// Every rank's shards of the scenario, and what the engine wrote.
struct host_shards {
  std::vector<std::vector<float>> q, k, v, d_out, out, lse, dq, dk, dv;
};

inline host_shards random_host_shards(seeded_rng& rng) {
  using s = checked_scenario;
  host_shards x;
  const std::size_t q_elems = std::size_t(s::local_tokens) * s::heads_q * s::dim, kv_elems = std::size_t(s::local_tokens) * s::heads_kv * s::dim;
  for (index_t r = 0; r < s::world; ++r) {
    x.q.push_back(rng.values<float>(q_elems));
    x.k.push_back(rng.values<float>(kv_elems));
    x.v.push_back(rng.values<float>(kv_elems));
    x.d_out.push_back(rng.values<float>(q_elems));
    x.out.emplace_back(q_elems);
    x.lse.emplace_back(std::size_t(s::heads_q) * s::local_tokens);
    x.dq.emplace_back(q_elems);
    x.dk.emplace_back(kv_elems);
    x.dv.emplace_back(kv_elems);
  }
  return x;
}

}  // namespace stria::test
