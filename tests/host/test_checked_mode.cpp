// SPDX-License-Identifier: Apache-2.0
// Checked mode on the host backend (issue 20): a NaN put into one element of K, V or dO raises
// non_finite_error naming the rank, ring step, head and token where it first appears; -inf LSE of
// empty rows is legal; with the check off (the default) the same run completes without a word.
#include <doctest/doctest.h>

#include <chrono>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/host/ring_attention.hpp"
#include "stria/index/local_index.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/topology/flat_ring.hpp"
#include "support/checked_scenario.hpp"
#include "support/checked_shards.hpp"
#include "support/oracle.hpp"
#include "support/random.hpp"

using namespace stria;
using test::checked_scenario;
using test::view2;
using test::view3;

namespace {

constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();
constexpr float inf = std::numeric_limits<float>::infinity();

using shards = test::host_shards;
using test::random_host_shards;

/// The host ring's forward (and, if asked, backward on the forward's results) on the scenario's 4 ranks.
void run_ring(shards& x, finite_check check, bool backward) {
  using s = checked_scenario;
  const global_selection selection = s::selection();
  const topology::flat_ring ring(s::world);
  const double scale = 0.125;
  comm::host_world host(s::world, std::chrono::seconds(30));
  host.run([&](comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const std::vector<step_index> indices = build_ring_indices(selection, sharding::sequential{}, ring, c.rank());
    const auto q = view3(std::as_const(x.q[r]), s::local_tokens, s::heads_q, s::dim), k = view3(std::as_const(x.k[r]), s::local_tokens, s::heads_kv, s::dim),
               v = view3(std::as_const(x.v[r]), s::local_tokens, s::heads_kv, s::dim);
    host::ring_forward(c, ring, std::span<const step_index>(indices),
                       forward_tensors<float>{q, k, v, view3(x.out[r], s::local_tokens, s::heads_q, s::dim), view2(x.lse[r], s::heads_q, s::local_tokens)},
                       scale, check);
    if (!backward) return;
    host::ring_backward(c, ring, std::span<const step_index>(indices),
                        backward_tensors<float>{q, k, v, view3(std::as_const(x.out[r]), s::local_tokens, s::heads_q, s::dim),
                                                view3(std::as_const(x.d_out[r]), s::local_tokens, s::heads_q, s::dim),
                                                view2(std::as_const(x.lse[r]), s::heads_q, s::local_tokens),
                                                view3(x.dq[r], s::local_tokens, s::heads_q, s::dim), view3(x.dk[r], s::local_tokens, s::heads_kv, s::dim),
                                                view3(x.dv[r], s::local_tokens, s::heads_kv, s::dim)},
                        scale, check);
  });
}

bool any_nan(const std::vector<std::vector<float>>& x) {
  for (const auto& shard : x)
    for (const float value : shard)
      if (value != value) return true;
  return false;
}

}  // namespace

TEST_CASE("checked mode: the rule for a value, and where a flat index lies") {
  CHECK(non_finite_code(1.5f, false) == -1);
  CHECK(non_finite_code(-3.4e38f, false) == -1);
  CHECK(non_finite_code(nan_value, true) == int(non_finite_kind::nan));
  CHECK(non_finite_code(inf, true) == int(non_finite_kind::positive_infinity));
  CHECK(non_finite_code(-inf, false) == int(non_finite_kind::negative_infinity));
  CHECK(non_finite_code(-inf, true) == -1);  // an LSE of -inf: a row no key has reached

  const std::vector<float> lse{0.5f, -inf, 1.0f, inf, nan_value};
  CHECK(first_non_finite(std::span<const float>(lse), true)->index == 3);
  CHECK(first_non_finite(std::span<const float>(lse), false)->index == 1);
  CHECK_FALSE(first_non_finite(std::span<const float>(lse).first(3), true).has_value());

  // LSE [Hq 4, Sq 10]: flat 23 is head 2, token 3.
  std::vector<float> lse_all(40, -inf);
  lse_all[23] = inf;
  try {
    check_finite(std::span<const float>(lse_all), checked_tensor::lse(4, 10), 3, 1, "ring step 1");
    FAIL("no error");
  } catch (const non_finite_error& e) {
    CHECK(std::string(e.what()) == "stria: checked mode: rank 3, ring step 1, head 2, local token 3: LSE is +inf (the first non-finite value of this step's result)");
    CHECK(e.rank() == 3);
    CHECK(e.step() == 1);
    CHECK(e.head() == 2);
    CHECK(e.token() == 3);
    CHECK(e.tensor() == "LSE");
  }
  // A travelling dK [Sk 8, Hkv 2, D 4] of rank 5's chunk: flat 13 is token 1, KV head 1.
  std::vector<float> dk(64, 0.0f);
  dk[13] = -inf;
  dk[20] = nan_value;
  CHECK_THROWS_WITH_AS(check_finite(std::span<const float>(dk), checked_tensor::kv_gradient("dK", 8, 2, 4, 5), 0, 6, "ring step 6"),
                       "stria: checked mode: rank 0, ring step 6, KV head 1, token 1 of rank 5's KV chunk: dK is -inf (the first non-finite "
                       "value of this step's result)",
                       non_finite_error);
  CHECK_NOTHROW(check_finite(std::span<const float>(dk).first(13), checked_tensor::kv_gradient("dK", 8, 2, 4, 5), 0, 6, "ring step 6"));
}

