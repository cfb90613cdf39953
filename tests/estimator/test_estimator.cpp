// SPDX-License-Identifier: Apache-2.0
// The online Vertical-Slash estimator on the host: window statistics equal a brute-force fp64
// computation; distributed statistics and selections are identical on every rank and agree with a
// single rank; the selection recalls at least max(p_v, p_s) of the window's mass; budgets, safeguards
// and the other estimators behave as documented; bad settings are rejected.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/estimator/block_mask.hpp"
#include "stria/estimator/dense.hpp"
#include "stria/estimator/vertical_slash_top_k.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "support/random.hpp"

using namespace stria;

namespace {

struct problem {
  host::synthetic_vs_options options;
  host::synthetic_vs data;
  [[nodiscard]] double scale() const { return 1.0 / std::sqrt(double(options.head_dim)); }
};

problem make_problem(index_t seq_len, index_t heads_q, index_t heads_kv, index_t dim, std::uint64_t seed) {
  problem p;
  p.options.seq_len = seq_len;
  p.options.heads_q = heads_q;
  p.options.heads_kv = heads_kv;
  p.options.head_dim = dim;
  p.options.seed = seed;
  p.options.density = 0.1;
  p.data = host::make_synthetic_vs(p.options);
  return p;
}

/// Window probabilities in double, straight from the definition: [Hq][rows][S].
std::vector<double> window_probabilities(const problem& p, index_t rows, bool causal) {
  const index_t s = p.options.seq_len, hq = p.options.heads_q, hkv = p.options.heads_kv, d = p.options.head_dim;
  std::vector<double> prob(static_cast<std::size_t>(hq) * rows * s, 0.0);
  for (index_t h = 0; h < hq; ++h)
    for (index_t a = 0; a < rows; ++a) {
      const index_t n = s - rows + a;
      std::vector<double> score(static_cast<std::size_t>(s), -INFINITY);
      double top = -INFINITY;
      for (index_t m = 0; m < s; ++m) {
        if (causal && m > n) continue;
        double dot = 0;
        for (index_t e = 0; e < d; ++e)
          dot += double(p.data.q[(static_cast<std::size_t>(n) * hq + h) * d + e]) *
                 double(p.data.k[(static_cast<std::size_t>(m) * hkv + h / (hq / hkv)) * d + e]);
        score[static_cast<std::size_t>(m)] = dot * p.scale();
        top = std::max(top, score[static_cast<std::size_t>(m)]);
      }
      double z = 0;
      for (index_t m = 0; m < s; ++m) z += std::exp(score[static_cast<std::size_t>(m)] - top);
      for (index_t m = 0; m < s; ++m)
        prob[(static_cast<std::size_t>(h) * rows + a) * s + m] = std::exp(score[static_cast<std::size_t>(m)] - top) / z;
    }
  return prob;
}

/// Runs gather_window_statistics + select on `world` host ranks; returns every rank's results.
template <class Sharding, class Estimator>
std::pair<std::vector<vs_statistics>, std::vector<global_selection>> run_distributed(const problem& p, const Sharding& sharding, index_t world,
                                                                                     const Estimator& estimator, bool causal) {
  const index_t s = p.options.seq_len, hq = p.options.heads_q, hkv = p.options.heads_kv, d = p.options.head_dim, local = s / world;
  const auto q = stria::sharding::split(sharding, std::span<const float>(p.data.q), std::array<index_t, 3>{s, hq, d}, world);
  const auto k = stria::sharding::split(sharding, std::span<const float>(p.data.k), std::array<index_t, 3>{s, hkv, d}, world);
  std::vector<vs_statistics> stats(static_cast<std::size_t>(world));
  std::vector<global_selection> selections(static_cast<std::size_t>(world));
  comm::host_world host(world, std::chrono::seconds(60));
  host.run([&](comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const tensor_view<const float, 3> qv(q[r].data(), {local, hq, d}), kv(k[r].data(), {local, hkv, d});
    stats[r] = estimator::gather_window_statistics(c, sharding, s, causal, qv, kv, p.scale(), estimator.request(s));
    selections[r] = estimator::estimate(estimator, c, sharding, s, causal, qv, kv, p.scale());
  });
  return {stats, selections};
}

/// Window mass (fp64) that a selection's entries cover, over the window rows, per head, as a fraction.
std::vector<double> window_recall(const problem& p, const global_selection& g, const std::vector<double>& prob, index_t rows) {
  const index_t s = p.options.seq_len;
  std::vector<double> recall;
  for (index_t h = 0; h < g.num_heads(); ++h) {
    const head_selection& head = g.heads[static_cast<std::size_t>(h)];
    double hit = 0;
    for (index_t a = 0; a < rows; ++a) {
      const index_t n = s - rows + a;
      for (index_t m = 0; m <= n; ++m)
        if (std::binary_search(head.vertical_tokens.begin(), head.vertical_tokens.end(), m) ||
            std::binary_search(head.slash_deltas.begin(), head.slash_deltas.end(), n / 64 - m / 64))
          hit += prob[(static_cast<std::size_t>(h) * rows + a) * s + m];
    }
    recall.push_back(hit / rows);
  }
  return recall;
}

bool same(const vs_statistics& a, const vs_statistics& b) {
  return a.slash_mass == b.slash_mass && a.window_mass == b.window_mass && a.vertical == b.vertical;
}
bool same(const global_selection& a, const global_selection& b) {
  if (a.heads.size() != b.heads.size()) return false;
  for (std::size_t h = 0; h < a.heads.size(); ++h)
    if (a.heads[h].vertical_tokens != b.heads[h].vertical_tokens || a.heads[h].slash_deltas != b.heads[h].slash_deltas) return false;
  return true;
}

}  // namespace

