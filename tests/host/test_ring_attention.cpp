// SPDX-License-Identifier: Apache-2.0
// Host ring attention equals single-rank attention on the same global selection, forward and
// backward, for every sharding x topology (stripes placed per selection too), world sizes 1-8, GQA 1/2/8, D 64/128, causal and full;
// its fp32 error does not grow with the world size; mismatched indices are rejected.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/host/ring_attention.hpp"
#include "stria/index/local_index.hpp"
#include "stria/index/stripe_balance.hpp"
#include "stria/sharding/dispatch.hpp"
#include "stria/sharding/sequential.hpp"
#include "stria/sharding/striped.hpp"
#include "stria/sharding/zigzag.hpp"
#include "stria/topology/flat_ring.hpp"
#include "stria/topology/hierarchical_ring.hpp"
#include "support/oracle.hpp"
#include "support/selection.hpp"
#include "support/whole_reference.hpp"

using namespace stria;
using test::view2;
using test::view3;

namespace {

/// Runs the ring on `world` threads and compares with single-rank attention in double on the same selection.
template <class Sharding, class Topology>
test::attention_errors compare_ring(test::seeded_rng& rng, const Sharding& sharding, const Topology& topology, const global_selection& selection,
                                    index_t heads_kv, index_t dim) {
  const test::whole_problem p(rng, selection, heads_kv, dim);
  const index_t world = topology.world_size(), seq = p.seq, heads_q = p.hq;
  const std::array<index_t, 3> q_ext{seq, heads_q, dim}, kv_ext{seq, heads_kv, dim};
  const std::array<index_t, 2> lse_ext{heads_q, seq};
  const auto q_s = stria::sharding::split(sharding, std::span<const float>(p.q), q_ext, world), k_s = stria::sharding::split(sharding, std::span<const float>(p.k), kv_ext, world),
             v_s = stria::sharding::split(sharding, std::span<const float>(p.v), kv_ext, world);
  const auto d_out_s = stria::sharding::split(sharding, std::span<const float>(p.d_out), q_ext, world);
  std::vector<std::vector<float>> out_s(q_s), lse_s(static_cast<std::size_t>(world), std::vector<float>(p.lse.size() / static_cast<std::size_t>(world)));
  std::vector<std::vector<float>> dq_s(q_s), dk_s(k_s), dv_s(k_s);
  const index_t sq = seq / world;
  comm::host_world host(world, std::chrono::seconds(120));
  host.run([&](comm::host_threads& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const std::vector<step_index> indices = build_ring_indices(selection, sharding, topology, c.rank());
    const auto q = view3(q_s[r], sq, heads_q, dim), k = view3(k_s[r], sq, heads_kv, dim), v = view3(v_s[r], sq, heads_kv, dim);
    host::ring_forward(c, topology, std::span<const step_index>(indices),
                       forward_tensors<float>{q, k, v, view3(out_s[r], sq, heads_q, dim), view2(lse_s[r], heads_q, sq)}, p.scale);
    host::ring_backward(c, topology, std::span<const step_index>(indices),
                        backward_tensors<float>{q, k, v, view3(std::as_const(out_s[r]), sq, heads_q, dim), view3(d_out_s[r], sq, heads_q, dim),
                                                view2(std::as_const(lse_s[r]), heads_q, sq), view3(dq_s[r], sq, heads_q, dim),
                                                view3(dk_s[r], sq, heads_kv, dim), view3(dv_s[r], sq, heads_kv, dim)},
                        p.scale);
  });
  using stria::sharding::join;
  return test::errors_against(p, join(sharding, out_s, q_ext), join(sharding, lse_s, lse_ext, 1), join(sharding, dq_s, q_ext),
                              join(sharding, dk_s, kv_ext), join(sharding, dv_s, kv_ext));
}

template <class Sharding>
void check_all_topologies(test::seeded_rng& rng, const Sharding& sharding) {
  struct ring_case {
    index_t nodes, cards;  // nodes == 0: flat ring of `cards` ranks
  };
  const ring_case cases[] = {{0, 1}, {0, 2}, {0, 3}, {0, 4}, {0, 6}, {0, 8}, {2, 2}, {2, 3}, {2, 4}, {4, 2}};
  int variant = 0;
  for (const ring_case& rc : cases) {
    if (!test::in_sweep(variant, 3)) {
      ++variant;
      continue;
    }
    const index_t world = rc.nodes == 0 ? rc.cards : rc.nodes * rc.cards;
    // Cycle GQA ratio, head dim and causality over the cases, so each appears with several rings.
    const index_t group = std::array<index_t, 3>{1, 2, 8}[static_cast<std::size_t>(variant % 3)];
    const index_t dim = variant % 2 ? 128 : 64;
    const bool causal = variant % 4 != 1;
    ++variant;
    const index_t seq = 2 * world * 64;  // the smallest length every sharding accepts
    const global_selection selection = test::random_selection(rng, seq, 8, causal, 0.35, 0.03);
    CAPTURE(Sharding::name);
    CAPTURE(world);
    CAPTURE(rc.nodes);
    CAPTURE(group);
    CAPTURE(dim);
    CAPTURE(causal);
    const test::attention_errors e = rc.nodes == 0 ? compare_ring(rng, sharding, topology::flat_ring(world), selection, 8 / group, dim)
                                        : compare_ring(rng, sharding, topology::hierarchical_ring(rc.nodes, rc.cards), selection, 8 / group, dim);
    test::check_errors(e, 1e-5);
  }
}

}  // namespace

