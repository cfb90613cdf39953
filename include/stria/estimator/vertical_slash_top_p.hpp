// SPDX-License-Identifier: Apache-2.0
// estimator::vertical_slash_top_p: per head, the fewest vertical tokens and the fewest slash block
// diagonals whose window attention mass reaches p_vertical and p_slash, within budgets (MTraining's
// online budget approximation, DESIGN 7).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>
#include <string>
#include <string_view>

#include "stria/core/concepts.hpp"
#include "stria/estimator/select.hpp"

namespace stria::estimator {

struct vertical_slash_top_p {
  static constexpr std::string_view name = "vertical_slash_top_p";

  /// Default caps, used when a budget's max is 0; they scale with the sequence. Verticals: 1/32 of
  /// the key tokens (each covers ~1/seq_len of the causal entries), in [128, 8192]: at S / 64 the cap
  /// left out planted vertical keys (tests/bench/RESULTS.md, 2026-12-02 and 2026-12-03, sixth).
  /// Slashes: 1/32 of the block diagonals.
  static constexpr index_t default_vertical_cap(index_t seq_len) {
    return std::min(seq_len, std::clamp<index_t>(seq_len / 32, 128, 8192));
  }
  static constexpr index_t default_slash_cap(index_t seq_len) {
    const index_t blocks = seq_len / block_tokens;
    return std::min(blocks, std::clamp<index_t>(blocks / 32, 4, 512));
  }

  index_t last_q = 64;        // observation window: the last last_q query tokens of the sequence
  double p_vertical = top_p_rule{}.p_vertical;  // the goals' defaults and why: top_p_rule (select.hpp)
  double p_slash = top_p_rule{}.p_slash;
  budget vertical{1, 0};      // tokens; max 0: default_vertical_cap(seq_len)
  budget slash{1, 0};         // block diagonals beyond the local ones; max 0: default_slash_cap(seq_len)
  index_t sink_tokens = 64;     // the first tokens, always vertical (64: the sink block)
  index_t local_diagonals = 3;  // block diagonals 0 .. local_diagonals - 1 (those that exist), always slash

  /// The local diagonals at `seq_len`: no more than the seq_len / 64 there are, so that the default
  /// (3) also holds for sequences of one or two blocks.
  [[nodiscard]] constexpr index_t local_diagonals_at(index_t seq_len) const { return std::min(local_diagonals, seq_len / block_tokens); }

  void validate(index_t seq_len, index_t num_heads) const {
    if (seq_len <= 0 || seq_len % block_tokens != 0)
      throw invalid_argument("seq_len", seq_len, "must be a positive multiple of 64 (the block size)");
    if (num_heads < 1) throw invalid_argument("num_heads", num_heads, "must be at least 1");
    if (!(p_vertical > 0.0 && p_vertical <= 1.0)) throw invalid_argument("p_vertical", p_vertical, "must lie in (0, 1]");
    if (!(p_slash > 0.0 && p_slash <= 1.0)) throw invalid_argument("p_slash", p_slash, "must lie in (0, 1]");
    if (last_q < 1 || last_q > std::min(seq_len, block_tokens))
      throw invalid_argument("last_q", last_q,
                             "must lie in [1, " + std::to_string(std::min(seq_len, block_tokens)) +
                                 "]: the window is the end of the last block (and no longer than seq_len)");
    const index_t blocks = seq_len / block_tokens;
    detail::validate_budget(vertical, "vertical", default_vertical_cap(seq_len), seq_len, "key tokens");
    detail::validate_budget(slash, "slash", default_slash_cap(seq_len), blocks, "causal block diagonals");
    if (sink_tokens < 0 || sink_tokens > seq_len)
      throw invalid_argument("sink_tokens", sink_tokens, "must lie in [0, seq_len = " + std::to_string(seq_len) + "]");
    if (local_diagonals < 1)
      throw invalid_argument("local_diagonals", local_diagonals, "must be at least 1 (diagonal 0 is always selected)");
  }

  [[nodiscard]] statistics_request request(index_t seq_len) const {
    const top_p_rule r = rule(seq_len);
    return {last_q, r.vertical_cap, r.local_diagonals};
  }

  /// The selection's parameters at `seq_len`, caps resolved (the GPU selection follows them too).
  [[nodiscard]] top_p_rule rule(index_t seq_len) const {
    return {p_vertical,
            p_slash,
            vertical.min,
            detail::cap_of(vertical, default_vertical_cap(seq_len), seq_len),
            slash.min,
            detail::cap_of(slash, default_slash_cap(seq_len), seq_len / block_tokens),
            sink_tokens,
            local_diagonals_at(seq_len)};
  }

  [[nodiscard]] global_selection select(const vs_statistics& s) const {
    validate(s.seq_len, s.num_heads);  // unchecked, a sink past seq_len wrote past the token bitmap
    detail::check_statistics(s, "vertical_slash_top_p");
    if (s.local_blocks != local_diagonals_at(s.seq_len))
      throw invalid_argument("statistics.local_blocks", s.local_blocks,
                             "must equal local_diagonals " + std::to_string(local_diagonals_at(s.seq_len)) +
                                 " (statistics gathered for another estimator)");
    return detail::select_with_rule(s, rule(s.seq_len));
  }
};
static_assert(index_estimator<vertical_slash_top_p>);

}  // namespace stria::estimator
