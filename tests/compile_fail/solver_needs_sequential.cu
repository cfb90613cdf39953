// SPDX-License-Identifier: Apache-2.0
// Must not compile: topology::solver moves the chunks of a sequential layout only.
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sparse_attention.cuh"

int main() {
  using attention = stria::sparse_attention<stria::estimator::vertical_slash_top_p, stria::sharding::striped<64>, stria::topology::solver,
                                            stria::tile<64, 64, 128>>;
  return static_cast<int>(sizeof(attention));
}
