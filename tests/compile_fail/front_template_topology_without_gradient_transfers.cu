// SPDX-License-Identifier: Apache-2.0
// Must not compile: the front template's ring topology moves KV chunks but has no
// gradient_transfers() for the backward's dK/dV partials, and the check names it.
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sparse_attention.cuh"

struct without_gradient_transfers {
  static constexpr const char* name = "without_gradient_transfers";
  stria::index_t world_size() const { return 1; }
  stria::index_t num_steps() const { return 1; }
  stria::index_t kv_source_rank(stria::index_t rank, stria::index_t) const { return rank; }
  int kv_buffer(stria::index_t, stria::index_t) const { return 0; }
  stria::transfer_list transfers(stria::index_t, stria::index_t) const { return {}; }
};

int main() {
  using attention = stria::sparse_attention<stria::estimator::vertical_slash_top_p, stria::sharding::striped<64>, without_gradient_transfers,
                                            stria::tile<64, 64, 64>>;
  return static_cast<int>(sizeof(attention)) == 0;
}
