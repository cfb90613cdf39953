// SPDX-License-Identifier: Apache-2.0
// The workload planner counts what the built indices hold, per rank and step; the imbalance degrees
// follow their definitions; on Vertical-Slash inputs striped beats zigzag and sequential, and on the
// heavy-tailed families (issue 21) stripes placed by balance_stripes reach worker <= 1.05 and step
// <= 1.10 where striped<64> does not.
#include <doctest/doctest.h>

#include <vector>

#include "stria/host/synthetic_vs.hpp"
#include "stria/index/local_index.hpp"
#include "stria/index/stripe_balance.hpp"
#include "stria/index/workload.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "support/random.hpp"
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
          const sharding::placed_stripes placed = balance_stripes(g, world);
          check_counts(g, placed, topology::flat_ring(world));
          if (world % 2 == 0) check_counts(g, placed, topology::hierarchical_ring(2, world / 2));
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

TEST_CASE("measure_imbalance refuses a workload whose counts do not fill world_size x num_steps") {
  // It indexed entries unchecked: 2 x 2 with one count read past the vector (ASan heap-buffer-overflow),
  // and an empty workload reported imbalance 0 where 1.0 is perfect.
  CHECK_THROWS_WITH_AS(measure_imbalance(ring_workload{2, 2, {1}}), "stria: workload.entries.size() = 1: must be world_size x num_steps = 4",
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(measure_imbalance(ring_workload{}), "stria: workload.world_size = 0: must be at least 1", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(measure_imbalance(ring_workload{1, 2, {3, -1}}), "stria: workload.entries[1] = -1: counts must be >= 0", stria::invalid_argument);
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

TEST_CASE("heavy-tailed Vertical-Slash patterns at W 8 and 32: striped beats zigzag, placed stripes reach the targets") {
  // 128K tokens, 4 query heads on 1 KV head: few heads leave the most imbalance (at W 32 each rank
  // owns 64 blocks). Measured at this commit (worker mean, step mean):
  //                        W  striped        zigzag         placed_stripes
  //   power_law_slash      8  1.070 1.120    1.195 3.636    1.001 1.001
  //                       32  1.122 1.589    1.402 7.320    1.023 1.028
  //   periodic_slash       8  1.073 1.278    1.210 2.983    1.001 1.001
  //                       32  1.148 2.457    1.681 5.210    1.033 1.040
  //   clustered_vertical   8  1.036 1.127    1.755 4.076    1.001 1.001
  //                       32  1.286 1.628    4.977 8.638    1.020 1.019
  //   mixture              8  1.071 1.146    1.166 3.947    1.001 1.001
  //                       32  1.130 1.948    1.408 8.036    1.023 1.025
  host::synthetic_vs_options o;
  o.seq_len = 131072;
  o.heads_q = 4;
  o.heads_kv = 1;
  int variant = 0;
  for (const host::vs_pattern pattern :
       {host::vs_pattern::power_law_slash, host::vs_pattern::periodic_slash, host::vs_pattern::clustered_vertical, host::vs_pattern::mixture}) {
    o.pattern = pattern;
    const global_selection g = host::plant_vs_selection(o);
    for (const index_t world : {8, 32}) {
      if (!test::in_sweep(variant++, 2)) continue;  // the sanitized build runs half
      const topology::flat_ring ring(world);
      const imbalance_degrees striped = measure_imbalance(count_ring_workload(g, sharding::striped<64>{}, ring));
      const imbalance_degrees zigzag = measure_imbalance(count_ring_workload(g, sharding::zigzag{}, ring));
      const sharding::placed_stripes placement = balance_stripes(g, world);
      const imbalance_degrees placed = measure_imbalance(count_ring_workload(g, placement, ring));
      const imbalance_degrees placed_hierarchical = measure_imbalance(count_ring_workload(g, placement, topology::hierarchical_ring(world / 4, 4)));
      CAPTURE(host::pattern_name(pattern));
      CAPTURE(world);
      CAPTURE(striped.worker_mean);
      CAPTURE(striped.step_mean);
      CAPTURE(placed.worker_mean);
      CAPTURE(placed.worker_max);
      CAPTURE(placed.step_mean);
      CAPTURE(placed.step_max);
      CHECK(striped.worker_mean < zigzag.worker_mean);
      CHECK(striped.step_mean < zigzag.step_mean);
      // striped<64> misses the targets on these patterns at W 32 (and on its steps at W 8).
      CHECK(striped.worker_mean < (world == 8 ? 1.10 : 1.35));
      CHECK(striped.step_mean < (world == 8 ? 1.35 : 2.60));
      if (world == 32) CHECK(striped.worker_mean > 1.05);
      CHECK(striped.step_mean > 1.10);
      // The placement reaches them on every ring, and no step is far off.
      CHECK(placed.worker_mean <= 1.05);
      CHECK(placed.step_mean <= 1.10);
      CHECK(placed.worker_max <= 1.08);
      CHECK(placed.step_max <= 1.08);
      CHECK(placed_hierarchical.worker_mean <= 1.05);
      CHECK(placed_hierarchical.step_mean <= 1.10);
      CHECK(placed.worker_mean < striped.worker_mean);
      CHECK(placed.step_mean < striped.step_mean);
    }
  }
}
