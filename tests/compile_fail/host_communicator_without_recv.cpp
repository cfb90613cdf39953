// SPDX-License-Identifier: Apache-2.0
// Must not compile: the host ring receives KV chunks with Comm::recv, which this communicator lacks.
#include <cstddef>

#include "stria/host/ring_attention.hpp"
#include "stria/topology/flat_ring.hpp"

struct without_recv {
  stria::index_t rank() const { return 0; }
  stria::index_t world_size() const { return 1; }
  template <class T>
  void send(const T*, std::size_t, stria::index_t, int) {}
  template <class T>
  void broadcast(T*, std::size_t, stria::index_t) {}
  template <class T>
  void all_reduce(const T*, T*, std::size_t, stria::comm::reduce_op) {}
  template <class T>
  void all_gather(const T*, T*, std::size_t) {}
};

int main() {
  without_recv comm;
  const stria::tensor_view<const float, 3> x(nullptr, {0, 0, 0});
  stria::host::ring_forward(comm, stria::topology::flat_ring(1), {},
                            stria::forward_tensors<float>{x, x, x, stria::tensor_view<float, 3>(nullptr, {0, 0, 0}), stria::tensor_view<float, 2>(nullptr, {0, 0})},
                            0.125);
}
