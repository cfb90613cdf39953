// SPDX-License-Identifier: Apache-2.0
// The workload planner counts what the built indices hold, per rank and step; the imbalance degrees
// follow their definitions; on Vertical-Slash inputs striped beats zigzag and sequential.
#include <doctest/doctest.h>

#include <vector>

#include "stria/host/synthetic_vs.hpp"
#include "stria/index/local_index.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "support/selection.hpp"

using namespace stria;

namespace {
template <class Sharding, class Topology>
void check_counts(const global_selection& g, const Sharding& sharding, const Topology& topology) {
  const ring_workload w = count_ring_workload(g, sharding, topology);
  for (index_t r = 0; r < topology.world_size(); ++r) {
    const std::vector<step_index> indices = build_ring_indices(g, sharding, topology, r);
    for (index_t s = 0; s < topology.num_steps(); ++s) {
      CAPTURE(r);
      CAPTURE(s);
      CHECK(w.at(r, s) == indices[static_cast<std::size_t>(s)].active_entries());
    }
  }
}
}  // namespace

TEST_CASE("planner counts equal the active entries of the built indices, per rank and step") {
  STRIA_SEEDED_RNG(rng);
  for (const bool causal : {true, false})
    for (const index_t world : {1, 3, 4, 5, 8})
      for (const double token_density : {0.02, 0.3})  // dense tokens: many per key block, on active tiles
        for (const index_t blocks_per_rank : {4, 16}) {  // 16: zigzag's runs are long enough to be walked as stretches too
          CAPTURE(causal);
          CAPTURE(world);
          CAPTURE(token_density);
          CAPTURE(blocks_per_rank);
          const global_selection g = test::random_selection(rng, blocks_per_rank * world * 64, 3, causal, 0.3, token_density);
          check_counts(g, sharding::sequential{}, topology::flat_ring(world));
          check_counts(g, sharding::zigzag{}, topology::flat_ring(world));
          check_counts(g, sharding::striped<64>{}, topology::flat_ring(world));
          if (world % 2 == 0) check_counts(g, sharding::striped<64>{}, topology::hierarchical_ring(2, world / 2));
        }
}

TEST_CASE("imbalance degrees follow their definitions") {
  // 2 ranks x 3 steps: step 0 (4, 4), step 1 (6, 2), step 2 (0, 0).
  const ring_workload w{2, 3, {4, 6, 0, 4, 2, 0}};
  const imbalance_degrees d = measure_imbalance(w);
  CHECK(d.worker_max == doctest::Approx(1.5));                  // step 1: 6 / 4
  CHECK(d.worker_mean == doctest::Approx((1.0 + 1.5 + 1.0) / 3));  // an empty step counts as balanced
  CHECK(d.step_max == doctest::Approx(2.0));                    // rank 1: 4 / (6 / 3); rank 0: 6 / (10 / 3) = 1.8
  CHECK(d.step_mean == doctest::Approx((1.8 + 4.0 / 2.0) / 2));   // rank 1: 4 / 2
  CHECK(w.max_rank_total() == 10);
  CHECK(forward_flops(10, 128) == 5120.0);
  CHECK(backward_flops(10, 128) == 12800.0);
}

TEST_CASE("on Vertical-Slash inputs striped is better balanced than zigzag and sequential") {
  host::synthetic_vs_options o;
  o.seq_len = 32768;
  o.heads_q = 8;
  o.heads_kv = 2;
  for (const double theta : {1e4, 1e6}) {
    o.rope_theta = theta;
    const global_selection g = host::plant_vs_selection(o);
    const topology::flat_ring ring(8);
    const imbalance_degrees striped = measure_imbalance(count_ring_workload(g, sharding::striped<64>{}, ring));
    const imbalance_degrees zigzag = measure_imbalance(count_ring_workload(g, sharding::zigzag{}, ring));
    const imbalance_degrees sequential = measure_imbalance(count_ring_workload(g, sharding::sequential{}, ring));
    CAPTURE(theta);
    CAPTURE(striped.worker_mean);
    CAPTURE(zigzag.worker_mean);
    CAPTURE(sequential.worker_mean);
    CHECK(striped.worker_mean < zigzag.worker_mean);
    CHECK(striped.worker_mean < sequential.worker_mean);
    CHECK(striped.step_mean < zigzag.step_mean);
    CHECK(striped.step_mean < sequential.step_mean);
    CHECK(striped.worker_mean < 1.1);
  }
}
