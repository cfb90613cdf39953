// SPDX-License-Identifier: Apache-2.0
// Attention executed as the dynamic solver plans it (query/output and key/value chunks both move)
// equals single-rank attention in double on the same selection, forward and backward, for full,
// causal, causal-document, sliding-window and VS masks, world sizes 1-5 (odd ones too), 1 and 2
// chunks per rank, GQA 1/2, D 64/128, and plans whose tasks run on third ranks (query and KV chunks
// both moved there); plans that do not fit the call are refused by name.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/host/solver_attention.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "support/oracle.hpp"
#include "support/selection.hpp"
#include "support/whole_reference.hpp"

using namespace stria;
using test::view2;
using test::view3;

namespace {

/// Runs the plan on `world` threads and compares with single-rank attention in double.
test::attention_errors compare_solver(test::seeded_rng& rng, const global_selection& g, index_t world, index_t chunks_per_rank, index_t heads_kv,
                                      index_t dim, std::size_t* moves = nullptr, std::size_t* third_rank_tasks = nullptr) {
  const test::whole_problem p(rng, g, heads_kv, dim);
  const index_t seq = p.seq, hq = p.hq, local = seq / world;
  const solver::problem problem = solver::problem_from_selection(g, world, chunks_per_rank, heads_kv);
  const solver::plan plan = solver::solve(problem);
  if (moves) *moves = plan.moves.size();
  if (third_rank_tasks) {
    *third_rank_tasks = 0;
    for (index_t r = 0; r < world; ++r)
      for (const solver::task& t : plan.remote_tasks[static_cast<std::size_t>(r)])
        *third_rank_tasks += problem.owner(t.query_chunk) != r && problem.owner(t.kv_chunk) != r;
  }
  // Sequential sharding: rank r's shard is rows [r local, (r + 1) local) of every tensor, LSE columns likewise.
  std::vector<float> out(p.q.size()), lse(p.lse.size()), dq(p.q.size()), dk(p.k.size()), dv(p.k.size());
  comm::host_world host(world, std::chrono::seconds(120));
  host.run([&](comm::host_threads& c) {
    const index_t first = c.rank() * local;
    const auto shard = [&](const std::vector<float>& x, index_t heads) {
      return tensor_view<const float, 3>(x.data() + static_cast<std::size_t>(first) * heads * dim, {local, heads, dim});
    };
    const auto shard_out = [&](std::vector<float>& x, index_t heads) {
      return tensor_view<float, 3>(x.data() + static_cast<std::size_t>(first) * heads * dim, {local, heads, dim});
    };
    std::vector<float> my_lse(static_cast<std::size_t>(hq) * local);
    host::solver_forward(c, problem, plan, g,
                         forward_tensors<float>{shard(p.q, hq), shard(p.k, heads_kv), shard(p.v, heads_kv), shard_out(out, hq), view2(my_lse, hq, local)},
                         p.scale);
    for (index_t h = 0; h < hq; ++h)
      std::copy_n(my_lse.begin() + static_cast<std::ptrdiff_t>(h * local), local, lse.begin() + static_cast<std::ptrdiff_t>(h * seq + first));
    host::solver_backward(c, problem, plan, g,
                          backward_tensors<float>{shard(p.q, hq), shard(p.k, heads_kv), shard(p.v, heads_kv), shard(std::as_const(out), hq),
                                                  shard(p.d_out, hq), view2(std::as_const(my_lse), hq, local), shard_out(dq, hq),
                                                  shard_out(dk, heads_kv), shard_out(dv, heads_kv)},
                          p.scale);
  });
  return test::errors_against(p, out, lse, dq, dk, dv);
}

}  // namespace