TEST_CASE("checked mode, host ring: a NaN in K or V is named where it first appears (rank, step, head, token)") {
  STRIA_SEEDED_RNG(rng);
  using s = checked_scenario;
  const std::string expected =
      "stria: checked mode: rank 2, ring step 1, head 3, local token 64: O is NaN (the first non-finite value of this step's result)";
  for (const bool in_values : {false, true}) {
    CAPTURE(in_values);
    shards x = random_host_shards(rng);
    auto& poisoned = in_values ? x.v : x.k;
    poisoned[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
    CHECK_THROWS_WITH_AS(run_ring(x, finite_check::every_step, false), expected.c_str(), non_finite_error);
  }
}

TEST_CASE("checked mode, host ring: a NaN in dO is named in dQ at the step it is first used") {
  STRIA_SEEDED_RNG(rng);
  using s = checked_scenario;
  shards x = random_host_shards(rng);
  x.d_out[s::d_out_rank][s::element(s::d_out_token, s::d_out_head, s::heads_q)] = nan_value;
  CHECK_THROWS_WITH_AS(run_ring(x, finite_check::every_step, true),
                       "stria: checked mode: rank 2, ring step 1, head 3, local token 70: dQ is NaN (the first non-finite value of this step's result)",
                       non_finite_error);
}

TEST_CASE("checked mode, host ring: clean inputs pass, with empty rows (LSE -inf) legal") {
  STRIA_SEEDED_RNG(rng);
  shards checked = random_host_shards(rng);
  shards unchecked = checked;
  REQUIRE_NOTHROW(run_ring(checked, finite_check::every_step, true));
  run_ring(unchecked, finite_check::off, true);
  // Head 2 selects nothing: every rank's head-2 rows are empty.
  for (const auto& lse : checked.lse) CHECK(lse[2 * checked_scenario::local_tokens] == -inf);
  // The check reads the results only: they are the unchecked run's, bit for bit.
  for (auto [a, b] : {std::pair{&checked.out, &unchecked.out}, std::pair{&checked.lse, &unchecked.lse}, std::pair{&checked.dq, &unchecked.dq},
                      std::pair{&checked.dk, &unchecked.dk}, std::pair{&checked.dv, &unchecked.dv}})
    CHECK(*a == *b);
}

TEST_CASE("checked mode is off by default: the same NaN passes silently into the results") {
  STRIA_SEEDED_RNG(rng);
  using s = checked_scenario;
  shards x = random_host_shards(rng);
  x.k[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
  // finite_check not passed: the default.
  const global_selection selection = s::selection();
  const topology::flat_ring ring(s::world);
  comm::host_world host(s::world, std::chrono::seconds(30));
  REQUIRE_NOTHROW(host.run([&](comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const std::vector<step_index> indices = build_ring_indices(selection, sharding::sequential{}, ring, c.rank());
    host::ring_forward(c, ring, std::span<const step_index>(indices),
                       forward_tensors<float>{view3(std::as_const(x.q[r]), s::local_tokens, s::heads_q, s::dim),
                                              view3(std::as_const(x.k[r]), s::local_tokens, s::heads_kv, s::dim),
                                              view3(std::as_const(x.v[r]), s::local_tokens, s::heads_kv, s::dim),
                                              view3(x.out[r], s::local_tokens, s::heads_q, s::dim), view2(x.lse[r], s::heads_q, s::local_tokens)},
                       0.125);
  }));
  const float o = x.out[2][s::element(64, 3, s::heads_q) - 7];
  CHECK(o != o);  // rank 2's head 3, local token 64: NaN, unreported
  x.out[2].assign(x.out[2].size(), 0.0f);
  x.lse[2].assign(x.lse[2].size(), 0.0f);
  CHECK_FALSE(any_nan(x.out));  // and no other rank's output
}
