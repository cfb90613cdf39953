// SPDX-License-Identifier: Apache-2.0
// Must not compile: the GPU estimator brings every rank's share to every rank with
// Comm::all_gather(send, recv, count, stream) of device arrays, which this communicator lacks.
#include <cuda_bf16.h>

#include <cstddef>

#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/window_statistics.cuh"
#include "stria/sharding/sequential.hpp"

struct without_all_gather {
  stria::index_t rank() const { return 0; }
  stria::index_t world_size() const { return 1; }
  template <class T>
  void broadcast(T*, std::size_t, stria::index_t, cudaStream_t) {}
  template <class T>
  void all_reduce(const T*, T*, std::size_t, stria::comm::reduce_op, cudaStream_t) {}
};

int main() {
  without_all_gather comm;
  const __nv_bfloat16* none = nullptr;
  (void)stria::estimator::estimate_device(stria::estimator::vertical_slash_top_p{}, comm, stria::sharding::sequential{}, 4096, true, none, none,
                                          2, 1, 64, 0.125, nullptr);
}
