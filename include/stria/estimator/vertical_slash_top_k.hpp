// SPDX-License-Identifier: Apache-2.0
// estimator::vertical_slash_top_k: per head, a fixed number of vertical tokens and of slash block
// diagonals, those with the most window attention mass (MInference's fixed budgets).
#pragma once

#include <string>
#include <string_view>

#include "stria/core/concepts.hpp"
#include "stria/estimator/select.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"

namespace stria::estimator {

struct vertical_slash_top_k {
  static constexpr std::string_view name = "vertical_slash_top_k";

  index_t last_q = 64;
  index_t vertical_count = 1024;  // tokens per head (capped at seq_len)
  index_t slash_count = 16;       // block diagonals per head (capped at their number)
  index_t sink_tokens = 4;
  index_t local_diagonals = 1;

  void validate(index_t seq_len, index_t num_heads) const {
    if (vertical_count < 1) throw invalid_argument("vertical_count", vertical_count, "budgets must be at least 1");
    if (slash_count < 1) throw invalid_argument("slash_count", slash_count, "budgets must be at least 1");
    to_top_p(seq_len).validate(seq_len, num_heads);  // the same rules as top-p with fixed budgets
  }

  [[nodiscard]] statistics_request request(index_t seq_len) const { return to_top_p(seq_len).request(seq_len); }

  [[nodiscard]] top_p_rule rule(index_t seq_len) const { return to_top_p(seq_len).rule(seq_len); }

  [[nodiscard]] global_selection select(const vs_statistics& s) const {
    validate(s.seq_len, s.num_heads);  // its own counts first: to_top_p's checks would name the budgets it made
    detail::check_statistics(s, "vertical_slash_top_k");
    return to_top_p(s.seq_len).select(s);
  }

 private:
  /// Top-k is top-p with p = 1 and min = max = k: it always stops at the budget.
  [[nodiscard]] vertical_slash_top_p to_top_p(index_t seq_len) const {
    const index_t blocks = seq_len / block_tokens;
    const index_t v = std::min(vertical_count, seq_len), sl = std::min(slash_count, blocks);
    return {last_q, 1.0, 1.0, {v, v}, {sl, sl}, sink_tokens, local_diagonals};
  }
};
static_assert(index_estimator<vertical_slash_top_k>);

}  // namespace stria::estimator
