// SPDX-License-Identifier: Apache-2.0
// Host ring attention: one rank's part of the distributed forward and backward, run on a
// communicator with the host_threads surface. Each step computes the reference kernel on that step's
// local index; the running O/LSE are fp32; in backward the fp32 dK/dV partials travel as the
// topology's gradient_transfers say and end at their owners. The oracle for the device ring. In
// checked mode (finite_check::every_step) each step's merged O and LSE (backward: dQ and the
// travelling dK/dV) are verified finite, and the first NaN or infinity raises non_finite_error.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/finite_check.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/host/reference_attention.hpp"
#include "stria/index/step_index.hpp"
#include "stria/topology/ring_steps.hpp"

namespace stria::host {

namespace detail {

/// K and V of one chunk packed in one buffer, so a KV transfer is one message.
struct kv_chunk {
  std::vector<float> data;  // [2, S_local, Hkv, D]: K then V
  std::size_t half = 0;

  tensor_view<const float, 3> k(index_t tokens, index_t heads, index_t dim) const { return {data.data(), {tokens, heads, dim}}; }
  tensor_view<const float, 3> v(index_t tokens, index_t heads, index_t dim) const { return {data.data() + half, {tokens, heads, dim}}; }
};

template <class T>
std::vector<float> pack_kv(tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
  const index_t tokens = k.extent(0), heads = k.extent(1), dim = k.extent(2);
  std::vector<float> packed(2 * static_cast<std::size_t>(k.size()));
  std::size_t i = 0;
  for (const auto* x : {&k, &v})
    for (index_t t = 0; t < tokens; ++t)
      for (index_t h = 0; h < heads; ++h)
        for (index_t d = 0; d < dim; ++d) packed[i++] = float((*x)(t, h, d));
  return packed;
}

/// Moves KV chunks between the four slots as the topology says: receives complete before the step
/// that needs them; sends are posted at the start of each step.
template <class Comm, ring_topology Topology>
class kv_mover {
 public:
  kv_mover(Comm& comm, const Topology& topology, std::vector<float> own) : comm_(comm), topology_(topology) {
    for (auto& slot : slots_) slot.half = own.size() / 2;
    slots_[static_cast<std::size_t>(topology.kv_buffer(comm.rank(), 0))].data = std::move(own);
  }

  /// Completes the receives this step needs, posts this step's sends and receives, returns the chunk to compute with.
  const kv_chunk& begin_step(index_t step) {
    finish_receives(step);
    const index_t rank = comm_.rank();
    for (const ring_transfer& t : topology_.transfers(rank, step)) {
      const kv_chunk& chunk = slots_[static_cast<std::size_t>(t.send_buffer)];
      comm_.send(chunk.data.data(), chunk.data.size(), t.send_to, ring_message_tag(t, false));
      pending_.push_back(t);
    }
    return slots_[static_cast<std::size_t>(topology_.kv_buffer(rank, step))];
  }

  void finish() { finish_receives(topology_.num_steps()); }

 private:
  void finish_receives(index_t step) {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->ready_step > step) {
        ++it;
        continue;
      }
      kv_chunk& slot = slots_[static_cast<std::size_t>(it->receive_buffer)];
      slot.data.resize(2 * slot.half);
      comm_.recv(slot.data.data(), slot.data.size(), it->receive_from, ring_message_tag(*it, false));
      it = pending_.erase(it);
    }
  }

  Comm& comm_;
  const Topology& topology_;
  kv_chunk slots_[4];
  std::vector<ring_transfer> pending_;
};

}  // namespace detail

