// SPDX-License-Identifier: Apache-2.0
// The ring engine on a backend written as a third party would, with no attention math: every step
// computes with the chunk the topology names, every rank ends with its own chunk's dK/dV summed
// over all ranks, and a broken gradient schedule is reported; incomplete backends are rejected.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/engine/ring_engine.hpp"
#include "stria/host/ring_attention.hpp"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"

namespace third_party {

using stria::index_t;
using stria::ring_message_tag;
using stria::ring_transfer;

/// A KV chunk is its owner's rank (one float); a step records whose chunk it computed with; a
/// chunk's dK/dV counts, per rank, the steps that computed with it.
class tracing_backend {
 public:
  using partial = std::vector<float>;  // [world]

  explicit tracing_backend(stria::comm::host_threads& comm) : comm_(comm) {}

  index_t rank() const { return comm_.rank(); }
  void load_own_kv(int slot) { slots_[slot] = static_cast<float>(rank()); }
  void post_kv(index_t, const stria::transfer_list& list) {
    for (const ring_transfer& t : list) comm_.send(&slots_[t.send_buffer], 1, t.send_to, ring_message_tag(t, false));
  }
  void complete_kv(const ring_transfer& t) { comm_.recv(&slots_[t.receive_buffer], 1, t.receive_from, ring_message_tag(t, false)); }
  void finish_transfers() {}
  void add_partial(partial& sum, partial x) {
    for (std::size_t i = 0; i < x.size(); ++i) sum[i] += x[i];
  }
  void send_partial(const ring_transfer& t, partial sum) {
    comm_.send(sum.data(), sum.size(), t.send_to, ring_message_tag(t, true));
    posted_.push_back(t);
  }
  partial receive_partial(const ring_transfer& t, std::size_t n) {  // n: the receive's place in post order, each once
    places_ok = places_ok && n < posted_.size() && posted_[n].receive_from == t.receive_from && posted_[n].ready_step == t.ready_step;
    if (places_ok) posted_[n].ready_step = -1;
    partial in(static_cast<std::size_t>(comm_.world_size()));
    comm_.recv(in.data(), in.size(), t.receive_from, ring_message_tag(t, true));
    return in;
  }

  /// The two directions' steps, as the engine calls them.
  void forward(const auto& topology, stria::finite_check check) {
    stria::engine::ring_forward(
        *this, topology, check, [&](index_t, int slot) { seen.push_back(static_cast<index_t>(slots_[slot])); },
        [&](index_t, const std::string&) { ++checks; });
  }
  partial backward(const auto& topology, stria::finite_check check) {
    posted_.clear();
    return stria::engine::ring_backward(
        *this, topology, check,
        [&](index_t, int slot) {
          seen.push_back(static_cast<index_t>(slots_[slot]));
          partial mine(static_cast<std::size_t>(comm_.world_size()), 0.0f);
          mine[static_cast<std::size_t>(rank())] = 1.0f;
          return mine;
        },
        [&](index_t, const std::string&, index_t, const partial&) { ++checks; });
  }

  std::vector<index_t> seen;  // whose chunk each step computed with
  int checks = 0;
  bool places_ok = true;  // receive_partial named each posted receive by its place, once

  bool every_receive_completed_once() const {
    return places_ok && std::all_of(posted_.begin(), posted_.end(), [](const ring_transfer& t) { return t.ready_step == -1; });
  }

