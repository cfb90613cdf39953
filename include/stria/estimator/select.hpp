// SPDX-License-Identifier: Apache-2.0
// Shared selection steps of the Vertical-Slash estimators: budgets, top-p counts, and the slash
// diagonals in selection order.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/error.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::estimator {

/// How many lines an estimator may keep: at least `min`, at most `max` (0: the estimator's default cap).
struct budget {
  index_t min = 1;
  index_t max = 0;
};

/// A top-p selection resolved for one sequence length: what the host select() and the GPU
/// selection (select.cuh) both follow, so that they pick the same lines.
struct top_p_rule {
  /// The goals' defaults, vertical_slash_top_p's too. Vertical 0.99: at 0.9 the verticals left out a
  /// quarter of a noise-free pattern's mass, and 0.99 costs the noisy generator 0.2-5.7% more
  /// entries (16% on periodic_slash). Slash 0.9: 0.99 as well added 2.8 points of density at 128K
  /// for 0.013 more recall (tests/bench/RESULTS.md, 2026-12-07, fifth).
  double p_vertical = 0.99;
  double p_slash = 0.9;
  index_t vertical_min = 1, vertical_cap = 0;  // tokens
  index_t slash_min = 1, slash_cap = 0;        // block diagonals beyond the local ones
  index_t sink_tokens = 0;                     // the first tokens, always vertical
  index_t local_diagonals = 1;                 // block diagonals (-local, local), always slash
};

