// SPDX-License-Identifier: Apache-2.0
// The dynamic solver's promises, for full, causal, causal-document, sliding-window and VS masks over
// 2 to 64 ranks: every active task runs exactly once, where both its chunks are (its own or moved
// there); moves are in range and exactly what the tasks need; no plan moves more than the flat ring;
// a feasible plan keeps every load within mu x mean; causal, document and VS masks with GQA 8:1 at
// W = 64 balance within 1.10 inside the ring's volume; the plan is deterministic; bad problems are
// refused.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "stria/host/synthetic_vs.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/solver/dynamic_solver.hpp"
#include "support/random.hpp"
#include "support/selection.hpp"

using namespace stria;

namespace {

void check_plan(const solver::problem& p, const solver::plan& x, const std::string& name, double volume_cap = 1.0) {
  CAPTURE(name);
  CAPTURE(p.world_size);
  CAPTURE(p.chunks_per_rank);
  const index_t c = p.num_chunks(), w = p.world_size;
  REQUIRE(x.local_tasks.size() == static_cast<std::size_t>(w));
  REQUIRE(x.remote_tasks.size() == static_cast<std::size_t>(w));
  std::map<std::pair<index_t, index_t>, int> seen;
  std::set<solver::chunk_move> used;
  std::vector<std::int64_t> load(static_cast<std::size_t>(w), 0);
  bool complete = true;
  int out_of_range = 0, wrong_area = 0, wrong_stage = 0;
  for (index_t r = 0; r < w; ++r)
    for (const bool remote : {false, true})
      for (const solver::task& t : (remote ? x.remote_tasks : x.local_tasks)[static_cast<std::size_t>(r)]) {
        // Counted, not asserted one by one: the sweeps place hundreds of thousands of tasks.
        if (t.query_chunk < 0 || t.query_chunk >= c || t.kv_chunk < 0 || t.kv_chunk >= c) {
          ++out_of_range;
          continue;
        }
        wrong_area += t.area != p.at(t.query_chunk, t.kv_chunk);
        wrong_stage += remote == (p.owner(t.query_chunk) == r && p.owner(t.kv_chunk) == r);
        ++seen[{t.query_chunk, t.kv_chunk}];
        load[static_cast<std::size_t>(r)] += t.area;
        if (p.owner(t.kv_chunk) != r) used.insert({solver::chunk_move::kind::kv, t.kv_chunk, r});
        if (p.owner(t.query_chunk) != r) used.insert({solver::chunk_move::kind::qo, t.query_chunk, r});
      }
  int empty_run = 0, twice = 0;
  for (index_t i = 0; i < c; ++i)
    for (index_t j = 0; j < c; ++j) {
      const auto it = seen.find({i, j});
      const int n = it == seen.end() ? 0 : it->second;
      if (p.at(i, j) == 0 && n > 0) ++empty_run;
      if (n > 1) ++twice;
      if (p.at(i, j) > 0 && n != 1) complete = false;
    }
  CHECK(out_of_range == 0);
  CHECK(wrong_area == 0);
  CHECK(wrong_stage == 0);   // local = both chunks the rank's own
  CHECK(empty_run == 0);     // no task without active entries
  CHECK(twice == 0);      // nothing computed twice
  CHECK(load == x.load);
  // The moves are exactly what the placed tasks need (each task's chunks are on its rank), each from
  // its owner to another rank.
  CHECK(std::set<solver::chunk_move>(x.moves.begin(), x.moves.end()) == used);
  CHECK(std::is_sorted(x.moves.begin(), x.moves.end()));
  for (const solver::chunk_move& m : x.moves) {
    CHECK(m.to >= 0);
    CHECK(m.to < w);
    CHECK(m.to != p.owner(m.chunk));
  }
  CHECK(double(solver::comm_volume(p, x)) <= std::max(1.0, volume_cap) * double(p.ring_volume()));  // feasible or not
  CHECK(complete);  // every active task runs exactly once, feasible or not (the plan can be executed)
  if (x.feasible) CHECK(x.max_load_over_mean() <= 1.10 + 1e-9);
  // The plan's busiest rank is what its moves make it, sending or receiving.
  std::vector<std::int64_t> send(static_cast<std::size_t>(w), 0), receive(send.size(), 0);
  for (const solver::chunk_move& m : x.moves) {
    const auto from = static_cast<std::size_t>(p.owner(m.chunk)), to = static_cast<std::size_t>(m.to);
    if (m.what == solver::chunk_move::kind::kv) {
      send[from] += p.kv_cost();
      receive[to] += p.kv_cost();
    } else {  // Q there, O back
      send[from] += p.qo_cost(), receive[from] += p.qo_cost();
      send[to] += p.qo_cost(), receive[to] += p.qo_cost();
    }
  }
  CHECK(std::max(*std::max_element(send.begin(), send.end()), *std::max_element(receive.begin(), receive.end())) == x.max_rank_traffic);
}

/// Tasks of a plan whose query and KV chunks both moved to the rank that runs them.
std::size_t third_rank_tasks(const solver::problem& p, const solver::plan& x) {
  std::size_t n = 0;
  for (index_t r = 0; r < p.world_size; ++r)
    for (const solver::task& t : x.remote_tasks[static_cast<std::size_t>(r)]) n += p.owner(t.query_chunk) != r && p.owner(t.kv_chunk) != r;
  return n;
}

/// Two plans place every task alike and move the same chunks.
bool same_plan(const solver::plan& a, const solver::plan& b) {
  return a.local_tasks == b.local_tasks && a.remote_tasks == b.remote_tasks && a.moves == b.moves && a.load == b.load &&
         a.feasible == b.feasible;
}

}  // namespace

