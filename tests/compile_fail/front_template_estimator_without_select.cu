// SPDX-License-Identifier: Apache-2.0
// Must not compile: the front template's estimator has no select(), and the check names it.
#include "stria/estimator/statistics.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"

struct without_select {
  static constexpr const char* name = "without_select";
  void validate(stria::index_t, stria::index_t) const {}
  stria::statistics_request request(stria::index_t) const { return {}; }
};

int main() {
  using attention = stria::sparse_attention<without_select, stria::sharding::striped<64>, stria::topology::flat_ring, stria::tile<64, 64, 64>>;
  return static_cast<int>(sizeof(attention)) == 0;
}