TEST_CASE("single-rank window statistics equal the fp64 definition") {
  STRIA_SEEDED_RNG(rng);
  const problem p = make_problem(2048, 4, 2, 64, rng.seed);
  for (const index_t rows : {64, 17}) {
    estimator::vertical_slash_top_p e;
    e.last_q = rows;
    e.vertical = {1, 2048};
    const vs_statistics st = run_distributed(p, sharding::sequential{}, 1, e, true).first[0];
    const std::vector<double> prob = window_probabilities(p, rows, true);
    const index_t s = 2048, nb = 32;
    for (index_t h = 0; h < 4; ++h) {
      CHECK(st.window_mass[static_cast<std::size_t>(h)] == doctest::Approx(rows).epsilon(1e-5));
      std::vector<double> vertical(static_cast<std::size_t>(s), 0.0), slash(static_cast<std::size_t>(nb), 0.0);
      for (index_t a = 0; a < rows; ++a)
        for (index_t m = 0; m < s; ++m) {
          const double x = prob[(static_cast<std::size_t>(h) * rows + a) * s + m];
          vertical[static_cast<std::size_t>(m)] += x;
          slash[static_cast<std::size_t>((s - rows + a) / 64 - m / 64)] += x;
        }
      for (index_t delta = 0; delta < nb; ++delta)
        CHECK(st.slash_mass[static_cast<std::size_t>(h * nb + delta)] == doctest::Approx(slash[static_cast<std::size_t>(delta)]).epsilon(1e-4).scale(1e-6));
      // Every token outside the local (last local_diagonals) blocks is a candidate; each one's mass matches.
      REQUIRE(st.vertical[static_cast<std::size_t>(h)].size() == static_cast<std::size_t>(s - 64 * e.local_diagonals));
      for (const vertical_candidate& c : st.vertical[static_cast<std::size_t>(h)])
        CHECK(c.mass == doctest::Approx(vertical[static_cast<std::size_t>(c.token)]).epsilon(1e-4).scale(1e-6));
      CHECK(std::is_sorted(st.vertical[static_cast<std::size_t>(h)].begin(), st.vertical[static_cast<std::size_t>(h)].end()));
    }
  }
}

