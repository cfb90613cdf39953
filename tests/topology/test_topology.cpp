// SPDX-License-Identifier: Apache-2.0
// Ring schedules, simulated: every rank meets every KV chunk once; transfers pair up and carry the
// chunk the receiver expects; no slot is overwritten while it is read; dK/dV partials end, complete,
// at their owners. For flat rings up to W = 64 and every N x C factoring of W <= 64.
#include <doctest/doctest.h>

#include <map>
#include <set>
#include <vector>

#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "stria/topology/solver.hpp"

using namespace stria;

namespace {

template <class Topology>
void check_meets_every_chunk_once(const Topology& t) {
  for (index_t r = 0; r < t.world_size(); ++r) {
    std::vector<int> met(static_cast<std::size_t>(t.world_size()), 0);
    for (index_t s = 0; s < t.num_steps(); ++s) ++met[static_cast<std::size_t>(t.kv_source_rank(r, s))];
    for (int m : met) REQUIRE(m == 1);
    REQUIRE(t.kv_source_rank(r, 0) == r);  // step 0 uses the rank's own KV: no wait before the first compute
  }
}

/// Each posted transfer has a partner: the receiver lists the same move from the same sender.
template <class Topology, class List>
void check_pairing(const Topology& t, List list_of) {
  for (index_t r = 0; r < t.world_size(); ++r)
    for (index_t s = 0; s < t.num_steps(); ++s)
      for (const ring_transfer& x : list_of(r, s)) {
        REQUIRE(x.send_to != r);  // no self-transfers
        bool found = false;
        for (const ring_transfer& y : list_of(x.send_to, s))
          if (y.channel == x.channel && y.receive_from == r && y.received_origin == x.sent_origin && y.ready_step == x.ready_step)
            found = true;
        INFO("rank ", r, " step ", s, " sends chunk ", x.sent_origin, " to ", x.send_to);
        REQUIRE(found);
      }
}

/// Simulates the KV slots: receives land by their ready step; each compute finds its chunk in place;
/// each send reads the chunk it claims; no slot is written while a send from it, a receive into it
/// or the step's compute is in flight (intervals [post, ready) per transfer, [s, s + 1) per compute).
template <class Topology>
void check_kv_slots(const Topology& t) {
  const index_t w = t.world_size(), steps = t.num_steps();
  std::vector<std::map<int, index_t>> slot(static_cast<std::size_t>(w));
  for (index_t r = 0; r < w; ++r) slot[static_cast<std::size_t>(r)][t.kv_buffer(r, 0)] = r;
  struct flight {
    ring_transfer x;
    index_t rank;
  };
  std::vector<flight> in_flight;
  for (index_t s = 0; s < steps; ++s) {
    for (auto it = in_flight.begin(); it != in_flight.end();) {
      if (it->x.ready_step == s) {
        slot[static_cast<std::size_t>(it->rank)][it->x.receive_buffer] = it->x.received_origin;
        it = in_flight.erase(it);
      } else ++it;
    }
    for (index_t r = 0; r < w; ++r) {
      INFO("rank ", r, " step ", s);
      REQUIRE(slot[static_cast<std::size_t>(r)].count(t.kv_buffer(r, s)));
      REQUIRE(slot[static_cast<std::size_t>(r)][t.kv_buffer(r, s)] == t.kv_source_rank(r, s));
      for (const ring_transfer& x : t.transfers(r, s)) {
        REQUIRE(x.post_step == s);
        REQUIRE(x.ready_step > s);
        REQUIRE(slot[static_cast<std::size_t>(r)][x.send_buffer] == x.sent_origin);
        REQUIRE(x.received_origin == t.kv_source_rank(r, x.ready_step));
        REQUIRE(x.receive_buffer == t.kv_buffer(r, x.ready_step));
        in_flight.push_back({x, r});
      }
    }
  }
  REQUIRE(in_flight.empty());
  // Slot conflicts, per rank: a receive's write interval against every read of the same slot.
  for (index_t r = 0; r < w; ++r) {
    struct use {
      int slot;
      index_t begin, end;
      bool write;
    };
    std::vector<use> uses;
    for (index_t s = 0; s < steps; ++s) {
      uses.push_back({t.kv_buffer(r, s), s, s + 1, false});
      for (const ring_transfer& x : t.transfers(r, s)) {
        uses.push_back({x.send_buffer, x.post_step, x.ready_step, false});
        uses.push_back({x.receive_buffer, x.post_step, x.ready_step, true});
      }
    }
    for (std::size_t a = 0; a < uses.size(); ++a)
      for (std::size_t b = 0; b < uses.size(); ++b)
        if (a != b && uses[a].write && uses[a].slot == uses[b].slot && uses[a].begin < uses[b].end && uses[b].begin < uses[a].end) {
          INFO("rank ", r, ": slot ", uses[a].slot, " written during [", uses[a].begin, ", ", uses[a].end, ") and used during [",
               uses[b].begin, ", ", uses[b].end, ")");
          REQUIRE(false);
        }
  }
}

/// Follows every contribution to every chunk's dK/dV: each rank contributes to the chunk it computed,
/// partials move in list order at each step end, a received partial is added when due. At the end
/// each rank must hold exactly its own chunk, with one contribution from every rank.
template <class Topology>
void check_gradients_reach_owner(const Topology& t) {
  const index_t w = t.world_size(), steps = t.num_steps();
  using contributions = std::multiset<index_t>;
  std::vector<std::map<index_t, contributions>> held(static_cast<std::size_t>(w));
  struct flight {
    ring_transfer x;
    index_t to;
    contributions payload;
  };
  std::vector<flight> in_flight;
  auto deliver = [&](index_t step, index_t rank) {
    for (auto it = in_flight.begin(); it != in_flight.end();) {
      if (it->to == rank && it->x.ready_step <= step) {
        REQUIRE(it->x.ready_step == step);  // never left waiting past its ready step
        auto& into = held[static_cast<std::size_t>(rank)][it->x.sent_origin];
        into.insert(it->payload.begin(), it->payload.end());
        it = in_flight.erase(it);
      } else ++it;
    }
  };
  for (index_t s = 0; s < steps; ++s) {
    for (index_t r = 0; r < w; ++r) held[static_cast<std::size_t>(r)][t.kv_source_rank(r, s)].insert(r);
    // Lockstep by list position: every rank posts its k-th transfer, then partials due at this step
    // end are added, before anyone posts a (k+1)-th (the hierarchical outer send needs the inner one in).
    for (int k = 0; k < transfer_list::capacity; ++k) {
      for (index_t r = 0; r < w; ++r) {
        deliver(s, r);  // partials due at this step end are in before this rank's next send
        const transfer_list list = t.gradient_transfers(r, s);
        if (k >= list.count) continue;
        const ring_transfer& x = list.items[k];
        REQUIRE(x.post_step == s);
        REQUIRE(x.ready_step >= s);
        auto& mine = held[static_cast<std::size_t>(r)];
        INFO("rank ", r, " step ", s, " sends the partial of chunk ", x.sent_origin);
        REQUIRE(mine.count(x.sent_origin));
        in_flight.push_back({x, x.send_to, mine[x.sent_origin]});
        mine.erase(x.sent_origin);
      }
    }
    for (index_t r = 0; r < w; ++r) deliver(s, r);
  }
  for (index_t r = 0; r < w; ++r) deliver(steps, r);
  REQUIRE(in_flight.empty());
  for (index_t r = 0; r < w; ++r) {
    const auto& mine = held[static_cast<std::size_t>(r)];
    INFO("rank ", r);
    REQUIRE(mine.size() == 1);
    REQUIRE(mine.begin()->first == r);
    contributions all;
    for (index_t c = 0; c < w; ++c) all.insert(c);
    REQUIRE(mine.begin()->second == all);
  }
}

template <class Topology>
void check_schedule(const Topology& t) {
  check_meets_every_chunk_once(t);
  check_pairing(t, [&](index_t r, index_t s) { return t.transfers(r, s); });
  check_pairing(t, [&](index_t r, index_t s) { return t.gradient_transfers(r, s); });
  check_kv_slots(t);
  check_gradients_reach_owner(t);
}

}  // namespace