/// This rank's ring forward. q [Sq, Hq, D], k, v [Sk, Hkv, D] are the local shards; indices[s] is
/// this rank's index for step s (see build_ring_indices). Writes out [Sq, Hq, D] and the fp32 lse
/// [Hq, Sq] of the whole sequence's attention for the local queries. With finite_check::every_step
/// the running O and LSE are checked after every step's merge.
template <class Comm, ring_topology Topology, class T>
void ring_forward(Comm& comm, const Topology& topology, tensor_view<const T, 3> q, tensor_view<const T, 3> k,
                  tensor_view<const T, 3> v, std::span<const step_index> indices, double softmax_scale,
                  tensor_view<T, 3> out, tensor_view<float, 2> lse, finite_check check = finite_check::off) {
  static_assert(check_host_communicator<Comm>());
  check_ring_world(comm.world_size(), topology);
  check_ring_indices(topology, comm.rank(), indices);
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  check_extents(out, {shape.query_tokens, shape.heads_q, shape.head_dim}, "out");
  check_extents(lse, {shape.heads_q, shape.query_tokens}, "lse");

  const auto q_elems = static_cast<std::size_t>(q.size());
  std::vector<float> running_out(q_elems, 0.0f), part_out(q_elems);
  std::vector<float> running_lse(static_cast<std::size_t>(shape.heads_q) * shape.query_tokens, -std::numeric_limits<float>::infinity());
  std::vector<float> part_lse(running_lse.size());
  const tensor_view<float, 3> running_out_view(running_out.data(), {shape.query_tokens, shape.heads_q, shape.head_dim});
  const tensor_view<float, 3> part_out_view(part_out.data(), {shape.query_tokens, shape.heads_q, shape.head_dim});
  const tensor_view<float, 2> running_lse_view(running_lse.data(), {shape.heads_q, shape.query_tokens});
  const tensor_view<float, 2> part_lse_view(part_lse.data(), {shape.heads_q, shape.query_tokens});

  std::vector<float> q32(q_elems);
  for (index_t t = 0, i = 0; t < shape.query_tokens; ++t)
    for (index_t h = 0; h < shape.heads_q; ++h)
      for (index_t d = 0; d < shape.head_dim; ++d) q32[static_cast<std::size_t>(i++)] = float(q(t, h, d));
  const tensor_view<const float, 3> q_view(q32.data(), {shape.query_tokens, shape.heads_q, shape.head_dim});

  detail::kv_mover mover(comm, topology, detail::pack_kv(k, v));
  for (index_t s = 0; s < topology.num_steps(); ++s) {
    const detail::kv_chunk& chunk = mover.begin_step(s);
    reference_forward<float>(q_view, chunk.k(shape.kv_tokens, shape.heads_kv, shape.head_dim),
                             chunk.v(shape.kv_tokens, shape.heads_kv, shape.head_dim),
                             indices[static_cast<std::size_t>(s)].view(), softmax_scale, part_out_view, part_lse_view);
    merge_partial<float>(running_out_view, running_lse_view, part_out_view, part_lse_view);
    if (check == finite_check::every_step) {
      const std::string phase = "ring step " + std::to_string(s);
      check_finite(std::span<const float>(running_out), checked_tensor::queries("O", shape.query_tokens, shape.heads_q, shape.head_dim),
                   comm.rank(), s, phase);
      check_finite(std::span<const float>(running_lse), checked_tensor::lse(shape.heads_q, shape.query_tokens), comm.rank(), s, phase);
    }
  }
  mover.finish();
  for (index_t t = 0; t < shape.query_tokens; ++t)
    for (index_t h = 0; h < shape.heads_q; ++h) {
      for (index_t d = 0; d < shape.head_dim; ++d) out(t, h, d) = T(running_out_view(t, h, d));
      lse(h, t) = running_lse_view(h, t);
    }
}