TEST_CASE("solver plans run every task once, move what the tasks need, and keep their promises") {
  STRIA_SEEDED_RNG(rng);
  int config = 0;
  for (const index_t world : {2, 3, 4, 8, 16, 64})
    for (const index_t chunks_per_rank : {1, 4}) {
      if (!test::in_sweep(config++)) continue;
      const index_t seq_len = world * chunks_per_rank * block_tokens * 2, nb = seq_len / block_tokens;
      const std::vector<std::pair<std::string, global_selection>> masks{
          {"causal", test::band_selection(seq_len, 4, 0, nb - 1, true)},
          {"full", test::band_selection(seq_len, 4, -(nb - 1), nb - 1, false)},
          {"sliding window", test::band_selection(seq_len, 4, 0, 3, true)},
          {"causal documents", test::document_selection(rng, seq_len, 4)},
          {"VS", test::random_selection(rng, seq_len, 4, true, 0.1, 0.02)}};
      for (const auto& [name, g] : masks)
        for (const index_t heads_kv : {4, 1}) {  // MHA and GQA 4:1
          const solver::problem p = solver::problem_from_selection(g, world, chunks_per_rank, heads_kv);
          const solver::plan x = solver::solve(p);
          check_plan(p, x, name);
          CHECK(solver::solve(p).moves == x.moves);  // deterministic
          CHECK(solver::solve(p).load == x.load);
        }
    }
}

TEST_CASE("the solver balances causal attention with multi-head attention, within the ring's volume") {
  // Chunks of 1/8 of a rank give the balance room to move; with MHA a QO move (Q there, O back) costs
  // what a KV move costs.
  for (const index_t world : {2, 4, 8, 16}) {
    CAPTURE(world);
    const index_t seq_len = world * 8 * block_tokens, nb = seq_len / block_tokens;
    const solver::problem p = solver::problem_from_selection(test::band_selection(seq_len, 8, 0, nb - 1, true), world, 8, 8);
    const solver::plan x = solver::solve(p);
    check_plan(p, x, "causal");
    CHECK(x.feasible);
    MESSAGE("W ", world, ": max load / mean ", x.max_load_over_mean(), ", volume / ring ",
            double(solver::comm_volume(p, x)) / double(p.ring_volume()));
  }
}

