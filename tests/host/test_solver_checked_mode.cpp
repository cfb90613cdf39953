// SPDX-License-Identifier: Apache-2.0
// Checked mode in the dynamic solver's host executor (issue 20): a NaN put into one element of Q, K,
// V or dO raises non_finite_error naming the rank, solver stage, tensor, head and token where it
// first appears, for plans that move KV chunks, query chunks, or both to a third rank (each puts
// the poisoned task on another rank); clean inputs give the unchecked results bit for bit; off by
// default, the same NaN reaches the results without a word.
#include <doctest/doctest.h>

#include <chrono>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/host/solver_attention.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "support/checked_scenario.hpp"
#include "support/checked_shards.hpp"
#include "support/oracle.hpp"
#include "support/random.hpp"

using namespace stria;
using test::checked_scenario;
using test::view2;
using test::view3;

namespace {

using s = checked_scenario;
constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();
using test::hand_plan;
using test::name_of;
using test::placement;
using test::rank_of_task;
const auto scenario_problem = &checked_scenario::solver_problem;

using shards = test::host_shards;
using test::random_host_shards;

/// The host solver execution's forward (and, if asked, backward on the forward's results) of `plan`
/// on the scenario's 4 ranks; `check` not given: the default.
void run_solver(shards& x, const solver::plan& plan, std::optional<finite_check> check, bool backward) {
  const global_selection g = s::selection();
  const solver::problem p = scenario_problem();
  comm::host_world host(s::world, std::chrono::seconds(30));
  host.run([&](comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const auto q = view3(std::as_const(x.q[r]), s::local_tokens, s::heads_q, s::dim), k = view3(std::as_const(x.k[r]), s::local_tokens, s::heads_kv, s::dim),
               v = view3(std::as_const(x.v[r]), s::local_tokens, s::heads_kv, s::dim);
    const auto out = view3(x.out[r], s::local_tokens, s::heads_q, s::dim);
    const auto lse = view2(x.lse[r], s::heads_q, s::local_tokens);
    const forward_tensors<float> tensors{q, k, v, out, lse};
    if (check) host::solver_forward(c, p, plan, g, tensors, 0.125, *check);
    else host::solver_forward(c, p, plan, g, tensors, 0.125);
    if (!backward) return;
    const auto out_in = view3(std::as_const(x.out[r]), s::local_tokens, s::heads_q, s::dim);
    const auto d_out = view3(std::as_const(x.d_out[r]), s::local_tokens, s::heads_q, s::dim);
    const auto lse_in = view2(std::as_const(x.lse[r]), s::heads_q, s::local_tokens);
    const auto dq = view3(x.dq[r], s::local_tokens, s::heads_q, s::dim), dk = view3(x.dk[r], s::local_tokens, s::heads_kv, s::dim),
               dv = view3(x.dv[r], s::local_tokens, s::heads_kv, s::dim);
    const backward_tensors<float> gradients{q, k, v, out_in, d_out, lse_in, dq, dk, dv};
    if (check) host::solver_backward(c, p, plan, g, gradients, 0.125, *check);
    else host::solver_backward(c, p, plan, g, gradients, 0.125);
  });
}

std::string message(const std::string& where) { return "stria: checked mode: " + where + " (the first non-finite value of this step's result)"; }

}  // namespace

TEST_CASE("checked mode names a solver chunk's element by its owner's local token") {
  // O [64 tokens, Hq 4, D 64] of rank 2's chunk 5 (its local tokens 64..127), computed on rank 1:
  // flat 3 x 64 + 7 is token 0, head 3.
  std::vector<float> o(std::size_t{64} * 4 * 64, 0.0f);
  o[3 * 64 + 7] = nan_value;
  const checked_tensor moved = checked_tensor::solver_chunk(checked_tensor::queries("O", 64, 4, 64), 2, 64);
  try {
    check_finite(std::span<const float>(o), moved, 1, 1, "solver stage 1");
    FAIL("no error");
  } catch (const non_finite_error& e) {
    CHECK(std::string(e.what()) == message("rank 1, solver stage 1, head 3, local token 64 of rank 2: O is NaN"));
    CHECK(e.rank() == 1);
    CHECK(e.step() == 1);
    CHECK(e.head() == 3);
    CHECK(e.token() == 64);
    CHECK(e.chunk_owner() == 2);
  }
  // The rank's own dK [128, Hkv 2, D 64]: KV heads, local tokens, no owner named.
  std::vector<float> dk(std::size_t{128} * 2 * 64, 0.0f);
  dk[(70 * 2 + 1) * 64] = std::numeric_limits<float>::infinity();
  const checked_tensor own = checked_tensor::solver_chunk(checked_tensor::kv_gradient("dK", 128, 2, 64, 3), 3, 0);
  try {
    check_finite(std::span<const float>(dk), own, 3, 0, "solver stage 0");
    FAIL("no error");
  } catch (const non_finite_error& e) {
    CHECK(std::string(e.what()) == message("rank 3, solver stage 0, KV head 1, local token 70: dK is +inf"));
    CHECK(e.chunk_owner() == -1);
    CHECK(e.tensor() == "dK");
  }
}