TEST_CASE("attention run as the solver plans it equals single-rank attention, every mask, W 1-5") {
  STRIA_SEEDED_RNG(rng);
  int variant = 0;
  std::size_t plans_with_moves = 0;
  for (const index_t world : {1, 2, 3, 4, 5})
    for (const index_t chunks_per_rank : {1, 2}) {
      const index_t seq = world * chunks_per_rank * 64 * (world <= 2 ? 2 : 1);
      const index_t nb = seq / block_tokens;
      const std::pair<std::string, global_selection> masks[] = {
          {"VS", test::random_selection(rng, seq, 4, true, 0.3, 0.03)},
          {"causal", test::band_selection(seq, 4, 0, nb - 1, true)},
          {"full", test::band_selection(seq, 4, -(nb - 1), nb - 1, false)},
          {"sliding window", test::band_selection(seq, 4, 0, 1, true)},
          {"causal documents", test::document_selection(rng, seq, 4)},
      };
      for (const auto& [name, g] : masks) {
        if (!test::in_sweep(variant++, 3)) continue;
        const index_t heads_kv = variant % 2 ? 4 : 2, dim = variant % 5 == 0 ? 128 : 64;
        CAPTURE(name);
        CAPTURE(world);
        CAPTURE(chunks_per_rank);
        CAPTURE(heads_kv);
        CAPTURE(dim);
        std::size_t moves = 0;
        const test::attention_errors e = compare_solver(rng, g, world, chunks_per_rank, heads_kv, dim, &moves);
        plans_with_moves += moves > 0;
        test::check_errors(e, 1e-5);
      }
    }
  CHECK(plans_with_moves > 0);  // the sweep exercised moved chunks, not only local tasks
}

TEST_CASE("attention equals single-rank attention where the plan runs tasks on third ranks (GQA 4:1)") {
  // A query chunk costs 4x a KV chunk to move here, so the solver balances causal and document masks
  // by sending a busy rank's queries to a light rank together with KV chunks of other ranks: the
  // light rank returns partial O/LSE (forward) and dQ, dK/dV (backward) for chunks it does not own.
  STRIA_SEEDED_RNG(rng);
  const index_t world = 6, m = 4, seq = world * m * 64, nb = seq / block_tokens;
  const std::pair<std::string, global_selection> masks[] = {
      {"causal", test::band_selection(seq, 4, 0, nb - 1, true)},
      {"causal documents", test::document_selection(rng, seq, 4)},
      {"VS", test::random_selection(rng, seq, 4, true, 0.3, 0.03)},
  };
  std::size_t with_third_rank = 0;
  for (const auto& [name, g] : masks) {
    CAPTURE(name);
    std::size_t third = 0;
    test::check_errors(compare_solver(rng, g, world, m, 1, 64, nullptr, &third), 1e-5);
    MESSAGE(name, ": ", third, " third-rank tasks");
    with_third_rank += third > 0;
  }
  CHECK(with_third_rank > 0);
}

TEST_CASE("solver execution refuses a plan or tensors that do not fit") {
  STRIA_SEEDED_RNG(rng);
  const global_selection g = test::band_selection(4 * 64, 2, 0, 3, true);
  const solver::problem p = solver::problem_from_selection(g, 2, 2, 1);
  const solver::plan plan = solver::solve(p);
  std::vector<float> q(4 * 64 * 2 * 64, 0.5f), kv(4 * 64 * 64, 0.5f), out(q.size()), lse(2 * 128);
  const auto run_with = [&](index_t world, index_t local_tokens) {
    comm::host_world host(world, std::chrono::seconds(10));
    host.run([&](comm::host_threads& c) {
      host::solver_forward(c, p, plan, g,
                           forward_tensors<float>{view3(std::as_const(q), local_tokens, 2, 64), view3(std::as_const(kv), local_tokens, 1, 64),
                                                  view3(std::as_const(kv), local_tokens, 1, 64), view3(out, local_tokens, 2, 64),
                                                  view2(lse, 2, local_tokens)},
                           0.125);
    });
  };
  CHECK_THROWS_WITH_AS(run_with(3, 128), doctest::Contains("comm.world_size() = 3: must equal the plan's world size 2"), invalid_argument);
  CHECK_THROWS_WITH_AS(run_with(2, 64), doctest::Contains("q.extent(0) = 64: must equal the rank's chunks x chunk tokens = 128"), invalid_argument);
}