TEST_CASE("distributed statistics and selections are identical on every rank and agree with one rank") {
  STRIA_SEEDED_RNG(rng);
  const problem p = make_problem(3072, 4, 1, 64, rng.seed);  // divisible as every sharding below needs
  estimator::vertical_slash_top_p e;
  e.vertical = {1, 256};
  const auto [one_stats, one_sel] = run_distributed(p, sharding::sequential{}, 1, e, true);
  auto check = [&](const auto& sharding, index_t world) {
    CAPTURE(world);
    const auto [stats, selections] = run_distributed(p, sharding, world, e, true);
    for (index_t r = 1; r < world; ++r) {
      CHECK(same(stats[static_cast<std::size_t>(r)], stats[0]));  // bit-identical: every rank combines the same gathered partials in rank order, same sort
      CHECK(same(selections[static_cast<std::size_t>(r)], selections[0]));
    }
    const vs_statistics& a = stats[0];
    const vs_statistics& b = one_stats[0];
    for (std::size_t i = 0; i < a.slash_mass.size(); ++i) CHECK(a.slash_mass[i] == doctest::Approx(b.slash_mass[i]).epsilon(1e-4).scale(1e-6));
    // Exact distributed top-k: the union's first 256 are the global top 256 (masses agree in order).
    for (index_t h = 0; h < 4; ++h)
      for (std::size_t i = 0; i < 256; ++i)
        CHECK(a.vertical[static_cast<std::size_t>(h)][i].mass ==
              doctest::Approx(b.vertical[static_cast<std::size_t>(h)][i].mass).epsilon(1e-4).scale(1e-7));
  };
  check(sharding::sequential{}, 4);
  check(sharding::zigzag{}, 4);
  check(sharding::striped<64>{}, 8);
  check(sharding::striped<64>{}, 3);
}

TEST_CASE("the selection recalls at least max(p_v, p_s) of the window's attention mass") {
  STRIA_SEEDED_RNG(rng);
  const problem p = make_problem(2048, 4, 2, 64, rng.seed);
  for (const double pv : {0.5, 0.9})
    for (const double ps : {0.6, 0.95}) {
      estimator::vertical_slash_top_p e;
      e.p_vertical = pv;
      e.p_slash = ps;
      e.vertical = {1, 2048};  // budgets that never bind
      e.slash = {1, 32};
      const global_selection g = run_distributed(p, sharding::striped<64>{}, 4, e, true).second[0];
      const std::vector<double> recall = window_recall(p, g, window_probabilities(p, 64, true), 64);
      for (double r : recall) {
        CAPTURE(pv);
        CAPTURE(ps);
        CHECK(r >= std::max(pv, ps) - 1e-4);
      }
    }
}

TEST_CASE("budgets bound the selection, and safeguards are always present") {
  STRIA_SEEDED_RNG(rng);
  const problem p = make_problem(2048, 2, 1, 64, rng.seed);
  estimator::vertical_slash_top_p capped;
  capped.p_vertical = capped.p_slash = 1.0;
  capped.vertical = {1, 10};
  capped.slash = {1, 3};
  capped.sink_tokens = 2;
  capped.local_diagonals = 2;
  const global_selection g = run_distributed(p, sharding::striped<64>{}, 2, capped, true).second[0];
  for (const head_selection& h : g.heads) {
    CHECK(h.vertical_tokens.size() <= 12);  // 10 + the 2 sinks
    CHECK(h.slash_deltas.size() <= 5);      // 3 + diagonals 0 and 1
    CHECK(h.vertical_tokens[0] == 0);
    CHECK(h.vertical_tokens[1] == 1);
    CHECK(h.slash_deltas[0] == 0);
    CHECK(h.slash_deltas[1] == 1);
  }
  estimator::vertical_slash_top_p floor;
  floor.p_vertical = floor.p_slash = 1e-6;
  floor.vertical = {7, 0};
  floor.slash = {5, 10};
  floor.sink_tokens = 0;
  const global_selection f = run_distributed(p, sharding::sequential{}, 1, floor, true).second[0];
  for (const head_selection& h : f.heads) {
    CHECK(h.vertical_tokens.size() == 7);
    // The 5 heaviest diagonals beyond the local ones (never among them), and the local diagonals 0, 1, 2.
    REQUIRE(h.slash_deltas.size() == static_cast<std::size_t>(5 + floor.local_diagonals));
    for (index_t d = 0; d < floor.local_diagonals; ++d) CHECK(h.slash_deltas[static_cast<std::size_t>(d)] == d);
  }
  estimator::vertical_slash_top_k topk;
  topk.vertical_count = 33;
  topk.slash_count = 6;
  topk.sink_tokens = 0;
  const global_selection k = run_distributed(p, sharding::zigzag{}, 2, topk, true).second[0];
  for (const head_selection& h : k.heads) {
    CHECK(h.vertical_tokens.size() == 33);
    CHECK(h.slash_deltas.size() >= 6);  // the 6 heaviest, plus diagonal 0 when it is not among them
    CHECK(h.slash_deltas.size() <= 7);
    CHECK(h.slash_deltas[0] == 0);
  }
}