namespace detail {

/// The cap a budget stands for: its max, or `default_cap` when max is 0, never above what exists.
inline index_t cap_of(const budget& b, index_t default_cap, index_t existing) {
  return std::min(b.max > 0 ? b.max : default_cap, existing);
}

/// Throws unless the budget is usable: min >= 1, max >= 0 and not above what exists, min <= the cap.
inline void validate_budget(const budget& b, const char* name, index_t default_cap, index_t existing, const char* what) {
  const std::string n(name);
  if (b.min < 1) throw invalid_argument(n + ".min", b.min, "budgets must be at least 1");
  if (b.max < 0) throw invalid_argument(n + ".max", b.max, "must be >= 0 (0 picks the default cap)");
  if (b.max > existing)
    throw invalid_argument(n + ".max", b.max, "exceeds the " + std::to_string(existing) + " " + what + " that exist");
  if (b.min > cap_of(b, default_cap, existing))
    throw invalid_argument(n + ".min", b.min, "exceeds the budget's cap " + std::to_string(cap_of(b, default_cap, existing)));
}

/// The fewest leading entries of `mass` (already in selection order) whose sum reaches `goal`,
/// clamped to [min, cap] and to the entries there are.
inline index_t count_to_goal(const std::vector<float>& mass, double goal, index_t min, index_t cap) {
  double sum = 0;
  index_t count = 0;
  while (count < static_cast<index_t>(mass.size()) && count < cap && sum < goal) sum += mass[static_cast<std::size_t>(count++)];
  return std::min(std::max(count, min), std::min(cap, static_cast<index_t>(mass.size())));
}

/// The first `count` diagonals in selection order (larger mass first, ties to the smaller delta),
/// as deltas, with their masses; diagonals with delta in (-local, local) are left out. A partial
/// sort under that total order picks exactly what a full stable sort would, for O(n log count).
inline std::vector<index_t> diagonals_by_mass(const vs_statistics& s, const std::vector<double>& mass, index_t local, index_t count,
                                              std::vector<float>& mass_in_order) {
  std::vector<index_t> order;
  for (index_t i = 0; i < s.num_diagonals(); ++i) {
    const index_t delta = i - s.diagonal_offset();
    if (delta > -local && delta < local) continue;
    order.push_back(i);
  }
  const auto first = order.begin(), middle = order.begin() + std::min<std::ptrdiff_t>(count, static_cast<std::ptrdiff_t>(order.size()));
  std::partial_sort(first, middle, order.end(), [&](index_t a, index_t b) {
    const double ma = mass[static_cast<std::size_t>(a)], mb = mass[static_cast<std::size_t>(b)];
    return ma != mb ? ma > mb : a < b;
  });
  order.erase(middle, order.end());
  mass_in_order.resize(order.size());
  for (std::size_t i = 0; i < order.size(); ++i) {
    mass_in_order[i] = float(mass[static_cast<std::size_t>(order[i])]);
    order[i] -= s.diagonal_offset();  // index -> delta
  }
  return order;
}

/// The Vertical-Slash selection of one head (DESIGN 7, step 4), with the window in the last block:
/// 1. the local diagonals (-local, local) are always selected;
/// 2. verticals: the fewest candidates (which exclude the local blocks) whose mass reaches
///    p_vertical of the window mass outside the local diagonals, within the vertical budget;
/// 3. slashes: by residual mass (a diagonal's mass minus that of the chosen verticals on it), the
///    fewest further diagonals that bring the union to p_slash of the window mass, within budget.
/// The union then recalls at least max(p_vertical, p_slash) of the window's mass unless a budget
/// cap binds first.
inline head_selection select_head(const vs_statistics& s, index_t h, const top_p_rule& rule) {
  const index_t n = s.num_diagonals(), local_diagonals = rule.local_diagonals;
  const float* slash_mass = s.slash_mass.data() + static_cast<std::size_t>(h) * static_cast<std::size_t>(n);
  const double total = s.window_mass[static_cast<std::size_t>(h)];
  double local = 0;
  std::vector<double> residual(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) {
    residual[static_cast<std::size_t>(i)] = slash_mass[i];
    const index_t delta = i - s.diagonal_offset();
    if (delta > -local_diagonals && delta < local_diagonals) local += slash_mass[i];
  }
  head_selection head;
  const auto& candidates = s.vertical[static_cast<std::size_t>(h)];
  std::vector<float> mass(candidates.size());
  for (std::size_t i = 0; i < candidates.size(); ++i) mass[i] = candidates[i].mass;
  const index_t n_vertical = count_to_goal(mass, rule.p_vertical * (total - local), rule.vertical_min, rule.vertical_cap);
  double covered = local;
  for (index_t i = 0; i < n_vertical; ++i) {
    const vertical_candidate& c = candidates[static_cast<std::size_t>(i)];
    head.vertical_tokens.push_back(c.token);
    residual[static_cast<std::size_t>(s.diagonal_of(c.token) + s.diagonal_offset())] -= c.mass;
    covered += c.mass;
  }
  for (double& r : residual) r = std::max(r, 0.0);
  const std::vector<index_t> diagonals = diagonals_by_mass(s, residual, local_diagonals, rule.slash_cap, mass);
  const index_t n_slash = count_to_goal(mass, rule.p_slash * total - covered, rule.slash_min, rule.slash_cap);
  head.slash_deltas.assign(diagonals.begin(), diagonals.begin() + n_slash);
  return head;
}

/// Throws unless the statistics were gathered (they are empty for estimators that need none).
inline void check_statistics(const vs_statistics& s, const char* estimator) {
  if (s.empty() || s.vertical.size() != static_cast<std::size_t>(s.num_heads) ||
      s.slash_mass.size() != static_cast<std::size_t>(s.num_heads) * static_cast<std::size_t>(s.num_diagonals()) ||
      s.window_mass.size() != static_cast<std::size_t>(s.num_heads))
    throw invalid_argument("statistics", "(incomplete)",
                           std::string(estimator) + " needs the window statistics of every head (see request())");
  // The candidates' tokens index the per-diagonal masses and the token bitmap.
  for (std::size_t h = 0; h < s.vertical.size(); ++h)
    for (std::size_t i = 0; i < s.vertical[h].size(); ++i)
      if (const index_t token = s.vertical[h][i].token; token < 0 || token >= s.seq_len)
        throw invalid_argument("statistics.vertical[" + std::to_string(h) + "][" + std::to_string(i) + "].token", token,
                               "must lie in [0, seq_len = " + std::to_string(s.seq_len) + ")");
}

/// Adds the safeguards (sink tokens; the local diagonals, which include 0) and puts both lists in
/// ascending order without duplicates. Tokens go through a bitmap over the sequence (a scan of
/// seq_len / 64 words instead of a sort of thousands of tokens); the few diagonals are sorted.
inline void finish_head(head_selection& head, index_t seq_len, index_t sink_tokens, index_t local_diagonals, bool causal,
                        std::vector<std::uint64_t>& bitmap) {
  bitmap.assign(static_cast<std::size_t>((seq_len + 63) / 64), 0);
  for (index_t t = 0; t < sink_tokens; ++t) bitmap[static_cast<std::size_t>(t / 64)] |= std::uint64_t{1} << (t % 64);
  for (const index_t t : head.vertical_tokens) bitmap[static_cast<std::size_t>(t / 64)] |= std::uint64_t{1} << (t % 64);
  head.vertical_tokens.clear();
  for (std::size_t w = 0; w < bitmap.size(); ++w)
    for (std::uint64_t bits = bitmap[w]; bits != 0; bits &= bits - 1)
      head.vertical_tokens.push_back(static_cast<index_t>(w * 64) + std::countr_zero(bits));
  for (index_t d = 0; d < local_diagonals; ++d) {
    head.slash_deltas.push_back(d);
    if (!causal && d > 0) head.slash_deltas.push_back(-d);
  }
  std::sort(head.slash_deltas.begin(), head.slash_deltas.end());
  head.slash_deltas.erase(std::unique(head.slash_deltas.begin(), head.slash_deltas.end()), head.slash_deltas.end());
}

/// Every head's selection under `rule`.
inline global_selection select_with_rule(const vs_statistics& s, const top_p_rule& rule) {
  global_selection g{s.seq_len, s.causal, {}};
  std::vector<std::uint64_t> bitmap;
  for (index_t h = 0; h < s.num_heads; ++h) {
    head_selection head = select_head(s, h, rule);
    finish_head(head, s.seq_len, rule.sink_tokens, rule.local_diagonals, s.causal, bitmap);
    g.heads.push_back(std::move(head));
  }
  return g;
}

}  // namespace detail
}  // namespace stria::estimator
