// SPDX-License-Identifier: Apache-2.0
// One small problem for checked mode (issue 20), shared by the host and GPU tests: a NaN put into
// one input element is first met by a known rank, at a known ring step, in a known head.
#pragma once

#include <cstddef>
#include <limits>
#include <vector>

#include "stria/index/global_selection.hpp"

namespace stria::test {

/// 4 ranks on a flat ring, sequential sharding, 512 tokens (two 64-token blocks per rank), Hq 4,
/// Hkv 2, D 64, full (non-causal) attention. Heads 0 and 1 (KV head 0) select block diagonals
/// -2, 0 and 2; head 2 selects nothing, so its rows stay empty (O = 0, LSE = -inf: legal); head 3
/// (KV head 1) selects one tile, query block 5 x key block 2. Query block 5 is rank 2's local block
/// 1 and key block 2 is rank 1's local block 0, which rank 2 holds at ring step 1 ((2 - 1) mod 4);
/// no other query reads key block 2 through KV head 1. So a NaN in K or V of rank 1's local token 5,
/// KV head 1, appears first on rank 2 at ring step 1, in head 3, from local token 64 on; and a NaN
/// in dO of rank 2's local token 70, head 3, reaches dQ there at step 1 (that row is empty at step 0).
struct checked_scenario {
  static constexpr index_t world = 4, seq_len = 512, local_tokens = seq_len / world, heads_q = 4, heads_kv = 2, dim = 64;
  static constexpr index_t poisoned_rank = 1, poisoned_token = 5, poisoned_kv_head = 1;  // K or V
  static constexpr index_t d_out_rank = 2, d_out_token = 70, d_out_head = 3;            // dO

  static global_selection selection() {
    global_selection g;
    g.seq_len = seq_len;
    g.causal = false;
    g.heads.resize(heads_q);
    for (const index_t h : {0, 1}) g.heads[static_cast<std::size_t>(h)].slash_deltas = {-2, 0, 2};
    g.heads[3].blocks = {{5, 2}};
    g.validate();
    return g;
  }

  /// The flat position of (token, head, d = 7) in a rank's token-major [local_tokens, heads, dim] shard.
  static std::size_t element(index_t token, index_t head, index_t heads) {
    return (static_cast<std::size_t>(token) * heads + head) * dim + 7;
  }
};

}  // namespace stria::test