TEST_CASE("the hand-made plans are plans of the scenario's problem, each placing the poisoned task (5, 2) elsewhere") {
  const solver::problem p = scenario_problem();
  for (const auto& [how, rank] : {std::pair{placement::kv_moves, 2}, std::pair{placement::query_moves, 1}, std::pair{placement::third_rank, 0}}) {
    const std::string plan_name = name_of(how);
    CAPTURE(plan_name);
    const solver::plan plan = hand_plan(p, how);
    CHECK_NOTHROW(solver::check_plan_of(p, plan));
    for (index_t r = 0; r < s::world; ++r) CHECK_NOTHROW(solver::check_rank_tasks(p, plan, r));
    CHECK(rank_of_task(plan, 5, 2) == rank);
  }
}

TEST_CASE("checked mode, host solver: a NaN in K or V is named on the rank that computes with it, at stage 1") {
  STRIA_SEEDED_RNG(rng);
  // Only task (5, 2) reads rank 1's KV chunk 2 through KV head 1 (head 3; head 2 selects nothing).
  const std::pair<placement, std::string> cases[] = {
      {placement::kv_moves, message("rank 2, solver stage 1, head 3, local token 64: O is NaN")},
      {placement::query_moves, message("rank 1, solver stage 1, head 3, local token 64 of rank 2: O is NaN")},
      {placement::third_rank, message("rank 0, solver stage 1, head 3, local token 64 of rank 2: O is NaN")},
  };
  for (const auto& [how, expected] : cases)
    for (const bool in_values : {false, true}) {
      const std::string plan_name = name_of(how);
      CAPTURE(plan_name);
      CAPTURE(in_values);
      shards x = random_host_shards(rng);
      (in_values ? x.v : x.k)[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
      CHECK_THROWS_WITH_AS(run_solver(x, hand_plan(scenario_problem(), how), finite_check::every_step, false), expected.c_str(), non_finite_error);
    }
}

TEST_CASE("checked mode, host solver: the plan solve() makes, as the front template runs it") {
  STRIA_SEEDED_RNG(rng);
  const solver::plan plan = solver::solve(scenario_problem());
  // The GPU test through sparse_attention<..., topology::solver> asserts the same message: it
  // relies on solve() placing task (5, 2) on rank 2 (KV chunk 2 moves there).
  REQUIRE(rank_of_task(plan, 5, 2) == 2);
  shards x = random_host_shards(rng);
  x.k[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
  CHECK_THROWS_WITH_AS(run_solver(x, plan, finite_check::every_step, false),
                       message("rank 2, solver stage 1, head 3, local token 64: O is NaN").c_str(), non_finite_error);
  shards y = random_host_shards(rng);
  y.d_out[s::d_out_rank][s::element(s::d_out_token, s::d_out_head, s::heads_q)] = nan_value;
  CHECK_THROWS_WITH_AS(run_solver(y, plan, finite_check::every_step, true),
                       message("rank 2, solver stage 1, head 3, local token 70: dQ is NaN").c_str(), non_finite_error);
}

TEST_CASE("checked mode, host solver: a NaN in a rank's own Q is named at stage 0") {
  STRIA_SEEDED_RNG(rng);
  // Rank 1's local token 5 (chunk 2), head 0: task (2, 2) is local; with KV chunks moving, rank 1
  // runs every task of query chunk 2, so no other rank meets the NaN.
  shards x = random_host_shards(rng);
  x.q[1][s::element(5, 0, s::heads_q)] = nan_value;
  CHECK_THROWS_WITH_AS(run_solver(x, hand_plan(scenario_problem(), placement::kv_moves), finite_check::every_step, false),
                       message("rank 1, solver stage 0, head 0, local token 5: O is NaN").c_str(), non_finite_error);
}

TEST_CASE("checked mode, host solver: a NaN in dO is named in dQ, or in the dK/dV it reaches first") {
  STRIA_SEEDED_RNG(rng);
  // dO of rank 2's local token 70, head 3 reaches only task (5, 2) (stage 1): its dQ row, and the
  // dK (every key of the tile) and dV of rank 1's KV chunk 2, KV head 1 (local tokens 0..63). dQ is
  // checked first, the rank's own results before those computed for others.
  const std::pair<placement, std::string> cases[] = {
      {placement::kv_moves, message("rank 2, solver stage 1, head 3, local token 70: dQ is NaN")},
      {placement::query_moves, message("rank 1, solver stage 1, KV head 1, local token 0: dK is NaN")},
      {placement::third_rank, message("rank 0, solver stage 1, head 3, local token 70 of rank 2: dQ is NaN")},
  };
  for (const auto& [how, expected] : cases) {
    const std::string plan_name = name_of(how);
    CAPTURE(plan_name);
    shards x = random_host_shards(rng);
    x.d_out[s::d_out_rank][s::element(s::d_out_token, s::d_out_head, s::heads_q)] = nan_value;
    CHECK_THROWS_WITH_AS(run_solver(x, hand_plan(scenario_problem(), how), finite_check::every_step, true), expected.c_str(), non_finite_error);
  }
}

TEST_CASE("checked mode, host solver: clean inputs pass, results bit-identical to unchecked runs, LSE -inf legal") {
  STRIA_SEEDED_RNG(rng);
  const solver::problem p = scenario_problem();
  for (const auto& [name, plan] : {std::pair{"solve()", solver::solve(p)}, std::pair{"query moves", hand_plan(p, placement::query_moves)},
                                   std::pair{"third rank", hand_plan(p, placement::third_rank)}}) {
    CAPTURE(name);
    shards checked = random_host_shards(rng);
    shards unchecked = checked;
    REQUIRE_NOTHROW(run_solver(checked, plan, finite_check::every_step, true));
    run_solver(unchecked, plan, finite_check::off, true);
    for (const auto& lse : checked.lse) CHECK(lse[2 * s::local_tokens] == -std::numeric_limits<float>::infinity());  // head 2: empty rows
    for (auto [a, b] : {std::pair{&checked.out, &unchecked.out}, std::pair{&checked.lse, &unchecked.lse}, std::pair{&checked.dq, &unchecked.dq},
                        std::pair{&checked.dk, &unchecked.dk}, std::pair{&checked.dv, &unchecked.dv}})
      CHECK(*a == *b);
  }
}

TEST_CASE("checked mode is off by default in the solver's execution: the same NaN reaches the results unreported") {
  STRIA_SEEDED_RNG(rng);
  const auto is_nan = [](float x) { return x != x; };
  const auto any_nan = [&](const std::vector<std::vector<float>>& shards_of_all) {
    for (const auto& shard : shards_of_all)
      for (const float value : shard)
        if (is_nan(value)) return true;
    return false;
  };
  for (const placement how : {placement::kv_moves, placement::query_moves, placement::third_rank}) {
    const std::string plan_name = name_of(how);
    CAPTURE(plan_name);
    const solver::plan plan = hand_plan(scenario_problem(), how);
    shards x = random_host_shards(rng);
    x.k[s::poisoned_rank][s::element(s::poisoned_token, s::poisoned_kv_head, s::heads_kv)] = nan_value;
    REQUIRE_NOTHROW(run_solver(x, plan, std::nullopt, false));
    // The NaN computed for rank 2's query chunk 5 (wherever the plan runs it) is in its output and
    // LSE: a merge does not drop it as an empty row's.
    CHECK(is_nan(x.out[2][s::element(64, 3, s::heads_q) - 7]));
    CHECK(is_nan(x.lse[2][3 * s::local_tokens + 64]));
    CHECK_FALSE(is_nan(x.out[2][s::element(64, 1, s::heads_q)]));  // head 1 of the same token: untouched

    shards y = random_host_shards(rng);
    y.d_out[s::d_out_rank][s::element(s::d_out_token, s::d_out_head, s::heads_q)] = nan_value;
    REQUIRE_NOTHROW(run_solver(y, plan, std::nullopt, true));
    CHECK_FALSE(any_nan(y.out));
    CHECK(is_nan(y.dq[2][s::element(70, 3, s::heads_q) - 7]));  // rank 2's dQ, head 3, local token 70
    CHECK(is_nan(y.dk[1][s::element(0, 1, s::heads_kv) - 7]));  // rank 1's dK, KV head 1, local token 0
    CHECK(is_nan(y.dv[1][s::element(0, 1, s::heads_kv)]));      // dV: at d = 7, where dO is NaN
  }
}
