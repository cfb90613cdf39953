// SPDX-License-Identifier: Apache-2.0
// The oracle VS selection: its entry count is exact, at the estimate's density it spends no more
// entries than the estimate, and with budgets that do not bind its top-p recalls at least p of the
// exact attention mass of all rows. The mass profile bounds what a selection of any shape recalls.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/host/oracle_selection.hpp"
#include "stria/host/recall.hpp"
#include "stria/host/synthetic_vs.hpp"
#include "stria/sharding/sequential.hpp"

using namespace stria;

TEST_CASE("selection_entries counts the causal entries of a head exactly") {
  const index_t s = 512, nb = s / 64;
  const head_selection head{{0, 3, 70, 200, 511}, {0, 2, 5}, {}};
  std::int64_t brute = 0;
  for (index_t n = 0; n < s; ++n)
    for (index_t m = 0; m <= n; ++m)
      brute += std::binary_search(head.vertical_tokens.begin(), head.vertical_tokens.end(), m) ||
               std::binary_search(head.slash_deltas.begin(), head.slash_deltas.end(), n / 64 - m / 64);
  CHECK(host::selection_entries(head, s) == brute);
  CHECK(nb == 8);
}

TEST_CASE("the oracle: exact top-p reaches p over all rows, at the estimate's density it spends no more") {
  for (const host::vs_pattern pattern : {host::vs_pattern::rope, host::vs_pattern::mixture}) {
    host::synthetic_vs_options o;
    o.seq_len = 2048;
    o.heads_q = 4;
    o.heads_kv = 2;
    o.head_dim = 64;
    o.density = 0.05;
    o.pattern = pattern;
    const host::synthetic_vs x = host::make_synthetic_vs(o);
    const tensor_view<const float, 3> q(x.q.data(), {o.seq_len, o.heads_q, o.head_dim}), k(x.k.data(), {o.seq_len, o.heads_kv, o.head_dim});
    const double scale = 1.0 / std::sqrt(double(o.head_dim));
    estimator::vertical_slash_top_p est;
    global_selection estimate;
    comm::host_world one(1);
    one.run([&](comm::host_threads& c) { estimate = estimator::estimate(est, c, sharding::sequential{}, o.seq_len, true, q, k, scale); });
    // Budgets that cannot bind: every token and every diagonal.
    estimator::vertical_slash_top_p open = est;
    open.vertical.max = o.seq_len;
    open.slash.max = o.seq_len / 64;
    const host::oracle_selections best = host::oracle_vs_selection(q, k, scale, {open.rule(o.seq_len), &estimate, 1});
    const host::recall_summary top_p = host::attention_recall(best.top_p, q, k, scale);
    CAPTURE(host::pattern_name(pattern));
    CAPTURE(top_p.mean);
    CHECK(top_p.mean >= std::max(open.p_vertical, open.p_slash) - 1e-4);
    for (index_t h = 0; h < o.heads_q; ++h)
      CHECK(host::selection_entries(best.same_density.heads[static_cast<std::size_t>(h)], o.seq_len) <=
            host::selection_entries(estimate.heads[static_cast<std::size_t>(h)], o.seq_len));
    // Sampled rows: the same rule over every 4th query block still validates and keeps the safeguards.
    const host::oracle_selections sampled = host::oracle_vs_selection(q, k, scale, {est.rule(o.seq_len), nullptr, 4});
    for (const head_selection& h : sampled.top_p.heads) {
      CHECK(h.slash_deltas.front() == 0);
      CHECK(h.vertical_tokens.front() == 0);
    }
  }
}