TEST_CASE("top-p defaults: p_vertical 0.99 and p_slash 0.9, vertical cap S / 32 in [128, 8192], the sink block, three local diagonals (those that exist)") {
  const estimator::vertical_slash_top_p e;
  CHECK(e.p_vertical == 0.99);
  CHECK(e.p_slash == 0.9);
  CHECK(estimator::top_p_rule{}.p_vertical == e.p_vertical);  // the plain rule's defaults are the estimator's
  CHECK(estimator::top_p_rule{}.p_slash == e.p_slash);
  CHECK(e.sink_tokens == 64);
  CHECK(e.local_diagonals == 3);
  struct expected {
    index_t seq_len, vertical_cap, slash_cap, local_diagonals;
  };
  for (const expected x : {expected{64, 64, 1, 1}, expected{128, 128, 2, 2}, expected{2048, 128, 4, 3}, expected{16384, 512, 8, 3},
                           expected{131072, 4096, 64, 3}, expected{262144, 8192, 128, 3}, expected{1048576, 8192, 512, 3}}) {
    CAPTURE(x.seq_len);
    CHECK_NOTHROW(e.validate(x.seq_len, 1));
    const estimator::top_p_rule r = e.rule(x.seq_len);
    CHECK(r.vertical_cap == x.vertical_cap);
    CHECK(r.slash_cap == x.slash_cap);
    CHECK(r.sink_tokens == 64);
    CHECK(r.local_diagonals == x.local_diagonals);
    CHECK(e.request(x.seq_len).local_blocks == x.local_diagonals);
    CHECK(e.request(x.seq_len).vertical_candidates == x.vertical_cap);
  }
  // Two blocks: the defaults select both diagonals and the sink block.
  STRIA_SEEDED_RNG(rng);
  problem p;
  p.options.seq_len = 128;
  p.options.heads_q = 2;
  p.options.heads_kv = 1;
  p.options.head_dim = 64;
  p.options.seed = rng.seed;
  p.data = host::make_synthetic_vs(p.options);
  const global_selection g = run_distributed(p, sharding::sequential{}, 1, e, true).second[0];
  for (const head_selection& h : g.heads) {
    CHECK(h.slash_deltas == std::vector<index_t>{0, 1});
    REQUIRE(h.vertical_tokens.size() >= 64);
    for (index_t t = 0; t < 64; ++t) CHECK(h.vertical_tokens[static_cast<std::size_t>(t)] == t);
  }
}

TEST_CASE("dense and block-mask estimators need no statistics") {
  vs_statistics shape;
  shape.seq_len = 256;
  shape.num_heads = 2;
  const global_selection d = estimator::dense{}.select(shape);
  CHECK(d.heads[1].slash_deltas == std::vector<index_t>{0, 1, 2, 3});
  shape.causal = false;
  CHECK(estimator::dense{}.select(shape).heads[0].slash_deltas.size() == 7);
  CHECK(estimator::dense{}.request(256).window_rows == 0);

  estimator::block_mask mask{{{{3, 1}, {2, 2}}, {{0, 0}}}};
  shape.causal = true;
  const global_selection m = mask.select(shape);
  CHECK(m.heads[0].blocks == std::vector<block_pair>{{2, 2}, {3, 1}});
  CHECK(m.heads[0].slash_deltas == std::vector<index_t>{0});  // diagonal added for causal attention
  estimator::block_mask above{{{{1, 3}}, {}}};
  CHECK_THROWS_WITH_AS(above.select(shape), doctest::Contains("key_block must not exceed query_block"), stria::invalid_argument);
  CHECK_THROWS_WITH_AS(mask.validate(256, 3), "stria: block_mask.blocks.size() = 2: must equal the number of query heads 3", stria::invalid_argument);
  const estimator::block_mask out_of_range{{{{4, 0}}, {}}};
  CHECK_THROWS_WITH_AS(out_of_range.validate(256, 2), doctest::Contains("(4, 0): both blocks must lie in [0, seq_len / 64 = 4)"),
                       stria::invalid_argument);
}