 private:
  stria::comm::host_threads& comm_;
  float slots_[4] = {};
  std::vector<ring_transfer> posted_;  // the dK/dV receives, in post order
};
static_assert(stria::engine::ring_backend<tracing_backend>);

/// KV movement only: no dK/dV partials.
struct kv_only {
  index_t rank() const { return 0; }
  void load_own_kv(int) {}
  void post_kv(index_t, const stria::transfer_list&) {}
  void complete_kv(const ring_transfer&) {}
  void finish_transfers() {}
};
static_assert(!stria::engine::ring_backend<kv_only>);

/// A flat ring whose dK/dV partials never move, and one that sends a partial it does not hold.
struct ring_without_gradient_moves : stria::topology::flat_ring {
  using flat_ring::flat_ring;
  stria::transfer_list gradient_transfers(index_t, index_t) const { return {}; }
};
struct ring_sending_a_stranger : stria::topology::flat_ring {
  using flat_ring::flat_ring;
  stria::transfer_list gradient_transfers(index_t rank, index_t step) const {
    stria::transfer_list list = flat_ring::gradient_transfers(rank, step);
    for (int i = 0; i < list.count; ++i) list.items[i].sent_origin = list.items[i].received_origin;
    return list;
  }
};

}  // namespace third_party

static_assert(stria::engine::ring_backend<stria::host::detail::ring_backend<stria::comm::host_threads>>);

using namespace stria;

namespace {

/// Runs forward then backward on every rank; per rank: the chunks seen, the checks made and the own dK/dV.
template <class Topology>
void check_schedule(const Topology& topology) {
  const index_t world = topology.world_size(), steps = topology.num_steps();
  std::vector<std::vector<index_t>> seen(static_cast<std::size_t>(world));
  std::vector<std::vector<float>> own(static_cast<std::size_t>(world));
  std::vector<int> checks(static_cast<std::size_t>(world));
  std::vector<char> receives_ok(static_cast<std::size_t>(world));
  comm::host_world(world, std::chrono::seconds(60)).run([&](comm::host_threads& c) {
    third_party::tracing_backend backend(c);
    backend.forward(topology, finite_check::every_step);
    const auto me = static_cast<std::size_t>(c.rank());
    own[me] = backend.backward(topology, finite_check::every_step);
    seen[me] = backend.seen;
    checks[me] = backend.checks;
    receives_ok[me] = backend.every_receive_completed_once();
  });
  for (index_t r = 0; r < world; ++r) {
    const auto me = static_cast<std::size_t>(r);
    REQUIRE(seen[me].size() == static_cast<std::size_t>(2 * steps));
    for (index_t s = 0; s < steps; ++s) {
      CHECK(seen[me][static_cast<std::size_t>(s)] == topology.kv_source_rank(r, s));
      CHECK(seen[me][static_cast<std::size_t>(steps + s)] == topology.kv_source_rank(r, s));
    }
    CHECK(checks[me] == 2 * steps);
    CHECK(receives_ok[me]);
    CHECK(own[me] == std::vector<float>(static_cast<std::size_t>(world), 1.0f));  // every rank's step, once
  }
}

}  // namespace

TEST_CASE("ring engine: each step computes with the chunk the topology names, and each rank ends with its own dK/dV from every rank") {
  for (index_t world = 1; world <= 5; ++world) {
    CAPTURE(world);
    check_schedule(topology::flat_ring(world));
  }
  for (const auto& [nodes, cards] : {std::pair{1, 3}, std::pair{2, 1}, std::pair{2, 2}, std::pair{2, 3}, std::pair{3, 2}}) {
    CAPTURE(nodes);
    CAPTURE(cards);
    check_schedule(topology::hierarchical_ring(nodes, cards));
  }
}

TEST_CASE("ring engine: a gradient schedule that breaks its promise is an error naming the rank") {
  auto backward = [](const auto& topology) {
    comm::host_world(topology.world_size(), std::chrono::seconds(60)).run([&](comm::host_threads& c) {
      third_party::tracing_backend backend(c);
      (void)backend.backward(topology, finite_check::off);
    });
  };
  // Either rank may fail first; the other then reports it.
  CHECK_THROWS_WITH_AS(backward(third_party::ring_without_gradient_moves(2)),
                       doctest::Contains("ended the backward ring without exactly its own dK/dV (inconsistent gradient schedule)"),
                       comm_error);
  CHECK_THROWS_WITH_AS(backward(third_party::ring_sending_a_stranger(2)),
                       "stria: rank 0 has no dK/dV partial of rank 1's chunk to send at step 0 (inconsistent gradient schedule)", comm_error);
}
