// SPDX-License-Identifier: Apache-2.0
// Must not compile: the device ring confirms each transfer through Comm::wait(event, what) (a
// bounded wait, so a dead peer raises instead of hanging), which this communicator lacks.
#include <cuda_bf16.h>

#include <cstddef>

#include "stria/device/ring_attention.cuh"
#include "stria/topology/flat_ring.hpp"

struct without_wait {
  stria::index_t rank() const { return 0; }
  stria::index_t world_size() const { return 1; }
  void group_start() {}
  void group_end() {}
  template <class T>
  void send(const T*, std::size_t, stria::index_t, cudaStream_t, int) {}
  template <class T>
  void recv(T*, std::size_t, stria::index_t, cudaStream_t, int) {}
};

int main() {
  using T = __nv_bfloat16;
  without_wait comm;
  const stria::tensor_view<const T, 3> x(nullptr, {0, 0, 0});
  stria::device::ring_forward(comm, stria::topology::flat_ring(1), {},
                              stria::forward_tensors<T>{x, x, x, stria::tensor_view<T, 3>(nullptr, {0, 0, 0}), stria::tensor_view<float, 2>(nullptr, {0, 0})},
                              0.125, {});
}