TEST_CASE("the solver balances causal, document and VS masks with GQA 8:1 at W = 64 within the ring's volume") {
  // Issue 21's setting at a CI size: 64 ranks, 8 chunks of one block each per rank, a query chunk 8x
  // as costly to move as a KV chunk (GQA 64:8 has the same ratio). With tasks only on their chunks'
  // owners these stayed at 1.36-1.76 x the mean; a light rank running a busy rank's queries against
  // KV chunks it holds or receives (third-rank tasks) brings them within 1.10.
  STRIA_SEEDED_RNG(rng);
  const index_t world = 64, m = 8, seq_len = world * m * block_tokens, nb = seq_len / block_tokens;
  const std::vector<std::pair<std::string, global_selection>> masks{
      {"causal", test::band_selection(seq_len, 8, 0, nb - 1, true)},
      {"causal documents", test::document_selection(rng, seq_len, 8)},
      {"VS", test::random_selection(rng, seq_len, 8, true, 0.1, 0.02)}};
  for (const auto& [name, g] : masks) {
    CAPTURE(name);
    const solver::problem p = solver::problem_from_selection(g, world, m, 1);
    const solver::plan x = solver::solve(p);
    check_plan(p, x, name);
    CHECK(x.feasible);
    CHECK(x.max_load_over_mean() <= 1.10);
    CHECK(solver::comm_volume(p, x) <= p.ring_volume());
    CHECK(third_rank_tasks(p, x) > 0);  // the balance comes from tasks away from both owners
    MESSAGE(name, ": max load / mean ", x.max_load_over_mean(), ", volume / ring ", double(solver::comm_volume(p, x)) / double(p.ring_volume()),
            ", third-rank tasks ", third_rank_tasks(p, x));
  }
}

TEST_CASE("a cap below the ring's volume is kept where the query owners' placement is within it") {
  // Causal: every task on its query's owner moves about half of the ring's KV chunks; shedding adds
  // QO moves and drops KV moves. A cap of 0.5 x the ring's must hold, balanced or not.
  const index_t world = 16, m = 8, seq_len = world * m * block_tokens, nb = seq_len / block_tokens;
  const solver::problem p = solver::problem_from_selection(test::band_selection(seq_len, 8, 0, nb - 1, true), world, m, 1);
  for (const double cap : {0.5, 0.6, 1.0}) {
    CAPTURE(cap);
    const solver::plan x = solver::solve(p, {1.10, cap});
    check_plan(p, x, "causal, GQA 8:1");
    CHECK(double(solver::comm_volume(p, x)) <= cap * double(p.ring_volume()));
    if (cap == 1.0) CHECK(x.feasible);
    MESSAGE("cap ", cap, ": max load / mean ", x.max_load_over_mean(), ", volume / ring ", double(solver::comm_volume(p, x)) / double(p.ring_volume()),
            ", feasible ", x.feasible);
  }
}

TEST_CASE("hand-overs taken back leave the placement as it was") {
  // The shedding tries a column and takes it back when it lifts the volume past the cap: the loads,
  // the volume and the moves must then be exactly those before.
  STRIA_SEEDED_RNG(rng);
  const index_t world = 8, m = 4, seq_len = world * m * block_tokens;
  const solver::problem p = solver::problem_from_selection(test::random_selection(rng, seq_len, 4, true, 0.2, 0.05), world, m, 1);
  solver::detail::placement x(p);
  x.place_on_query_owners();
  const solver::plan before = x.finish();
  const std::int64_t volume = x.volume();
  CHECK(volume == solver::comm_volume(p, before));
  std::size_t handed = 0;
  for (index_t i = p.num_chunks() - m; i < p.num_chunks(); ++i)  // the last rank's rows to ranks 0 and 1
    for (index_t j = 0; j < p.num_chunks(); ++j)
      if (p.at(i, j) > 0) x.hand_over(i, j, (i + j) % 2), ++handed;
  REQUIRE(handed > 0);
  const solver::plan moved = x.finish();
  check_plan(p, moved, "handed over");
  CHECK(moved.load != before.load);
  x.take_back(0);
  const solver::plan back = x.finish();
  CHECK(same_plan(back, before));
  CHECK(x.volume() == volume);
  CHECK(back.max_rank_traffic == before.max_rank_traffic);
}

