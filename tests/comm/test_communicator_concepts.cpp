// SPDX-License-Identifier: Apache-2.0
// A host communicator written as a third party would (it counts the messages of the ranks it wraps)
// satisfies stria::host_communicator and runs the host ring and the estimator with the same results
// as comm::host_threads; incomplete communicators are rejected by the concepts.
#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/core/concepts.hpp"
#include "stria/estimator/vertical_slash_top_p.hpp"
#include "stria/estimator/window_statistics.hpp"
#include "stria/host/ring_attention.hpp"
#include "stria/index/local_index.hpp"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/topology/flat_ring.hpp"
#include "support/oracle.hpp"
#include "support/counting_comm.hpp"
#include "support/random.hpp"
#include "support/selection.hpp"

namespace third_party {

using stria::index_t;

static_assert(stria::host_communicator<counting_comm>);

/// Collectives only (what an estimator needs, e.g. a world of one rank): not enough for the host ring.
struct collectives_only {
  index_t rank() const { return 0; }
  index_t world_size() const { return 1; }
  template <class T>
  void broadcast(T*, std::size_t, index_t) {}
  template <class T>
  void all_reduce(const T*, T*, std::size_t, stria::comm::reduce_op) {}
  template <class T>
  void all_gather(const T*, T*, std::size_t) {}
};
static_assert(stria::host_collectives<collectives_only>);
static_assert(!stria::host_communicator<collectives_only>);

/// A rank number that is not an index, and no all_gather.
struct incomplete {
  const char* rank() const { return "zero"; }
  index_t world_size() const { return 1; }
  template <class T>
  void broadcast(T*, std::size_t, index_t) {}
  template <class T>
  void all_reduce(const T*, T*, std::size_t, stria::comm::reduce_op) {}
};
static_assert(!stria::host_collectives<incomplete>);
static_assert(!stria::host_communicator<incomplete>);

}  // namespace third_party

using namespace stria;

TEST_CASE("a third-party host communicator runs the host ring and the estimator as host_threads does") {
  STRIA_SEEDED_RNG(rng);
  const index_t world = 2, seq = 512, hq = 4, hkv = 2, dim = 64, local = seq / world;
  const sharding::striped<64> striped;
  const topology::flat_ring ring(world);
  const global_selection selection = test::random_selection(rng, seq, hq, true, 0.3, 0.02);
  const std::vector<float> q = rng.values<float>(static_cast<std::size_t>(seq) * hq * dim), k = rng.values<float>(static_cast<std::size_t>(seq) * hkv * dim),
                           v = rng.values<float>(k.size());
  const auto q_s = sharding::split(striped, std::span<const float>(q), std::array<index_t, 3>{seq, hq, dim}, world);
  const auto k_s = sharding::split(striped, std::span<const float>(k), std::array<index_t, 3>{seq, hkv, dim}, world);
  const auto v_s = sharding::split(striped, std::span<const float>(v), std::array<index_t, 3>{seq, hkv, dim}, world);

  // out, lse and the estimated selection of every rank, through `Comm` made from each host_threads rank.
  struct results {
    std::vector<std::vector<float>> out, lse;
    std::vector<global_selection> estimated;
    int messages = 0, collectives = 0;
  };
  auto run = [&](auto make_comm) {
    results r{std::vector<std::vector<float>>(world, std::vector<float>(static_cast<std::size_t>(local) * hq * dim)),
              std::vector<std::vector<float>>(world, std::vector<float>(static_cast<std::size_t>(hq) * local)),
              std::vector<global_selection>(world)};
    comm::host_world host(world, std::chrono::seconds(60));
    host.run([&](comm::host_threads& c) {
      auto&& comm = make_comm(c);
      const auto me = static_cast<std::size_t>(c.rank());
      const std::vector<step_index> indices = build_ring_indices(selection, striped, ring, c.rank());
      host::ring_forward(comm, ring, std::span<const step_index>(indices),
                         forward_tensors<float>{test::view3(q_s[me], local, hq, dim), test::view3(k_s[me], local, hkv, dim),
                                                test::view3(v_s[me], local, hkv, dim), test::view3(r.out[me], local, hq, dim),
                                                test::view2(r.lse[me], hq, local)},
                         0.125);
      r.estimated[me] = estimator::estimate(estimator::vertical_slash_top_p{}, comm, striped, seq, true, test::view3(q_s[me], local, hq, dim),
                                            test::view3(k_s[me], local, hkv, dim), 0.125);
      if constexpr (requires { comm.messages; })
        if (me == 0) {
          r.messages = comm.messages;
          r.collectives = comm.collectives;
        }
    });
    return r;
  };
  const results built_in = run([](comm::host_threads& c) -> comm::host_threads& { return c; });
  const results counted = run([](comm::host_threads& c) { return third_party::counting_comm(c); });
  CHECK(counted.out == built_in.out);  // bit-identical: the same messages, in the same order
  CHECK(counted.lse == built_in.lse);
  for (std::size_t r = 0; r < static_cast<std::size_t>(world); ++r) CHECK(counted.estimated[r] == built_in.estimated[r]);
  CHECK(counted.messages == 1);  // a ring of two: one KV transfer per rank
  CHECK(counted.collectives > 0);
}