TEST_CASE("flat ring schedules are complete and conflict free for W = 1..64") {
  for (index_t w = 1; w <= 64; ++w) {
    CAPTURE(w);
    check_schedule(topology::flat_ring(w));
  }
  const topology::flat_ring ring(5);
  CHECK(ring.kv_source_rank(1, 3) == 3);  // (1 - 3) mod 5
}

TEST_CASE("hierarchical ring schedules are complete and conflict free for every N x C with W <= 64") {
  for (index_t w = 1; w <= 64; ++w)
    for (index_t nodes = 1; nodes <= w; ++nodes) {
      if (w % nodes != 0) continue;
      CAPTURE(nodes);
      CAPTURE(w / nodes);
      check_schedule(topology::hierarchical_ring(nodes, w / nodes));
    }
}

TEST_CASE("the hierarchical ring follows DESIGN 5: node n - o, card c - i, the outer buffer is only read by the inner ring") {
  const topology::hierarchical_ring ring(2, 4);
  for (index_t r = 0; r < 8; ++r)
    for (index_t s = 0; s < 8; ++s) {
      const index_t o = s / 4, i = s % 4, n = r / 4, c = r % 4;
      CHECK(ring.kv_source_rank(r, s) == ((n - o + 2) % 2) * 4 + (c - i + 4) % 4);
      for (const ring_transfer& x : ring.transfers(r, s)) {
        if (x.channel == ring_channel::inner) CHECK(x.receive_buffer < topology::hierarchical_ring::outer_slot);
        else CHECK(x.receive_buffer >= topology::hierarchical_ring::outer_slot);
      }
    }
  // The outer send is posted at the first inner step and has a whole inner round to complete.
  const transfer_list first = ring.transfers(0, 0);
  REQUIRE(first.count == 2);
  CHECK(first.items[0].channel == ring_channel::outer);
  CHECK(first.items[0].ready_step == 4);
}

