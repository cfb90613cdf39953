// SPDX-License-Identifier: Apache-2.0
// The ring engine, written once for the host and the device backend (DESIGN 5 and 10): when KV
// chunks and dK/dV partials move, which chunk each step computes with, and where the partials add up.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/topology/ring_steps.hpp"

namespace stria::engine {

/// Requirements of a ring backend B, one rank's transport (built-ins: host::detail::ring_backend,
/// device::detail::ring_backend). Buffers a transfer may still use belong to it, never to the engine:
/// a failed step may leave transfers in flight.
/// - `b.rank()`; `b.load_own_kv(slot)`: this rank's KV chunk into one of the four slots;
/// - `b.post_kv(step, list)`: posts `step`'s KV transfers (`list` may be empty) once `b.complete_kv(t)`
///   has put each chunk due at `step` in place, in post order; `b.finish_transfers()`: none left in flight;
/// - `B::partial`, one chunk's fp32 dK/dV: `b.add_partial(sum, x)`: sum += x; `b.send_partial(t, sum)`
///   posts its send and the receive of `t`; `b.receive_partial(t, n)`: what the n-th posted receive brought.
template <class B>
concept ring_backend = requires(B& b, const B& cb, int slot, index_t step, const transfer_list& list, const ring_transfer& t,
                                typename B::partial& sum, typename B::partial x, std::size_t n) {
  { cb.rank() } -> std::convertible_to<index_t>;
  b.load_own_kv(slot);
  b.post_kv(step, list);
  b.complete_kv(t);
  b.finish_transfers();
  b.add_partial(sum, std::move(x));
  b.send_partial(t, std::move(sum));
  { b.receive_partial(t, n) } -> std::same_as<typename B::partial>;
};

/// ring_backend<B> as one static_assert per requirement, each naming the missing member.
template <class B>
constexpr bool check_ring_backend() {
  static_assert(requires(const B& b) { { b.rank() } -> std::convertible_to<index_t>; }, "stria: Backend must have index_t rank() const");
  static_assert(requires(B& b) { b.load_own_kv(0); }, "stria: Backend must have load_own_kv(int slot)");
  static_assert(requires(B& b, const transfer_list& l) { b.post_kv(0, l); },
                "stria: Backend must have post_kv(stria::index_t step, const stria::transfer_list&)");
  static_assert(requires(B& b, const ring_transfer& t) { b.complete_kv(t); }, "stria: Backend must have complete_kv(const stria::ring_transfer&)");
  static_assert(requires(B& b) { b.finish_transfers(); }, "stria: Backend must have finish_transfers()");
  static_assert(requires { typename B::partial; }, "stria: Backend must have a member type partial (one chunk's fp32 dK/dV)");
  static_assert(requires(B& b, typename B::partial p) { b.add_partial(p, std::move(p)); },
                "stria: Backend must have add_partial(partial& sum, partial x)");
  static_assert(requires(B& b, const ring_transfer& t, typename B::partial p) { b.send_partial(t, std::move(p)); },
                "stria: Backend must have send_partial(const stria::ring_transfer&, partial sum)");
  static_assert(requires(B& b, const ring_transfer& t) { { b.receive_partial(t, std::size_t{}) } -> std::same_as<typename B::partial>; },
                "stria: Backend must have receive_partial(const stria::ring_transfer&, std::size_t n) returning partial");
  return true;
}

/// The checks every ring call makes first, on either backend: the communicator's world and this
/// rank's indices fit the schedule, and q, k have a shape the kernels accept (returned).
template <ring_topology Topology, class Index, class T>
attention_shape check_ring_call(const Topology& topology, index_t world_size, index_t rank, std::span<const Index> indices,
                                tensor_view<const T, 3> q, tensor_view<const T, 3> k) {
  check_ring_world(world_size, topology);
  check_ring_indices(topology, rank, indices);
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  return shape;
}

namespace detail {

/// Transfers with their place in post order; `complete(transfer, place)` those due by `step`, in post order.
using posted_transfers = std::vector<std::pair<ring_transfer, std::size_t>>;
template <class Complete>
void complete_due(posted_transfers& posted, index_t step, Complete&& complete) {
  const auto due = std::stable_partition(posted.begin(), posted.end(), [&](const auto& p) { return p.first.ready_step > step; });
  for (auto it = due; it != posted.end(); ++it) complete(it->first, it->second);
  posted.erase(due, posted.end());
}

/// The topology's steps on `b`: a received chunk is completed at the start of its ready step,
/// before that step's sends (which may forward it); then `compute(s, slot)` computes with the chunk
/// in `slot`, the one the topology names.
template <class Backend, ring_topology Topology, class Compute>
void run_steps(Backend& b, const Topology& topology, Compute&& compute) {
  const index_t rank = b.rank();
  posted_transfers posted;
  const auto complete = [&](const ring_transfer& t, std::size_t) { b.complete_kv(t); };
  b.load_own_kv(topology.kv_buffer(rank, 0));
  for (index_t s = 0; s < topology.num_steps(); ++s) {
    complete_due(posted, s, complete);
    const transfer_list list = topology.transfers(rank, s);
    for (const ring_transfer& t : list) posted.emplace_back(t, 0);  // complete_kv needs no place
    b.post_kv(s, list);
    compute(s, topology.kv_buffer(rank, s));
  }
  complete_due(posted, topology.num_steps(), complete);
  b.finish_transfers();
}

inline std::string ring_phase(index_t step) { return "ring step " + std::to_string(step); }

}  // namespace detail

/// One rank's ring forward: `compute(s, slot)` merges step s's attention with the chunk in `slot` into
/// the running O and LSE; with finite_check::every_step, `check_step(s, phase)` then checks them.
template <class Backend, ring_topology Topology, class Compute, class CheckStep>
void ring_forward(Backend& b, const Topology& topology, finite_check check, Compute&& compute, CheckStep&& check_step) {
  static_assert(check_ring_backend<Backend>());
  detail::run_steps(b, topology, [&](index_t s, int slot) {
    compute(s, slot);
    if (check == finite_check::every_step) check_step(s, detail::ring_phase(s));
  });
}

/// One rank's ring backward: `compute(s, slot)` adds step s's dQ in and returns the dK/dV of the chunk
/// in `slot`, which is added into the fp32 partial sum of that chunk's owner. The sums travel as
/// gradient_transfers says, in list order, each send after every partial due at that step's end is
/// added in. Returns this rank's complete dK/dV. With finite_check::every_step, `check_step(s,
/// phase, owner, sum)` checks dQ and the step's chunk's sum before that sum travels on.
template <class Backend, ring_topology Topology, class Compute, class CheckStep>
typename Backend::partial ring_backward(Backend& b, const Topology& topology, finite_check check, Compute&& compute, CheckStep&& check_step) {
  static_assert(check_ring_backend<Backend>());
  using partial = typename Backend::partial;
  const index_t rank = b.rank(), steps = topology.num_steps();
  std::map<index_t, partial> sums;  // keyed by the chunk's owner
  detail::posted_transfers posted;
  auto add_to_sum = [&](index_t owner, partial x) {
    if (auto it = sums.find(owner); it != sums.end()) b.add_partial(it->second, std::move(x));
    else sums.emplace(owner, std::move(x));
  };
  auto finish_receives = [&](index_t step) {  // the partials due by the end of `step`
    detail::complete_due(posted, step, [&](const ring_transfer& t, std::size_t n) { add_to_sum(t.received_origin, b.receive_partial(t, n)); });
  };
  std::size_t sent = 0;
  detail::run_steps(b, topology, [&](index_t s, int slot) {
    const index_t source = topology.kv_source_rank(rank, s);
    add_to_sum(source, compute(s, slot));
    if (check == finite_check::every_step) check_step(s, detail::ring_phase(s), source, std::as_const(sums.at(source)));
    for (const ring_transfer& t : topology.gradient_transfers(rank, s)) {
      finish_receives(s);
      auto it = sums.find(t.sent_origin);
      if (it == sums.end())
        throw gradient_schedule_error(rank, "has no dK/dV partial of rank " + std::to_string(t.sent_origin) + "'s chunk to send at step " +
                                                std::to_string(s));
      b.send_partial(t, std::move(it->second));
      sums.erase(it);
      posted.emplace_back(t, sent++);
    }
    finish_receives(s);
  });
  finish_receives(steps);
  if (sums.size() != 1 || sums.begin()->first != rank)
    throw gradient_schedule_error(rank, "ended the backward ring without exactly its own dK/dV");
  return std::move(sums.begin()->second);
}

}  // namespace stria::engine