TEST_CASE("a corrupted plan is refused naming the entry, never reaching a lookup that throws out_of_range") {
  const global_selection g = test::band_selection(4 * 64, 2, 0, 3, true);
  const solver::problem p = solver::problem_from_selection(g, 2, 2, 1);  // chunks 0, 1 on rank 0; 2, 3 on rank 1
  const solver::plan good = solver::solve(p);
  const std::vector<float> q(4 * 64 * 2 * 64, 0.5f), kv(4 * 64 * 64, 0.5f);
  const auto run_with = [&](const solver::plan& plan) {
    comm::host_world host(2, std::chrono::seconds(10));
    host.run([&](comm::host_threads& c) {
      std::vector<float> mine(std::size_t{128} * 2 * 64), mine_lse(std::size_t{2} * 128);
      host::solver_forward(c, p, plan, g,
                           forward_tensors<float>{view3(q, 128, 2, 64), view3(kv, 128, 1, 64), view3(kv, 128, 1, 64), view3(mine, 128, 2, 64),
                                                  view2(mine_lse, 2, 128)},
                           0.125);
    });
  };
  CHECK_NOTHROW(run_with(good));
  solver::plan bad = good;
  bad.local_tasks[0].push_back({2, 0, 1});
  CHECK_THROWS_WITH_AS(run_with(bad), doctest::Contains("2 x 0: a local task's chunks must both belong to rank 0"), invalid_argument);
  bad = good;
  bad.remote_tasks[1].push_back({7, 2, 1});
  CHECK_THROWS_WITH_AS(run_with(bad), doctest::Contains(".query_chunk = 7: must be a chunk in [0, 4)"), invalid_argument);
  bad = good;
  bad.moves.push_back({solver::chunk_move::kind::kv, 3, 1});
  CHECK_THROWS_WITH_AS(run_with(bad), doctest::Contains(".to = 1: must be a rank in [0, 2) other than the chunk's owner 1"), invalid_argument);
  bad = good;
  bad.moves.clear();
  bad.remote_tasks.assign(2, {});
  bad.remote_tasks[0].push_back({1, 3, 1});
  CHECK_THROWS_WITH_AS(run_with(bad),
                       doctest::Contains("plan.remote_tasks[0][0] = 1 x 3: a remote task's query and KV chunks must each be rank 0's own or brought there by a move"),
                       invalid_argument);
  bad.remote_tasks[0][0] = {1, 0, 1};  // both chunks its own: a local task filed as remote
  CHECK_THROWS_WITH_AS(run_with(bad), doctest::Contains("plan.remote_tasks[0][0] = 1 x 0: a remote task's query and KV chunks must each be rank 0's own"),
                       invalid_argument);
  bad.remote_tasks[0][0] = {3, 2, 1};  // two chunks of rank 1, only the query moved here
  bad.moves = {{solver::chunk_move::kind::qo, 3, 0}};
  CHECK_THROWS_WITH_AS(run_with(bad), doctest::Contains("plan.remote_tasks[0][0] = 3 x 2"), invalid_argument);
  bad = good;
  bad.moves = {{solver::chunk_move::kind::kv, 2, 0}, {solver::chunk_move::kind::kv, 2, 0}};
  CHECK_THROWS_WITH_AS(run_with(bad), doctest::Contains("plan.moves[1] = (out of order or repeated): moves must be sorted and unique"),
                       invalid_argument);
  bad = good;
  bad.remote_tasks.pop_back();
  CHECK_THROWS_WITH_AS(run_with(bad), doctest::Contains("must equal the problem's world size 2"), invalid_argument);
}
