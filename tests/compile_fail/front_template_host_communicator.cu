// SPDX-License-Identifier: Apache-2.0
// Must not compile: the front template runs on the device, and comm::host_threads moves host arrays
// (its send takes no stream), so it is no device communicator.
#include <cuda_bf16.h>

#include "stria/comm/host_threads.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sparse_attention.cuh"
#include "stria/topology/flat_ring.hpp"

int main() {
  using T = __nv_bfloat16;
  using attention = stria::sparse_attention<stria::estimator::vertical_slash_top_p, stria::sharding::striped<64>, stria::topology::flat_ring,
                                            stria::tile<64, 64, 64>>;
  stria::comm::host_world world(1);
  world.run([](stria::comm::host_threads& comm) {
    attention layer({}, {}, stria::topology::flat_ring(1), {64, 1, 1});
    const stria::tensor_view<const T, 3> x(nullptr, {0, 0, 0});
    layer.forward(comm, x, x, x, stria::tensor_view<T, 3>(nullptr, {0, 0, 0}), stria::tensor_view<float, 2>(nullptr, {0, 0}), nullptr);
  });
}