TEST_CASE("bad estimator settings are rejected with the argument, the value and the rule") {
  auto expect = [](estimator::vertical_slash_top_p e, const char* text) {
    CHECK_THROWS_WITH_AS(e.validate(4096, 8), doctest::Contains(text), stria::invalid_argument);
  };
  estimator::vertical_slash_top_p e;
  CHECK_NOTHROW(e.validate(4096, 8));
  e.p_vertical = 0;
  expect(e, "p_vertical = 0: must lie in (0, 1]");
  e = {};
  e.p_slash = 1.5;
  expect(e, "p_slash = 1.5: must lie in (0, 1]");
  e = {};
  e.last_q = 65;
  expect(e, "last_q = 65: must lie in [1, 64]: the window is the end of the last block");
  e = {};
  e.vertical.min = 0;
  expect(e, "vertical.min = 0: budgets must be at least 1");
  e = {};
  e.vertical.max = 5000;
  expect(e, "vertical.max = 5000: exceeds the 4096 key tokens that exist");
  e = {};
  e.slash.max = 65;
  expect(e, "slash.max = 65: exceeds the 64 causal block diagonals that exist");
  e = {};
  e.slash = {10, 5};
  expect(e, "slash.min = 10: exceeds the budget's cap 5");
  e = {};
  e.local_diagonals = 0;
  expect(e, "local_diagonals = 0: must be at least 1 (diagonal 0 is always selected)");
  e = {};
  e.sink_tokens = 4097;
  expect(e, "sink_tokens = 4097: must lie in [0, seq_len = 4096]");
  estimator::vertical_slash_top_k k;
  k.vertical_count = 0;
  CHECK_THROWS_WITH_AS(k.validate(4096, 8), doctest::Contains("vertical_count = 0: budgets must be at least 1"), stria::invalid_argument);
  vs_statistics none;
  none.seq_len = 4096;
  none.num_heads = 8;
  CHECK_THROWS_WITH_AS(estimator::vertical_slash_top_p{}.select(none), doctest::Contains("needs the window statistics"), stria::invalid_argument);
}

TEST_CASE("top-p and top-k select() check their options and the statistics' tokens, as dense and block_mask do") {
  // select() ran on unchecked options: sink_tokens 100000 at seq_len 256 wrote past the token bitmap
  // (ASan heap-buffer-overflow, select.hpp:142), slash.max -1 or p NaN picked silently; a candidate
  // token past seq_len, or negative, indexed outside the per-diagonal masses (SEGV, select.hpp:117).
  const vs_statistics s{256, 1, true, 64, {1.0f}, {0.5f, 0.2f, 0.2f, 0.1f}, {{{0.3f, 3}, {0.1f, 10}}}, 1};
  estimator::vertical_slash_top_p p;
  p.local_diagonals = 1;
  CHECK_NOTHROW((void)p.select(s));
  auto refused = [&](estimator::vertical_slash_top_p e, const char* text) {
    CAPTURE(text);
    CHECK_THROWS_WITH_AS((void)e.select(s), text, stria::invalid_argument);
  };
  estimator::vertical_slash_top_p e = p;
  e.sink_tokens = 100000;
  refused(e, "stria: sink_tokens = 100000: must lie in [0, seq_len = 256]");
  e = p;
  e.slash = {1, -1};
  refused(e, "stria: slash.max = -1: must be >= 0 (0 picks the default cap)");
  e = p;
  e.p_vertical = std::nan("");
  refused(e, "stria: p_vertical = nan: must lie in (0, 1]");
  estimator::vertical_slash_top_k k;
  k.slash_count = -4;
  CHECK_THROWS_WITH_AS((void)k.select(s), "stria: slash_count = -4: budgets must be at least 1", stria::invalid_argument);
  for (const auto& [token, text] : {std::pair{100000, "stria: statistics.vertical[0][0].token = 100000: must lie in [0, seq_len = 256)"},
                                     std::pair{-70, "stria: statistics.vertical[0][0].token = -70: must lie in [0, seq_len = 256)"}}) {
    vs_statistics bad = s;
    bad.vertical[0][0].token = token;
    CHECK_THROWS_WITH_AS((void)p.select(bad), text, stria::invalid_argument);
  }
}
