// SPDX-License-Identifier: Apache-2.0
// The radix key of a vertical candidate orders masses descending (and the -1 sentinel last) and
// decodes back exactly. Host code compiled by nvcc: no GPU needed.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "stria/estimator/statistics.hpp"
#include "stria/kernel/window_statistics.cuh"

TEST_CASE("candidate keys sort like vertical_candidate's selection order and decode exactly") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mass(0.0f, 1.0f);
  std::vector<stria::vertical_candidate> candidates;
  for (int i = 0; i < 2000; ++i) candidates.push_back({i % 97 == 0 ? -1.0f : i % 89 == 0 ? 0.0f : mass(rng) * (i % 3 == 0 ? 1e-6f : 1.0f), i});
  candidates.push_back({candidates[5].mass, 2001});  // a tie, broken by the smaller token
  for (const auto& c : candidates) CHECK(stria::kernel::mass_of_descending_bits(stria::kernel::descending_bits(c.mass)) == c.mass);
  // Stable sort by key, ascending (what the device radix sort does) == sort in selection order.
  std::vector<stria::vertical_candidate> by_key = candidates, expected = candidates;
  std::stable_sort(by_key.begin(), by_key.end(), [](const auto& a, const auto& b) {
    return stria::kernel::descending_bits(a.mass) < stria::kernel::descending_bits(b.mass);
  });
  std::sort(expected.begin(), expected.end());
  CHECK(by_key == expected);
  CHECK(by_key.back().mass == -1.0f);
}
