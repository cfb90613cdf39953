// SPDX-License-Identifier: Apache-2.0
// The oracle Vertical-Slash selection: the estimator's top-p rule applied to statistics of the exact
// attention of every query row instead of an observation window, so the gap between an estimate
// and the best VS index of its kind can be measured. Host only; for validating estimators.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/estimator/select.hpp"
#include "stria/host/recall.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::host {

/// What the oracle follows: the estimator's rule (its p, budgets and safeguards), and optionally a
/// selection (the estimate) whose density, head by head, the second oracle selection matches.
struct oracle_request {
  estimator::top_p_rule rule;
  const global_selection* same_density_as = nullptr;
  /// Rows of every stride-th query block enter the statistics (the last block always): 1 is exact;
  /// larger strides make long sequences affordable (the statistics then describe a row sample).
  index_t query_block_stride = 1;
};

struct oracle_selections {
  global_selection top_p;         // the rule's p on exact statistics
  global_selection same_density;  // per head the largest p (same for verticals and slashes) whose
                                  // selection has no more entries than same_density_as's head
};

/// Causal entries a head selection covers (verticals not double counted on selected diagonals).
inline std::int64_t selection_entries(const head_selection& head, index_t seq_len) {
  const index_t nb = seq_len / block_tokens;
  std::int64_t entries = 0;
  for (const index_t delta : head.slash_deltas)
    entries += delta == 0 ? std::int64_t{nb} * block_tokens * (block_tokens + 1) / 2 : std::int64_t{nb - delta} * block_tokens * block_tokens;
  for (const index_t v : head.vertical_tokens) {
    entries += seq_len - v;
    for (const index_t delta : head.slash_deltas) {
      if (v / block_tokens + delta >= nb) continue;
      entries -= delta == 0 ? block_tokens - v % block_tokens : block_tokens;
    }
  }
  return entries;
}

