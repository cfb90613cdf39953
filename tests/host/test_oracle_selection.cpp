// SPDX-License-Identifier: Apache-2.0
// The oracle VS selection: its entry count is exact, at the estimate's density it spends no more
// entries than the estimate, and with budgets that do not bind its top-p recalls at least p of the
// exact attention mass of all rows.
#include <doctest/doctest.h>

#include <cmath>
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
    CHECK(top_p.mean >= 0.9 - 1e-4);
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