/// This rank's ring backward. out and lse are the forward results, d_out the incoming gradient
/// (all local shards). Writes dq [Sq, Hq, D] and the complete dk, dv [Sk, Hkv, D] of this rank's
/// own KV chunk, summed in fp32 over all ranks as they travel the ring. With
/// finite_check::every_step, dQ and the step's chunk's dK/dV sum are checked after every step,
/// before that sum travels on.
template <class Comm, ring_topology Topology, class T>
void ring_backward(Comm& comm, const Topology& topology, tensor_view<const T, 3> q, tensor_view<const T, 3> k,
                   tensor_view<const T, 3> v, tensor_view<const T, 3> out, tensor_view<const T, 3> d_out,
                   tensor_view<const float, 2> lse, std::span<const step_index> indices, double softmax_scale,
                   tensor_view<T, 3> dq, tensor_view<T, 3> dk, tensor_view<T, 3> dv, finite_check check = finite_check::off) {
  static_assert(check_host_communicator<Comm>());
  check_ring_world(comm.world_size(), topology);
  const index_t rank = comm.rank();
  check_ring_indices(topology, rank, indices);
  const attention_shape shape{q.extent(0), k.extent(0), q.extent(1), k.extent(1), q.extent(2)};
  shape.validate();
  detail::check_backward_tensors(shape, out, d_out, lse, dq, dk, dv);

  auto to_float = [](tensor_view<const T, 3> x) {
    std::vector<float> y(static_cast<std::size_t>(x.size()));
    for (index_t t = 0, i = 0; t < x.extent(0); ++t)
      for (index_t h = 0; h < x.extent(1); ++h)
        for (index_t d = 0; d < x.extent(2); ++d) y[static_cast<std::size_t>(i++)] = float(x(t, h, d));
    return y;
  };
  const std::vector<float> q32 = to_float(q), out32 = to_float(out), d_out32 = to_float(d_out);
  const std::array<index_t, 3> q_extents{shape.query_tokens, shape.heads_q, shape.head_dim};
  const std::array<index_t, 3> kv_extents{shape.kv_tokens, shape.heads_kv, shape.head_dim};
  const auto kv_elems = static_cast<std::size_t>(k.size());
  std::vector<float> dq32(q32.size(), 0.0f), working(2 * kv_elems);

  // The travelling partial sums, keyed by the chunk's owner: [2, Sk, Hkv, D], dK then dV.
  std::map<index_t, std::vector<float>> partial;
  std::vector<ring_transfer> pending;
  auto add_into = [&](index_t origin, const std::vector<float>& x) {
    auto [it, fresh] = partial.try_emplace(origin, x.size(), 0.0f);
    for (std::size_t i = 0; i < x.size(); ++i) it->second[i] += x[i];
  };
  // Completes the gradient receives due by the end of `step`, adding each into its chunk's sum.
  auto finish_receives = [&](index_t step) {
    for (auto it = pending.begin(); it != pending.end();) {
      if (it->ready_step > step) {
        ++it;
        continue;
      }
      std::vector<float> incoming(2 * kv_elems);
      comm.recv(incoming.data(), incoming.size(), it->receive_from, ring_message_tag(*it, true));
      add_into(it->received_origin, incoming);
      it = pending.erase(it);
    }
  };

  detail::kv_mover mover(comm, topology, detail::pack_kv(k, v));
  for (index_t s = 0; s < topology.num_steps(); ++s) {
    const detail::kv_chunk& chunk = mover.begin_step(s);
    std::fill(working.begin(), working.end(), 0.0f);
    reference_backward<float>(tensor_view<const float, 3>(q32.data(), q_extents), chunk.k(kv_extents[0], kv_extents[1], kv_extents[2]),
                              chunk.v(kv_extents[0], kv_extents[1], kv_extents[2]), tensor_view<const float, 3>(out32.data(), q_extents),
                              tensor_view<const float, 3>(d_out32.data(), q_extents), lse, indices[static_cast<std::size_t>(s)].view(),
                              softmax_scale, tensor_view<float, 3>(dq32.data(), q_extents), tensor_view<float, 3>(working.data(), kv_extents),
                              tensor_view<float, 3>(working.data() + kv_elems, kv_extents));
    const index_t source = topology.kv_source_rank(rank, s);
    add_into(source, working);
    if (check == finite_check::every_step) {
      const std::string phase = "ring step " + std::to_string(s);
      check_finite(std::span<const float>(dq32), checked_tensor::queries("dQ", shape.query_tokens, shape.heads_q, shape.head_dim), rank, s, phase);
      const std::span<const float> sum(partial.at(source));
      for (const auto& [name, half] : {std::pair{"dK", sum.first(kv_elems)}, std::pair{"dV", sum.subspan(kv_elems)}})
        check_finite(half, checked_tensor::kv_gradient(name, shape.kv_tokens, shape.heads_kv, shape.head_dim, source), rank, s, phase);
    }
    // Sends in list order; before each, every partial due at this step end is added in.
    for (const ring_transfer& t : topology.gradient_transfers(rank, s)) {
      finish_receives(s);
      auto it = partial.find(t.sent_origin);
      if (it == partial.end())
        throw gradient_schedule_error(rank, "has no dK/dV partial of rank " + std::to_string(t.sent_origin) + "'s chunk to send at step " +
                                                std::to_string(s));
      comm.send(it->second.data(), it->second.size(), t.send_to, ring_message_tag(t, true));
      partial.erase(it);
      pending.push_back(t);
    }
    finish_receives(s);
  }
  mover.finish();
  finish_receives(topology.num_steps());
  if (partial.size() != 1 || partial.begin()->first != rank)
    throw gradient_schedule_error(rank, "ended the backward ring without exactly its own dK/dV");

  const std::vector<float>& own = partial.begin()->second;
  for (index_t t = 0, i = 0; t < shape.kv_tokens; ++t)
    for (index_t h = 0; h < shape.heads_kv; ++h)
      for (index_t d = 0; d < shape.head_dim; ++d, ++i) {
        dk(t, h, d) = T(own[static_cast<std::size_t>(i)]);
        dv(t, h, d) = T(own[kv_elems + static_cast<std::size_t>(i)]);
      }
  for (index_t t = 0, i = 0; t < shape.query_tokens; ++t)
    for (index_t h = 0; h < shape.heads_q; ++h)
      for (index_t d = 0; d < shape.head_dim; ++d) dq(t, h, d) = T(dq32[static_cast<std::size_t>(i++)]);
}

}  // namespace stria::host