/// The oracle VS selections of causal attention for q [S, Hq, D] and k [S, Hkv, D]: per head,
/// (1) every sampled row's softmax normaliser; (2) per query block and key token, the exact
/// probability mass; from these the vertical mass of each key token (outside the local diagonals)
/// and the slash mass of each block diagonal; (3) the selection of estimator::detail::select_head
/// on them: verticals by top-p, then slash diagonals by residual mass (their mass less that of the
/// chosen verticals on them) until the union reaches p; (4) sinks and local diagonals added.
template <class T>
oracle_selections oracle_vs_selection(tensor_view<const T, 3> q, tensor_view<const T, 3> k, double softmax_scale, const oracle_request& request,
                                      unsigned threads = 0) {
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  check_extents(k, {shape.query_tokens, shape.heads_kv, shape.head_dim}, "k");
  const index_t s = shape.query_tokens, dim = shape.head_dim, nb = s / block_tokens, stride = request.query_block_stride;
  if (s % block_tokens != 0) throw invalid_argument("q.extent(0)", s, "must be a multiple of 64");
  if (stride < 1 || stride > nb) throw invalid_argument("query_block_stride", stride, "must lie in [1, seq_len / 64]");
  if (request.same_density_as && request.same_density_as->num_heads() != shape.heads_q)
    throw invalid_argument("same_density_as.num_heads()", request.same_density_as->num_heads(), "must equal q.extent(1)");
  const estimator::top_p_rule& rule = request.rule;
  const index_t local = rule.local_diagonals;
  std::vector<index_t> sampled;  // sampled query blocks, ascending, the last one always
  for (index_t qb = (nb - 1) % stride; qb < nb; qb += stride) sampled.push_back(qb);

  oracle_selections out{{s, true, std::vector<head_selection>(static_cast<std::size_t>(shape.heads_q))}, {}};
  if (request.same_density_as) out.same_density = out.top_p;
  vs_statistics shape_only;  // what diagonals_by_mass needs: the diagonal count and offset
  shape_only.seq_len = s;
  shape_only.causal = true;

  auto run_head = [&](index_t h) {
    const index_t hk = shape.kv_head(h);
    const std::vector<float> kt = detail::transposed_keys(k, hk);
    std::vector<float> qs(static_cast<std::size_t>(block_tokens) * dim), score(static_cast<std::size_t>(block_tokens) * block_tokens);
    // mass[i][m]: probability mass of key token m summed over the rows of sampled query block i.
    std::vector<float> mass(sampled.size() * static_cast<std::size_t>(s), 0.0f);
    for (std::size_t i = 0; i < sampled.size(); ++i) {
      const index_t qb = sampled[i];
      detail::scaled_queries(q, h, qb, softmax_scale, qs.data());
      // (1) the row max and normaliser, over all causal keys.
      float row_max[block_tokens];
      double row_sum[block_tokens];
      detail::row_normalisers(qs.data(), kt.data(), s, dim, qb, qb + 1, true, score.data(), row_max, row_sum);
      // (2) probabilities summed over the block's rows, per key token.
      float* column = mass.data() + i * static_cast<std::size_t>(s);
      for (index_t kb = 0; kb <= qb; ++kb) {
        detail::score_tile(qs.data(), kt.data(), s, dim, kb, score.data());
        for (index_t a = 0; a < block_tokens; ++a) {
          const index_t count = kb == qb ? a + 1 : block_tokens;
          const float* row = score.data() + static_cast<std::size_t>(a) * block_tokens;
          const float inv = float(1.0 / row_sum[a]);
          for (index_t b = 0; b < count; ++b) column[kb * block_tokens + b] += detail::exp2_nonpositive(row[b] - row_max[a]) * inv;
        }
      }
    }
    // (3) vertical and slash statistics.
    std::vector<double> vertical(static_cast<std::size_t>(s), 0.0), slash(static_cast<std::size_t>(nb), 0.0);
    double total = 0, local_mass = 0;
    for (std::size_t i = 0; i < sampled.size(); ++i)
      for (index_t m = 0; m < (sampled[i] + 1) * block_tokens; ++m) {
        const double p = mass[i * static_cast<std::size_t>(s) + static_cast<std::size_t>(m)];
        const index_t delta = sampled[i] - m / block_tokens;
        slash[static_cast<std::size_t>(delta)] += p;
        total += p;
        if (delta < local) local_mass += p;
        else vertical[static_cast<std::size_t>(m)] += p;
      }
    std::vector<index_t> order(static_cast<std::size_t>(s));
    std::iota(order.begin(), order.end(), index_t{0});
    const index_t cap = rule.vertical_cap;
    std::partial_sort(order.begin(), order.begin() + cap, order.end(), [&](index_t a, index_t b) {
      const double ma = vertical[static_cast<std::size_t>(a)], mb = vertical[static_cast<std::size_t>(b)];
      return ma != mb ? ma > mb : a < b;
    });
    std::vector<float> in_order(static_cast<std::size_t>(cap));
    for (index_t c = 0; c < cap; ++c) in_order[static_cast<std::size_t>(c)] = float(vertical[static_cast<std::size_t>(order[static_cast<std::size_t>(c)])]);
    // The selection at top-p (p_vertical, p_slash), as select_head makes it from window statistics.
    auto select = [&](double p_vertical, double p_slash) {
      head_selection head;
      const index_t n_vertical = estimator::detail::count_to_goal(in_order, p_vertical * (total - local_mass), rule.vertical_min, cap);
      double covered = local_mass;
      std::vector<double> residual = slash;
      for (index_t c = 0; c < n_vertical; ++c) {
        const index_t t = order[static_cast<std::size_t>(c)];
        head.vertical_tokens.push_back(t);
        covered += vertical[static_cast<std::size_t>(t)];
        for (std::size_t i = 0; i < sampled.size(); ++i) {
          const index_t delta = sampled[i] - t / block_tokens;
          if (delta >= local) residual[static_cast<std::size_t>(delta)] -= mass[i * static_cast<std::size_t>(s) + static_cast<std::size_t>(t)];
        }
      }
      for (double& r : residual) r = std::max(r, 0.0);
      std::vector<float> slash_in_order;
      const std::vector<index_t> diagonals = estimator::detail::diagonals_by_mass(shape_only, residual, local, rule.slash_cap, slash_in_order);
      const index_t n_slash = estimator::detail::count_to_goal(slash_in_order, p_slash * total - covered, rule.slash_min, rule.slash_cap);
      head.slash_deltas.assign(diagonals.begin(), diagonals.begin() + n_slash);
      std::vector<std::uint64_t> bitmap;
      estimator::detail::finish_head(head, s, rule.sink_tokens, local, true, bitmap);
      return head;
    };
    out.top_p.heads[static_cast<std::size_t>(h)] = select(rule.p_vertical, rule.p_slash);
    if (request.same_density_as) {
      // Entries grow with p: bisect for the largest p within the reference head's entries.
      const std::int64_t budget = selection_entries(request.same_density_as->heads[static_cast<std::size_t>(h)], s);
      double lo = 0, hi = 1;
      head_selection best = select(1e-9, 1e-9);
      for (int iteration = 0; iteration < 24; ++iteration) {
        const double mid = 0.5 * (lo + hi);
        head_selection x = select(mid, mid);
        if (selection_entries(x, s) <= budget) lo = mid, best = std::move(x);
        else hi = mid;
      }
      out.same_density.heads[static_cast<std::size_t>(h)] = std::move(best);
    }
  };

  detail::for_each_head(shape.heads_q, threads, run_head);
  out.top_p.validate();
  if (request.same_density_as) out.same_density.validate();
  return out;
}

}  // namespace stria::host