TEST_CASE("topologies reject world sizes that do not match") {
  CHECK_THROWS_WITH_AS(topology::hierarchical_ring(2, 4).check_world(6),
                       "stria: world_size = 6: does not match hierarchical_ring(2 nodes x 4 cards) = 8 ranks", stria::invalid_argument);
  CHECK_THROWS_WITH_AS(topology::flat_ring(4).check_world(3), doctest::Contains("does not match flat_ring(4)"), stria::invalid_argument);
  CHECK_THROWS_AS(topology::hierarchical_ring(0, 4), stria::invalid_argument);
  CHECK_THROWS_AS(topology::flat_ring(0), stria::invalid_argument);
  // Past the index widths (issue 20, defect 4): 65536 x 65537 ranks wrapped to 65536 in 32 bits.
  CHECK_THROWS_WITH_AS(topology::hierarchical_ring(65536, 65537), "stria: nodes x cards_per_node = 4295032832: must be at most 65536 ranks",
                       stria::invalid_argument);
  CHECK_THROWS_WITH_AS(topology::flat_ring(max_world_size + 1), "stria: world_size = 65537: must be at most 65536 ranks", stria::invalid_argument);
  CHECK_NOTHROW(topology::hierarchical_ring(256, 256));
}

TEST_CASE("topology::solver refuses bad sizes, naming the argument and the rule") {
  CHECK_THROWS_WITH_AS(topology::solver(0), doctest::Contains("world_size = 0: must be at least 1"), invalid_argument);
  CHECK_THROWS_WITH_AS(topology::solver(4, 0), doctest::Contains("chunks_per_rank = 0: must be at least 1"), invalid_argument);
  CHECK_THROWS_WITH_AS(topology::solver(4, 2, {0.9}), doctest::Contains("options.mu = 0.9: must be >= 1"), invalid_argument);
  CHECK_THROWS_WITH_AS(topology::solver(4, 2, {1.1, -1.0}), doctest::Contains("options.volume_cap = -1: must be positive and finite"), invalid_argument);
  // Past the index widths: 65536 x 1024 chunks of 64 tokens wrapped to 0 in check_seq_len's index_t
  // product, which then divided by zero (SIGFPE).
  CHECK_THROWS_WITH_AS(topology::solver(65536, 1024),
                       "stria: world_size x chunks_per_rank x 64 = 4294967296: must be at most 2147483647 (the shortest seq_len, one block per "
                       "chunk, is an index_t)",
                       invalid_argument);
  CHECK_THROWS_WITH_AS(topology::solver(max_world_size + 1), "stria: world_size = 65537: must be at most 65536 ranks", invalid_argument);
  CHECK_NOTHROW(topology::solver(max_world_size, 511).check_seq_len(max_world_size * 511 * 64));
  const topology::solver t(4, 2);
  CHECK(t.world_size() == 4);
  CHECK(t.chunks_per_rank() == 2);
  CHECK_NOTHROW(t.check_seq_len(4 * 2 * 64 * 3));
  CHECK_THROWS_WITH_AS(t.check_seq_len(4 * 2 * 64 * 3 + 64), doctest::Contains("seq_len = 1600: must be divisible by world_size x chunks_per_rank x 64 = 512"),
                       invalid_argument);
  static_assert(topology::is_dynamic_solver<topology::solver>);
  static_assert(!topology::is_dynamic_solver<topology::flat_ring>);
}
