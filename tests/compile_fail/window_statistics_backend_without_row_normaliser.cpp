// SPDX-License-Identifier: Apache-2.0
// Must not compile: the window statistics engine asks Backend::row_normaliser for this rank's row
// max and sums of exp, which this backend lacks.
#include <cstdint>
#include <span>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/engine/window_statistics_engine.hpp"
#include "stria/sharding/sequential.hpp"

struct without_row_normaliser {
  using floats = std::vector<float>;
  using share = stria::engine::rank_share<floats, std::vector<std::uint64_t>>;
  using window_rows = std::span<float>;
  using statistics = stria::vs_statistics;
  std::vector<float> rows;
  template <class Comm>
  stria::engine::host_exchange<Comm> exchange(Comm& comm) {
    return {comm};
  }
  window_rows window() { return rows; }
  void score_window() {}
  void place_normaliser(std::vector<float>) {}
  void probabilities() {}
  share rank_share() { return {}; }
  statistics global_statistics(share) { return {}; }
  statistics own_statistics() { return {}; }
};

int main() {
  const stria::engine::window_plan plan = stria::engine::make_window_plan(stria::sharding::sequential{}, 64, 1, true, 1, {64, 1, 1});
  stria::comm::host_world one(1);
  one.run([&](stria::comm::host_threads& c) {
    without_row_normaliser backend;
    (void)stria::engine::gather_window_statistics(backend, c, plan);
  });
}
