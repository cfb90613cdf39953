// SPDX-License-Identifier: Apache-2.0
// estimator::dense: every block diagonal (all causal tiles, or all tiles for full attention): plain
// ring attention through the sparse machinery. Needs no statistics.
#pragma once

#include <string_view>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::estimator {

struct dense {
  static constexpr std::string_view name = "dense";

  void validate(index_t seq_len, index_t num_heads) const {
    if (seq_len <= 0 || seq_len % block_tokens != 0)
      throw invalid_argument("seq_len", seq_len, "must be a positive multiple of 64 (the block size)");
    if (num_heads < 1) throw invalid_argument("num_heads", num_heads, "must be at least 1");
  }
  [[nodiscard]] statistics_request request(index_t) const { return {}; }

  [[nodiscard]] global_selection select(const vs_statistics& s) const {
    validate(s.seq_len, s.num_heads);
    global_selection g{s.seq_len, s.causal, {}};
    head_selection all;
    for (index_t d = s.causal ? 0 : -(s.num_blocks() - 1); d < s.num_blocks(); ++d) all.slash_deltas.push_back(d);
    g.heads.assign(static_cast<std::size_t>(s.num_heads), all);
    return g;
  }
};
static_assert(index_estimator<dense>);

}  // namespace stria::estimator