TEST_CASE("host ring attention equals single-rank attention: sequential sharding, all rings") {
  STRIA_SEEDED_RNG(rng);
  check_all_topologies(rng, sharding::sequential{});
}

TEST_CASE("host ring attention equals single-rank attention: zigzag sharding, all rings") {
  STRIA_SEEDED_RNG(rng);
  check_all_topologies(rng, sharding::zigzag{});
}

TEST_CASE("host ring attention equals single-rank attention: striped sharding, all rings") {
  STRIA_SEEDED_RNG(rng);
  check_all_topologies(rng, sharding::striped<64>{});
  // A wider stripe too.
  const global_selection selection = test::random_selection(rng, 1024, 4, true);
  CHECK(compare_ring(rng, sharding::striped<128>{}, topology::hierarchical_ring(2, 2), selection, 2, 64).max() < 1e-5);
}

TEST_CASE("host ring attention equals single-rank attention: stripes placed by balance_stripes") {
  // The placement depends on the selection and the world size: one per case, flat and hierarchical.
  STRIA_SEEDED_RNG(rng);
  struct ring_case {
    index_t nodes, cards;  // nodes == 0: flat ring of `cards` ranks
    bool causal;
  };
  const ring_case cases[] = {{0, 1, true}, {0, 3, true}, {0, 4, false}, {0, 8, true}, {2, 2, true}, {2, 3, false}, {4, 2, true}};
  int variant = 0;
  for (const ring_case& rc : cases) {
    if (!test::in_sweep(variant++, 2)) continue;
    const index_t world = rc.nodes == 0 ? rc.cards : rc.nodes * rc.cards;
    const index_t dim = variant % 2 ? 128 : 64, heads_kv = variant % 3 ? 2 : 8;
    const global_selection selection = test::random_selection(rng, 2 * world * 64, 8, rc.causal, 0.35, 0.03);
    const sharding::placed_stripes placed = balance_stripes(selection, world);
    CAPTURE(world);
    CAPTURE(rc.nodes);
    CAPTURE(rc.causal);
    CAPTURE(dim);
    const test::attention_errors e = rc.nodes == 0 ? compare_ring(rng, placed, topology::flat_ring(world), selection, heads_kv, dim)
                                                   : compare_ring(rng, placed, topology::hierarchical_ring(rc.nodes, rc.cards), selection, heads_kv, dim);
    test::check_errors(e, 1e-5);
  }
}

TEST_CASE("every GQA ratio, head dim and mode on one ring") {
  STRIA_SEEDED_RNG(rng);
  int variant = 0;
  for (const index_t group : {1, 2, 8})
    for (const index_t dim : {64, 128})
      for (const bool causal : {true, false}) {
        if (!test::in_sweep(variant++, 4)) continue;
        CAPTURE(group);
        CAPTURE(dim);
        CAPTURE(causal);
        const global_selection selection = test::random_selection(rng, 768, 8, causal, 0.3, 0.03);
        CHECK(compare_ring(rng, sharding::striped<64>{}, topology::hierarchical_ring(3, 1), selection, 8 / group, dim).max() < 1e-5);
      }
}

TEST_CASE("the fp32 ring error does not grow with the world size") {
  STRIA_SEEDED_RNG(rng);
  const global_selection selection = test::random_selection(rng, 1536, 4, true, 0.4, 0.03);
  std::vector<double> errors;
  for (const index_t world : {1, 2, 3, 4, 6, 8}) {
    if (!test::full_sweep && world != 1 && world != 8) continue;
    const test::seeded_rng replay{rng.seed, std::mt19937_64(rng.seed)};  // the same inputs for every world size
    test::seeded_rng inputs = replay;
    errors.push_back(compare_ring(inputs, sharding::striped<64>{}, topology::flat_ring(world), selection, 2, 64).max());
    CAPTURE(world);
    CAPTURE(errors.back());
    CHECK(errors.back() < 1e-5);
  }
  // fp32 running state: eight merges cost at most a small factor over one rank's fp32 error.
  CHECK(*std::max_element(errors.begin(), errors.end()) < 3.0 * errors.front() + 1e-7);
}