TEST_CASE("the solver refuses bad problems with the field, the value and the rule") {
  solver::problem p{2, 1, 64, 4, 2, std::vector<std::int64_t>(3, 1)};
  CHECK_THROWS_WITH_AS(solver::solve(p), doctest::Contains("problem.area.size() = 3: must be (world_size x chunks_per_rank)^2 = 4"),
                       stria::invalid_argument);
  p.area.assign(4, 1);
  CHECK_THROWS_WITH_AS(solver::solve(p, {0.9}), doctest::Contains("options.mu = 0.9: must be >= 1"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(solver::solve(p, {1.1, 0.0}), doctest::Contains("options.volume_cap = 0: must be positive and finite"),
                       stria::invalid_argument);
  p.heads_kv = 3;
  CHECK_THROWS_WITH_AS(solver::solve(p), doctest::Contains("problem.heads_kv = 3: must be >= 1 and divide heads_q = 4"), stria::invalid_argument);
  const global_selection g = test::band_selection(64 * 6, 2, 0, 5, true);
  CHECK_THROWS_WITH_AS(solver::problem_from_selection(g, 4, 1, 1), doctest::Contains("must divide seq_len / 64 = 6"), stria::invalid_argument);
  // Past the index widths: 65536 x 65536 chunks wrapped to 0 in index_t, so an empty area matched
  // the wrapped (0)^2 and the problem was accepted; problem_from_selection reported "= 0".
  CHECK_THROWS_WITH_AS(solver::problem({65536, 65536, 64, 1, 1, {}}).validate(),
                       "stria: problem world_size x chunks_per_rank x chunk_tokens = 274877906944: must be at most 2147483647 (the sequence "
                       "length is an index_t)",
                       stria::invalid_argument);
  // Volumes past int64 (a bad-input hunt's leftover): 1024 ranks of 2^20 tokens at 2^23 KV heads,
  // whose flat-ring volume W (W - 1) x tokens x 2 Hkv (1.8e19) wrapped negative in ring_volume();
  // the bound is 2^62, which leaves the solver's sums a factor of two.
  CHECK_THROWS_WITH_AS(solver::problem({1024, 1, 1 << 20, 1 << 23, 1 << 23, {}}).validate(),
                       doctest::Contains("problem volume (elements: world_size x chunks_per_rank x chunk_tokens x heads) = 1.84287e+19: the "
                                         "volumes moved"),
                       stria::invalid_argument);
  // Either side of the bound: 2^22 KV heads give 1023 x 2^53 (past 2^62), 2^21 give 1023 x 2^52 (within).
  CHECK_THROWS_AS(solver::problem({1024, 1, 1 << 20, 1 << 22, 1 << 22, {}}).validate(), stria::invalid_argument);
  CHECK_NOTHROW(solver::problem({1024, 1, 1 << 20, 1 << 21, 1 << 21, std::vector<std::int64_t>(1024 * 1024, 1)}).validate());
  CHECK_THROWS_WITH_AS(solver::problem_from_selection(g, 65536, 65536, 1),
                       "stria: world_size x chunks_per_rank = 4294967296: must divide seq_len / 64 = 6 (whole blocks per chunk)",
                       stria::invalid_argument);
}

TEST_CASE("a volume cap past int64's range is no cap") {
  // volume_cap x the ring's volume was converted to int64 unchecked (undefined; it read as a
  // negative cap): --volume-cap 1e17 gave an infeasible plan that moved less than --volume-cap 1e6's.
  const index_t world = 4, m = 2, seq_len = world * m * block_tokens * 4, nb = seq_len / block_tokens;
  const solver::problem p = solver::problem_from_selection(test::band_selection(seq_len, 8, 0, nb - 1, true), world, m, 1);
  const solver::plan bounded = solver::solve(p, {1.10, 1e6});
  REQUIRE(bounded.feasible);
  for (const double cap : {1e17, 1e300}) {
    CAPTURE(cap);
    const solver::plan x = solver::solve(p, {1.10, cap});
    CHECK(x.feasible);
    CHECK(same_plan(x, bounded));
  }
}
