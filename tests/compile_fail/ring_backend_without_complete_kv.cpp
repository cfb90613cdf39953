// SPDX-License-Identifier: Apache-2.0
// Must not compile: the ring engine completes each received KV chunk with Backend::complete_kv,
// which this backend lacks.
#include <cstddef>
#include <string>
#include <vector>

#include "stria/engine/ring_engine.hpp"
#include "stria/topology/flat_ring.hpp"

struct without_complete_kv {
  using partial = std::vector<float>;
  stria::index_t rank() const { return 0; }
  void load_own_kv(int) {}
  void post_kv(stria::index_t, const stria::transfer_list&) {}
  void finish_transfers() {}
  void add_partial(partial&, partial) {}
  void send_partial(const stria::ring_transfer&, partial) {}
  partial receive_partial(const stria::ring_transfer&, std::size_t) { return {}; }
};

int main() {
  without_complete_kv backend;
  stria::engine::ring_forward(
      backend, stria::topology::flat_ring(1), stria::finite_check::off, [](stria::index_t, int) {},
      [](stria::index_t, const std::string&) {});
}