TEST_CASE("indices built for another configuration are rejected") {
  STRIA_SEEDED_RNG(rng);
  const global_selection selection = test::random_selection(rng, 512, 2, true);
  const topology::flat_ring ring(4);
  comm::host_world host(4, std::chrono::seconds(30));
  std::vector<float> q(128 * 2 * 64), k(128 * 1 * 64), out(q.size()), lse(2 * 128);
  CHECK_THROWS_WITH_AS(host.run([&](comm::host_threads& c) {
                         // Indices of rank 0 used on every rank.
                         const std::vector<step_index> indices = build_ring_indices(selection, sharding::striped<64>{}, ring, 0);
                         host::ring_forward(c, ring, std::span<const step_index>(indices),
                                            forward_tensors<float>{view3(std::as_const(q), 128, 2, 64), view3(std::as_const(k), 128, 1, 64),
                                                                   view3(std::as_const(k), 128, 1, 64), view3(out, 128, 2, 64), view2(lse, 2, 128)},
                                            0.125);
                       }),
                       doctest::Contains("the index was built for another configuration"), stria::invalid_argument);
  comm::host_world three(3, std::chrono::seconds(30));
  CHECK_THROWS_WITH_AS(three.run([&](comm::host_threads& c) {
                         const std::vector<step_index> indices;
                         host::ring_forward(c, ring, std::span<const step_index>(indices),
                                            forward_tensors<float>{view3(std::as_const(q), 128, 2, 64), view3(std::as_const(k), 128, 1, 64),
                                                                   view3(std::as_const(k), 128, 1, 64), view3(out, 128, 2, 64), view2(lse, 2, 128)},
                                            0.125);
                       }),
                       doctest::Contains("comm.world_size() = 3: must equal the topology's world size 4"), stria::invalid_argument);
}

TEST_CASE("the host ring refuses a step index that breaks its invariants") {
  // step_index is a plain struct: the ring read a corrupted one as it stood. block_col 1000 read past
  // kv_global_block (ASan heap-buffer-overflow in row_keys), col_token 100000 read past the KV
  // shard (SEGV in reference_forward), a short block_ptr read past its end.
  STRIA_SEEDED_RNG(rng);
  global_selection selection = test::random_selection(rng, 512, 2, true, 0.4, 0.03);
  // Every rank's second step must hold a block entry (the first corruption writes block_col[0]):
  // the diagonal just below the main one pairs each striped block with the other rank's block
  // before it. A seed whose selection lacked it failed with std::out_of_range (CI, 2026-12-07).
  for (head_selection& head : selection.heads)
    if (!std::ranges::binary_search(head.slash_deltas, 1)) head.slash_deltas.insert(std::ranges::upper_bound(head.slash_deltas, 1), 1);
  const topology::flat_ring ring(2);
  std::vector<float> q(256 * 2 * 64, 0.5f), k(256 * 1 * 64, 0.25f), out(q.size()), lse(2 * 256), dq(q.size()), dk(k.size()), dv(k.size());
  auto refused = [&](auto corrupt, const char* text) {
    CAPTURE(text);
    for (const bool backward : {false, true}) {
      comm::host_world host(2, std::chrono::seconds(30));
      CHECK_THROWS_WITH_AS(host.run([&](comm::host_threads& c) {
                             std::vector<step_index> indices = build_ring_indices(selection, sharding::striped<64>{}, ring, c.rank());
                             corrupt(indices[1]);
                             const auto q3 = view3(std::as_const(q), 256, 2, 64), k3 = view3(std::as_const(k), 256, 1, 64);
                             if (!backward)
                               host::ring_forward(c, ring, std::span<const step_index>(indices),
                                                  forward_tensors<float>{q3, k3, k3, view3(out, 256, 2, 64), view2(lse, 2, 256)}, 0.125);
                             else
                               host::ring_backward(c, ring, std::span<const step_index>(indices),
                                                   backward_tensors<float>{q3, k3, k3, q3, q3, view2(std::as_const(lse), 2, 256), view3(dq, 256, 2, 64),
                                                                           view3(dk, 256, 1, 64), view3(dv, 256, 1, 64)},
                                                   0.125);
                           }),
                           doctest::Contains(text), stria::invalid_argument);
    }
  };
  refused([](step_index& x) { x.block_col.at(0) = 1000; }, "block_col[0] = 1000: out of range [0, 4)");
  refused([](step_index& x) { x.block_ptr.resize(1); }, "block_ptr.size() = 1: must be 9");
  refused(
      [](step_index& x) {
        x.col_token.push_back(100000);
        x.col_ptr.back() += 1;
      },
      "= 100000: out of range [0, 256)");
}