TEST_CASE("the mass profile: the best recall of any selection, against every probability sorted in fp64") {
  host::synthetic_vs_options o;
  o.seq_len = 512;
  o.heads_q = 4;
  o.heads_kv = 2;
  o.head_dim = 64;
  o.density = 0.08;
  o.pattern = host::vs_pattern::mixture;
  const host::synthetic_vs x = host::make_synthetic_vs(o);
  const tensor_view<const float, 3> q(x.q.data(), {o.seq_len, o.heads_q, o.head_dim}), k(x.k.data(), {o.seq_len, o.heads_kv, o.head_dim});
  const double scale = 1.0 / std::sqrt(double(o.head_dim));
  // Every probability of the rows of query blocks `first`, first + stride, ... in fp64, pooled over
  // heads and rows, largest first.
  auto sorted_probabilities = [&](bool causal, index_t first, index_t stride) {
    std::vector<double> p;
    for (index_t h = 0; h < o.heads_q; ++h)
      for (index_t qb = first; qb < o.seq_len / 64; qb += stride)
        for (index_t n = qb * 64; n < qb * 64 + 64; ++n) {
          const index_t keys = causal ? n + 1 : o.seq_len;
          std::vector<double> logits(static_cast<std::size_t>(keys));
          for (index_t m = 0; m < keys; ++m) {
            double dot = 0;
            for (index_t d = 0; d < o.head_dim; ++d) dot += double(q(n, h, d)) * double(k(m, h / 2, d));
            logits[static_cast<std::size_t>(m)] = dot * scale;
          }
          const double top = *std::max_element(logits.begin(), logits.end());
          double total = 0;
          for (double& l : logits) total += (l = std::exp(l - top));
          for (const double l : logits) p.push_back(l / total);
        }
    std::sort(p.begin(), p.end(), std::greater<>());
    return p;
  };
  // The bound lies between the exact best recall and 1/128 over it (the straddling bin's upper edge).
  auto check_bound = [](const host::attention_mass_profile& profile, const std::vector<double>& p, double rows) {
    CHECK(profile.entries == static_cast<std::int64_t>(p.size()));
    CHECK(profile.rows == static_cast<std::int64_t>(rows));
    double previous = 0;
    for (const double density : {0.003, 0.01, 0.05, 0.1, 0.3, 1.0}) {
      CAPTURE(density);
      const double budget = density * double(p.size());
      const std::size_t whole = static_cast<std::size_t>(budget);
      double kept = 0;
      for (std::size_t i = 0; i < whole; ++i) kept += p[i];
      if (whole < p.size()) kept += (budget - double(whole)) * p[whole];
      const double best = profile.best_mean_recall(density);
      CHECK(best >= kept / rows * (1 - 1e-6));
      CHECK(best <= kept / rows * (1 + 1.0 / 128) + 1e-9);
      CHECK(best >= previous);
      previous = best;
    }
    CHECK(profile.best_mean_recall(1.0) == doctest::Approx(1.0).epsilon(1e-6));
  };
  for (const bool causal : {true, false}) {
    CAPTURE(causal);
    const host::attention_mass_profile profile = host::attention_mass_profile_of(q, k, scale, causal, 2);
    check_bound(profile, sorted_probabilities(causal, 0, 1), double(o.heads_q) * o.seq_len);
    CHECK_THROWS_WITH_AS(profile.best_mean_recall(0.0), "stria: density = 0: must lie in (0, 1]", stria::invalid_argument);
    CHECK_THROWS_WITH_AS(profile.best_mean_recall(1.5), "stria: density = 1.5: must lie in (0, 1]", stria::invalid_argument);
  }
  // Sampled rows: query blocks 3 and 7 (every 4th, the last always), as attention_recall samples them.
  check_bound(host::attention_mass_profile_of(q, k, scale, true, 0, 4), sorted_probabilities(true, 3, 4), double(o.heads_q) * 2 * 64);

  // selected_share against a count of the planted selection's entries row by row, every row and sampled.
  for (const index_t stride : {1, 4}) {
    CAPTURE(stride);
    std::int64_t held = 0, all = 0;
    for (const head_selection& h : x.planted.heads)
      for (index_t qb = (o.seq_len / 64 - 1) % stride; qb < o.seq_len / 64; qb += stride)
        for (index_t n = qb * 64; n < qb * 64 + 64; ++n)
          for (index_t m = 0; m <= n; ++m) {
            ++all;
            held += std::binary_search(h.vertical_tokens.begin(), h.vertical_tokens.end(), m) ||
                    std::binary_search(h.slash_deltas.begin(), h.slash_deltas.end(), n / 64 - m / 64) ||
                    std::binary_search(h.blocks.begin(), h.blocks.end(), block_pair{n / 64, m / 64});
          }
    CHECK(host::selected_share(x.planted, stride) == doctest::Approx(double(held) / double(all)).epsilon(1e-12));
  }
  // Explicit tiles count too.
  global_selection with_tiles = x.planted;
  with_tiles.heads[0].blocks = {{5, 1}, {7, 2}};
  CHECK(host::selected_share(with_tiles) > host::selected_share(x.planted));
  // The planted VS selection recalls no more than the profile allows at its own share.
  const host::recall_summary planted = host::attention_recall(x.planted, q, k, scale, 2);
  const host::attention_mass_profile causal = host::attention_mass_profile_of(q, k, scale, true);
  CAPTURE(planted.mean);
  CHECK(planted.mean <= causal.best_mean_recall(host::selected_share(x.planted)));
  // Bad input.
  CHECK_THROWS_WITH_AS(host::attention_mass_profile_of(q, k, scale, true, 0, 9), "stria: query_block_stride = 9: must lie in [1, seq_len / 64]",
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(host::attention_mass_profile_of(q, k, 1e39, true), doctest::Contains("softmax_scale = 1e+39: must be finite in float"),
                       stria::invalid_argument);
  std::vector<float> bad_q = x.q;
  bad_q[3 * 64 * static_cast<std::size_t>(o.heads_q * o.head_dim) + 1] = std::numeric_limits<float>::quiet_NaN();  // token 192, head 0
  CHECK_THROWS_WITH_AS(host::attention_mass_profile_of(tensor_view<const float, 3>(bad_q.data(), {o.seq_len, o.heads_q, o.head_dim}), k, scale, true),
                       "stria: q, k = head 0: must give finite scores (softmax_scale * q . k)", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(host::selected_share(x.planted, 0), "stria: query_block_stride = 0: must lie in [1, seq_len / 64]", stria::invalid_argument);
}
